"""Every family at real widths on one GPU: one step and one decode, measured against the planner.

    python bench/bench_familysteps.py [--families wan hunyuanvideo ...] [--steps 4] [--budget-s 420]
    python bench/bench_familysteps.py --smoke --out /tmp           # CPU, tiny widths: the code paths

Issue 40 item 2's table: family, shape, measured, predicted, error. For each family's headline
built-in (below), at its default request, bf16, guidance on, one device:

- the pipeline is the family's tiny pipeline (its scheduler, tokenizers, text encoders: what a
  step does not run) with the transformer at the built-in's published width (heads, head dim,
  FFN, the audio stream's; its latent channels) and the VAE at its published config, all
  random weights (0.02 scale; the VAE diffusers' own init);
- the transformer is built `--depths` deep (default 1 and 2 units of blocks; HunyuanVideo's
  unit is 1 double + 2 single blocks) and the Runner's step timed at each (median of steps
  2..N, each synchronised): per unit (s2 - s1) / (d2 - d1), and the step at the real depth
  s1 + (L - d1) x that. A stand-in for the full-depth model (its blocks are identical; said so
  in the output), which the 15-minute device budget needs;
- the decode: the Runner's decode of the step's latents through that VAE, on one rank;
- predicted: the planner's best plan on one device of this GPU's type, for the bench
  pipeline's own spec (its text tokens) at the real depth, step and decode: the rates an
  Engine plans with at start (same device type and tables); beside it the built-in's.

Needs torch and diffusers (no Ray). `--wheels DIR` installs wheels first (bench_gpu.py's).
Writes docs/benchmarks/familysteps.json (`--out`, `--name`) after every family.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parent.parent))

import benchlib  # noqa: E402
from bench_gpu import (  # noqa: E402
    Missing,
    _device_type_name,
    install_wheels,
    need,
    peak_gb,
    reset_peak,
    say,
    sync,
)

PROMPT = "a red fox running through fresh snow, cinematic light"
GUIDANCE = 5.0


@dataclasses.dataclass(frozen=True)
class Case:
    """One family's headline built-in as this bench builds it."""

    builtin: str
    tiny: str  # the family's tiny pipeline (raydit.models.registry.tiny_models)
    transformer: dict  # the published width; the depth keys come from `depth`
    vae: tuple[str, dict]  # diffusers class and config (its defaults are the published VAE)
    depth: tuple[tuple[str, int], ...]  # (config key, blocks per unit)
    units: int  # units of blocks at the real depth
    smoke: dict  # widths for --smoke (tiny)


