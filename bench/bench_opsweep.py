"""Measure the op rates of the planner's device model on the GPU this runs on; write its table.

    python bench/bench_opsweep.py --budget-s 280                # on a GPU: writes raydit/planner/tables/<gpu>.json
    python bench/bench_opsweep.py --smoke --out /tmp/t.json     # CPU, tiny shapes, seconds: the code paths
    python bench/bench_opsweep.py --scale                       # rewrite the scaled tables from the measured ones
    python bench/bench_opsweep.py --count-blocks                # CPU, needs diffusers: elementwise bytes per block

Needs torch only (no Ray, no diffusers; --count-blocks needs diffusers). Each part runs guarded
(a part that fails is recorded with its error; the others run), the table is written after every
part, and `--budget-s` stops before a part that would start past the budget. Figures a run did not
measure keep the table's previous ones with their `source` (raydit.planner.devicemodel).

Parts (bf16 on CUDA; float32 on a CPU --smoke):
  launch       per-launch cost: 2000 tiny adds queued, divided
  elementwise  a DiT block's elementwise chain (float32 layer norm, modulation, gate, residual,
               tanh-GELU) eager: the bytes into and out of its ops (counted as bench_blockcounts
               counts a family's, so the two meet in the planner) over its time is the table's
               elementwise bandwidth; a large add (read 2, write 1 tensors) beside it, recorded;
               compile's fusion: the chain under torch.compile, compiled_fraction = compiled / eager
  gemm         bf16 GEMMs at DiT shapes (rows 1k..64k x widths 1536..16384) and square ones
  fp8          the same through torch._scaled_mm (e4m3, row-wise scales), where the GPU has FP8
  attention    SDPA (the ring-1 kernel) and the LSE kernels (cuDNN / flash with log-sum-exp) at
               head dims 64 / 128 and 4k..119k tokens; raydit's int8 / fp8 kernels where they pass their check
  p2p          with 2 GPUs: copies between them by message size (bandwidth, latency)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TABLES = ROOT / "raydit" / "planner" / "tables"
sys.path.insert(0, str(ROOT))

# Published figures of the GPUs the planner knows (vendor datasheets, dense, no sparsity): bf16 and
# fp8 tensor TFLOP/s (0: no FP8 tensor cores), memory bandwidth GB/s, link GB/s one direction.
PUBLISHED = {
    "H100": {"gpu": "NVIDIA H100 SXM5 80GB", "bf16": 989.4, "fp8": 1978.9, "hbm": 3350, "link": 450},
    "H200": {"gpu": "NVIDIA H200 SXM 141GB", "bf16": 989.4, "fp8": 1978.9, "hbm": 4800, "link": 450},
    "A100-80GB": {"gpu": "NVIDIA A100 SXM4 80GB", "bf16": 312, "fp8": 0, "hbm": 2039, "link": 300},
    "A100-40GB": {"gpu": "NVIDIA A100 SXM4 40GB", "bf16": 312, "fp8": 0, "hbm": 1555, "link": 300},
    "L40S": {"gpu": "NVIDIA L40S", "bf16": 362.05, "fp8": 733, "hbm": 864, "link": 25},
    "L4": {"gpu": "NVIDIA L4", "bf16": 121, "fp8": 242.5, "hbm": 300, "link": 12},
    "H20": {"gpu": "NVIDIA H20 96GB", "bf16": 148, "fp8": 296, "hbm": 4000, "link": 450},
    "B200": {"gpu": "NVIDIA B200 (HGX, 180GB)", "bf16": 2250, "fp8": 4500, "hbm": 8000, "link": 900},
}
SCALED = ("A100-80GB", "A100-40GB", "L40S", "L4", "H20", "B200")
# Types whose device figures are fit on published steps (raydit.planner.hardware): a scaled table
# is data beside them, not used; the others (no fit of their own) are priced with it.
FIT_FIGURES = ("H100", "A100-80GB", "A100-40GB", "L40S", "L4")
# Which measured table each scaled GPU comes from (the one measured on the closest part).
SCALE_FROM = "H200"

GEMM_ROWS = (1024, 4096, 16384, 32768, 65536)
GEMM_WIDTHS = ((1536, 1536), (3072, 3072), (5120, 5120), (8960, 1536), (1536, 8960), (12288, 3072),
               (3072, 12288), (13824, 5120), (5120, 13824))
SQUARE = (2048, 4096, 8192)
ATTN_SHAPES = ((64, 30, 17776, 2), (64, 6, 17776, 2), (64, 32, 4096, 1), (128, 12, 32760, 1), (128, 24, 8192, 1),
               (128, 3, 119056, 1), (128, 40, 32760, 1), (128, 12, 17160, 2))
SMOKE_ROWS, SMOKE_WIDTHS = (64, 128), ((64, 64), (128, 64))
SMOKE_ATTN = ((16, 2, 128, 1), (32, 2, 256, 1))


def _sig(x: float) -> float:
    """x to 4 significant digits (a CPU smoke's rates are tiny: rounding to 0.01 would zero them)."""
    return float(f"{x:.4g}")


def gpu_device_type(name: str) -> str:
    """Device type of a torch.cuda device name: 'NVIDIA H100 80GB HBM3' -> 'H100'."""
    n = name.upper()
    for key in ("H200", "H100", "H20", "B200", "L40S", "L4"):
        if key in n.replace("-", " ").split() or n.replace("NVIDIA ", "").startswith(key):
            return key
    if "A100" in n:
        return "A100-40GB" if "40GB" in n else "A100-80GB"
    raise ValueError(f"GPU {name!r} is not one of the planner's device types; pass --device-type NAME "
                     f"(known: {', '.join(PUBLISHED)})")


class Sweep:
    def __init__(self, device: str, smoke: bool, budget_s: float, table: dict, out: Path):
        import torch

        self.torch = torch
        self.device = device
        self.smoke = smoke
        self.dtype = torch.bfloat16 if device == "cuda" else torch.float32
        self.dev = torch.device("cuda", 0) if device == "cuda" else torch.device("cpu")
        self.t0 = time.perf_counter()
        self.budget_s = budget_s
        self.table = table
        self.out = out
        self.parts: dict[str, dict] = {}

    def sync(self):
        if self.device == "cuda":
            self.torch.cuda.synchronize()

    def timed(self, fn, repeats: int = 5, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    def left(self) -> float:
        return self.budget_s - (time.perf_counter() - self.t0)

    def part(self, name: str, fn, need_s: float):
        if self.left() < need_s:
            self.parts[name] = {"status": f"skipped: {self.left():.0f} s of the budget left, the part needs ~{need_s:g}"}
            print(f"{name}: skipped (budget)")
            return
        t = time.perf_counter()
        try:
            got = fn()
            self.parts[name] = {"status": "ok", "seconds": round(time.perf_counter() - t, 1)}
            print(f"{name}: ok ({time.perf_counter() - t:.1f} s) {json.dumps(got)[:300]}")
        except Exception as exc:  # a part that fails leaves the others and the table's figures
            self.parts[name] = {"status": f"failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"}
            print(f"{name}: failed: {type(exc).__name__}: {exc}")
        finally:
            if self.device == "cuda":
                self.torch.cuda.empty_cache()
        self.write()

    def source(self, what: str) -> str:
        return f"measured {self.table['date']} by bench_opsweep ({what})"

    def write(self):
        self.table["sweep_parts"] = self.parts
        self.out.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.table, indent=1) + "\n")
        tmp.replace(self.out)

    # -- parts ---------------------------------------------------------------------------------

    def launch(self):
        torch = self.torch
        x = torch.zeros(8, device=self.dev)
        n = 200 if self.smoke else 2000

        def run():
            for _ in range(n):
                x.add_(1)

        us = self.timed(run, repeats=3, warmup=1) / n * 1e6
        self.table["launch_us"] = {"value": _sig(us), "source": self.source(f"{n} tiny adds queued")}
        return {"launch_us": us}

    def elementwise(self):
        torch = self.torch
        F = torch.nn.functional
        n = (1 << 20) if self.smoke else (1 << 27)  # 256 MB of bf16
        a, b = torch.randn(n, device=self.dev, dtype=self.dtype), torch.randn(n, device=self.dev, dtype=self.dtype)
        c = torch.empty_like(a)
        t = self.timed(lambda: torch.add(a, b, out=c))
        gb_s = 3 * n * a.element_size() / t / 1e9
        self.table["add_gb_s"] = {"value": _sig(gb_s), "source": self.source(f"add of {n} elements, 3 tensors moved")}
        tokens, hidden = (256, 64) if self.smoke else (32760, 1536)
        x = torch.randn(1, tokens, hidden, device=self.dev, dtype=self.dtype)
        y = torch.randn(1, tokens, 4 * hidden, device=self.dev, dtype=self.dtype)
        mod = torch.randn(6, hidden, device=self.dev, dtype=torch.float32)

        def chain(x, y, mod):
            # A DiT block's elementwise work around its GEMMs, modulation in float32 (Wan's way).
            h = (F.layer_norm(x.float(), (hidden,)) * (1 + mod[1]) + mod[0]).type_as(x)
            r = x + (h.float() * mod[2]).type_as(x)
            h2 = (F.layer_norm(r.float(), (hidden,)) * (1 + mod[4]) + mod[3]).type_as(x)
            return r + (h2.float() * mod[5]).type_as(x), F.gelu(y, approximate="tanh")

        with torch.no_grad():
            eager = self.timed(lambda: chain(x, y, mod))
            moved = chain_bytes(chain, x, y, mod)
            self.table["elementwise_gb_s"] = {"value": _sig(moved / eager / 1e9), "source": self.source(
                f"a DiT block's eager elementwise chain at {tokens} x {hidden}: {moved / 1e9:.3f} GB into and out "
                f"of its ops in {eager * 1e3:.3f} ms; an add of {n} elements reached {_sig(gb_s)} GB/s")}
            out = {"add_gb_s": gb_s, "chain_bytes": moved, "chain_eager_s": eager}
            try:
                compiled_fn = torch.compile(chain, fullgraph=True)
                compiled = self.timed(lambda: compiled_fn(x, y, mod), warmup=3)
                frac = min(1.0, compiled / eager)
                self.table["compiled_fraction"] = {
                    "value": round(frac, 4),
                    "source": self.source(f"a DiT block's elementwise chain, torch.compile {compiled * 1e3:.3f} ms "
                                          f"/ eager {eager * 1e3:.3f} ms at {tokens} x {hidden}")}
                out.update(chain_compiled_s=compiled, compiled_fraction=frac)
            except Exception as exc:  # no compiler here: the table's figure stays
                out["compile"] = f"not measured: {type(exc).__name__}"
        return out

    def _gemm_shapes(self):
        if self.smoke:
            return [(m, n, k) for m in SMOKE_ROWS for n, k in SMOKE_WIDTHS]
        shapes = [(m, n, k) for m in GEMM_ROWS for n, k in GEMM_WIDTHS]
        return shapes + [(s, s, s) for s in SQUARE]

    def gemm(self):
        torch = self.torch
        rows = []
        for m, n, k in self._gemm_shapes():
            if self.left() < 5:
                break
            a = torch.randn(m, k, device=self.dev, dtype=self.dtype)
            w = torch.randn(n, k, device=self.dev, dtype=self.dtype)
            t = self.timed(lambda: torch.nn.functional.linear(a, w))
            rows.append({"m": m, "n": n, "k": k, "tflops": _sig(2 * m * n * k / t / 1e12),
                         "source": self.source("F.linear")})
        if rows:
            self.table.setdefault("gemm", {})["bf16"] = rows
        return {"shapes": len(rows), "max_tflops": max((r["tflops"] for r in rows), default=0)}

    def fp8(self):
        torch = self.torch
        if self.device != "cuda" or not hasattr(torch, "float8_e4m3fn"):
            raise RuntimeError("FP8 GEMMs need a CUDA GPU with float8 (torch._scaled_mm)")
        rows = []
        for m, n, k in self._gemm_shapes():
            if self.left() < 5:
                break
            a = torch.randn(m, k, device=self.dev).to(torch.float8_e4m3fn)
            w = torch.randn(n, k, device=self.dev).to(torch.float8_e4m3fn)
            sa = torch.ones(m, 1, device=self.dev)
            sw = torch.ones(1, n, device=self.dev)
            t = self.timed(lambda: torch._scaled_mm(a, w.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16))
            rows.append({"m": m, "n": n, "k": k, "tflops": _sig(2 * m * n * k / t / 1e12),
                         "source": self.source("torch._scaled_mm e4m3, row-wise scales, bf16 out")})
        if rows:
            self.table.setdefault("gemm", {})["fp8"] = rows
        return {"shapes": len(rows), "max_tflops": max((r["tflops"] for r in rows), default=0)}

    def attention(self):
        torch = self.torch
        F = torch.nn.functional
        aten = torch.ops.aten
        plain, lse, int8, fp8, fa2 = [], [], [], [], []
        lowbit = {}  # raydit's 8-bit kernels (raydit.parallel.kernels.lowbit), those that pass their float64 check
        if self.device == "cuda":
            try:
                from raydit.parallel import kernels as K

                for mode in ("int8", "fp8"):
                    name = f"{mode}-triton"
                    if name in K.candidate_kernels(self.dev, self.dtype, mode) and \
                            all(K.check_kernel(name, self.dev, self.dtype, d) is None for d in (64, 128)):
                        lowbit[mode] = (name, K.KERNELS[name])
            except Exception:
                lowbit = {}
        for d, heads, tokens, batch in (SMOKE_ATTN if self.smoke else ATTN_SHAPES):
            if self.left() < 8:
                break
            q, k, v = (torch.randn(batch, tokens, heads, d, device=self.dev, dtype=self.dtype).transpose(1, 2)
                       for _ in range(3))
            flop = 4 * batch * heads * tokens * tokens * d
            row = {"head_dim": d, "tokens": tokens, "heads": heads, "batch": batch}
            t = self.timed(lambda: F.scaled_dot_product_attention(q, k, v), repeats=5)
            plain.append(dict(row, tflops=_sig(flop / t / 1e12), kernel="sdpa",
                              source=self.source("F.scaled_dot_product_attention")))
            best = None
            if self.device == "cuda":
                for name, fn in (("cudnn-lse", lambda: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)),
                                 ("flash-lse", lambda: aten._scaled_dot_product_flash_attention(q, k, v))):
                    try:
                        t = self.timed(fn, repeats=5)
                    except Exception:
                        continue
                    if name == "flash-lse":
                        fa2.append(dict(row, tflops=_sig(flop / t / 1e12), kernel="torch-flash",
                                        source=self.source("aten flash attention (FlashAttention-2)")))
                    if best is None or t < best[1]:
                        best = (name, t)
            else:
                best = ("sdpa (CPU: no LSE kernel timed)", t)
            if best:
                lse.append(dict(row, tflops=_sig(flop / best[1] / 1e12), kernel=best[0],
                                source=self.source("the fastest LSE kernel")))
            for mode, rows in (("int8", int8), ("fp8", fp8)):
                if mode in lowbit:
                    name, fn = lowbit[mode]
                    try:
                        t = self.timed(lambda: fn(q, k, v, d ** -0.5), repeats=5)
                        rows.append(dict(row, tflops=_sig(flop / t / 1e12), kernel=name,
                                         source=self.source(f"raydit.parallel.kernels.lowbit {name} (quantization included)")))
                    except Exception:
                        pass
        att = self.table.setdefault("attention", {})
        for key, rows in (("bf16", plain), ("bf16-lse", lse), ("int8", int8), ("fp8", fp8), ("fa2", fa2)):
            if rows:
                att[key] = rows
        return {"plain": len(plain), "lse": len(lse), "int8": len(int8), "fp8": len(fp8), "fa2": len(fa2)}

    def p2p(self):
        torch = self.torch
        if self.device != "cuda" or torch.cuda.device_count() < 2:
            raise RuntimeError("one GPU: the links keep the table's published figures")
        rows = []
        for nbytes in (1 << 16, 1 << 20, 1 << 24, 1 << 27):
            a = torch.empty(nbytes, dtype=torch.uint8, device="cuda:0")
            b = torch.empty(nbytes, dtype=torch.uint8, device="cuda:1")

            def copy_():
                b.copy_(a, non_blocking=True)
                torch.cuda.synchronize(1)

            t = self.timed(copy_)
            rows.append({"bytes": nbytes, "seconds": t})
        small = rows[0]["seconds"]
        big = rows[-1]
        gb_s = (big["bytes"] - rows[0]["bytes"]) / (big["seconds"] - small) / 1e9
        lat = max(0.0, small - rows[0]["bytes"] / (gb_s * 1e9)) * 1e6
        self.table["p2p"] = [{"bytes": r["bytes"], "gb_s": _sig(gb_s), "latency_us": _sig(lat),
                              "source": self.source("copies cuda:0 -> cuda:1")} for r in rows]
        return {"p2p_gb_s": gb_s, "latency_us": lat}


