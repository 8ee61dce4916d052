"""Run every raydit benchmark and write docs/benchmarks/: one JSON per benchmark, results.json
(all of them with the command and machine), summary.md (the table) and benchmarks.png.

    python bench/run_all.py --quick      # under 5 minutes on 2 cores
    python bench/run_all.py              # full: more rounds, 1 and 3 latent frames, attention
    python bench/run_all.py --only scaling costmodel --update-readme

Each benchmark runs in its own process (Ray and process groups start clean), one after the
other, never two at once. `--update-readme` replaces the body of README.md's
"## Performance" section with the table, the plot and the command.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import benchlib  # noqa: E402

BENCH = Path(__file__).resolve().parent
REPO = BENCH.parent

# name -> (script, quick arguments, full arguments); None: not run in that mode.
SUITE = {
    "scaling": ("bench_scaling.py", ["--frames", "1", "--rounds", "3", "--warmup", "0", "--max-wait", "1"],
                ["--frames", "1", "3", "--rounds", "5", "--warmup", "1", "--max-wait", "10"]),
    # CogVideoX-2b's 30 layers at 1 and 3 latent frames (about 17 and 55 minutes); full mode only.
    "scaling-30l": ("bench_scaling.py", None, ["--frames", "1", "3", "--layers", "30", "--rounds", "3", "--warmup", "1",
                                               "--max-wait", "10", "--name", "scaling-30l"]),
    "costmodel": ("bench_costmodel.py", [], []),
    "planpick": ("bench_planpick.py", ["--worlds", "2", "4", "--rounds", "3", "--layers", "1", "--max-wait", "1"],
                 ["--worlds", "2", "4", "--rounds", "5", "--layers", "2", "--max-wait", "10"]),
    "overhead": ("bench_overhead.py", ["--steps", "3", "--rounds", "3", "--fixed-steps", "6"],
                 ["--steps", "8", "--rounds", "8", "--fixed-steps", "12"]),
    "startup": ("bench_startup.py", ["--workers", "1", "2", "4", "--repeats", "1", "--no-warmup", "--compare-warmup"],
                ["--workers", "1", "2", "4", "--repeats", "4", "--compare-warmup"]),
    "recovery": ("bench_recovery.py", ["--repeats", "1", "--steps", "4"], ["--repeats", "4", "--steps", "6"]),
    "plan": ("bench_plan.py", ["--repeats", "5"], ["--repeats", "15"]),
    "throughput": ("bench_throughput.py", ["--requests", "2", "--steps", "2", "--rounds", "2"],
                   ["--requests", "4", "--steps", "4", "--rounds", "3"]),
    "attention": ("bench_attention.py", None, ["--max-wait", "10"]),
    # Real 480 x 720 VAEs: about 4 minutes per VAE and round on 2 cores; full mode only.
    "decode": ("bench_decode.py", None, ["--vaes", "cogvideox", "wan2.1", "wan2.2", "--frames", "1", "--rounds", "3",
                                         "--max-wait", "10"]),
    "decode-e2e": ("bench_decode.py", None, ["--end-to-end", "--layers", "2", "--steps", "2", "--rounds", "2",
                                             "--max-wait", "10"]),
    "families": ("bench_families.py", None, ["--families", "hunyuanvideo", "ltx", "ltx2", "--rounds", "3", "--max-wait", "10"]),
    "serve": ("bench_serve.py", None, ["--requests", "16", "--steps", "4", "--rounds", "3"]),
    "serve-short": ("bench_serve.py", None, ["--requests", "16", "--steps", "1", "--rounds", "10", "--name", "serve-short"]),
    # The same with the client that lists the burst every 0.25 s instead of long-polling.
    "serve-short-poll": ("bench_serve.py", None, ["--requests", "16", "--steps", "1", "--rounds", "6", "--client", "poll",
                                                  "--name", "serve-short-poll"]),
    "gpu": ("bench_gpu.py", [], []),
    "engine-step": ("bench_engine_step.py", ["--rounds", "2", "--steps", "4", "--max-wait", "1"],
                    ["--rounds", "6", "--steps", "6", "--max-wait", "10"]),
}


def run_suite(names: list[str], quick: bool, out: Path) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1", RAYDIT_NO_PROGRESS="1", TOKENIZERS_PARALLELISM="false")
    status = {}
    for name in names:
        script, quick_args, full_args = SUITE[name]
        args = quick_args if quick else full_args
        if args is None:
            status[name] = {"ran": False, "why": "full mode only"}
            continue
        cmd = [sys.executable, str(BENCH / script), *args, "--out", str(out)]
        print(f"== {name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        proc = subprocess.run(cmd, cwd=REPO, env=env)
        status[name] = {"ran": True, "returncode": proc.returncode, "seconds": round(time.perf_counter() - t0, 1),
                        "command": " ".join(["python", str(Path("bench") / script), *args])}
        print(f"== {name}: exit {proc.returncode} after {status[name]['seconds']} s", flush=True)
    return status


# -- the table -----------------------------------------------------------------------------

def _pct(x: float) -> str:
    return f"{x:+.0%}"


def _s(stat: dict | None, digits: int = 2, unit: str = "s") -> str:
    if not stat:
        return "n/a"
    return f"{stat['median']:.{digits}f} {unit} ({stat['min']:.{digits}f}-{stat['max']:.{digits}f}, n={stat['n']})"


def summary_rows(res: dict) -> tuple[list[tuple], list[str]]:
    """(rows of (measure, result, target, met), notes)."""
    rows, notes = [], []
    # The target names a CogVideoX-2b-shaped step: where the 30-layer run measured a frame
    # count, it judges it and the 2-layer step of that frame count is shown as a stand-in.
    full_shape = {c["latent_frames"] for c in (res.get("scaling-30l") or {}).get("cases", []) if c.get("layers") == 30}
    for sc in (res.get("scaling"), res.get("scaling-30l")):
        if not sc:
            continue
        target = sc.get("target_speedup", 1.85)
        for case in sc["cases"]:
            stand_in = case.get("layers", 30) != 30 and case["latent_frames"] in full_shape
            tag = f"{case['latent_frames']} latent frame{'s' if case['latent_frames'] > 1 else ''}, {case['tokens']} tokens"
            if case.get("layers"):
                tag += f", {case['layers']} layers"
            base = case["configs"]["1 rank"]
            ceiling = case["configs"].get("both alone", {}).get("ceiling")
            rows.append((f"1. step, 1 rank ({tag})", _s(base["step_seconds"]), "", ""))
            if ceiling:
                rows.append((f"1. compute-only ceiling of 2 ranks ({tag}; both ranks run the whole step at once, "
                             "no communication)", _s(ceiling, 2, "x"), "", ""))
            for name in ("ulysses 2", "ulysses 2 no overlap", "ring 2"):
                e = case["configs"].get(name)
                if e is None:
                    continue
                judged = name != "ulysses 2 no overlap" and not stand_in
                rows.append((f"1. step, 2 ranks {name} ({tag})",
                             f"{_s(e['step_seconds'])}; speedup {_s(e['speedup'], 2, 'x')}; "
                             f"CPU-time split {e['cpu_speedup']['median']:.2f}x",
                             f">= {target}x" if judged else
                             ("stand-in for the 30-layer row" if stand_in and name != "ulysses 2 no overlap" else ""),
                             ("yes" if e["speedup"]["median"] >= target else "**no**") if judged else ""))
            for name in ("ulysses 2", "ring 2"):
                e = case["configs"].get(name, {})
                if "blocks_speedup" in e and "outside_blocks_seconds" in base:
                    out = e["outside_blocks_seconds"]
                    notes.append(
                        f"Scaling, {tag}, {name}: the blocks alone speed up {_s(e['blocks_speedup'], 2, 'x')} "
                        "(1 rank's over this plan's, paired by round). The work outside them is not split: "
                        "before the blocks the time and patch embeddings and the text projection, after them "
                        "the gather (where a rank also waits for the slower one) and the final norm and "
                        f"projection; {_s(base['outside_blocks_seconds'], 3)} "
                        f"on 1 rank, {_s(out, 3)} on each of 2 ranks here, "
                        f"{out['median'] / e['step_seconds']['median']:.1%} of this plan's step.")
            beaten = [n for n in ("ulysses 2", "ring 2")
                      if ceiling and n in case["configs"] and case["configs"][n]["speedup"]["median"] > ceiling["median"]]
            if beaten:
                notes.append(f"Scaling, {tag}: {' and '.join(beaten)} beat the compute-only ceiling "
                             f"({ceiling['median']:.2f}x): two ranks each running the whole step slow each other "
                             "more (memory traffic, the shared L3 cache) than two ranks each running half of it, "
                             "so on this machine the ceiling is no upper bound.")
            notes.append(f"Scaling, {tag}: figures from {case['figures_from']} ({case['clean_rounds']} of "
                         f"{len(case['rounds'])} rounds clean: other processes used < 15% of a core); median 1-min "
                         f"load {base['load_1m']['median']} (range {base['load_1m']['min']}-{base['load_1m']['max']})"
                         + (f"; other processes' CPU during the 1-rank step {base['foreign_cpu_seconds']['median']} s "
                            "(median)." if "foreign_cpu_seconds" in base else "."))
    ov = res.get("overhead")
    if ov:
        p = ov["plan"]
        fc = ov.get("fixed_cost")
        direct = (f"raydit {_s(ov['raydit_step_seconds'], 3)}, plain {_s(ov['plain_step_seconds'], 3)}; "
                  f"ratio {ov['ratio']['median']:.3f} (per round {ov['ratio']['min']:.3f}-{ov['ratio']['max']:.3f})")
        # Judged on the comparison the target names (same model, same plan, interleaved
        # rounds); the tiny pipeline's fixed cost per step is shown beside it, not judged.
        result = f"direct: {direct}"
        if fc:
            result += (f"; fixed cost on the tiny pipeline {fc['seconds_per_step']['median'] * 1e3:.1f} ms/step "
                       f"({fc['seconds_per_step']['min'] * 1e3:.1f}-{fc['seconds_per_step']['max'] * 1e3:.1f}, "
                       f"n={fc['seconds_per_step']['n']}) = {fc['share_of_bench_step']:+.1%} of the step")
        met = ov["ratio"]["median"] <= 1.02
        rows.append((f"2. Ray engine vs plain torch.multiprocessing, per step (ulysses {p['ulysses']} x ring "
                     f"{p['ring']} x cfg {p['cfg']}, {ov['model']['height']}x{ov['model']['width']}, "
                     f"{ov['model']['frames']} frames)", result, "<= +2%", "yes" if met else "**no**"))
        notes.append("Overhead: judged on the direct comparison's median ratio; its per-round ratios spread wider "
                     "than the 2% target on this shared machine. The fixed cost per step (the same comparison on the "
                     "tiny pipeline, a step of a few ms) is what remains of the engine's own per-step work; it is a "
                     "stand-in, not the measurement the target names.")
        if "ray_worker_niceness" in ov:
            notes.append(f"Overhead: Ray runs its workers at nice {ov['ray_worker_niceness']} (RAY_worker_niceness); "
                         f"the plain ranks ran at nice {ov['plain_niceness']}, so priority on this shared machine "
                         "is " + ("the same on both sides." if ov["plain_niceness"] == ov["ray_worker_niceness"]
                                  else "not the same on both sides."))
    cm = res.get("costmodel")
    if cm:
        for r in cm["measured"]:
            if "error_range" in r:
                result = (f"predicted {r['predicted']:.2f} s vs measured {r['measured']:.2f} s ({_pct(r['error'])}, "
                          f"per round {r['error_range']}; calibrated at plan time); table `cpu` entry: "
                          f"{_pct(r['table_error'])}")
            else:  # results of an older bench_costmodel
                result = f"predicted {r['predicted']:.2f} s vs measured {r['measured']:.2f} s ({_pct(r['error'])})"
            layers = f", {r['layers']} layers" if r.get("layers") else ""
            rows.append((f"3. cost model, cpu {r['plan']}, {r['latent_frames']} latent frame(s){layers}", result,
                         "within 15%", "yes" if r["within_target"] else "**no**"))
        for r in cm["anchors"]:
            if r["role"] in ("approximation", "check") and r["model"].startswith("open-sora") and not r["guidance"]:
                continue  # the table shows the guidance-on reading; both are in costmodel.json
            judged = r["role"] != "context"
            rows.append((f"3. cost model vs published: {r['anchor']} ({r['role']})",
                         f"predicted {r['predicted']:.2f} vs published {r['published']:.2f} {r['unit']} "
                         f"({_pct(r['error'])}; {r['layout']})", "within 15%" if judged else "",
                         ("yes" if abs(r["error"]) <= 0.15 else "**no**") if judged else ""))
        multi = cm.get("multi_gpu") or {}
        target = multi.get("target")
        for r in multi.get("rows", []) if target is not None else []:
            rows.append((f"3. cost model beyond one GPU: {r['family']} {r['shape']}, {r['gpus']} x {r['gpu']} vs "
                         f"{r.get('system', r['source'])} ({r['role']})",
                         f"predicted {r['predicted']:g} vs published {r['published']:g} {r['unit']} "
                         f"({_pct(r['error'])}; {r['layout']}; attention {r['kernel']})", f"within {target:.0%}",
                         "yes" if abs(r["error"]) <= target else "**no**"))
        implied = cm.get("implied_serial_seconds") or {}
        model_serial = cm.get("model_serial_seconds") or {}
        if implied:
            notes.append("Cost model: the published 1- and 8-GPU end-to-end figures imply a part that does not shrink "
                         "with GPUs of " + ", ".join(f"{k} {v} s" for k, v in implied.items() if v is not None) +
                         " per video ((8 t8 - t1) / 7); the model's own serial part (text encoding and the tiled "
                         "VAE decode on one GPU: HunyuanVideo's decoder counted, VAE_EFFICIENCY fit on SGLang's "
                         "decode) is " + ", ".join(f"{k} {v} s" for k, v in model_serial.items() if v is not None) +
                         " (docs/benchmarks/costmodel.json, end_to_end and multi_gpu.columns).")
    pp = res.get("planpick")
    if pp:
        for c in pp["cases"]:
            ratio = c["pick_over_fastest"]
            rows.append((f"8. planner's pick vs fastest of {len(c['plans'])} feasible plans, {c['world']} ranks "
                         f"(cfg guidance, {c['latent_frames']} latent frame, {c['layers']} layer(s))",
                         f"pick {c['pick']} {_s(c['steps'][c['pick']])}; fastest {c['fastest']} "
                         f"{_s(c['steps'][c['fastest']])}; pick / fastest {ratio:.3f} (per round "
                         f"{c['pick_over_fastest_by_round']['min']:.2f}-{c['pick_over_fastest_by_round']['max']:.2f})",
                         f"<= {1 + pp['target']:.2f}", "yes" if ratio <= 1 + pp["target"] else "**no**"))
            notes.append(f"Plan pick, {c['world']} ranks: figures from {c['figures_from']} ({c['clean_rounds']} of "
                         f"{len(c['rounds'])} rounds clean); median 1-min load {c['load_1m']['median']} "
                         f"(range {c['load_1m']['min']}-{c['load_1m']['max']})"
                         + ("; 4 ranks share the 2 cores." if c["world"] > 2 else "."))
    st = res.get("startup")
    if st:
        for r in st["rows"]:
            video = (f"; first video {_s(r['first_video_seconds'])} (its request {_s(r['request_seconds'])})"
                     if "first_video_seconds" in r else "")
            warm = f", --warmup (warm-up {_s(r['warmup_seconds'])})" if r.get("warmup") else ""
            rows.append((f"4. start-up, {r['workers']} worker(s) ({r['plan']}){warm}",
                         f"ready {_s(r['ready_seconds'])}; first step {_s(r['first_step_seconds'])}{video}", "", ""))
    rc = res.get("recovery")
    if rc:
        rows.append(("5. recovery: node removed mid-request (2 ranks on 2 nodes -> 1)",
                     f"detected {_s(rc['detect_seconds'])}; regroup {_s(rc['regroup_seconds'])}; kill -> first "
                     f"resumed step {_s(rc['kill_to_first_resumed_step_seconds'])}; request delayed by "
                     f"{_s(rc['added_delay_seconds'])} ({rc['steps']} steps, "
                     f"{_s(rc['baseline_total_seconds'])} uninterrupted)", "", ""))
    pl = res.get("plan")
    if pl:
        for c in pl["cases"]:
            if c["case"] in ("8xH100 cogvideox-2b", "64xH100 cogvideox-2b", "1024xH100 cogvideox-2b"):
                rows.append((f"6. plan {c['case']}", f"{c['median_ms']:.1f} ms ({c['min_ms']:.1f}-{c['max_ms']:.1f}, "
                             f"n={c['repeats']})", "", ""))
    tp = res.get("throughput")
    if tp:
        for r in tp["rows"]:
            rows.append((f"7. throughput, {r['config']}", _s(r["requests_per_minute"], 2, "req/min"), "", ""))
        rows.append(("7. throughput ratio, 2 replicas / 1", _s(tp["ratio_2_replicas_over_1"], 2, "x"), "", ""))
    dc = res.get("decode")
    if dc:
        target = dc.get("target_speedup", 1.7)
        for c in dc["cases"]:
            if "rounds" not in c or "cpu_speedup" not in c:
                continue  # a summary assembled from printed lines, not the bench's own record
            shape = "x".join(str(v) for v in c["video_shape"][2:])
            judged = c.get("channels_div", 1) == 1
            rows.append((f"9. VAE decode {c['vae']}, {c['latent_frames']} latent frame(s) -> {shape}, 2 ranks vs 1 "
                         "(exact, split by rows)",
                         f"1 rank {_s(c['one_rank_seconds'], 1)}, 2 ranks {_s(c['two_rank_seconds'], 1)}; speedup "
                         f"{_s(c['speedup'], 2, 'x')}; CPU-time split {c['cpu_speedup']['median']:.2f}x; max abs diff "
                         f"{c['max_abs_diff']:.1e}", f">= {target}x" if judged else "",
                         ("yes" if c["speedup"]["median"] >= target else "**no**") if judged else ""))
            notes.append(f"Decode, {c['vae']} {c['latent_frames']} latent frame(s): figures from {c['figures_from']} "
                         f"({c['clean_rounds']} of {len(c['rounds'])} rounds clean); median 1-min load "
                         f"{c['load_1m']['median']}.")
    de = res.get("decode-e2e")
    if de:
        one, two = de["parts"]["1 rank"], de["parts"]["2 ranks"]
        rows.append((f"9. whole generation, 2 ranks vs 1 (CogVideoX VAE, 2b-shaped transformer with {de['layers']} "
                     f"layers, {de['height']}x{de['width']}, {de['latent_frames']} latent frame, {de['steps']} steps; "
                     f"{de['plan_2_ranks']})",
                     f"1 rank {_s(one['seconds'], 1)} (decode {one['decode']['median']:.1f} s), 2 ranks "
                     f"{_s(two['seconds'], 1)} (decode {two['decode']['median']:.1f} s on {two['decode_ranks']} ranks); "
                     f"speedup {_s(de['speedup'], 2, 'x')}; frames within {de['max_level_diff']} level(s)", "", ""))
    fa = res.get("families")
    if fa:
        for c in fa["cases"]:
            ceil = c["configs"]["both alone"]["ceiling"]["median"]
            for name in ("ulysses 2", "ring 2"):
                e = c["configs"][name]
                rows.append((f"11. {c['family']}-shaped step ({c['layers']} layer(s), {c['latent_frames']} latent "
                             f"frame(s)), 2 ranks {name}", f"{_s(e['step_seconds'])}; speedup {_s(e['speedup'], 2, 'x')}; "
                             f"CPU-time split {e['cpu_speedup']['median']:.2f}x; compute-only ceiling {ceil:.2f}x", "", ""))
    for key in ("serve", "serve-short", "serve-short-poll"):
        sv = res.get(key)
        if sv and "throughput_ratio_http_over_direct" in sv:
            ratio = sv["throughput_ratio_http_over_direct"]
            run_s = sv.get("rows", {}).get("direct", {}).get("run_seconds_mean", {}).get("median")
            length = f"{sv.get('steps', '?')}-step requests" + (f" of {run_s:.1f} s" if run_s else "")
            how = ("each waits with GET ?wait=60" if sv.get("client") == "wait"
                   else "one list call every 0.25 s")
            rows.append((f"10. `raydit serve`: requests per minute through HTTP over the Engine called directly "
                         f"({sv.get('requests_per_burst', '?')} queued {length}; {how})",
                         _s(ratio, 3, "x"), ">= 0.98x", "yes" if ratio["median"] >= 0.98 else "**no**"))
    at = res.get("attention")
    if at:
        notes.append("Attention-only speedups: attention.md beside this table (bench/bench_attention.py).")
    gpu = res.get("gpu")
    if gpu and gpu.get("skipped"):
        notes.append(f"GPU-only measurements (bench/bench_gpu.py): skipped, {gpu['skipped']}.")
    elif gpu:
        rows.extend(gpu_rows(gpu))
    es = res.get("engine-step")
    if es:
        ratio = es["engine_over_diffusers"]
        rows.append((f"Engine (1 Ray worker) / diffusers per step, Wan-1.3B-shaped {es['model']['transformer']['num_layers']}"
                     f" layers, CPU, 1 thread (rank 0 alone: {es['engine_rank_step_s']['median']:.3f} s, Ray's part "
                     f"{es['ray_part_s']['median'] * 1e3:.1f} ms)", _s(ratio, 4, "x"), "<= 1.02x",
                     "yes" if ratio["median"] <= 1.02 else "**no**"))
    return rows, notes


def gpu_rows(gpu: dict) -> list[tuple]:
    """bench_gpu's figures: the kernels at each shape, the step of every side against
    diffusers', the planner's prediction against the Engine."""
    rows = []
    parts = gpu.get("parts", {})
    where = gpu.get("device", "GPU")
    by_shape: dict[tuple, list[str]] = {}
    for r in (parts.get("kernels") or {}).get("rows", []):
        rate = f"{r['tflops']:.0f}" if "tflops" in r else "dropped" if "dropped" in r else "failed"
        by_shape.setdefault(tuple(r["shape"]), []).append(f"{r['kernel'].replace(' (default, no LSE)', '')} {rate}")
    for shape, rates in by_shape.items():
        rows.append((f"{where} attention TFLOP/s at {shape} (B, H, S, D), bf16", ", ".join(rates), "", ""))
    for key, ratio in (gpu.get("ratios") or {}).items():
        side = key.removesuffix("_over_diffusers").replace("_", " --")
        target = "<= 1.02x" if side == "engine" else ""
        met = ("yes" if ratio <= 1.02 else "**no**") if target else ""
        rows.append((f"{where} step, {side} / diffusers (Wan-1.3B-shaped, 81x480x832, bf16)", f"{ratio:.4f}x", target, met))
    pred = parts.get("prediction") or {}
    if "calibrated" in pred and "step_error" in pred["calibrated"]:
        err = pred["calibrated"]["step_error"]
        rows.append((f"{where} 1-GPU step predicted with the device's calibration alone vs the Engine", _pct(err),
                     "", ""))
    if "model" in pred and "step_error" in pred["model"]:
        err = pred["model"]["step_error"]
        rows.append((f"{where} 1-GPU step predicted with its calibration and the model's own rates (timed at "
                     f"{pred['model'].get('model_timed_at', '?')}) vs the Engine at 81x480x832", _pct(err),
                     "within 10%", "yes" if abs(err) <= 0.10 else "**no**"))
    return rows


def _measured_when(res: dict, status: dict) -> str:
    """Which results this run measured and when the others on disk were (a table may mix them)."""
    parts = []
    machines = {name: r["machine"] for name, r in res.items() if r and isinstance(r.get("machine"), dict)}
    # The development machine is not always the same CPU: where the results ran on more
    # than one, each says which.
    mixed = len({m.get("processor") for m in machines.values()}) > 1
    for name, r in res.items():
        if not r:
            continue
        m = machines.get(name, {})
        when = m.get("date_utc")
        load = (m.get("load_average") or [None])[0]
        ran = status.get(name, {}).get("ran")
        tag = "this run" if ran else "on disk"
        where = f", {m.get('processor') or 'processor not recorded'}" if mixed else ""
        parts.append(f"{name} {tag}" + (f" ({when} UTC, 1-min load {load}{where})" if when else ""))
    return "Results: " + "; ".join(parts) + "." if parts else ""


def write_summary(res: dict, status: dict, quick: bool, out: Path, report_only: bool = False) -> str:
    rows, notes = summary_rows(res)
    m = benchlib.machine()
    cmd = "python bench/run_all.py" + (" --report-only" if report_only else " --quick" if quick else "")
    lines = [
        f"Command: `{cmd}` ({time.strftime('%Y-%m-%d %H:%M', time.gmtime())} UTC). Machine: {m['processor']}, "
        f"{m['cpu_count']} cores, no GPU, Python {m['python']}, torch {m['torch']}, Ray {m.get('ray')}, "
        f"diffusers {m.get('diffusers')}; shared with other engineers' test runs (1-min load average "
        f"{m['load_average'][0] if m['load_average'] else 'n/a'} at the end; each result records its own).",
        "Figures: median (min-max, n runs). Compared runs are interleaved in one process.",
        _measured_when(res, status),
        "",
        "| measure | result | target | met |",
        "|---|---|---|---|",
    ]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    failed = [n for n, s in status.items() if s.get("ran") and s.get("returncode")]
    if failed:
        notes.append(f"Failed in this run (older results shown where present): {', '.join(failed)}.")
    lines += [""] + [f"- {n}" for n in notes]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text("# raydit benchmarks\n\n" + text + "\n![benchmarks](benchmarks.png)\n")
    return text


# -- the plot ------------------------------------------------------------------------------

def write_plot(res: dict, out: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e '.[bench]'): no plot")
        return None
    fig, axes = plt.subplots(2, 2, figsize=(12, 9))
    ax = axes[0][0]
    sc = res.get("scaling")
    if sc:
        labels, meds, lo, hi, cpu = [], [], [], [], []
        for case in sc["cases"]:
            for name in ("ulysses 2", "ulysses 2 no overlap", "ring 2"):
                if name not in case["configs"]:
                    continue
                e = case["configs"][name]
                labels.append(f"{name}\n{case['latent_frames']} frame(s)")
                meds.append(e["speedup"]["median"])
                lo.append(e["speedup"]["median"] - e["speedup"]["min"])
                hi.append(e["speedup"]["max"] - e["speedup"]["median"])
                cpu.append(e["cpu_speedup"]["median"])
        x = range(len(labels))
        ax.bar(x, meds, yerr=[lo, hi], capsize=4, color="tab:blue", label="wall-clock speedup (min-max)")
        ax.scatter(x, cpu, color="tab:orange", zorder=3, label="CPU-time split")
        ax.axhline(2.0, color="gray", ls=":", label="ideal 2x")
        ax.axhline(sc.get("target_speedup", 1.85), color="tab:red", ls="--",
                   label=f"target {sc.get('target_speedup', 1.85)}x")
        ax.set_xticks(list(x), labels)
        ax.set_ylabel("speedup over 1 rank")
        ax.set_title("1. CogVideoX-2b-shaped step, 2 ranks vs 1 (CPU)")
        ax.legend(fontsize=8)
    ax = axes[0][1]
    cm = res.get("costmodel")
    if cm:
        pts = [(r["measured"], r["predicted"], "cpu (measured here)") for r in cm["measured"]]
        per_step = {"s / step": 1, "s / video": 50, "s / 50 steps": 50}
        pts += [(r["published"] / per_step[r["unit"]], r["predicted"] / per_step[r["unit"]], r["role"])
                for r in cm["anchors"] if r["unit"] in per_step and r["guidance"]]
        colors = {"cpu (measured here)": "tab:blue", "fit": "tab:gray", "calibration": "tab:gray",
                  "check": "tab:green", "context": "tab:orange", "approximation": "tab:purple"}
        for kind, color in colors.items():
            xs = [p[0] for p in pts if p[2] == kind]
            ys = [p[1] for p in pts if p[2] == kind]
            if xs:
                ax.scatter(xs, ys, color=color, label=f"{kind} (GPU: published)" if kind != "cpu (measured here)" else kind)
        lo_ = min(min(p[0] for p in pts), min(p[1] for p in pts)) * 0.7
        hi_ = max(max(p[0] for p in pts), max(p[1] for p in pts)) * 1.4
        ax.plot([lo_, hi_], [lo_, hi_], color="black", lw=1)
        ax.fill_between([lo_, hi_], [lo_ * 0.85, hi_ * 0.85], [lo_ * 1.15, hi_ * 1.15], color="gray", alpha=0.2,
                        label="within 15%")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("measured / published s per step")
        ax.set_ylabel("predicted s per step")
        ax.set_title("3. cost model against reality")
        ax.legend(fontsize=8)
    ax = axes[1][0]
    st = res.get("startup")
    if st:
        cold = [r for r in st["rows"] if not r.get("warmup")]
        ws = [r["workers"] for r in cold]
        ax.plot(ws, [r["ready_seconds"]["median"] for r in cold], "o-", label="Engine(...) ready")
        ax.plot(ws, [r["first_step_seconds"]["median"] for r in cold], "s-", label="first step finished")
        ax.set_xticks(ws)
        ax.set_xlabel("workers (tiny pipeline, cold local Ray)")
        ax.set_ylabel("seconds")
        ax.set_ylim(bottom=0)
        ax.set_title("4. start-up")
        ax.legend(fontsize=8)
    ax = axes[1][1]
    bars = []
    rc = res.get("recovery")
    if rc:
        bars += [("detect", rc["detect_seconds"]), ("regroup", rc["regroup_seconds"]),
                 ("kill -> resumed step", rc["kill_to_first_resumed_step_seconds"]),
                 ("added to request", rc["added_delay_seconds"])]
    if bars:
        names = [b[0] for b in bars]
        meds = [b[1]["median"] for b in bars]
        err = [[b[1]["median"] - b[1]["min"] for b in bars], [b[1]["max"] - b[1]["median"] for b in bars]]
        ax.barh(names, meds, xerr=err, capsize=4, color="tab:red")
        ax.set_xlabel("seconds (min-max)")
        ax.set_title("5. losing 1 of 2 nodes mid-request")
    ov = res.get("overhead")
    if ov:
        fc = ov.get("fixed_cost")
        text = (f"2. Ray engine's fixed cost per step: {fc['seconds_per_step']['median'] * 1e3:.1f} ms "
                f"({fc['share_of_bench_step']:+.1%} of a {ov['plain_step_seconds']['median']:.2f} s step)"
                if fc else f"2. Ray engine overhead per step: {ov['overhead']:+.1%}")
        ax.text(0.98, 0.02, text, transform=ax.transAxes, ha="right", va="bottom", fontsize=9)
    fig.suptitle("raydit benchmarks (summary.md beside this plot has every figure with its spread)")
    fig.tight_layout()
    path = out / "benchmarks.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


HOW_TO_READ = (
    "`python bench/run_all.py --quick` measures everything below in about 5 minutes on 2 cores; "
    "`python bench/run_all.py` (about three hours) adds 3 latent frames, more rounds, CogVideoX-2b's 30 "
    "layers, the real VAEs' decode, the other families, `raydit serve` and the "
    "attention-only benchmark (docs/benchmarks/attention.md). The development machine has 2 cores shared "
    "with other engineers' test runs, so every result records the load average (and, for the scaling runs, "
    "the CPU time other processes took meanwhile); compared runs are interleaved in one process and ratios "
    "are taken per round. \"CPU-time split\" is the 1-rank step's CPU time over the busiest rank's: the "
    "speedup with a core per rank and nothing else running, as an upper bound (it leaves out time blocked "
    "in communication)."
)


def replace_section(text: str, heading: str, body: str) -> str:
    """`text` with the body of the Markdown section `heading` (a "## " line) replaced by `body`;
    the heading and every other section stay as they are."""
    head = heading.rstrip("\n") + "\n"
    if head not in text:
        raise ValueError(f"no {heading.strip()!r} section; add the heading first")
    start = text.index(head) + len(head)
    nxt = text.find("\n## ", start)
    rest = "" if nxt < 0 else text[nxt + 1:]
    return text[:start] + "\n" + body.strip("\n") + "\n" + ("\n" + rest if rest else "")


def update_readme(summary: str, readme: Path = REPO / "README.md", plot_written: bool = True) -> None:
    plot_note = "" if plot_written else ("(The plot is from an earlier run: matplotlib was not installed for this "
                                         "one, `pip install -e '.[bench]'`.)\n\n")
    body = (HOW_TO_READ + "\n\n" + summary + "\n![raydit benchmarks](docs/benchmarks/benchmarks.png)\n\n" + plot_note +
            "An earlier full run on a quiet machine, before the pipelined Ulysses: docs/benchmarks/full/summary.md. "
            "Every figure with its spread, load average and raw values: `docs/benchmarks/*.json`; how each "
            "is measured: the docstring of its script in `bench/`. GPU-only figures: `python bench/bench_gpu.py` "
            "on a CUDA machine (one with torch alone: `--wheels DIR` installs Ray's and diffusers' wheels "
            "carried there first; `--smoke` checks the script on a CPU). The planner against every family at "
            "real widths on one GPU (step and decode, measured against predicted, issue 40's table): `python "
            "bench/bench_familysteps.py` (torch and diffusers, no Ray; the transformer timed at two depths and "
            "carried to its real one, said so in its output; not yet run on a GPU). The cost model against "
            "published figures, one GPU and beyond (no GPU needed): `python bench/bench_costmodel.py`, "
            "docs/benchmarks/costmodel.md.")
    readme.write_text(replace_section(readme.read_text(), "## Performance", body))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer rounds; under 5 minutes on 2 cores")
    ap.add_argument("--only", nargs="+", choices=list(SUITE), help="run these only (the rest: results on disk)")
    ap.add_argument("--report-only", action="store_true", help="run nothing; rebuild the table and plot")
    ap.add_argument("--update-readme", action="store_true", help="write the table into README.md's Performance section")
    ap.add_argument("--out", default=str(benchlib.OUT_DIR))
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    status = {} if args.report_only else run_suite(args.only or list(SUITE), args.quick, out)
    res = {name: benchlib.read_json(name, out) for name in SUITE}
    summary = write_summary(res, status, args.quick, out, args.report_only)
    plot = write_plot(res, out)
    elapsed = round(time.perf_counter() - t0, 1)
    benchlib.write_json("results", {"command": "python bench/run_all.py" + (" --quick" if args.quick else ""),
                                    "seconds": elapsed, "status": status, "results": res}, out)
    if args.update_readme:
        update_readme(summary, plot_written=plot is not None)
    print(summary)
    print(f"run_all: {elapsed} s; wrote {out}/summary.md, benchmarks.png, results.json")
    return 1 if any(s.get("returncode") for s in status.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