_WAN_VAE = ("AutoencoderKLWan", {})
_HY_VAE = ("AutoencoderKLHunyuanVideo", {})
CASES = {
    "cogvideox": Case("cogvideox-2b", "tiny",
                      dict(num_attention_heads=30, attention_head_dim=64, time_embed_dim=512, max_text_seq_length=226,
                           in_channels=16, out_channels=16, sample_height=60, sample_width=90, sample_frames=49),
                      ("AutoencoderKLCogVideoX", {}), (("num_layers", 1),), 30,
                      dict(num_attention_heads=2, attention_head_dim=16, time_embed_dim=16)),
    "wan": Case("wan2.1-t2v-1.3b", "tiny-wan",
                dict(num_attention_heads=12, attention_head_dim=128, ffn_dim=8960, freq_dim=256, in_channels=16,
                     out_channels=16),
                _WAN_VAE, (("num_layers", 1),), 30, dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64)),
    "skyreels": Case("skyreels-v2-t2v-14b-540p", "tiny-skyreels",
                     dict(num_attention_heads=40, attention_head_dim=128, ffn_dim=13824, freq_dim=256, in_channels=16,
                          out_channels=16),
                     _WAN_VAE, (("num_layers", 1),), 40, dict(num_attention_heads=2, attention_head_dim=16, ffn_dim=64)),
    "hunyuanvideo": Case("hunyuanvideo", "tiny-hunyuan",
                         dict(num_attention_heads=24, attention_head_dim=128, mlp_ratio=4.0, rope_axes_dim=(16, 56, 56),
                              num_refiner_layers=2, in_channels=16, out_channels=16),
                         _HY_VAE, (("num_layers", 1), ("num_single_layers", 2)), 20,
                         dict(num_attention_heads=2, attention_head_dim=16, rope_axes_dim=(4, 6, 6))),
    "hunyuanvideo15": Case("hunyuanvideo-1.5-480p", "tiny-hunyuan15",
                           dict(num_attention_heads=16, attention_head_dim=128, mlp_ratio=4.0, rope_axes_dim=(16, 56, 56),
                                num_refiner_layers=2, in_channels=65, out_channels=32),
                           ("AutoencoderKLHunyuanVideo15", {}), (("num_layers", 1),), 54,
                           dict(num_attention_heads=2, attention_head_dim=16, rope_axes_dim=(4, 6, 6))),
    "ltx": Case("ltx-video-2b", "tiny-ltx",
                dict(num_attention_heads=32, attention_head_dim=64, cross_attention_dim=2048, in_channels=128,
                     out_channels=128),
                ("AutoencoderKLLTXVideo", {}), (("num_layers", 1),), 28,
                dict(num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32)),
    "ltx2": Case("ltx-2", "tiny-ltx2",
                 dict(num_attention_heads=32, attention_head_dim=128, cross_attention_dim=4096,
                      audio_num_attention_heads=32, audio_attention_head_dim=64, audio_cross_attention_dim=2048,
                      in_channels=128, out_channels=128),
                 ("AutoencoderKLLTX2Video", {}), (("num_layers", 1),), 48,
                 dict(num_attention_heads=2, attention_head_dim=16, cross_attention_dim=32, audio_num_attention_heads=2,
                      audio_attention_head_dim=8, audio_cross_attention_dim=16)),
    "mochi": Case("mochi-1", "tiny-mochi",
                  dict(num_attention_heads=24, attention_head_dim=128, pooled_projection_dim=1536, time_embed_dim=256,
                       in_channels=12),
                  ("AutoencoderKLMochi", dict(latent_channels=12, out_channels=3)), (("num_layers", 1),), 48,
                  dict(num_attention_heads=2, attention_head_dim=16, pooled_projection_dim=16)),
    "kandinsky5": Case("kandinsky5-t2v-lite", "tiny-kandinsky5",
                       dict(model_dim=1792, ff_dim=7168, axes_dims=(16, 24, 24), time_dim=512, num_text_blocks=2,
                            in_visual_dim=16, out_visual_dim=16),
                       _HY_VAE, (("num_visual_blocks", 1),), 32,
                       dict(model_dim=32, ff_dim=64, axes_dims=(4, 6, 6), time_dim=16)),
}
# Cheapest first (the budget is checked before each family): the 720p HunyuanVideo last.
ORDER = ("wan", "cogvideox", "ltx", "kandinsky5", "ltx2", "hunyuanvideo15", "mochi", "skyreels", "hunyuanvideo")
assert sorted(ORDER) == sorted(CASES)

# --smoke: a tiny VAE of the same class (the published one is seconds per frame on a CPU); a
# class not listed takes the tiny pipeline's VAE config with the published latent channels.
SMOKE_VAE = {
    "AutoencoderKLWan": dict(base_dim=8, dim_mult=[1, 1, 1, 1], z_dim=16),
    "AutoencoderKLCogVideoX": dict(block_out_channels=(8, 8, 8, 8), latent_channels=16, norm_num_groups=4),
    "AutoencoderKLHunyuanVideo": dict(block_out_channels=(8, 8, 8, 8), latent_channels=16, norm_num_groups=4),
    "AutoencoderKLHunyuanVideo15": dict(block_out_channels=(32, 32, 32, 32, 32), latent_channels=32),
    "AutoencoderKLLTXVideo": dict(block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
                                  latent_channels=128),
    "AutoencoderKLMochi": dict(latent_channels=12, out_channels=3, encoder_block_out_channels=(32, 32, 32, 32),
                               decoder_block_out_channels=(32, 32, 32, 32)),
}


def _real_geometry(spec, smoke: bool) -> tuple[int, int, int]:
    if not smoke:
        return spec.default_frames, spec.default_height, spec.default_width
    # a few latent frames and rows: whole multiples of the VAE's factors
    t, s = spec.vae_temporal, spec.vae_spatial * spec.patch_size
    return 2 * t + 1, 2 * s, 3 * s