def chain_bytes(fn, *args) -> int:
    """Bytes into and out of every op `fn(*args)` dispatches but views, as bench_blockcounts counts
    a family's block (the same rule on both sides of the planner's elementwise term)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    class Count(TorchDispatchMode):
        moved = 0

        def __torch_dispatch__(self, func, types, a=(), kw=None):
            out = func(*a, **(kw or {}))
            if func._overloadpacket.__name__ not in ("view", "_unsafe_view", "select", "expand", "unsqueeze"):
                self.moved += sum(t.numel() * t.element_size() for t in tree_flatten((a, kw, out))[0]
                                  if isinstance(t, torch.Tensor))
            return out

    c = Count()
    with torch.no_grad(), c:
        fn(*args)
    return c.moved


def scaled_table(base: dict, name: str) -> dict:
    """A table for `name` scaled from a measured one by published specs (module docstring of
    raydit.planner.devicemodel): compute rates by the peak ratio per dtype, bytes by bandwidth,
    links by link rate; launch cost and compile's fraction as measured."""
    src, dst = PUBLISHED[base["device_type"]], PUBLISHED[name]
    t = copy.deepcopy(base)
    how = (f"scaled from {base['device_type']} ({base['provenance']}, {base['date']}) by published specs: "
           f"bf16 {dst['bf16']:g} / {src['bf16']:g} TFLOP/s, fp8 {dst['fp8']:g} / {src['fp8']:g}, "
           f"memory {dst['hbm']:g} / {src['hbm']:g} GB/s, link {dst['link']:g} / {src['link']:g} GB/s")
    t.update(device_type=name, gpu=dst["gpu"], provenance=f"scaled from {base['device_type']}", note=how,
             sweep_parts={}, replaces_figures=name not in FIT_FIGURES)
    ratio = {"bf16": dst["bf16"] / src["bf16"], "fp8": dst["fp8"] / src["fp8"] if src["fp8"] else 0.0}
    for dtype, rows in list(t["gemm"].items()):
        if not ratio[dtype]:
            del t["gemm"][dtype]
            continue
        t["gemm"][dtype] = [dict(r, tflops=round(r["tflops"] * ratio[dtype], 2), source="scaled: " + r["source"])
                            for r in rows]
    for kernel, rows in t["attention"].items():  # 8-bit attention runs on the int8 / fp8 tensor cores
        r8 = ratio["fp8"] if kernel in ("int8", "fp8") else ratio["bf16"]
        t["attention"][kernel] = [dict(r, tflops=round(r["tflops"] * r8, 2), source="scaled: " + r["source"])
                                  for r in rows] if r8 else []
    for key in ("hbm_gb_s", "elementwise_gb_s", "add_gb_s"):
        if key in t:
            t[key] = {"value": round(t[key]["value"] * dst["hbm"] / src["hbm"], 1),
                      "source": "scaled: " + t[key]["source"]}
    for kind in ("all_to_all", "p2p"):
        t[kind] = [dict(r, gb_s=round(r["gb_s"] * dst["link"] / src["link"], 1), source="scaled: " + r["source"])
                   for r in t.get(kind) or []]
    return t


