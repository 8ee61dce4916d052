"""Shared helpers of the bench/ scripts: machine description, statistics, result files.

Every figure a script reports is a `summary(values)`: the median with min, max, the
interquartile range and the raw values, so a reader can judge the spread. Load averages are
recorded beside the measurements: this machine is shared, and a figure taken under load says
so in its own record.

Bench scripts put this directory on sys.path and import this module; spawned children find
it there too (multiprocessing's spawn passes the parent's sys.path on).
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT_DIR = REPO / "docs" / "benchmarks"


def loadavg() -> list[float]:
    """1, 5 and 15 minute load averages (empty where the OS has none)."""
    return [round(x, 2) for x in os.getloadavg()] if hasattr(os, "getloadavg") else []


def machine() -> dict:
    """What the figures ran on."""
    import torch

    info = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "processor": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
        "load_average": loadavg(),
        "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
    }
    try:
        import diffusers
        import ray

        info["diffusers"] = diffusers.__version__
        info["ray"] = ray.__version__
    except ImportError:  # pragma: no cover - both are raydit dependencies
        pass
    return info


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def summary(values: list[float], digits: int = 4) -> dict:
    """Median, min, max, quartiles and the raw values (n may be 1: then all are equal)."""
    if not values:
        raise ValueError("summary of no values; run at least one repeat")
    xs = sorted(float(v) for v in values)
    if len(xs) >= 2:
        q1, _, q3 = statistics.quantiles(xs, n=4, method="inclusive")
    else:
        q1 = q3 = xs[0]
    r = lambda v: round(v, digits)  # noqa: E731
    return {
        "median": r(statistics.median(xs)),
        "min": r(xs[0]),
        "max": r(xs[-1]),
        "q1": r(q1),
        "q3": r(q3),
        "n": len(xs),
        "values": [r(v) for v in values],
    }


def fmt(stat: dict, unit: str = "s", digits: int = 3) -> str:
    """'1.234 s (1.200-1.300, n=5)': median with the min-max range."""
    if stat is None:
        return "n/a"
    d = digits
    return f"{stat['median']:.{d}f} {unit} ({stat['min']:.{d}f}-{stat['max']:.{d}f}, n={stat['n']})".replace(" ()", "")


def write_json(name: str, payload: dict, out: Path = OUT_DIR) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path


def read_json(name: str, out: Path = OUT_DIR) -> dict | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.is_file() else None


def machine_busy_seconds() -> float:
    """CPU seconds every process of the machine has used since boot (Linux /proc/stat);
    nan where there is no /proc/stat. Busy time during a measurement minus the measured
    processes' own CPU time is the interference from everyone else."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:9]
    except OSError:
        return float("nan")
    user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields)
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def cpu_by_process() -> dict[int, tuple[str, float, int]]:
    """pid -> (name, CPU seconds used so far, reaped children included, start time in clock
    ticks) for every process of the machine (Linux /proc; {} elsewhere). The name is Ray's
    process title where it set one (`ray::RankWorker.step`), else the executable's base name;
    kernel threads (no command line) are `kernel:` + their kind (`kernel:kworker`), as a
    kworker renames itself with each work item it runs. Two snapshots' difference shows where
    a measurement's CPU went."""
    out: dict[int, tuple[str, float, int]] = {}
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    try:
        pids = [int(d) for d in os.listdir("/proc") if d.isdigit()]
    except OSError:
        return out
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        seconds = sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
        started = int(fields[19])  # starttime: tells a reused pid from the same process
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        if not (cmd and cmd[0]):
            out[pid] = ("kernel:" + comm.split("/")[0], seconds, started)
            continue
        title = cmd[0].decode(errors="replace")
        name = title.split()[0] if title.startswith("ray::") else os.path.basename(title.split()[0] if title else "?")
        out[pid] = (name.split(".")[0] if name.startswith("ray::") else name, seconds, started)
    return out


def delta_by_name(before: dict, after: dict, top: int = 8) -> dict[str, float]:
    """Per process name, how much a per-process counter grew between two snapshots of
    cpu_by_process() or runqueue_wait_by_process() (processes born in between count from
    zero), the `top` largest."""
    acc: dict[str, float] = {}
    for pid, (name, sec, started) in after.items():
        prev = before.get(pid)
        d = sec - (prev[1] if prev and prev[2] == started else 0.0)
        if d > 0:
            acc[name] = acc.get(name, 0.0) + d
    return {k: round(v, 2) for k, v in sorted(acc.items(), key=lambda kv: -kv[1])[:top]}


def runqueue_wait_by_process(procs: dict[int, tuple[str, float, int]]) -> dict[int, tuple[str, float, int]]:
    """For the processes of a cpu_by_process() snapshot: pid -> (name, seconds its threads have
    spent runnable but waiting for a CPU, start time) from /proc/PID/task/*/schedstat (its
    second field); {} where the kernel keeps no schedstat. Threads that ended before the
    snapshot are not counted."""
    out: dict[int, tuple[str, float, int]] = {}
    for pid, (name, _cpu, started) in procs.items():
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        wait_ns = 0
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    wait_ns += int(f.read().split()[1])
            except (OSError, IndexError, ValueError):
                continue
        out[pid] = (name, wait_ns / 1e9, started)
    return out


