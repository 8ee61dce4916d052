"""Count what a family's transformer blocks do besides GEMMs and attention, per transformer call.

    PYTHONPATH=$PWD python bench/bench_blockcounts.py [--out docs/benchmarks/blockcounts.json]

CPU, needs diffusers; seconds. For every family it runs the family's own tiny forward case
(raydit/models/families/<family>/cases.py) in bf16 at two video lengths, with the FFN at the
released model's width ratio, and watches every aten op a transformer block dispatches (a
TorchDispatchMode entered by the blocks' forward hooks, so embeddings, the final norm and the
projection out are not counted):

    launches   ops that are neither views, GEMMs nor the attention kernel: each launches one
               kernel in eager mode; per block and call, averaged over the blocks (a family
               with two kinds of block, HunyuanVideo's dual- and single-stream, weighs them by
               the released model's counts). Mochi's attention loops over the samples of a
               batch: its count is at the batch of two the pipeline runs.
    bytes      the input and output bytes of those ops (and the copy a norm kernel makes of a
               non-contiguous input inside itself: bench_opsweep.hidden_copy_bytes), as their slope in the video tokens
               (the difference of the two lengths over the difference of their tokens x batch x
               width): bytes per video token and channel, what the planner multiplies by the
               step's tokens and width (ModelSpec.elementwise_bytes). The slope leaves out
               what does not grow with the video (the modulation vectors, the text stream of a
               dual-stream model beside it).

Each family's package keeps the figures it reports (Family.elementwise_bytes / _launches).
"""

from __future__ import annotations

import argparse
import importlib
import json
from pathlib import Path

from bench_opsweep import hidden_copy_bytes  # a norm's copy of its non-contiguous input, inside the kernel
from benchlib import dispatch_counter, write_json

SKIP = {"mm", "addmm", "bmm", "linear", "matmul", "baddbmm", "_scaled_dot_product_flash_attention_for_cpu",
        "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
        "_scaled_dot_product_cudnn_attention", "scaled_dot_product_attention"}
VIEWS = {"view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "expand", "permute", "split",
         "split_with_sizes", "chunk", "unbind", "select", "slice", "detach", "alias", "unflatten", "flatten",
         "as_strided", "lift_fresh", "unsafe_split", "view_as_real", "view_as_complex", "_reshape_alias", "reshape",
         "expand_as", "view_as", "narrow", "movedim", "_to_copy_noop", "contiguous_noop", "empty_like_noop"}

# family: (cases module, builder, the two calls' kwargs, FFN override giving the released ratio,
#          block weights {module list: released count} where it has two kinds of block)
CASES = {
    "cogvideox": ("cogvideox", "cogvideox_forward", [dict(latent_frames=f, latent_height=8, latent_width=12, batch=2)
                                                      for f in (2, 4)], None, None),
    "wan": ("wan", "wan_forward", [dict(kind="t2v", latent_frames=f, latent_height=8, latent_width=12, heads=6,
                                        head_dim=12, batch=1) for f in (2, 4)],
            ("ffn_dim", 8960 / 1536), None),
    "hunyuanvideo": ("hunyuanvideo", "hunyuan_forward",
                     [dict(latent_frames=f, latent_height=8, latent_width=12, heads=6, head_dim=16, rope_axes=(4, 6, 6),
                           valid=(9,)) for f in (2, 4)], ("mlp_ratio", 4.0),
                     {"transformer_blocks": 20, "single_transformer_blocks": 40}),
    "hunyuanvideo15": ("hunyuanvideo15", "hunyuan15_forward",
                       [dict(latent_frames=f, latent_height=8, latent_width=12, heads=6, head_dim=8, rope_axes=(2, 2, 4),
                             valid=(9,), valid_2=(5,)) for f in (2, 4)], ("mlp_ratio", 4.0), None),
    "kandinsky5": ("kandinsky5", "kandinsky5_forward",
                   [dict(latent_frames=f, latent_height=8, latent_width=12, heads=6, axes=(2, 2, 4), batch=1)
                    for f in (2, 4)], ("ff_dim", 4.0), {"visual_transformer_blocks": 1}),
    "ltx": ("ltx", "ltx_forward", [dict(latent_frames=f, latent_height=4, latent_width=6, heads=6, head_dim=12,
                                        valid=(9, 9)) for f in (2, 4)], None, None),
    "ltx2": ("ltx2", "ltx2_forward", [dict(latent_frames=f, latent_height=4, latent_width=6, audio_frames=8,
                                           valid=(9,)) for f in (2, 4)], None, None),
    "mochi": ("mochi", "mochi_forward", [dict(latent_frames=f, latent_height=8, latent_width=12, heads=6, head_dim=16,
                                              valid=(9, 9)) for f in (2, 4)], None, None),
}


