"""The HunyuanVideo 1.5 family: `HunyuanVideo15Pipeline` (text-to-video) and
`HunyuanVideo15ImageToVideoPipeline` (image-to-video).

Its tiny pipelines are in `tiny.py`, its conformance cases in `cases.py`.

Adapter. The model runs one kind of block (`transformer_blocks`, 54 dual-stream blocks in
the released 480p / 720p checkpoints): video and text with their own weights and one joint
attention over [video ; text]. The "text" the blocks see is built by the model itself from
three streams, reordered so that the valid tokens come first: [valid image (SigLIP, I2V
only), valid ByT5 glyph tokens, valid Qwen2.5-VL tokens, then every masked token]; the
block's mask is [B, Lt] over that text alone (a prefix), and the model's processor masks a
padded token both as a key and as a query.

Under sequence parallelism only the video is split: the split hook cuts `hidden_states`
before the first block, the gather hook restores it after the last. The text stays whole
on every rank (every rank computes its projections, norms and feed-forward: the same
numbers everywhere). Inside each attention the *valid* text tokens are laid out as a second
part beside the video, each on exactly one rank (`SeqLayout((video, n_valid), sp)`), so
that `sp_attention` (Ulysses, ring or both) counts every key once and never sees a masked
one; the valid text's attention output is all-gathered over the sp group, so every rank
holds the whole text again. A masked text token's attention output is zero here (a masked
query has no key in diffusers either); it never reaches a valid token (masked as a key in
every block, feed-forwards per token, the text dropped after the last block), so the video
is the same. Samples whose masks differ are attended one after the other. RoPE covers the
video tokens only; the model's table for all video tokens is cut to this rank's chunk.
Image-to-video conditions by channels (noisy latents, the image's latents on frame 0 and a
frame mask are concatenated before the patch embedding, patch 1): that conditioning is part
of each video token and is split with it.

Steps. Guidance is classifier-free and lives in the pipeline's guider
(`ClassifierFreeGuidance`): the request's `guidance_scale` is the guider's scale
(`--guidance-scale` sets it; `reference_latents` runs diffusers' pipeline with a copy of its
guider at that scale). Two transformer calls per step (conditional, unconditional), as the
pipeline makes them; cfg = 2 runs them on two rank groups. FlowMatchEulerDiscreteScheduler
on the pipeline's sigmas (linspace(1, 0)). A guider the runner cannot reproduce (rescaled,
original formulation, a start/stop window, another guidance method) is refused in one line.

Text. The Qwen2.5-VL encoder (chat template, 108 template tokens cropped, 1000 tokens), the
ByT5 glyph encoder (quoted text in the prompt; zeros and an empty mask without) and, for
I2V, the SigLIP image encoder run in `encode`, once per request on the replica's rank 0.

Module-level imports stay light (no torch, no diffusers): the planner reads this family
through the registry without importing torch.

Legend: B batch, S local video tokens (this rank's chunk), Lv all video tokens, Lt text
tokens (image + ByT5 + Qwen, padded), n valid text tokens, H heads, D head dim, C = H*D.
"""

from __future__ import annotations

import json
import math

from raydit.models.adapter import ModelAdapter
from raydit.models.family import Family, Prepared
from raydit.models.quantize_options import block_linear_params
from raydit.models.requests import check_frames, check_size, linear_sigma_timesteps, png_to_image, reference_call
from raydit.models.joint_text import JointTextProcessor, joint_text_plan, valid_text_counts
from raydit.models.tiny import request_defaults
from raydit.planner.model import DecoderShape

VIDEO = 0  # the only part split across the blocks

T2V, I2V = "HunyuanVideo15Pipeline", "HunyuanVideo15ImageToVideoPipeline"
# HunyuanVideo15Pipeline.__call__ defaults: 121 frames; the size from the transformer's
# target_size at 16:9 (480p: 480 x 848, 720p: 720 x 1280). A directory may carry its own
# request defaults in DEFAULTS_FILE (the tiny built-ins do).
DEFAULT_FRAMES = 121
# The text the blocks attend: Qwen tokens after the template crop, ByT5 tokens, and the
# image tokens (SigLIP's 729 for I2V; 729 masked zeros for T2V): all padded lengths.
QWEN_TOKENS, BYT5_TOKENS, IMAGE_TOKENS = 1000, 256, 729


