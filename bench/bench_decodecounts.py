"""Count what a VAE decode does besides its convolutions, per output pixel and frame.

    PYTHONPATH=$PWD python bench/bench_decodecounts.py [--out docs/benchmarks/decodecounts.json]

CPU, needs diffusers; seconds (nothing is computed: the VAE and its latents live on torch's
meta device, where every op only makes its output's shape). For each decoder the planner's
decode anchors price (bench/bench_costmodel.py's decode rows), diffusers' VAE with its default
config (= the released model's widths) decodes a latent of the anchor's own geometry the way
the anchor's pipeline decodes it (`vae.decode`, framewise with its conv caches; tiled where
the pipeline enables tiling), and a TorchDispatchMode watches every aten op:

    launches   every op that is not a view: one kernel each in eager mode (convolutions,
               their caches' concatenations and pads, norms, activations, upsampling, the
               growing output's concatenation, the clamp)
    values     the input and output elements of the ops that are neither views, convolutions
               nor GEMMs / attention (counted by FLOP in DecoderShape.flops_per_pixel): values
               moved through memory per output pixel and frame (the decode's bytes per value,
               2 in fp16 / bf16, 4 in float32, times it is what the planner prices at the
               device's elementwise bandwidth: raydit.planner.decode)

Both are divided by the pixel-frames the decoder calls produce as the planner counts them
(raydit.planner.decode.decoded_pixel_frames: overlapping tiles and framewise calls as decoded). The families keep the
figures in their DecoderShape (elementwise_values, launches_per_pixel).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchlib import dispatch_counter, write_json

CONV = {"convolution", "_convolution", "conv3d", "conv2d", "conv1d", "cudnn_convolution",
        "mkldnn_convolution", "slow_conv3d", "slow_conv3d_forward", "_slow_conv2d_forward"}
MATMUL = {"mm", "addmm", "bmm", "linear", "matmul", "baddbmm", "scaled_dot_product_attention",
          "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
          "_scaled_dot_product_flash_attention", "_scaled_dot_product_cudnn_attention",
          "_scaled_dot_product_fused_attention_overrideable"}
VIEWS = {"view", "_unsafe_view", "t", "transpose", "unsqueeze", "squeeze", "expand", "permute", "split",
         "split_with_sizes", "chunk", "unbind", "select", "slice", "detach", "alias", "unflatten", "flatten",
         "as_strided", "lift_fresh", "unsafe_split", "view_as_real", "view_as_complex", "_reshape_alias", "reshape",
         "expand_as", "view_as", "narrow", "movedim", "empty", "empty_like", "empty_strided", "new_empty",
         "new_empty_strided", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
         "_local_scalar_dense", "lift_fresh_copy", "set_", "resize_"}

# name: (anchor, VAE builder, the planner's built-in model, (frames, height, width), tiled, dtype)
CASES = {
    "wan2.1": ("TensorRT-LLM Wan 2.2 720p decode (81 x 720 x 1280), float32 (its wan_t2v.py loads the VAE so)",
               "wan", "wan2.2-t2v-a14b", (81, 720, 1280), False, "float32"),
    "hunyuanvideo": ("SGLang HunyuanVideo decode 77 x 480 x 848, fp16 (SGLang's HunyuanConfig.vae_precision), tiled",
                     "hunyuanvideo", "hunyuanvideo", (77, 480, 848), True, "float16"),
}


def _vae(kind: str):
    from diffusers import AutoencoderKLHunyuanVideo, AutoencoderKLWan

    return AutoencoderKLWan() if kind == "wan" else AutoencoderKLHunyuanVideo()


def count(name: str) -> dict:
    import torch

    from raydit.planner import model_spec
    from raydit.planner.decode import decoded_pixel_frames

    anchor, kind, model, request, tiled, dtype = CASES[name]
    spec = model_spec(model)
    geo = spec.geometry(*request)
    channels, t, h, w = spec.in_channels, geo.latent_frames, geo.latent_height, geo.latent_width
    with torch.device("meta"):
        vae = _vae(kind).to(getattr(torch, dtype)).eval()
        z = torch.zeros(1, channels, t, h, w, dtype=getattr(torch, dtype))
    if tiled:
        vae.enable_tiling()
    c = dispatch_counter(VIEWS)()
    with torch.no_grad(), c:
        out = vae.decode(z, return_dict=False)[0]
    frames, height, width = out.shape[2:]
    assert (frames, height, width) == tuple(request), (out.shape, request)
    pixels = decoded_pixel_frames(spec, geo, tiled)  # as the planner counts them: tiles' overlaps too
    others = {name: row[1] for name, row in c.ops.items() if name not in CONV | MATMUL}  # values by op
    top = sorted(others.items(), key=lambda kv: -kv[1])[:8]
    launches = c.total(0)
    return {"anchor": anchor, "model": model, "dtype": dtype, "latent": [t, h, w], "output": [frames, height, width],
            "tiled": tiled, "decoded_pixel_frames": pixels,
            "elementwise_values_per_pixel": round(sum(others.values()) / pixels, 1),
            "launches": launches, "conv_launches": sum(c.ops.get(name, [0])[0] for name in CONV),
            "launches_per_pixel": launches / pixels,
            "largest_ops": {k: round(v / pixels, 1) for k, v in top}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--decoders", default=",".join(CASES))
    ap.add_argument("--out", help="write the counts as JSON here")
    args = ap.parse_args(argv)
    out = {}
    for name in args.decoders.split(","):
        out[name] = count(name)
        print(name, json.dumps(out[name]), flush=True)
    if args.out:
        path = Path(args.out)
        write_json(path.stem, out, path.parent)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
