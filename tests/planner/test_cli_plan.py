"""`raydit plan`: table and JSON output, exit status 2 and one line on bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from raydit.cli import main

REPO = Path(__file__).resolve().parents[2]


def run(capsys, *argv):
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_table(capsys):
    code, out, err = run(capsys, "plan", "--model", "cogvideox-2b", "--gpus", "8")
    assert code == 0 and err == ""
    assert "13 x 30 x 45 patches = 17550 video + 226 text = 17776 tokens" in out
    assert out.count("\nbest ") == 1 and "feasible (" in out and "rejected (" in out
    assert "ulysses 4 does not divide the 30 attention heads" in out


def test_table_defaults_from_model_and_cluster_file(capsys):
    code, out, _ = run(capsys, "plan", "--model", "cogvideox1.5-5b", "--cluster",
                       str(REPO / "cluster" / "2x8xH100.yaml"))
    assert code == 0
    assert "81 frames x 768 x 1360 -> 11 x 48 x 85 patches" in out


def test_json_schema(capsys):
    code, out, _ = run(capsys, "plan", "--model", "cogvideox-2b", "--frames", "49", "--height", "480",
                       "--width", "720", "--gpus", "4", "--json", "--top", "0")
    assert code == 0
    d = json.loads(out)
    assert {"model", "best", "candidates", "rejected"} <= set(d)
    m = d["model"]
    assert (m["heads"], m["layers"], m["text_tokens"], m["video_tokens"]) == (30, 30, 226, 17550)
    assert (m["latent_frames"], m["latent_height"], m["latent_width"]) == (13, 60, 90)
    assert len(d["candidates"]) == d["candidates_total"]
    for p in [d["best"], *d["candidates"]]:
        for key in ("ulysses", "ring", "cfg", "replicas", "world_size", "pad_tokens", "split",
                    "predicted_step_seconds", "memory_gb_per_gpu", "placement"):
            assert key in p, key
        assert len(p["placement"]) == p["world_size"]
    assert d["best"] == d["candidates"][0]
    for r in d["rejected"]:
        assert {"ulysses", "ring", "cfg", "replicas", "reason"} <= set(r)


def test_forced_and_no_cfg(capsys):
    code, out, _ = run(capsys, "plan", "--model", "cogvideox-2b", "--gpus", "8", "--ulysses", "2",
                       "--ring", "4", "--cfg", "1", "--replicas", "1", "--json")
    assert code == 0
    best = json.loads(out)["best"]
    assert (best["ulysses"], best["ring"], best["cfg"], best["replicas"]) == (2, 4, 1, 1)
    code, out, _ = run(capsys, "plan", "--model", "cogvideox-2b", "--gpus", "8", "--no-cfg", "--json")
    assert code == 0 and all(p["cfg"] == 1 for p in json.loads(out)["candidates"])


BAD = [
    (["--model", "cogvideox-2b", "--gpus", "8", "--height", "481"], "height 481 is not a multiple of 16"),
    (["--model", "cogvideox-2b", "--gpus", "8", "--frames", "50"], "frames 50 cannot be taken by the VAE"),
    (["--model", "cogvideox-2b", "--gpus", "0"], "gpus must be a positive integer, got 0"),
    (["--model", "nope", "--gpus", "8"], "unknown model 'nope'"),
    (["--model", "cogvideox-2b", "--gpus", "8", "--gpu-type", "Z80"], "unknown GPU type 'Z80'"),
    (["--model", "cogvideox-2b", "--gpus", "8", "--ulysses", "4"],
     "ulysses 4 does not divide the 30 attention heads; feasible: 1, 2, 3, 5, 6, 10, 15, 30"),
    (["--model", "cogvideox-2b", "--gpus", "8", "--cfg", "3"], "cfg 3 does not share the 2 guidance branches of a cogvideox-2b step evenly; use cfg 1 or cfg 2"),
    (["--model", "cogvideox-2b", "--gpus", "8", "--no-cfg", "--cfg", "2"], "guidance is off"),
    (["--model", "wan2.1-t2v-14b", "--gpus", "2", "--gpu-type", "T4"], "the weights alone do not fit"),  # 4 fit sharded
    (["--model", "cogvideox-2b", "--cluster", "/nonexistent/c.yaml"], "does not exist"),
    (["--model", "cogvideox-2b"], "one of the arguments --gpus --cluster --address is required"),
    (["--model", "cogvideox-2b", "--gpus", "8", "--cluster", "x.yaml"], "not allowed with argument"),
    (["--gpus", "8"], "the following arguments are required: --model"),
    (["--model", "cogvideox-2b", "--cluster", str(REPO / "cluster" / "8xH100.yaml"), "--gpu-type", "T4"],
     "(--gpu-type / --per-node) go with gpus=N (--gpus)"),
    (["--model", "cogvideox-2b", "--gpus", "eight"], "invalid int value: 'eight'"),
    (["--model", "cogvideox-2b", "--gpus", "8", "--gpu-type", ""], "unknown GPU type ''"),  # was planned as H100
    (["--model", "cogvideox-2b", "--gpus", "8", "--gpu-type", "A100-40GB", "--attention", "fp8"],
     "attention fp8 needs FP8 tensor cores"),  # was planned; the workers find no kernel
    (["--model", "cogvideox-2b", "--gpus", "8", "--full-precision-steps", "3"],
     "--full-precision-steps 3 leaves the quantized modes for those steps, and none is asked"),  # was dropped
]


DOCTOR_BAD = [
    (["--model", "tiny"], "--model, --frames, --height and --width go with --calibrate"),
    (["--calibrate", "--frames", "9"], "give --model DIR"),
    (["--calibrate", "--model", "wan2.1-t2v-1.3b"], "has no weights here; download its diffusers checkpoint"),
    (["--calibrate", "--model", "/nonexistent/wan"], "unknown model '/nonexistent/wan'"),
    (["--calibrate", "--model", "tiny", "--frames", "10"], "frames 10 cannot be taken by the VAE"),
]


# `doctor --calibrate --model`'s are refused before any Ray or device work starts.
@pytest.mark.parametrize("command,argv,message",
                         [("plan", a, m) for a, m in BAD] + [("doctor", a, m) for a, m in DOCTOR_BAD])
def test_bad_input_one_line_exit_2(capsys, command, argv, message):
    code, out, err = run(capsys, command, *argv)
    assert code == 2 and out == ""
    assert err.startswith("raydit: error: ") and err.count("\n") == 1, err
    assert message in err


def test_bad_yaml_file(capsys, tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("nodes: [ {gpu_type: H100, count: 8}\n")
    code, _, err = run(capsys, "plan", "--model", "cogvideox-2b", "--cluster", str(bad))
    assert code == 2 and err.startswith("raydit: error: cluster file") and err.count("\n") == 1
    wrong = tmp_path / "w.yaml"
    wrong.write_text("nodes:\n  - {gpu_type: H100, count: -1}\n")
    code, _, err = run(capsys, "plan", "--model", "cogvideox-2b", "--cluster", str(wrong))
    assert code == 2 and "count must be a positive integer, got -1" in err


def test_no_subcommand_is_a_usage_error(capsys):
    code, _, err = run(capsys)
    assert code == 2 and "plan" in err


def test_real_process_prints_no_traceback():
    out = subprocess.run([sys.executable, "-m", "raydit.cli", "plan", "--model", "cogvideox-2b",
                          "--gpus", "8", "--width", "721"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        "raydit: error: width 721 is not a multiple of 16 (VAE scale 8 x patch 2); nearest valid: 720 or 736"]


def test_world_size_option(capsys):
    code, out, _ = run(capsys, "plan", "--model", "tiny", "--gpus", "4", "--gpu-type", "cpu",
                       "--world-size", "4", "--replicas", "1", "--json")
    assert code == 0
    cands = json.loads(out)["candidates"]
    assert cands and all(p["world_size"] == 4 and p["replicas"] == 1 for p in cands)



def test_a_reader_that_goes_away_is_no_error():
    """`raydit plan ... | head`: the reader closes the pipe before the table is written; the
    command ends as a process killed by SIGPIPE is reported (141), saying nothing (it said
    "raydit: error: [Errno 32] Broken pipe", exit 2)."""
    proc = subprocess.Popen([sys.executable, "-m", "raydit.cli", "plan", "--model", "cogvideox-2b", "--gpus", "8"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()
    err = proc.stderr.read().decode()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 141 and err == "", err


def test_shared_flags_are_generates_and_fp8_sim_is_priced_as_bf16(capsys):
    """`raydit plan`'s flags that generate / serve also take are parsed as theirs (the options
    table's type, action, choices: --quantize's list is the one list, fp8-sim included), and
    --quantize fp8-sim is priced as bf16, as run_mode prices the Engine's fp8-sim."""
    import argparse

    from raydit.cli import PLAN_SHARED, build_parser
    from raydit.planner.modes import ATTENTION_MODES, QUANTIZE_MODES

    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    flags = {c: {a.dest: a for a in sub.choices[c]._actions if a.option_strings} for c in ("plan", "generate", "serve")}
    for key in PLAN_SHARED:
        plan, gen = flags["plan"][key], flags["generate"].get(key) or flags["serve"][key]
        choices = None if key == "cfg" else gen.choices  # the planner names the degrees a model takes
        assert (type(plan), plan.type, plan.choices, plan.option_strings[0]) == \
            (type(gen), gen.type, choices, gen.option_strings[0]), key
    assert flags["plan"]["quantize"].choices == list(QUANTIZE_MODES)
    assert flags["plan"]["attention"].choices == list(ATTENTION_MODES)
    base = ("plan", "--model", "wan2.1-t2v-1.3b", "--gpus", "2", "--json")
    docs = {}
    for quantize in ("none", "fp8-sim", "fp8"):
        code, out, err = run(capsys, *base, "--quantize", quantize)
        assert code == 0, err
        docs[quantize] = json.loads(out)
    assert docs["fp8-sim"]["best"] == docs["none"]["best"] != docs["fp8"]["best"]
    code, out, err = run(capsys, *base, "--attention", "auto")
    assert code == 0 and json.loads(out)["best"] == docs["none"]["best"], err