# -- adapter -----------------------------------------------------------------------------------
class HunyuanVideo15SPAttnProcessor(JointTextProcessor):
    """Sequence-parallel replacement for HunyuanVideo15AttnProcessor2_0; its mask is the text's,
    [B, Lt], with the valid tokens first (the model reorders the text so)."""

    video_part = VIDEO

    def valid_counts(self, mask, video_len, text_len, batch):
        return valid_text_counts(mask, text_len, batch, how="as HunyuanVideo15Transformer3DModel builds it: "
                                 "valid image, ByT5 and Qwen tokens first")

    def finish(self, attn, video, text):
        return attn.to_out[1](attn.to_out[0](video)), attn.to_add_out(text)  # linear, dropout


class HunyuanVideo15Adapter(ModelAdapter):
    name = "hunyuanvideo15"
    transformer_classes = ("HunyuanVideo15Transformer3DModel",)
    # HunyuanVideo15TransformerBlock.forward(hidden_states, encoder_hidden_states, temb,
    # attention_mask, freqs_cis) -> (hidden_states, encoder_hidden_states); temb is per sample.
    plan = joint_text_plan("transformer_blocks", video_part=VIDEO)
    processor = HunyuanVideo15SPAttnProcessor
    block_count = "num_layers"


# -- the family --------------------------------------------------------------------------------
def _image_size(pipe, image) -> tuple[int, int]:
    """(height, width) the I2V pipeline generates for `image`: the bucket of its aspect ratio
    at the transformer's target_size (HunyuanVideo15ImageToVideoPipeline.__call__)."""
    return tuple(pipe.video_processor.calculate_default_height_width(
        height=image.size[1], width=image.size[0], target_size=pipe.target_size))


def _request_image(pipe, request):
    """The request's image resized and cropped as the I2V pipeline does."""
    image = png_to_image(request.image)
    height, width = _image_size(pipe, image)
    return pipe.video_processor.resize(image, height=height, width=width, resize_mode="crop")


# -- the planner's built-in models and decoder (data the registry hands raydit.planner) ----------
TEXT_ENCODER_PARAMS = 7.07e9 + 0.22e9  # Qwen2.5-VL-7B text model + ByT5-small encoder

# HunyuanVideo 1.5 (AutoencoderKLHunyuanVideo15, default config: 16x, blocks 128 ... 1024, RMS
# norms), counted the same way on 5 x 16 x 16 latents (17 x 256 x 256 out): 2.535e7 FLOP per
# output pixel-frame in convolutions, plus its mid block's one-head attention over every latent
# token of the video at 1024 channels (6.7e9 = 4 N^2 C, N = 1280); 3370 halo values per output
# frame and column, 8 exchanges per latent frame, no group norm. diffusers decodes the whole
# video in one call (no framewise decode).
DECODER = DecoderShape(2.535e7, 3370, 8.0, 0.0, 128, 0, attention_channels=1024)


def builtin_models() -> list:
    """The planner's built-in models of this family (raydit.planner.BUILTIN_MODELS)."""
    from raydit.planner.model import ModelSpec

    # tiny-hunyuan15 / -i2v: HunyuanVideo 1.5's layout (patch 1, 16x VAE, joint text) at 6 heads x 8.
    # (4.6e6 parameters: the ByT5 projection's 2048-wide hidden layer is fixed by diffusers.)
    tiny = dict(family="hunyuanvideo15", heads=6, head_dim=8, layers=2, ffn_hidden=96, patch_size=1, patch_size_t=1,
                text_tokens=1256, text_in_sequence=True, positional="rotary", in_channels=9, params=4.6e6,
                vae_params=1.1e5, default_frames=9, default_height=48, default_width=80, vae_spatial=16)
    common = dict(family="hunyuanvideo15", heads=16, head_dim=128, layers=54, ffn_hidden=8192, patch_size=1,
                  patch_size_t=1, text_tokens=1256, text_in_sequence=True, positional="rotary", in_channels=65,
                  params=8.33e9, text_encoder_params=TEXT_ENCODER_PARAMS, vae_params=1.26e9, default_frames=121,
                  vae_spatial=16)
    return [
        # HunyuanVideo 1.5 (HunyuanVideo15Transformer3DModel's defaults: 16 heads x 128, 54
        # dual-stream blocks, patch 1, 65 = 32 noise + 32 image + 1 mask channels, 8.33e9 params
        # counted on the meta device; AutoencoderKLHunyuanVideo15: 16x / 4x, 32 channels, 1.26e9).
        # Text joins the attention: 1000 Qwen2.5-VL + 256 ByT5 tokens (padded); encoders: the
        # Qwen2.5-VL-7B text model 7.07e9 + ByT5-small's encoder 0.22e9. Defaults: 121 frames at
        # the 16:9 bucket of the transformer's target_size (640: 480 x 848; 960: 720 x 1280).
        ModelSpec(name="hunyuanvideo-1.5-480p", default_height=480, default_width=848, **common),
        ModelSpec(name="hunyuanvideo-1.5-720p", default_height=720, default_width=1280, **common),
        ModelSpec(name="tiny-hunyuan15", text_encoder_params=2.9e4, **tiny),
        ModelSpec(name="tiny-hunyuan15-i2v", text_encoder_params=3.4e4, **tiny),
    ]


