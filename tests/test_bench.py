"""The benchmark scripts' plumbing (never their timings): statistics, the summary table's
target column, the README section rewrite, and that every script parses its arguments."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"
sys.path.insert(0, str(BENCH))

import benchlib  # noqa: E402
import run_all  # noqa: E402


def test_summary_median_quartiles_and_raw_values():
    s = benchlib.summary([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (s["median"], s["min"], s["max"], s["q1"], s["q3"], s["n"]) == (3.0, 1.0, 5.0, 2.0, 4.0, 5)
    assert s["values"] == [4.0, 1.0, 3.0, 2.0, 5.0]  # in measurement order
    one = benchlib.summary([2.5])
    assert (one["median"], one["q1"], one["q3"], one["n"]) == (2.5, 2.5, 2.5, 1)


def test_summary_of_nothing_is_a_value_error():
    with pytest.raises(ValueError, match="at least one repeat"):
        benchlib.summary([])


def test_replace_section_keeps_every_other_section():
    text = "# raydit\n\nintro\n\n## Performance\n\nold table\n\n## Layout\n\nkept\n"
    out = run_all.replace_section(text, "## Performance", "new table")
    assert out == "# raydit\n\nintro\n\n## Performance\n\nnew table\n\n## Layout\n\nkept\n"
    last = run_all.replace_section("a\n\n## Performance\nold\n", "## Performance", "b")
    assert last == "a\n\n## Performance\n\nb\n"
    with pytest.raises(ValueError, match="Performance"):
        run_all.replace_section("no such section\n", "## Performance", "x")


def _scaling(speedup: float) -> dict:
    stat = lambda v: benchlib.summary([v])  # noqa: E731
    config = lambda t, sp=None: {  # noqa: E731
        "step_seconds": stat(t), "predicted_step_seconds": t, "prediction_error": 0.0, "load_1m": stat(1.0),
        **({"speedup": stat(sp), "cpu_speedup": stat(sp)} if sp else {}),
    }
    return {"cases": [{"latent_frames": 1, "tokens": 1576, "figures_from": "all rounds", "clean_rounds": 0,
                       "rounds": [{}], "configs": {"1 rank": config(2.0), "ulysses 2": config(2.0 / speedup, speedup),
                                                   "ring 2": config(2.0 / 1.5, 1.5)}}]}


def test_summary_table_marks_missed_targets():
    rows, notes = run_all.summary_rows({"scaling": _scaling(1.9)})
    met = {r[0]: r[3] for r in rows}
    assert met["1. step, 2 ranks ulysses 2 (1 latent frame, 1576 tokens)"] == "yes"
    assert met["1. step, 2 ranks ring 2 (1 latent frame, 1576 tokens)"] == "**no**"
    assert any("all rounds" in n for n in notes)


def test_summary_table_judges_the_target_it_names_and_shows_the_ceiling():
    sc = _scaling(1.88)
    sc["target_speedup"] = 1.9
    case = sc["cases"][0]
    stat = lambda v: benchlib.summary([v])  # noqa: E731
    case["configs"]["ulysses 2 no overlap"] = dict(case["configs"]["ulysses 2"])
    case["configs"]["both alone"] = {"step_seconds": stat(2.1), "ceiling": stat(1.9), "load_1m": stat(1.0)}
    case["configs"]["1 rank"]["foreign_cpu_seconds"] = stat(0.1)
    rows, notes = run_all.summary_rows({"scaling": sc})
    by_name = {r[0]: r for r in rows}
    tag = "(1 latent frame, 1576 tokens)"
    assert by_name[f"1. step, 2 ranks ulysses 2 {tag}"][2:] == (">= 1.9x", "**no**")  # 1.88 < 1.9
    assert by_name[f"1. step, 2 ranks ulysses 2 no overlap {tag}"][2:] == ("", "")  # shown, not judged
    assert any(r[0].startswith("1. compute-only ceiling") and "1.90 x" in r[1] for r in rows)


def test_scaling_notes_give_the_blocks_speedup_and_the_work_outside_them():
    sc = _scaling(1.8)
    case = sc["cases"][0]
    stat = lambda v: benchlib.summary([v])  # noqa: E731
    case["configs"]["1 rank"]["outside_blocks_seconds"] = stat(0.1)
    case["configs"]["ulysses 2"].update(blocks_speedup=stat(1.95), outside_blocks_seconds=stat(0.125))
    _, notes = run_all.summary_rows({"scaling": sc})
    [note] = [n for n in notes if ", ulysses 2: the blocks alone" in n]
    assert "speed up 1.95 x (1.95-1.95, n=1)" in note
    assert "0.100 s (0.100-0.100, n=1) on 1 rank, 0.125 s (0.125-0.125, n=1) on each of 2 ranks" in note
    assert "11.3% of this plan's step" in note  # 0.125 / (2.0 / 1.8)
    assert not any(", ring 2: the blocks alone" in n for n in notes)  # measured before the parts were


def test_the_30_layer_step_judges_its_frame_count_and_the_2_layer_one_stands_in():
    short, full = _scaling(1.8), _scaling(1.93)
    short["cases"][0]["layers"], full["cases"][0]["layers"] = 2, 30
    rows, _ = run_all.summary_rows({"scaling": short, "scaling-30l": full})
    by_name = {r[0]: r for r in rows}
    assert by_name["1. step, 2 ranks ulysses 2 (1 latent frame, 1576 tokens, 30 layers)"][2:] == (">= 1.85x", "yes")
    assert by_name["1. step, 2 ranks ulysses 2 (1 latent frame, 1576 tokens, 2 layers)"][2:] == (
        "stand-in for the 30-layer row", "")
    short["cases"][0]["latent_frames"] = 3  # a frame count the 30-layer run did not measure: judged
    rows, _ = run_all.summary_rows({"scaling": short, "scaling-30l": full})
    assert {r[0]: r for r in rows}["1. step, 2 ranks ulysses 2 (3 latent frames, 1576 tokens, 2 layers)"][3] == "**no**"


def test_results_from_different_processors_each_name_theirs():
    m = lambda cpu: {"machine": {"date_utc": "2026-11-25 12:00", "load_average": [1.0], "processor": cpu}}  # noqa: E731
    mixed = run_all._measured_when({"scaling": m("AMD EPYC"), "serve": m("Intel Xeon"), "gpu": None}, {})
    assert "scaling on disk (2026-11-25 12:00 UTC, 1-min load 1.0, AMD EPYC)" in mixed
    assert "serve on disk (2026-11-25 12:00 UTC, 1-min load 1.0, Intel Xeon)" in mixed
    same = run_all._measured_when({"scaling": m("AMD EPYC"), "serve": m("AMD EPYC")}, {"serve": {"ran": True}})
    assert same == ("Results: scaling on disk (2026-11-25 12:00 UTC, 1-min load 1.0); "
                    "serve this run (2026-11-25 12:00 UTC, 1-min load 1.0).")


def test_cost_model_rows_judge_fits_and_checks_never_context():
    anchor = lambda role, err: {"anchor": f"a {role}", "role": role, "model": "m", "guidance": True,  # noqa: E731
                                "predicted": 1.0, "published": 1.0, "unit": "s / step", "error": err, "layout": "l"}
    cm = {"measured": [], "anchors": [anchor("fit", 0.05), anchor("check", -0.35), anchor("context", 0.5)],
          "implied_serial_seconds": {"X": 114.3}}
    rows, notes = run_all.summary_rows({"costmodel": cm})
    met = {r[0]: r[3] for r in rows}
    assert met["3. cost model vs published: a fit (fit)"] == "yes"
    assert met["3. cost model vs published: a check (check)"] == "**no**"
    assert met["3. cost model vs published: a context (context)"] == ""
    assert any("114.3 s" in n for n in notes)


def test_published_columns_read_as_shrinking_part_plus_serial_part():
    """bench_costmodel.split_published: t(n) = D / n + F by least squares, a column made exactly
    of that form gives D and F back with no residual; the one-GPU count is left out in the
    second reading."""
    import bench_costmodel

    exact = bench_costmodel.split_published((1, 2, 4, 8), [1600 / n + 100 for n in (1, 2, 4, 8)])
    assert exact["all"]["D"] == pytest.approx(1600) and exact["all"]["F"] == pytest.approx(100)
    assert exact["all"]["max_residual"] == pytest.approx(0, abs=0.05)
    assert exact["above_one"]["gpus"] == [2, 4, 8]
    # A one-GPU figure off the line moves the all-counts reading, not the counts-above-one one.
    slow_one = bench_costmodel.split_published((1, 2, 4, 8), [1600 + 100 + 300] + [1600 / n + 100 for n in (2, 4, 8)])
    assert slow_one["above_one"]["D"] == pytest.approx(1600) and slow_one["above_one"]["F"] == pytest.approx(100)
    assert slow_one["all"]["max_residual"] > 50
    with pytest.raises(ValueError, match="two GPU counts"):
        bench_costmodel.split_published((2, 2), [1.0, 1.0])


def test_flash_attention_2_is_priced_at_its_published_h100_rate_and_never_above_a_devices_own():
    import bench_costmodel

    from raydit.planner import device_type, model_spec

    import dataclasses

    # head dim 128, its attention unmasked (the masked call is priced apart: ModelSpec.masked_attention)
    hv = dataclasses.replace(model_spec("hunyuanvideo"), masked_attention=False)
    _, lse, plain = device_type("H100").rates_for(hv)
    assert plain > 370e12  # the H100's measured SDPA is faster than FA2
    assert bench_costmodel.attention_rates("fa2", hv, lse, plain) == (370e12, 370e12)
    assert bench_costmodel.attention_rates("table", hv, lse, plain) == (lse, plain)
    _, lse20, plain20 = device_type("H20").rates_for(hv)
    assert bench_costmodel.attention_rates("fa2", hv, lse20, plain20) == (lse20, plain20)  # under FA2's H100 figure
    one = {k: bench_costmodel.published_step("hunyuanvideo", "H100", 1, 129, 720, 1280, kernel=k)[0]
           for k in ("table", "fa2")}
    # "table" prices diffusers' masked call (ModelSpec.masked_attention: the measured FA2 rows,
    # 342-352 TFLOP/s); "fa2" the official repository's unmasked varlen kernel at FA2's published 370.
    assert one["fa2"] < one["table"]
    with pytest.raises(ValueError, match="kernel 'fa3'"):
        bench_costmodel.attention_rates("fa3", hv, lse, plain)


def test_beyond_one_gpu_rows_set_no_constant_and_name_their_misses():
    import bench_costmodel

    multi = bench_costmodel.multi_gpu_rows()
    assert multi["rows"] and {r["role"] for r in multi["rows"]} == {"check"}
    hv = [r for r in multi["rows"] if r["family"] == "hunyuanvideo"]
    assert {(r["gpu"], r["gpus"]) for r in hv} >= {("H100", 8), ("H20", 8), ("H100", 6)}
    assert all(r["kernel"] == "fa2" for r in hv)
    missed = [r for r in multi["rows"] if abs(r["error"]) > multi["target"]]
    assert len(multi["misses"]) == len(missed)
    for c in multi["columns"]:
        assert c["model_D"] > 0 and c["model_F"] > 0 and set(c["published_split"]) == {"all", "above_one"}
    # A fit row whose step the type's op table prices (H100) is a check now; L40 (figures) stays a fit.
    roles = {r["anchor"]: r for r in bench_costmodel.anchors()}
    h100 = roles["CogVideoX-2b 1 x H100, ~45 s / 50 steps"]
    assert h100["role"] == "check" and "op table" in h100["note"]
    assert roles["xDiT CogVideoX-2b, 1 x L40 (0.49 s/step x 4.29)"]["role"] == "fit"
    from raydit.planner import device_type, model_spec

    cog = model_spec("cogvideox-2b")
    assert (device_type("H100").rates_kind(cog), device_type("L40").rates_kind(cog)) == ("table", "figures")
    # One published figure, one prediction: LightX2V's 8-H100 figure only in its own mode.
    assert [r["kernel"] for r in multi["rows"] if r["system"] == "LightX2V"] == ["int8 (table)"]


def test_cost_model_rows_beyond_one_gpu_are_judged_at_their_own_target():
    row = {"family": "hunyuanvideo", "shape": "s", "gpu": "H100", "gpus": 8, "layout": "l", "unit": "s / video",
           "published": 100.0, "predicted": 75.0, "error": -0.25, "kernel": "fa2", "role": "check",
           "source": "xDiT docs (official)", "system": "xDiT"}
    cm = {"measured": [], "anchors": [], "multi_gpu": {"target": 0.2, "rows": [row, dict(row, gpus=4, error=-0.19)]}}
    rows, _ = run_all.summary_rows({"costmodel": cm})
    met = {r[0]: (r[2], r[3]) for r in rows}
    assert met["3. cost model beyond one GPU: hunyuanvideo s, 8 x H100 vs xDiT (check)"] == ("within 20%", "**no**")
    assert met["3. cost model beyond one GPU: hunyuanvideo s, 4 x H100 vs xDiT (check)"] == ("within 20%", "yes")


SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if p.name not in ("benchlib.py",))

# Every script run as `python bench/SCRIPT --help` (runpy, as __main__, with its own argv),
# one after another in one child process: a fresh Python per script cost 5-17 s each.
_HELP_ALL = r"""
import contextlib, io, json, os, runpy, sys
out = {}
sys.path.insert(0, os.path.dirname(sys.argv[1]))  # bench/, as `python bench/SCRIPT` has it
for path in sys.argv[1:]:
    buf, err = io.StringIO(), io.StringIO()
    sys.argv = [path, "--help"]
    code = 0
    with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    out[path] = {"code": code, "stdout": buf.getvalue(), "stderr": err.getvalue()}