def test_no_cfg_prices_the_whole_few_step_request_and_its_shares(capsys):
    """`raydit plan --no-cfg --steps 4`: one branch, and the whole request (steps, text encoding,
    decode: raydit.planner.endtoend.end_to_end on the best plan's ranks) with each part's share."""
    from raydit.planner import cost as costmod
    from raydit.planner import plan
    from raydit.planner.endtoend import end_to_end
    from raydit.planner.report import request_seconds

    code, out, _ = run(capsys, "plan", "--model", "wan2.1-t2v-1.3b", "--gpus", "8", "--no-cfg", "--steps", "4",
                       "--json")
    assert code == 0
    data = json.loads(out)
    whole = data["request"]
    assert whole["steps"] == 4 and data["candidates"][0]["cfg"] == 1
    assert whole["total"] == pytest.approx(whole["denoise"] + whole["text_encode"] + whole["decode"], abs=1e-3)
    assert sum(whole["shares"].values()) == pytest.approx(1.0, abs=1e-3)
    result = plan("wan2.1-t2v-1.3b", gpus=8, guidance=False)
    best = result.best
    node = result.cluster.nodes[0]
    ranks = best.world_size // best.replicas
    link = costmod.Link(node.intra_gb_s, node.device.link_latency_us, node.intra_kind) if ranks > 1 else None
    expected = end_to_end(result.model, best.predicted_step_seconds, 4, 1, node.device.flops_per_second,
                          geo=result.geometry, ranks=ranks, link=link)
    assert request_seconds(result, 4).total == pytest.approx(expected.total, rel=1e-12)
    assert whole["denoise"] == pytest.approx(4 * best.predicted_step_seconds, abs=1e-4)
    # At 4 steps the parts around the steps are a visible share; at 50 with CFG, a smaller one.
    fifty = request_seconds(plan("wan2.1-t2v-1.3b", gpus=8), 50)
    assert expected.decode / expected.total > fifty.decode / fifty.total
    code, out, _ = run(capsys, "plan", "--model", "wan2.1-t2v-1.3b", "--gpus", "8", "--no-cfg", "--steps", "4")
    line = out.strip().splitlines()[-1]
    assert line.startswith("whole request, 4 steps (guidance off: 1 branch) on the best plan:")
    assert "denoising" in line and "text encoding" in line and "decode" in line and "%)" in line