def build(case: Case, units: int, device, dtype, smoke: bool):
    """The tiny pipeline with the case's transformer (`units` units deep) and VAE."""
    import diffusers
    import torch

    from raydit.models.registry import tiny_models

    pipe = diffusers.DiffusionPipeline.from_pretrained(tiny_models()[case.tiny]())
    config = dict(pipe.transformer.config)
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    config.update(case.transformer)
    if smoke:
        config.update(case.smoke)
    for key, per_unit in case.depth:
        config[key] = per_unit * units
    vae_cls, vae_kwargs = case.vae
    if smoke and vae_cls in SMOKE_VAE:
        vae_kwargs = dict(vae_kwargs, **SMOKE_VAE[vae_cls])
    elif smoke:  # the tiny pipeline's VAE config with the published latent channels
        real = getattr(diffusers, vae_cls)
        latent_key = "z_dim" if "z_dim" in pipe.vae.config else "latent_channels"
        vae_kwargs = {k: v for k, v in dict(pipe.vae.config).items() if not k.startswith("_")}
        vae_kwargs[latent_key] = case.vae[1].get(latent_key) or inspect.signature(real.__init__).parameters[latent_key].default
    with torch.device(device):
        transformer = type(pipe.transformer)(**config)
        vae = getattr(diffusers, vae_cls)(**vae_kwargs)
    generator = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for p in transformer.parameters():
            # an initialised network's scale (diffusers zero-initialises some gates: every weight drawn)
            p.copy_(torch.randn(p.shape, generator=generator, device=device) * 0.02)
    # A new pipeline of the components: what a pipeline derives from them at construction
    # (latent channels, the VAE's scale factors) follows the swapped transformer and VAE.
    pipe = type(pipe)(**dict(pipe.components, transformer=transformer.to(dtype), vae=vae.to(dtype)))
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def time_steps(pipe, request: dict, steps: int, device, dtype, decode: bool) -> dict:
    import torch

    from raydit.models.requests import GenerationRequest
    from raydit.models.runner import Runner
    from raydit.runtime.measure import timed_steps

    runner = Runner(pipe, device=device, dtype=dtype)
    try:
        state = runner.prepare(GenerationRequest(prompt=PROMPT, **request, num_inference_steps=steps,
                                                 guidance_scale=GUIDANCE, seed=0))
        reset_peak(device)
        state, times = timed_steps(runner, state, steps, device.type)
        out = {"step_seconds": benchlib.summary(times[1:]), "step_peak_gb": round(peak_gb(device), 3),
               "tokens": int(getattr(state, "tokens", 0) or 0)}
        if decode:
            reset_peak(device)
            sync(device)
            t0 = time.perf_counter()
            try:
                with torch.no_grad():
                    runner.decode(state)
            except Exception as exc:  # e.g. out of memory: the steps' figures stand
                out["decode_failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"
                say(f"decode failed: {out['decode_failed']}")
                return out
            sync(device)
            out["decode_seconds"] = round(time.perf_counter() - t0, 4)
            out["decode_peak_gb"] = round(peak_gb(device), 3)
        return out
    finally:
        runner.close()


def predict(spec_dir: str, builtin: str, layers: int, geometry: tuple[int, int, int], device) -> dict:
    from raydit.planner import ClusterSpec, NodeSpec, PlanError, device_type, model_spec, plan

    dev = device_type(_device_type_name(device))
    cluster = ClusterSpec(nodes=(NodeSpec("one", dev, 1),))
    out = {"device_type": dev.name}
    bench_spec = dataclasses.replace(model_spec(spec_dir), layers=layers)
    for label, spec in (("bench", bench_spec), ("builtin", model_spec(builtin))):
        try:
            best = plan(spec, *geometry, cluster=cluster, world_size=1).best
        except PlanError as exc:  # e.g. --smoke: a built-in's weights on one CPU slot
            out[label] = {"error": str(exc)}
            continue
        out[label] = {"step_seconds": round(best.predicted_step_seconds, 4),
                      "decode_seconds": round(best.decode.seconds, 4) if best.decode is not None else None,
                      "memory_gb": round(best.memory_gb_per_gpu, 2), "text_tokens": spec.text_tokens,
                      "sequence_tokens": spec.geometry(*geometry).sequence_tokens, "rates": best.cost.to_dict()
                      if hasattr(best.cost, "to_dict") else None}
    return out


def run_case(name: str, case: Case, args, device, dtype) -> dict:
    import gc

    import torch

    from raydit.planner import model_spec

    spec = model_spec(case.builtin)
    frames, height, width = _real_geometry(spec, args.smoke)
    request = {"num_frames": frames, "height": height, "width": width}
    d1, d2 = args.depths
    measured = {}
    spec_dir = None
    for units in (d1, d2):
        pipe = build(case, units, device, dtype, args.smoke)
        if spec_dir is None:
            spec_dir = _save_config_dir(pipe, name, args.scratch)
        measured[units] = time_steps(pipe, request, args.steps, device, dtype, decode=units == d2)
        del pipe
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    s1, s2 = measured[d1]["step_seconds"]["median"], measured[d2]["step_seconds"]["median"]
    per_unit = (s2 - s1) / (d2 - d1)
    real_units = case.units
    step = s1 + (real_units - d1) * per_unit
    blocks_per_unit = sum(n for _, n in case.depth)
    pred = predict(spec_dir, case.builtin, real_units * blocks_per_unit, (frames, height, width), device)
    out = {"builtin": case.builtin, "request": request, "depths": [d1, d2], "units": real_units,
           "blocks_per_unit": blocks_per_unit, "measured": {str(k): v for k, v in measured.items()},
           "per_unit_seconds": round(per_unit, 5), "step_seconds": round(step, 4),
           "decode_seconds": measured[d2].get("decode_seconds"), "predicted": pred}
    p = pred["bench"]
    if "error" in p:
        raise RuntimeError(f"the planner refused the bench pipeline's spec: {p['error']}")
    out["step_error"] = round(p["step_seconds"] / step - 1, 4) if step > 0 else None
    if p["decode_seconds"] and out["decode_seconds"]:
        out["decode_error"] = round(p["decode_seconds"] / out["decode_seconds"] - 1, 4)

    def err(key):
        return f" ({out[key]:+.1%})" if out.get(key) is not None else " (no error: the measured figure is not > 0)"

    say(f"{name:<15} {case.builtin:<26} {frames}x{height}x{width}: step {step:.4f} s at {real_units * blocks_per_unit} "
        f"blocks (from {d1} and {d2} units: {s1:.4f} / {s2:.4f} s), predicted {p['step_seconds']:.4f} s"
        + err("step_error") + f"; decode {out['decode_seconds']} s, predicted {p['decode_seconds']} s"
        + (err("decode_error") if p["decode_seconds"] else ""))
    return out


def _save_config_dir(pipe, name: str, scratch: str) -> str:
    """The bench pipeline's configs, no weights: a directory the planner reads a spec from."""
    root = Path(scratch) / f"spec-{name}"
    root.mkdir(parents=True, exist_ok=True)
    pipe.save_config(root)  # model_index.json
    for key in pipe.config:
        component = getattr(pipe, key, None) if not key.startswith("_") else None
        if component is None:
            continue
        if hasattr(component, "save_config"):  # diffusers models and schedulers
            component.save_config(root / key)
        elif hasattr(getattr(component, "config", None), "to_json_file"):  # transformers models
            (root / key).mkdir(exist_ok=True)
            component.config.to_json_file(root / key / "config.json")
    return str(root)


def main(argv=None) -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", nargs="*", default=list(ORDER), choices=list(CASES))
    ap.add_argument("--steps", type=int, default=4, help="steps per depth (the first is dropped)")
    ap.add_argument("--depths", type=int, nargs=2, default=(1, 2), help="the two depths timed, in units of blocks")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny widths and requests: the code paths")
    ap.add_argument("--wheels", nargs="*", default=[])
    ap.add_argument("--budget-s", type=float, default=420.0, help="families not started by then are skipped")
    ap.add_argument("--out", default=str(benchlib.OUT_DIR))
    ap.add_argument("--name", default="familysteps")
    args = ap.parse_args(argv)
    if args.depths[1] <= args.depths[0] or args.depths[0] < 1:
        ap.error(f"--depths {args.depths[0]} {args.depths[1]}: two depths, the second larger, both >= 1")
    t_start = time.perf_counter()
    if args.wheels:
        install_wheels(args.wheels)
    import torch

    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
        torch.set_num_threads(1)
    elif not torch.cuda.is_available():
        say("bench_familysteps: no CUDA device; nothing measured (--smoke checks the script on the CPU)")
        return 0
    else:
        device, dtype = torch.device("cuda", 0), torch.bfloat16
    args.scratch = tempfile.mkdtemp(prefix="raydit-familysteps-")
    result = {"machine": benchlib.machine(),
              "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": str(dtype), "smoke": args.smoke,
              "command": "python bench/bench_familysteps.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "method": "tiny pipeline + published-width transformer at two depths (extrapolated to the real "
                        "depth) + the published VAE config, random weights; predicted: the planner on one device",
              "families": {}}
    for name in args.families:
        if time.perf_counter() - t_start > args.budget_s:
            result["families"][name] = {"skipped": f"budget of {args.budget_s:g} s spent"}
            say(f"{name}: skipped (budget spent)")
            continue
        try:
            need("diffusers", "the families' pipelines")
            result["families"][name] = run_case(name, CASES[name], args, device, dtype)
        except Missing as exc:
            result["families"][name] = {"missing": str(exc)}
            say(f"{name}: {exc}")
        except Exception as exc:  # one family's failure must not cost the others their figures
            result["families"][name] = {"error": f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}"}
            say(f"{name}: FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        benchlib.write_json(args.name, result, Path(args.out))
    rows = [(n, r) for n, r in result["families"].items() if "step_seconds" in r]
    if rows:
        errors = [abs(r["step_error"]) for _, r in rows if r.get("step_error") is not None]
        say(f"{len(rows)} families measured; |step error| median {statistics.median(errors):.1%}, "
            f"max {max(errors):.1%}" if errors else f"{len(rows)} families measured")
    return 0


if __name__ == "__main__":
    sys.exit(main())