print("\n" + json.dumps(out))
"""


@pytest.fixture(scope="module")
def helps() -> dict:
    proc = subprocess.run([sys.executable, "-c", _HELP_ALL, *(str(BENCH / s) for s in SCRIPTS)],
                          capture_output=True, text=True, timeout=600, cwd=BENCH)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_script_parses_help(helps, script):
    got = helps[str(BENCH / script)]
    assert got["code"] == 0, got["stderr"]
    assert "usage:" in got["stdout"]


def test_families_predictions_only_rewrites_the_h100_rows_and_keeps_the_measured_ones(tmp_path):
    import json

    import bench_families

    measured = {"machine": {"cpu_count": 2}, "command": "python bench/bench_families.py", "cases": [],
                "h100": {"hunyuanvideo": {"request": "stale", "rows": [{"gpus": 1, "video_seconds": 1.0,
                                                                         "layout": "x"}]}}}
    (tmp_path / "families.json").write_text(json.dumps(measured))
    assert bench_families.main(["--predictions-only", "--out", str(tmp_path)]) == 0
    res = json.loads((tmp_path / "families.json").read_text())
    assert res["cases"] == [] and res["command"] == measured["command"]
    assert res["h100"] == json.loads(json.dumps(bench_families.predictions()))
    hv = {r["gpus"]: r for r in res["h100"]["hunyuanvideo"]["rows"]}
    assert set(hv) == {1, 2, 4, 8} and all(r["role"] == "check" for r in hv.values())
    assert "| hunyuanvideo | 129 x 720 x 1280, 50 steps | 8 |" in (tmp_path / "families.md").read_text()
    with pytest.raises(SystemExit, match="no families.json"):
        bench_families.main(["--predictions-only", "--out", str(tmp_path / "empty")])


def test_serve_front_cpu_is_net_of_the_idle_front_and_skips_rounds_that_did_not_record_it():
    """bench_serve: the front's CPU per request, gross and less what the same processes spent
    during the direct side's burst of the round; a round whose direct record lacks a process
    (it was below the recorded top entries, not at zero) is left out of that process's net."""
    import bench_serve

    def rec(rnd, side, replica, proxy):
        cpu = {"ray::RankWorker": 30.0, "ray::ProxyActor": proxy}
        if replica is not None:
            cpu["ray::ServeReplica:raydit:VideoAPI"] = replica
        return {"round": rnd, "side": side, "cpu_seconds_by_process": cpu}

    result = {"requests_per_burst": 10, "rounds": [
        rec(0, "direct", 0.3, 0.2), rec(0, "http", 1.3, 0.6),
        rec(1, "http", 1.5, 0.7), rec(1, "direct", None, 0.3),
        rec(2, "direct", 0.5, 0.2), rec(2, "http", 1.4, 0.5),
    ]}
    gross, net = bench_serve.front_cpu_ms(result)
    assert sorted(gross["the Serve replica"]["values"]) == [130.0, 140.0, 150.0]
    assert sorted(net["the Serve replica"]["values"]) == [90.0, 100.0] and net["the Serve replica"]["n"] == 2
    assert sorted(net["the HTTP proxy"]["values"]) == [30.0, 40.0, 40.0]