def write_scaled(tables: Path = TABLES) -> list[Path]:
    base = json.loads((tables / f"{SCALE_FROM.lower()}.json").read_text())
    out = []
    for name in SCALED + (("H100",) if _h100_unmeasured(tables) else ()):
        p = tables / f"{name.lower()}.json"
        p.write_text(json.dumps(scaled_table(base, name), indent=1) + "\n")
        out.append(p)
    return out


def _h100_unmeasured(tables: Path) -> bool:
    p = tables / "h100.json"
    return not p.exists() or json.loads(p.read_text()).get("provenance", "").startswith("scaled")


# Kernels that copy a non-contiguous input to a contiguous one inside themselves (ATen's
# `input.expect_contiguous()` in layer_norm's and group_norm's CPU and CUDA kernels): a copy no
# dispatch mode sees, as the kernel's own call. CogVideoX's per-head LayerNorm of q and k takes
# them as [B, heads, S, head_dim] views of [B, S, heads, head_dim].
HIDDEN_COPY_OPS = ("native_layer_norm", "native_group_norm")


def hidden_copy_bytes(name: str, args) -> int:
    """Bytes the kernel `name` moves copying its non-contiguous first input (read and write),
    beyond the inputs and outputs a dispatch mode counts; 0 for any other op or input."""
    x = args[0] if args else None
    if name not in HIDDEN_COPY_OPS or not hasattr(x, "is_contiguous") or x.is_contiguous():
        return 0
    return 2 * x.numel() * x.element_size()