def _as_loaded(transformer):
    """The modules diffusers keeps in float32 when a pipeline loads in bf16 (Wan's norms and
    modulation, Kandinsky's), back in float32, as from_pretrained(torch_dtype=bf16) leaves them."""
    import torch

    keep = getattr(transformer, "_keep_in_fp32_modules", None) or []
    for name, module in transformer.named_modules():
        if any(k in name.split(".") for k in keep):
            module.to(torch.float32)
    return transformer


def _none(_):
    return None  # a hook that returns a value would replace the block's inputs or output


def _tokens_and_width(transformer, kwargs) -> tuple[int, int, int]:
    """(video tokens, batch, width) of a call: the latent's elements over its channels and patches."""
    c = transformer.config
    hs = kwargs["hidden_states"]
    if hs.dim() == 3:  # packed [B, tokens, C] (LTX)
        tokens = hs.shape[1]
    else:
        p = c.get("patch_size", 1)
        p = tuple(p) if isinstance(p, (tuple, list)) else (c.get("patch_size_t", 1) or 1, p, p)
        if hs.shape[-1] < 64 and hs.dim() == 5 and "visual_cond" in c:  # Kandinsky: [B, F, H, W, C]
            f, h, w = hs.shape[1:4]
        elif "sample_frames" in c:  # CogVideoX: [B, F, C, H, W]
            f, h, w = hs.shape[1], hs.shape[3], hs.shape[4]
        else:
            f, h, w = hs.shape[2:5]
        tokens = (f // p[0]) * (h // p[1]) * (w // p[2])
    width = c.get("model_dim") or c.num_attention_heads * c.attention_head_dim
    return tokens, hs.shape[0], width


def count_family(name: str) -> dict:
    import torch

    module, builder, calls, ffn, weights = CASES[name]
    keep_float = () if name == "hunyuanvideo15" else ("timestep", "guidance", "sigma")
    mod = importlib.import_module(f"raydit.models.families.{module}.cases")
    build = getattr(mod, builder)
    if ffn is not None:
        real = mod.tiny_transformer
        key, ratio = ffn

        def widened(seed, **overrides):
            t = real(seed, **overrides)
            c = dict(t.config)
            width = c.get("model_dim") or c["num_attention_heads"] * c["attention_head_dim"]
            value = ratio if key == "mlp_ratio" else int(round(ratio * width))
            c = {k: v for k, v in c.items() if not k.startswith("_")}
            return real(seed, **dict(c, **{key: value}))

        mod.tiny_transformer = widened
    Count = dispatch_counter(VIEWS, hidden_copy_bytes)
    results = []
    try:
        for kw in calls:
            transformer, kwargs = build(**kw)
            transformer = _as_loaded(transformer.to(torch.bfloat16).eval())
            kwargs = {k: (v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point()
                          and k not in keep_float else v) for k, v in kwargs.items()}
            per_list = {}
            for list_name, blocks in transformer.named_children():
                if isinstance(blocks, torch.nn.ModuleList) and "block" in list_name and "text" not in list_name:
                    per_list[list_name] = [Count() for _ in blocks]
                    for block, c in zip(blocks, per_list[list_name]):
                        block.register_forward_pre_hook(lambda m, a, c=c: _none(c.__enter__()))
                        block.register_forward_hook(lambda m, a, o, c=c: _none(c.__exit__(None, None, None)))
            with torch.no_grad():
                transformer(**kwargs)
            tokens, batch, width = _tokens_and_width(transformer, kwargs)
            results.append((tokens, batch, width, per_list))
    finally:
        if ffn is not None:
            mod.tiny_transformer = real
    (t1, b, width, lists1), (t2, _, _, lists2) = results
    w = weights or {k: 1 for k in lists1}
    total = sum(w.values())
    launches = sum(w[k] * sum(c.total(0, SKIP) for c in lists2[k]) / len(lists2[k]) for k in w) / total
    slope = sum(w[k] * (sum(c.total(2, SKIP) for c in lists2[k]) / len(lists2[k]) - sum(c.total(2, SKIP) for c in lists1[k]) / len(lists1[k]))
                for k in w) / total
    return {"elementwise_bytes": round(slope / ((t2 - t1) * b * width), 1), "elementwise_launches": round(launches),
            "batch": b, "width": width, "tokens": [t1, t2],
            "per_block_kind": {k: {"launches": sum(c.total(0, SKIP) for c in lists2[k]) / len(lists2[k])} for k in lists2}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--families", default=",".join(CASES))
    ap.add_argument("--out", help="write the counts as JSON here")
    args = ap.parse_args(argv)
    out = {}
    for name in args.families.split(","):
        try:
            out[name] = count_family(name)
        except Exception as exc:  # one family's failure is reported, the others still count
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
        print(name, json.dumps(out[name]), flush=True)
    if args.out:
        path = Path(args.out)
        write_json(path.stem, out, path.parent)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