def wait_for_quiet(max_wait_s: float, window_s: float = 0.5, quiet: float = 0.2) -> float:
    """Wait (at most max_wait_s) until the machine's other work uses < `quiet` of a core
    over `window_s`; returns the seconds waited. Call while this benchmark itself is idle."""
    waited = 0.0
    while waited < max_wait_s:
        b0 = machine_busy_seconds()
        time.sleep(window_s)
        waited += window_s
        if not machine_busy_seconds() - b0 > quiet * window_s:  # nan: no /proc/stat, go
            break
    return round(waited, 2)


# The model the engine benchmarks run: the tiny pipeline (tokenizer, T5, VAE) with a
# CogVideoX-2b-wide transformer (30 heads x 64, 2 layers) at 128 x 128 pixels, 9 frames:
# 16 text + 3 x 8 x 8 video tokens, two guidance branches, so a step takes ~0.5 s on two
# 1-thread ranks here (large enough for a 2% overhead to be measurable).
BENCH_MODEL = dict(num_attention_heads=30, attention_head_dim=64, num_layers=2, sample_height=16, sample_width=16)
BENCH_MODEL_VERSION = "1"


def bench_model_dir() -> str:
    """Build (once, cached) and return the bench pipeline directory."""
    from raydit.models.families.cogvideox.tiny import TINY_VERSION, build_tiny_pipeline
    from raydit.models.tiny import cache_root

    name = f"bench-cogvideox-30x64-2l-128px-t{TINY_VERSION}-b{BENCH_MODEL_VERSION}"
    return str(build_tiny_pipeline(cache_root() / name, **BENCH_MODEL))


# Wan 2.1 1.3B's transformer shape (12 heads x 128, FFN 8960, 30 layers) with random weights,
# behind the tiny Wan pipeline's tokenizer, umT5 and VAE: what bench_gpu runs at 81 x 480 x 832
# and bench_engine_step runs on the CPU with fewer layers. No weights are downloaded.
WAN_1_3B = dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, freq_dim=256, num_layers=30)
WAN_BENCH_VERSION = "1"


def wan_bench_dir(layers: int = 30, dtype: str = "bfloat16", defaults: dict | None = None,
                  root: str | os.PathLike | None = None) -> str:
    """Build (once, cached under `root` or raydit's cache) and return a Wan pipeline directory
    with a Wan-1.3B-shaped transformer of `layers` layers stored in `dtype`; `defaults`: the
    request defaults (frames, height, width) the directory carries for the planner."""
    import torch
    from diffusers import WanTransformer3DModel

    from raydit.models.families.wan.tiny import TINY_TEXT_DIM, tiny_pipeline
    from raydit.models.tiny import DEFAULTS_FILE, cache_root, write_pipeline

    defaults = defaults or {"num_frames": 81, "height": 480, "width": 832}
    name = (f"bench-wan-1.3b-{layers}l-{dtype}-{defaults['num_frames']}x{defaults['height']}x{defaults['width']}"
            f"-w{WAN_BENCH_VERSION}")

    class _Bench:
        def save_pretrained(self, directory) -> None:
            pipe = tiny_pipeline("tiny-wan")
            config = dict(WAN_1_3B, num_layers=layers)
            torch.manual_seed(0)
            transformer = WanTransformer3DModel(
                patch_size=(1, 2, 2), in_channels=pipe.vae.config.z_dim, out_channels=pipe.vae.config.z_dim,
                text_dim=TINY_TEXT_DIM, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                rope_max_seq_len=1024, **config)
            generator = torch.Generator().manual_seed(0)
            with torch.no_grad():
                for p in transformer.parameters():
                    # 0.02: an initialised network's scale, so 30 layers stay finite in bf16
                    # (diffusers zero-initialises some gates; every weight is drawn here).
                    p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
            pipe.transformer = transformer.to(getattr(torch, dtype))
            pipe.register_to_config(transformer=("diffusers", "WanTransformer3DModel"))
            pipe.save_pretrained(directory)
            (Path(directory) / DEFAULTS_FILE).write_text(json.dumps(defaults, indent=1) + "\n")

    return str(write_pipeline(Path(root or cache_root()) / name, _Bench))


def dispatch_counter(views, extra_bytes=None):
    """A TorchDispatchMode class that counts what torch dispatches, op by op: for each op name
    not in `views` (ops that launch no kernel), `ops[name] = [launches, values, bytes]` over its
    tensor inputs and outputs, plus `extra_bytes(name, args)` where given (memory a kernel moves
    that no dispatch shows). `total(field, exclude)` sums a field (0 launches, 1 values,
    2 bytes) over the ops not in `exclude`. Runs on any device, the meta device included."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops: dict[str, list] = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func._overloadpacket.__name__
            if name in views:
                return out
            tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
            row = self.ops.setdefault(name, [0, 0, 0])
            row[0] += 1
            row[1] += sum(t.numel() for t in tensors)
            row[2] += sum(t.numel() * t.element_size() for t in tensors) + (extra_bytes(name, args) if extra_bytes else 0)
            return out

        def total(self, field: int, exclude=()) -> int:
            return sum(row[field] for name, row in self.ops.items() if name not in exclude)

    return Count