def count_blocks() -> dict:
    """Bytes per token and channel a layer's elementwise ops move (raydit.planner.model's
    ELEMENTWISE_BYTES): diffusers' blocks at real widths on the meta device, 1024 video tokens."""
    import torch
    import torch.nn.functional as F
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten

    skip = {"mm", "addmm", "bmm", "linear", "matmul", "baddbmm"}
    views = {"view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "expand", "permute", "split",
             "split_with_sizes", "chunk", "unbind", "select", "slice", "detach", "alias", "unflatten", "flatten",
             "as_strided", "lift_fresh", "_to_copy_noop", "unsafe_split", "view_as_real", "view_as_complex",
             "_reshape_alias", "reshape"}

    class Count(TorchDispatchMode):
        bytes = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func._overloadpacket.__name__
            if name not in skip and name not in views:
                ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
                ts = [t for t in ins + [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)] if t.numel() > 1000]
                self.bytes += sum(t.numel() * t.element_size() for t in ts) + hidden_copy_bytes(name, args)
            return out

    real_sdpa = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = lambda query=None, key=None, value=None, *a, **k: query.new_empty(
        query.shape[:-1] + (value.shape[-1],))
    try:
        from diffusers.models.transformers.cogvideox_transformer_3d import CogVideoXBlock
        from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoSingleTransformerBlock
        from diffusers.models.transformers.transformer_wan import WanTransformerBlock

        dev, dt, T = "meta", torch.bfloat16, 1024
        r = lambda *s, d=dt: torch.randn(*s, device=dev, dtype=d)  # noqa: E731
        out = {}
        with torch.device("meta"):  # the blocks' weights are never materialized
            cases = _block_cases(r, T, WanTransformerBlock, CogVideoXBlock, HunyuanVideoSingleTransformerBlock)
        for name, h, tokens, block, args, kw in cases:
            c = Count()
            block = block.to(dev, dt)  # outside the count: the weights' cast is not the block's work
            with torch.no_grad(), c:
                block(*args, **kw)
            out[name] = round(c.bytes / (tokens * h), 1)
        return out
    finally:
        F.scaled_dot_product_attention = real_sdpa