class HunyuanVideo15Family(Family):
    """HunyuanVideo15Pipeline / HunyuanVideo15ImageToVideoPipeline steps: classifier-free
    guidance from the pipeline's guider, two transformer calls per step."""

    name = "hunyuanvideo15"
    pipelines = (T2V, I2V)
    image_pipelines = (I2V,)
    adapter = HunyuanVideo15Adapter
    batch_branches = False  # the guider's batches: one call per branch, as the pipeline makes them
    # Per video token and channel, and kernels per block and call, of the block's ops besides GEMMs and
    # attention in eager bf16: bench/bench_blockcounts.py (the family's tiny forward case, FFN at the released ratio).
    elementwise_bytes = 351.6  # 343.6 + 8: its norms' copies of non-contiguous inputs (bench_opsweep.hidden_copy_bytes)
    elementwise_launches = 85
    keeps_scheduler_dtype = True  # as the pipelines' loops (they cast back on Apple's mps only)
    decoder = DECODER
    models = staticmethod(builtin_models)

    def fp8_weight_params(self, spec) -> float:
        # per (double-stream) block: video and text q, k, v, out (8 h^2), video and text FFN (4 h f)
        return block_linear_params(spec, 8, 4)

    def spec_from_dir(self, path, configs):
        """Geometry from transformer/config.json and vae/config.json (diffusers' defaults for
        absent keys: 16 x 128, 54 layers, patch 1, 16x / 4x VAE, 32 latent channels); request
        defaults: 121 frames at the 16:9 bucket of the transformer's target_size, unless the
        directory says otherwise (DEFAULTS_FILE); sizes from the weights' headers."""
        from raydit.planner.model import ModelSpec
        from raydit.planner.pipeline_dir import attention_shape, component_params, transformer_config

        cfg, where = transformer_config(path, configs, "HunyuanVideo15Transformer3DModel", "a HunyuanVideo 1.5 pipeline")
        heads, head_dim = attention_shape(cfg, where)
        layers = int(cfg.get("num_layers", 54))
        hidden = heads * head_dim
        ffn = int(hidden * float(cfg.get("mlp_ratio", 4.0)))
        vae = configs.get("vae", {})
        spatial = int(vae.get("spatial_compression_ratio", 16))
        height, width = default_size(int(cfg.get("target_size", 640)), spatial)
        defaults = request_defaults(path, {"num_frames": DEFAULT_FRAMES, "height": height, "width": width})
        # attention 8 h^2 (video and text), two FFNs 4 h ffn, two adaptive norms 12 h^2
        estimate = float(layers * (20 * hidden * hidden + 4 * hidden * ffn))
        encoders = sum(component_params(path / c) or 0.0 for c in ("text_encoder", "text_encoder_2", "image_encoder"))
        return ModelSpec(
            name=str(path), family=self.name, heads=heads, head_dim=head_dim, layers=layers, ffn_hidden=ffn,
            patch_size=int(cfg.get("patch_size", 1)), patch_size_t=int(cfg.get("patch_size_t", 1)),
            text_tokens=QWEN_TOKENS + BYT5_TOKENS, text_in_sequence=True, positional="rotary",
            in_channels=int(cfg.get("in_channels", 65)),
            params=component_params(path / "transformer") or estimate, text_encoder_params=encoders,
            vae_params=component_params(path / "vae") or 0.0,
            **defaults, vae_spatial=spatial,
            vae_temporal=int(vae.get("temporal_compression_ratio", 4)),
        )

    def reference_latents(self, pipe, request):
        pipe.set_progress_bar_config(disable=True)
        kwargs = reference_call(request, negative_none=True)
        del kwargs["guidance_scale"]  # the pipeline's guider takes it, below
        if type(pipe).__name__ == I2V:
            del kwargs["height"], kwargs["width"]
            kwargs["image"] = png_to_image(request.image)  # the pipeline sizes the video from it
        guider = pipe.guider
        pipe.guider = guider.new(guidance_scale=request.guidance_scale)  # what --guidance-scale sets
        try:
            return pipe(**kwargs).frames
        finally:
            pipe.guider = guider

    # -- hooks ---------------------------------------------------------------------------------
    def encoders(self, pipe) -> list:
        return [m for m in (getattr(pipe, n, None) for n in ("text_encoder", "text_encoder_2", "image_encoder"))
                if m is not None]

    def do_cfg(self, pipe, request) -> bool:
        # ClassifierFreeGuidance._is_cfg_enabled: on unless disabled or the scale is 1.
        guider = getattr(pipe, "guider", None)
        enabled = guider is None or getattr(guider, "_enabled", True)
        return enabled and not math.isclose(request.guidance_scale, 1.0)

    def call_defaults(self, model_dir) -> dict:
        """The pipeline's call takes no guidance_scale: its guider's scale is the default, from
        the directory's guider config (ClassifierFreeGuidance's own default where it gives none)."""
        import inspect
        from pathlib import Path

        from diffusers import ClassifierFreeGuidance

        out = super().call_defaults(model_dir)
        scale = inspect.signature(ClassifierFreeGuidance.__init__).parameters["guidance_scale"].default
        config = Path(model_dir) / "guider" / "guider_config.json"
        if config.is_file():
            given = json.loads(config.read_text()).get("guidance_scale")
            if isinstance(given, (int, float)) and not isinstance(given, bool):
                scale = given
        out["guidance_scale"] = float(scale)
        return out

    def check_request(self, pipe, request) -> None:
        super().check_request(pipe, request)
        guider = getattr(pipe, "guider", None)
        if guider is not None:
            name = type(guider).__name__
            config = getattr(guider, "config", {})
            if name != "ClassifierFreeGuidance":
                raise ValueError(f"the pipeline's guider is {name}; raydit runs HunyuanVideo 1.5 with ClassifierFreeGuidance only")
            odd = {k: config.get(k) for k, plain in (("guidance_rescale", 0.0), ("use_original_formulation", False),
                                                     ("start", 0.0), ("stop", 1.0)) if config.get(k, plain) != plain}
            if odd:
                raise ValueError(f"the pipeline's guider sets {odd}; raydit runs plain classifier-free guidance only "
                                 "(guidance_rescale 0, start 0, stop 1): save the pipeline with such a guider")
        temporal = pipe.vae_scale_factor_temporal
        check_frames(request.num_frames, temporal)
        multiple = pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size
        check_size(request, multiple, pipe.vae_scale_factor_spatial, pipe.transformer.config.patch_size)
        if type(pipe).__name__ == I2V:
            image = png_to_image(request.image)
            height, width = _image_size(pipe, image)
            if (request.height, request.width) != (height, width):
                raise ValueError(
                    f"{I2V} sizes the video from the image: a {image.size[0]}x{image.size[1]} image gives "
                    f"height {height} and width {width} (target size {pipe.target_size}); ask for those"
                )

    def encode(self, pipe, request, device, dtype):
        model_dtype = pipe.transformer.dtype
        image_embeds = None
        if type(pipe).__name__ == I2V:
            image_embeds = pipe.encode_image(image=_request_image(pipe, request), batch_size=1, device=device,
                                             dtype=model_dtype)

        def branch(prompt):
            embeds, mask, embeds_2, mask_2 = pipe.encode_prompt(prompt=prompt, device=device, dtype=model_dtype)
            out = {"encoder_hidden_states": embeds, "encoder_attention_mask": mask,
                   "encoder_hidden_states_2": embeds_2, "encoder_attention_mask_2": mask_2}
            if image_embeds is not None:
                out["image_embeds"] = image_embeds
            return out

        positive = branch(request.prompt)
        negative = branch(request.negative_prompt or None) if self.do_cfg(pipe, request) else None
        return positive, negative

    def init(self, pipe, request, generator, device, dtype):
        import torch
        from diffusers.pipelines.hunyuan_video1_5.pipeline_hunyuan_video1_5 import retrieve_timesteps

        timesteps = linear_sigma_timesteps(pipe, request.num_inference_steps, device, retrieve_timesteps)
        model_dtype = pipe.transformer.dtype
        # In the transformer's dtype, as both pipelines draw them (bf16 noise drawn in bf16).
        latents = pipe.prepare_latents(1, pipe.num_channels_latents, request.height, request.width,
                                       request.num_frames, model_dtype, device, generator)
        context = {}
        if type(pipe).__name__ == I2V:
            # The image's latents on frame 0 and a frame mask: channels of every video token.
            cond, mask = pipe.prepare_cond_latents_and_mask(
                latents=latents, image=_request_image(pipe, request), batch_size=1, height=request.height,
                width=request.width, dtype=model_dtype, device=device)
        else:
            cond, mask = pipe.prepare_cond_latents_and_mask(latents, model_dtype, device)
            context["image_embeds"] = torch.zeros(1, pipe.vision_num_semantic_tokens, pipe.vision_states_dim,
                                                  dtype=model_dtype, device=device)
        context["condition"] = torch.cat([cond, mask], dim=1)  # [1, C + 1, F, H, W]
        return Prepared(latents=latents, timesteps=timesteps, context=context)

    # Step-level batching: requests of one geometry share a call, each with its own timestep
    # (and refiner timestep), image features and prompts (their masks per sample).
    batched_inputs = ("hidden_states", "image_embeds", "timestep", "encoder_hidden_states", "encoder_attention_mask",
                      "encoder_hidden_states_2", "encoder_attention_mask_2", "timestep_r")

    def model_inputs(self, pipe, state, t, branch):
        import torch

        transformer = pipe.transformer
        b = branch["encoder_hidden_states"].shape[0]
        latents = state.latents.to(transformer.dtype)
        model_input = torch.cat([latents, state.context["condition"]], dim=1).expand(b, -1, -1, -1, -1)
        image_embeds = branch.get("image_embeds", state.context.get("image_embeds"))
        timestep_r = None
        if transformer.config.use_meanflow:  # the I2V pipeline's refiner timestep: the next one
            i = state.step_index
            nxt = state.timesteps[i + 1] if i + 1 < len(state.timesteps) else torch.tensor(0.0, device=t.device)
            timestep_r = nxt.expand(b).to(model_input.dtype)
        return transformer, dict(
            hidden_states=model_input,
            image_embeds=image_embeds.expand(b, -1, -1),
            timestep=t.expand(b).to(model_input.dtype),
            encoder_hidden_states=branch["encoder_hidden_states"],
            encoder_attention_mask=branch["encoder_attention_mask"],
            encoder_hidden_states_2=branch["encoder_hidden_states_2"],
            encoder_attention_mask_2=branch["encoder_attention_mask_2"],
            timestep_r=timestep_r,
        )

    def guidance_scale(self, pipe, state, t) -> float:
        return state.request.guidance_scale

    def decode_video(self, pipe, state, latents):
        vae = pipe.vae
        latents = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor
        return vae.decode(latents, return_dict=False)[0]


FAMILY = HunyuanVideo15Family()


def default_size(target_size: int, vae_spatial: int = 16) -> tuple[int, int]:
    """(height, width) HunyuanVideo15Pipeline generates without a size: the 16:9 bucket of
    `target_size` (generate_crop_size_list / get_closest_ratio), in pure Python."""
    num = round((target_size / vae_spatial) ** 2)
    buckets, wp, hp = [], num, 1
    while wp > 0:
        if max(wp, hp) / min(wp, hp) <= 4.0:
            buckets.append((wp * vae_spatial, hp * vae_spatial))
        if (hp + 1) * wp <= num:
            hp += 1
        else:
            wp -= 1
    aspect = 9 / 16
    candidates = [(i, round(h / w, 5) - aspect) for i, (h, w) in enumerate(buckets) if round(h / w, 5) - aspect >= 0]
    best = min(candidates, key=lambda pair: abs(pair[1]))[0]
    return buckets[best]
