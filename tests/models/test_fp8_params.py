"""The planner's FP8 weight count (ModelSpec.fp8_params, each family's `fp8_weight_params`) against
what `quantize fp8` really quantizes: raydit.models.quantize.select_linears on diffusers'
transformer built from the published config, at real widths, on the meta device (no memory).

Rule: exact (rel 1e-9); the counts are integer sums of weight shapes. Where a family's formula
leaves a part out on purpose (Wan 2.1 I2V's image k / v projections, priced at bf16 bytes: too
high, never too low), the test names that part and subtracts it."""

from __future__ import annotations

import pytest

from raydit.planner import model_spec

_WAN = dict(attention_head_dim=128, patch_size=(1, 2, 2), text_dim=4096, out_channels=16)
_WAN_14B = dict(_WAN, num_attention_heads=40, num_layers=40, ffn_dim=13824)
_HUNYUAN = dict(out_channels=16, num_attention_heads=24, attention_head_dim=128, num_layers=20, num_single_layers=40,
                num_refiner_layers=2, mlp_ratio=4.0, patch_size=2, patch_size_t=1, in_channels=16)
_LTX = dict(in_channels=128, out_channels=128, patch_size=1, patch_size_t=1, activation_fn="gelu-approximate",
            qk_norm="rms_norm_across_heads", norm_elementwise_affine=False, caption_channels=4096)

# (built-in, diffusers class, config, parts the family's count leaves out)
CASES = [
    ("cogvideox-2b", "CogVideoXTransformer3DModel", {}, ()),
    ("cogvideox-5b", "CogVideoXTransformer3DModel",
     dict(num_attention_heads=48, num_layers=42, use_rotary_positional_embeddings=True), ()),
    ("wan2.1-t2v-1.3b", "WanTransformer3DModel",
     dict(_WAN, num_attention_heads=12, num_layers=30, ffn_dim=8960, in_channels=16), ()),
    ("wan2.1-t2v-14b", "WanTransformer3DModel", dict(_WAN_14B, in_channels=16), ()),
    ("wan2.1-i2v-14b-480p", "WanTransformer3DModel",
     dict(_WAN_14B, in_channels=36, image_dim=1280, added_kv_proj_dim=5120), ("add_k_proj", "add_v_proj")),
    ("wan2.2-ti2v-5b", "WanTransformer3DModel",
     dict(_WAN, num_attention_heads=24, num_layers=30, ffn_dim=14336, in_channels=48, out_channels=48), ()),
    ("skyreels-v2-df-14b-540p", "SkyReelsV2Transformer3DModel",
     dict(_WAN_14B, in_channels=16, qk_norm="rms_norm_across_heads"), ()),
    ("hunyuanvideo", "HunyuanVideoTransformer3DModel", _HUNYUAN, ()),
    ("hunyuanvideo-1.5-480p", "HunyuanVideo15Transformer3DModel", {}, ()),
    ("ltx-video-2b", "LTXVideoTransformer3DModel",
     dict(_LTX, num_attention_heads=32, attention_head_dim=64, cross_attention_dim=2048, num_layers=28), ()),
    ("ltx-video-13b", "LTXVideoTransformer3DModel",
     dict(_LTX, num_attention_heads=32, attention_head_dim=128, cross_attention_dim=4096, num_layers=48), ()),
    ("ltx-2", "LTX2VideoTransformer3DModel", {}, ()),  # diffusers' defaults are LTX-2's config
    ("mochi-1", "MochiTransformer3DModel", {}, ()),  # and Mochi 1's
    ("kandinsky5-t2v-lite", "Kandinsky5Transformer3DModel",
     dict(model_dim=1792, ff_dim=7168, num_visual_blocks=32, in_visual_dim=16, out_visual_dim=16), ()),
    ("kandinsky5-t2v-pro", "Kandinsky5Transformer3DModel",
     dict(model_dim=4096, ff_dim=16384, num_visual_blocks=60, num_text_blocks=4, time_dim=1024, in_visual_dim=16,
          out_visual_dim=16, visual_cond=True, axes_dims=(32, 48, 48)), ()),
]


@pytest.mark.parametrize("name,cls,config,left_out", CASES, ids=[c[0] for c in CASES])
def test_fp8_params_are_the_weights_quantize_selects(name, cls, config, left_out):
    import diffusers
    from accelerate import init_empty_weights

    from raydit.models.quantize import select_linears
    from raydit.models.registry import families

    spec = model_spec(name)
    with init_empty_weights():
        model = getattr(diffusers, cls)(**config)
    chosen, skipped = select_linears(model, keep=families()[spec.family].quantize_keep)
    assert chosen and not skipped
    kept_out = sum(m.weight.numel() for n, m in chosen if n.rsplit(".", 1)[-1] in left_out)
    assert bool(kept_out) == bool(left_out)
    quantized = sum(m.weight.numel() for _, m in chosen)
    assert spec.fp8_params == pytest.approx(quantized - kept_out, rel=1e-9), \
        f"{name}: quantize fp8 keeps {quantized - kept_out:.6e} weights in FP8, the planner counts {spec.fp8_params:.6e}"
    # The width and depth the planner prices are this transformer's (the count is not a fit).
    assert spec.params == pytest.approx(sum(p.numel() for p in model.parameters()), rel=0.01)