def _block_cases(r, T, WanTransformerBlock, CogVideoXBlock, HunyuanVideoSingleTransformerBlock):
    import torch

    return [
        ("wan", 1536, T, WanTransformerBlock(1536, 8960, 12, "rms_norm_across_heads", True, 1e-6),
         (r(1, T, 1536), r(1, 512, 1536), r(1, 6, 1536, d=torch.float32),
          (r(1, T, 1, 128, d=torch.float32), r(1, T, 1, 128, d=torch.float32))), {}),
        ("cogvideox", 1920, T + 226, CogVideoXBlock(1920, 30, 64, 512),
         (r(1, T, 1920), r(1, 226, 1920), r(1, 512)), {}),
        ("hunyuanvideo", 3072, T + 256, HunyuanVideoSingleTransformerBlock(24, 128, 4.0),
         (r(1, T, 3072), r(1, 256, 3072), r(1, 3072)),
         {"image_rotary_emb": (r(T, 128, d=torch.float32), r(T, 128, d=torch.float32))}),
    ]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: the code paths in seconds")
    ap.add_argument("--budget-s", type=float, default=280.0, help="stop starting parts past this (default 280)")
    ap.add_argument("--out", help="table file (default raydit/planner/tables/<device type>.json)")
    ap.add_argument("--device-type", help="the planner's name of this GPU (default: from its CUDA name)")
    ap.add_argument("--parts", default="launch,elementwise,gemm,fp8,attention,p2p")
    ap.add_argument("--scale", action="store_true", help="rewrite the scaled tables from the measured ones")
    ap.add_argument("--count-blocks", action="store_true", help="count diffusers blocks' elementwise bytes")
    args = ap.parse_args(argv)
    if args.scale:
        for p in write_scaled():
            print("wrote", p)
        return 0
    if args.count_blocks:
        print(json.dumps(count_blocks()))
        return 0
    if not args.budget_s > 0:
        raise SystemExit(f"--budget-s {args.budget_s} must be > 0")
    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    if not cuda and not args.smoke:
        raise SystemExit("no CUDA GPU here: run with --smoke for the CPU code paths")
    gpu = torch.cuda.get_device_name(0) if cuda else "cpu (smoke)"
    try:
        name = args.device_type or (gpu_device_type(gpu) if cuda else "H200")
    except ValueError as exc:
        raise SystemExit(str(exc)) from None
    start = TABLES / f"{name.lower()}.json"
    if not start.exists():
        start = TABLES / f"{SCALE_FROM.lower()}.json"
    table = json.loads(start.read_text())
    now = datetime.now(timezone.utc)
    table.pop("replaces_figures", None)
    table.update(device_type=name, gpu=gpu, torch=torch.__version__, date=now.strftime("%Y-%m-%d"),
                 provenance="smoke (CPU, not a device figure)" if args.smoke else "measured by bench_opsweep",
                 command=" ".join(["python", "bench/bench_opsweep.py", *(argv if argv is not None else sys.argv[1:])]),
                 note=f"measured {now:%Y-%m-%d %H:%M} UTC on {gpu}; figures whose source does not say 'measured "
                      f"{now:%Y-%m-%d}' were kept from the previous table ({start.name}: {table.get('provenance')}, "
                      f"{table.get('date')})")
    out = Path(args.out) if args.out else TABLES / f"{name.lower()}.json"
    sweep = Sweep("cuda" if cuda else "cpu", args.smoke, args.budget_s, table, out)
    need = {"launch": 5, "elementwise": 40, "gemm": 30, "fp8": 30, "attention": 40, "p2p": 10}
    for part in args.parts.split(","):
        if part not in need:
            raise SystemExit(f"unknown part {part!r}; parts: {', '.join(need)}")
        sweep.part(part, getattr(sweep, part), 0.5 if args.smoke else need[part])
    sweep.write()
    print(f"wrote {out} ({time.perf_counter() - sweep.t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
