"""Per-step cost of a LoRA on a CogVideoX-2b-shaped transformer: none, unfused (active),
loaded but disabled (a base request on an engine holding LoRAs), fused into the weights with
peft's layers kept (diffusers' `fuse_lora`), and fused with peft's layers removed (what
`--fuse-lora` / `Engine(fuse_lora=...)` does: `fuse_lora` then `unload_lora_weights`).

The transformer has CogVideoX-2b's width (30 heads x 64, text embedding 4096, time embedding
512) and its layer structure; `--layers` (default 2 of the 30) and a small video keep a CPU
run short: every layer costs the same, so the LoRA's relative cost per layer is the figure.
The LoRA is made with peft (rank `--rank` on to_q, to_k, to_v, to_out.0, the layers published
video LoRAs target) through diffusers' `add_adapter`; fused with diffusers' `fuse_lora`.
Variants are interleaved round by round; ratios are taken per round, on CPU time (one thread:
the work done, robust to a shared machine's load) and on wall time.

    python bench/bench_lora.py [--layers 2] [--rank 64] [--rounds 5] [--out docs/benchmarks/lora.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import time
from pathlib import Path


def build(layers: int, latent: int):
    import torch
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(0)
    model = CogVideoXTransformer3DModel(
        num_attention_heads=30, attention_head_dim=64, in_channels=16, out_channels=16, time_embed_dim=512,
        text_embed_dim=4096, num_layers=layers, sample_width=latent, sample_height=latent, sample_frames=1,
        max_text_seq_length=226,
    ).eval()
    g = torch.Generator().manual_seed(1)
    kwargs = dict(
        hidden_states=torch.randn(1, 1, 16, latent, latent, generator=g),
        encoder_hidden_states=torch.randn(1, 226, 4096, generator=g),
        timestep=torch.tensor([500]),
        return_dict=False,
    )
    return model, kwargs


def add_lora(model, rank: int):
    import torch
    from peft import LoraConfig
    from peft.tuners.lora import LoraLayer

    model.add_adapter(LoraConfig(r=rank, lora_alpha=rank, target_modules=["to_q", "to_k", "to_v", "to_out.0"]),
                      adapter_name="style")
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, LoraLayer):
                m.lora_B["style"].weight.copy_(torch.randn(m.lora_B["style"].weight.shape, generator=g) * 0.01)
    return model


def timed(model, kwargs) -> tuple[float, float]:
    """(wall seconds, this process's CPU seconds) of one forward. With one thread the CPU
    time is the work done, whatever else the shared machine runs meanwhile."""
    import torch

    with torch.no_grad():
        t0, c0 = time.perf_counter(), time.process_time()
        model(**kwargs)
        return time.perf_counter() - t0, time.process_time() - c0


def summary(values):
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def main(argv=None) -> int:
    import diffusers
    import peft
    import torch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--latent", type=int, default=16, help="latent height = width (1 latent frame)")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="docs/benchmarks/lora.json")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)

    plain, kwargs = build(args.layers, args.latent)
    adapted = add_lora(copy.deepcopy(plain), args.rank)
    # raydit's --fuse-lora: merged at scale 1.0, then peft's layers removed (plain linear layers).
    engine_fused = copy.deepcopy(adapted)
    engine_fused.fuse_lora(lora_scale=1.0, adapter_names=["style"])
    engine_fused.unload_lora()
    timed(plain, kwargs), timed(adapted, kwargs), timed(engine_fused, kwargs)  # warm-up
    times = {"none": [], "unfused": [], "disabled": [], "fused": [], "fused_unloaded": []}  # (wall, cpu) per round
    for _ in range(args.rounds):
        times["none"].append(timed(plain, kwargs))
        adapted.set_adapters(["style"], [1.0])
        adapted.enable_lora()
        times["unfused"].append(timed(adapted, kwargs))
        adapted.disable_lora()
        times["disabled"].append(timed(adapted, kwargs))
        adapted.enable_lora()
        adapted.fuse_lora(lora_scale=1.0, adapter_names=["style"])
        times["fused"].append(timed(adapted, kwargs))
        adapted.unfuse_lora()
        times["fused_unloaded"].append(timed(engine_fused, kwargs))
    ratios = {f"{k}_{what}": [v[i] / n[i] for v, n in zip(times[k], times["none"])]
              for k in ("unfused", "disabled", "fused", "fused_unloaded") for i, what in ((1, "cpu"), (0, "wall"))}
    tokens = (args.latent // 2) ** 2 + 226
    lora_params = sum(p.numel() for n, p in adapted.named_parameters() if "lora_" in n)
    result = {
        "command": "python bench/bench_lora.py " + " ".join(argv or os.sys.argv[1:]),
        "when_utc": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "threads": args.threads, "load_average_1min_at_end": os.getloadavg()[0],
                    "torch": torch.__version__, "diffusers": diffusers.__version__, "peft": peft.__version__},
        "transformer": {"shape": "CogVideoX-2b width (30 heads x 64, text 4096, time 512)", "layers": args.layers,
                        "tokens": tokens, "lora_rank": args.rank, "lora_targets": "to_q, to_k, to_v, to_out.0",
                        "lora_params": lora_params},
        "variants": {"none": "no LoRA", "unfused": "peft LoRA active (set_adapters, scale 1.0)",
                     "disabled": "peft LoRA loaded, disable_lora() (a base request)",
                     "fused": "diffusers fuse_lora, peft layers kept (merged)",
                     "fused_unloaded": "fuse_lora then unload_lora (raydit --fuse-lora)"},
        "cpu_seconds_per_forward": {k: summary([c for _, c in v]) for k, v in times.items()},
        "wall_seconds_per_forward": {k: summary([w for w, _ in v]) for k, v in times.items()},
        "ratio_to_none_per_round": {k: summary(v) for k, v in ratios.items()},
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    for k, v in result["ratio_to_none_per_round"].items():
        print(f"{k:20s} {v['median']:.3f}x of no LoRA (min {v['min']:.3f}, max {v['max']:.3f}, n={v['n']})")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