@pytest.mark.long
def test_bench_gpu_smoke_runs_every_part_on_the_cpu(tmp_path):
    """bench/bench_gpu.py --smoke: the GPU script's own code on the CPU with tiny shapes. Every
    part runs (none skipped, none failed) and writes its figures; the Engine's steps carry
    rank 0's own time beside the driver's."""
    import json
    import os

    env = dict(os.environ, RAYDIT_NO_PROGRESS="1")
    # No time budget: the script's 360 s guard for a lent GPU's minutes skipped its last part
    # (engine_compile) on a loaded 2-core machine (461 s, seen 2026-12-02), a wall-clock outcome.
    done = subprocess.run([sys.executable, str(BENCH / "bench_gpu.py"), "--smoke", "--steps", "3", "--iters", "2",
                           "--budget-s", "1e9", "--out", str(tmp_path)], capture_output=True, text=True, timeout=1500,
                          env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "gpu.json").read_text())
    parts = result["parts"]
    for name, part in parts.items():
        assert "skipped" not in part and "error" not in part, (name, part, done.stdout[-3000:])
    assert {row["kernel"] for row in parts["kernels"]["rows"]} >= {"torch SDPA (default, no LSE)", "torch-cpu"}
    for side in ("diffusers", "runner", "engine", "engine_compile"):
        assert parts[side]["step_seconds"]["n"] == 2, side
    assert parts["engine"]["rank_step_seconds"]["median"] <= parts["engine"]["step_seconds"]["median"]
    assert parts["engine_compile"]["compile_seconds"] > 0
    assert set(result["ratios"]) == {"runner_over_diffusers", "engine_over_diffusers", "engine_compile_over_diffusers"}
    assert parts["prediction"]["calibrated"]["step_seconds"] > 0
    # The model's own rates, timed at a shorter request than the one predicted.
    assert parts["model"]["request"]["frames"] < result["request"]["num_frames"]
    assert parts["prediction"]["model"]["model_timed_at"] == "5x64x64"
    assert parts["prediction"]["model"]["step_seconds"] > 0


