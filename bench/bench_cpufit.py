"""Fit of the `cpu` device type's `efficiency` (raydit/planner/hardware.py): the fraction of
the matmul rate `raydit doctor --calibrate` measures that a CogVideoX-2b-shaped denoising
step reaches on one CPU thread.

Both sides are taken in CPU time of this process (time.process_time), so a shared,
loaded machine slows neither: the matmul rate over matrices of bench_scaling's
CALIBRATION_SIZES (the median size's rate), then one forward of the bench_scaling
transformer (2 layers, 1 and 3 latent frames). efficiency = the planner's prediction at
efficiency 1 on the measured rate / the step's CPU time. It is the table's `cpu` entry, used
where nothing was calibrated; a calibrated CPU slot measures its DiT block's rates instead
(raydit.runtime.measure.measure_dit), and bench_scaling.py's predictions use those.

    python bench/bench_cpufit.py [--repeats 2] [--out docs/benchmarks]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import benchlib  # noqa: E402


def cpu_time_matmul_tflops(sizes) -> float:
    import torch

    rates = []
    for n in sizes:
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.matmul(a, b)
        c0 = time.process_time()
        for _ in range(5):
            torch.matmul(a, b)
        rates.append(5 * 2 * n**3 / (time.process_time() - c0) / 1e12)
    return statistics.median(rates)


def run(frames_list, repeats: int) -> dict:
    import torch

    import bench_scaling as bs
    from raydit.planner import device_type

    torch.set_num_threads(1)
    rows = []
    for frames in frames_list:
        model = bs.bench_transformer(2, 4096)
        g = torch.Generator().manual_seed(1)
        inputs = dict(hidden_states=torch.randn(1, frames, bs.LATENT_C, bs.LATENT_H, bs.LATENT_W, generator=g),
                      encoder_hidden_states=torch.randn(1, bs.TEXT_TOKENS, 4096, generator=g),
                      timestep=torch.tensor([500]))
        with torch.no_grad():
            model(**inputs)  # warm-up
            for _ in range(repeats):
                rate = cpu_time_matmul_tflops(bs.CALIBRATION_SIZES)
                c0, w0, load = time.process_time(), time.perf_counter(), benchlib.loadavg()
                model(**inputs)
                cpu, wall = time.process_time() - c0, time.perf_counter() - w0
                dev = dataclasses.replace(device_type("cpu"), tflops=rate, efficiency=1.0)
                pred = bs.predictions(frames, 2, dev)["1 rank"]["predicted_step_seconds"]
                rows.append({"latent_frames": frames, "matmul_tflops_cpu_time": round(rate, 5),
                             "step_cpu_seconds": round(cpu, 3), "step_wall_seconds": round(wall, 3),
                             "predicted_at_efficiency_1": pred, "efficiency": round(pred / cpu, 3), "load": load})
                print(rows[-1], flush=True)
    return {"machine": benchlib.machine(), "rows": rows,
            "efficiency": benchlib.summary([r["efficiency"] for r in rows], 3)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--frames", type=int, nargs="+", default=[1, 3])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default=str(benchlib.OUT_DIR))
    args = ap.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    result = run(args.frames, args.repeats)
    print("efficiency", benchlib.fmt(result["efficiency"], "", 3))
    print("wrote", benchlib.write_json("cpufit", result, Path(args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