def test_bench_modes_smoke_runs_its_kernel_and_width_parts_on_the_cpu(tmp_path):
    """bench/bench_modes.py --smoke, kernels and the width stack (the steps part is the long
    one): every kernel of every mode is timed and its error against float64 is in the mode's
    range, and every mode of the width stack runs (fp8-sim for FP8 linear on a CPU)."""
    import json
    import os

    env = dict(os.environ, RAYDIT_NO_PROGRESS="1")
    done = subprocess.run([sys.executable, str(BENCH / "bench_modes.py"), "--smoke", "--iters", "2", "--skip", "steps",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    parts = json.loads((tmp_path / "modes.json").read_text())["parts"]
    for shape in parts["kernels"].values():
        if not isinstance(shape, dict):
            continue
        assert shape["torch-cpu"]["rel_l2_vs_f64"] < 1e-5
        assert 1e-3 < shape["int8-torch"]["rel_l2_vs_f64"] < 0.04
        assert 1e-2 < shape["fp8-torch"]["rel_l2_vs_f64"] < 0.15
        assert all(why is None for why in shape["check"].values())
    modes = parts["wide"]["modes"]
    assert set(modes) == {"bf16", "int8-attn", "fp8-linear", "fp8-linear+int8-attn", "fp8-linear+fp8-attn"}
    assert all("s_per_layer" in row for row in modes.values()), modes
    assert modes["fp8-linear"]["rel_l2_vs_bf16"] > 1e-4  # the linears really were rounded


@pytest.mark.long
def test_bench_familysteps_smoke_builds_and_times_every_family_on_the_cpu(tmp_path):
    """bench/bench_familysteps.py --smoke (issue 40's per-family table on a GPU): every family's
    bench pipeline builds (its tiny pipeline with the transformer's published channels and a VAE
    of the published class), steps at two depths, decodes, and the planner prices the same spec
    at the real depth. Timings are not judged (tiny widths on one CPU thread)."""
    import json
    import os

    from raydit.models.registry import families

    env = dict(os.environ, RAYDIT_NO_PROGRESS="1")
    done = subprocess.run([sys.executable, str(BENCH / "bench_familysteps.py"), "--smoke", "--steps", "2",
                           "--out", str(tmp_path)], capture_output=True, text=True, timeout=1200, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads((tmp_path / "familysteps.json").read_text())
    # every family of the registry has its case (SkyReels-V2 under its own name)
    assert set(result["families"]) == set(families()), sorted(result["families"])
    for name, row in result["families"].items():
        assert "error" not in row and "skipped" not in row, (name, row, done.stdout[-3000:])
        assert row["measured"]["1"]["step_seconds"]["n"] == 1 and row["decode_seconds"] > 0, (name, row)
        assert row["predicted"]["bench"]["step_seconds"] > 0
        assert row["blocks_per_unit"] * row["units"] == (60 if name == "hunyuanvideo" else row["units"])


@pytest.mark.long  # the second stage (suite time)
def test_bench_quantize_load_smoke_times_each_place_it_can_run(tmp_path):
    """bench/bench_quantize_load.py --smoke: a narrow Wan block quantized on the host at one
    thread and at all, fp8-sim always and fp8 where torchao is at hand (the device rows need a
    GPU); every row quantized the block's 10 linears and timed them. Timings are not judged."""
    import json

    done = subprocess.run([sys.executable, str(BENCH / "bench_quantize_load.py"), "--smoke", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = json.loads((tmp_path / "quantize-load.json").read_text())["rows"]
    sim = [r for r in rows if r["mode"] == "fp8-sim"]
    assert [r["place"].split(",")[0] for r in sim] == ["host", "host"], rows
    for row in rows:
        assert row["linears"] == 10 and row["seconds_per_block"] > 0, row
        assert abs(row["wan14b_40_blocks_s"] - 40 * row["seconds_per_block"]) < 0.01, row
    assert "| fp8-sim | host, 1 thread |" in (tmp_path / "quantize-load.md").read_text()


@pytest.mark.long  # the second stage (suite time)
def test_bench_full_precision_steps_smoke_runs_the_option_and_the_diagnostics(tmp_path):
    """bench/bench_full_precision_steps.py --smoke (one layer, 4 steps, fp8-sim on the CPU):
    the bf16 row, the option at N = 0 and 1, and the by-hand diagnostics, each with its share of
    unquantized steps; N = 0 really quantized (its error above bf16's own). Errors otherwise
    not judged (random weights, tiny shapes)."""
    import json

    done = subprocess.run([sys.executable, str(BENCH / "bench_full_precision_steps.py"), "--smoke", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = {r["run"]: r for r in json.loads((tmp_path / "full-precision-steps.json").read_text())["rows"]}
    assert [(r["run"], r["full_steps"]) for r in rows.values()] == [
        ("bf16", 4), ("fp8-sim, full_precision_steps 0", 0), ("fp8-sim, full_precision_steps 1", 2),
        ("fp8-sim, by hand: first 1 only", 1), ("fp8-sim, by hand: last 1 only", 1), ("fp8-sim, by hand: middle 2", 2)]
    assert rows["fp8-sim, full_precision_steps 0"]["error"] > rows["bf16"]["error"] > 0
    assert "| fp8-sim, full_precision_steps 1 | 2 of 4 |" in (tmp_path / "full-precision-steps.md").read_text()
