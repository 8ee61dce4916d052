"""Wan family: Wan 2.1 / 2.2 text-to-video (one or two experts, TI2V-5B) and image-to-video.

Sequence parallelism for diffusers' WanTransformer3DModel. Only video tokens are in
self-attention: the layout has one part, the video, split before the first block and
gathered after the last (before the final norm and projection). Text, and Wan 2.1 I2V's CLIP
image tokens (the model puts them in front of the text), reach the video through
cross-attention: they stay whole on every rank, so cross-attention of the local video chunk
needs no communication and keeps diffusers' own processor. Self-attention (attn1) gets
`WanSPAttnProcessor`; the rotary table, computed by the model for all video tokens, is cut
to this rank's chunk there. Wan 2.2 TI2V (`expand_timesteps`) has a timestep per token: the
blocks' `temb` is then [B, L, 6, C] and is split with the video before every block (the
model hands the same tensor to each block); the final norm, after the gather, uses the
model's full one.

Uneven token counts are padded (docs/design.md), never refused; the Ulysses degree must
divide the heads (40 heads on 3, 6 or 7 ranks run ring or hybrid layouts).

Module-level imports stay light (no torch, no diffusers): the planner reads this family
through the registry without importing torch.

Legend: B batch, L local video tokens, H heads, D head dim, C = H*D.
"""

from __future__ import annotations

from raydit.models.adapter import ForwardContext, GatherOutput, ModelAdapter, SequenceParallelPlan, SplitInput, attend
from raydit.models.family import Family, Prepared
from raydit.models.quantize_options import block_linear_params
from raydit.models.requests import check_frames, check_size, png_to_image, reference_call, round_frames_up
from raydit.models.tiny import request_defaults
from raydit.planner.model import DecoderShape

VIDEO = 0  # the layout's only part


# -- adapter -----------------------------------------------------------------------------------
def rotate_pairs(x_BLHD, cos, sin):
    """Wan's rotary: each channel pair (x[2i], x[2i+1]) is rotated by the angle whose cosine
    and sine the tables hold (repeated for both channels of the pair):
        out[2i]   = x[2i] cos - x[2i+1] sin
        out[2i+1] = x[2i] sin + x[2i+1] cos
    computed in the tables' dtype (float64 in diffusers) and returned in x's."""
    import torch

    x1, x2 = x_BLHD.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).type_as(x_BLHD)


class WanSPAttnProcessor:
    """Sequence-parallel replacement for the processor of a Wan block's self-attention.

    Projections and the QK RMS norms (across heads) are per token, so they run on the local
    chunk; only the attention itself needs the other ranks (sp_attention).
    """

    def __init__(self, context: ForwardContext):
        self.context = context

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        mesh, layout = self.context.self_attention(type(self).__name__, hidden_states, encoder_hidden_states,
                                                   attention_mask, "; Wan does not use one")
        out_BLC = attend(*self.qkv(attn, hidden_states, rotary_emb), mesh, layout)
        return attn.to_out[1](attn.to_out[0](out_BLC))  # linear, dropout

    def qkv(self, attn, hidden_states, rotary_emb):
        """q, k (normed, rotated by this rank's rows of the table), v: [B, L, H, D] each."""
        from raydit.parallel.sharding import shard_rotary

        q = attn.norm_q(attn.to_q(hidden_states)).unflatten(2, (attn.heads, -1))  # [B, L, H, D]
        k = attn.norm_k(attn.to_k(hidden_states)).unflatten(2, (attn.heads, -1))
        v = attn.to_v(hidden_states).unflatten(2, (attn.heads, -1))
        if rotary_emb is not None:
            cos, sin = shard_rotary(rotary_emb, self.context.layout, self.context.mesh.sp_index, VIDEO, dim=1)
            q, k = rotate_pairs(q, cos, sin), rotate_pairs(k, cos, sin)
        return q, k, v


class WanAdapter(ModelAdapter):
    name = "wan"
    transformer_classes = ("WanTransformer3DModel",)
    plan = SequenceParallelPlan(
        blocks="blocks",
        # WanTransformerBlock.forward(hidden_states, encoder_hidden_states, temb, rotary_emb)
        split_inputs=(
            SplitInput("hidden_states", VIDEO),
            # [B, L, 6, C] with a per-token timestep (TI2V); [B, 6, C] stays whole.
            SplitInput("temb", VIDEO, ndim=4, every_block=True),
        ),
        gather_outputs=(GatherOutput(0, VIDEO),),  # the block returns hidden_states alone
        attention="attn1",
    )
    processor = WanSPAttnProcessor


# -- the family --------------------------------------------------------------------------------
def _boundary_timestep(pipe):
    """Wan 2.2 A14B: `transformer` runs at t >= boundary, `transformer_2` below; None: one expert."""
    ratio = pipe.config.get("boundary_ratio")
    return None if ratio is None else ratio * pipe.scheduler.config.num_train_timesteps


def _low_noise(pipe, t) -> bool:
    boundary = _boundary_timestep(pipe)
    return boundary is not None and bool(t < boundary)


# -- the planner's built-in models and decoder (data the registry hands raydit.planner) ----------
# Wan 2.1 (AutoencoderKLWan, base 96, 21 -> 81 frames): 4.24e6 MAC per output pixel-frame, 6320
# halo values per output frame and column, 33 exchanges per latent frame, no group norm (RMS norm
# over channels); its other ops move 22379.6 values per output pixel-frame (bench/bench_decodecounts.py
# on diffusers' framewise decode of 81 x 720 x 1280: RMS norms, SiLU, the causal caches' cat and pad,
# upsampling, residual adds, the growing output's cat; docs/benchmarks/decodecounts.json).
DECODER = DecoderShape(2 * 4.24e6, 6320, 33.0, 0.0, 96, 4, elementwise_values=22379.6)
# Wan 2.2's 16x VAE (TI2V-5B: decoder base 256 at half resolution, patch 2; 5 -> 17 frames):
# 9.33e6 MAC per output pixel-frame, 8934 halo values, 33 exchanges per latent frame; its 256
# channels at half resolution hold as much as 64 at full resolution.
DECODER_16X = DecoderShape(2 * 9.33e6, 8934, 33.0, 0.0, 64, 4)


def builtin_models() -> list:
    """The planner's built-in models of this family (raydit.planner.BUILTIN_MODELS)."""
    from raydit.planner.model import CLIP_VIT_H_PARAMS, UMT5_XXL_PARAMS, ModelSpec

    common = dict(family="wan", head_dim=128, patch_size=2, patch_size_t=1, text_tokens=512,
                  text_in_sequence=False, positional="rotary")
    return [
        ModelSpec(name="wan2.1-t2v-1.3b", heads=12, layers=30, ffn_hidden=8960, in_channels=16, params=1.42e9,
                  text_encoder_params=UMT5_XXL_PARAMS, vae_params=0.13e9, default_frames=81,
                  default_height=480, default_width=832, **common),
        # Parameters as diffusers builds the published configs (tests/planner/test_model.py).
        ModelSpec(name="wan2.1-t2v-14b", heads=40, layers=40, ffn_hidden=13824, in_channels=16, params=14.29e9,
                  text_encoder_params=UMT5_XXL_PARAMS, vae_params=0.13e9, default_frames=81,
                  default_height=720, default_width=1280, **common),
        # I2V: 16 noise + 4 mask + 16 image-latent channels; 257 CLIP image tokens join the
        # text in cross-attention (the CLIP ViT-H image encoder counts with the text encoder); each
        # block's image k / v projections make it 16.39 B parameters.
        ModelSpec(name="wan2.1-i2v-14b-480p", heads=40, layers=40, ffn_hidden=13824, in_channels=36,
                  params=16.39e9, text_encoder_params=UMT5_XXL_PARAMS + CLIP_VIT_H_PARAMS, vae_params=0.13e9,
                  default_frames=81, default_height=480, default_width=832, **common),
        # Two 14B experts: `transformer` above the boundary timestep, `transformer_2` below.
        ModelSpec(name="wan2.2-t2v-a14b", heads=40, layers=40, ffn_hidden=13824, in_channels=16, params=14.29e9,
                  text_encoder_params=UMT5_XXL_PARAMS, vae_params=0.13e9, default_frames=81,
                  default_height=720, default_width=1280, experts=2, **common),
        # TI2V-5B: 48 latent channels, the 16x spatial VAE; 121 frames at 704 x 1280.
        ModelSpec(name="wan2.2-ti2v-5b", heads=24, layers=30, ffn_hidden=14336, in_channels=48, params=5.0e9,
                  text_encoder_params=UMT5_XXL_PARAMS, vae_params=0.7e9, default_frames=121,
                  default_height=704, default_width=1280, vae_spatial=16, **common),
    ]


# The pipelines' request defaults (81 x 480 x 832); a directory may carry its own in
# DEFAULTS_FILE (the tiny built-ins do: 32760 video tokens are far too many for them).
PIPELINE_DEFAULTS = {"num_frames": 81, "height": 480, "width": 832}


class WanFamily(Family):
    """Wan's steps, as diffusers' WanPipeline / WanImageToVideoPipeline take them.

    The guidance branches are two transformer calls (the pipeline's order and numbers).
    Wan 2.2 A14B switches expert and guidance scale at the boundary timestep. TI2V
    (`expand_timesteps`) gives every token its timestep; with an image the first latent frame
    is the image's latents at timestep 0, and `state.latents` always holds that frame (what
    the pipeline returns), so any step's latents are the output of a run stopped there. (The
    pipeline puts the frame only into the model input and its output; the scheduler's update
    is elementwise, so every other element is the same either way.)
    The scheduler is UniPC (or any diffusers scheduler): its multistep history is part of
    the scheduler state the runner checkpoints.
    """

    name = "wan"
    pipelines = ("WanPipeline", "WanImageToVideoPipeline")
    image_pipelines = ("WanImageToVideoPipeline",)
    adapter = WanAdapter
    batch_branches = False
    max_sequence_length = 512  # the pipelines' default (2.1 I2V's processor assumes 512)
    decoder = DECODER
    # WanTransformerBlock at 1536 wide (modulation, norms and rotary in float32): 658.8 MB over
    # 1024 tokens x 1536 channels (Family.elementwise_bytes says how it is counted).
    elementwise_bytes = 419.0
    elementwise_launches = 78  # per block and call (bench/bench_blockcounts.py; it counts 385 bytes on the tiny block)

    round_frames = staticmethod(round_frames_up)  # WanPipeline / WanImageToVideoPipeline's

    models = staticmethod(builtin_models)

    def fp8_weight_params(self, spec) -> float:
        # per block: self- and cross-attention's q, k, v, out (8 h^2; the text is projected to h
        # before the blocks) and the FFN (2 h f). The image-to-video models' image k / v (2 h^2 per
        # block where the transformer has them) are not counted: priced at bf16 bytes.
        return block_linear_params(spec, 8, 2)

    def decoder_for(self, spec):
        """Wan 2.2's 16x VAE (TI2V-5B) is another decoder than Wan 2.1's 8x."""
        return DECODER_16X if spec.vae_spatial == 16 else self.decoder

    def spec_from_dir(self, path, configs):
        """Geometry from transformer/config.json and vae/config.json; the request defaults are
        the pipelines' (81 frames, 480 x 832) unless the directory says otherwise
        (DEFAULTS_FILE); sizes from the weights' headers."""
        import json

        from raydit.planner.model import ModelSpec
        from raydit.planner.pipeline_dir import (attention_shape, component_params, require, t5_encoder_params,
                                                 transformer_config)

        index = configs[""]
        name = "transformer" if "transformer" in configs else "transformer_2"
        cfg, where = transformer_config(path, configs, "WanTransformer3DModel", "a Wan pipeline", name)
        heads, head_dim = attention_shape(cfg, where)
        layers, ffn = int(require(cfg, "num_layers", where)), int(require(cfg, "ffn_dim", where))
        patch_t, patch_h, patch_w = (int(p) for p in cfg.get("patch_size", (1, 2, 2)))
        if patch_h != patch_w:
            raise ValueError(f"{where}: patch_size {cfg.get('patch_size')} has unequal height and width patches")
        vae = configs.get("vae", {})
        experts = sum(1 for c in ("transformer", "transformer_2") if (index.get(c) or [None])[0] is not None)
        encoders = t5_encoder_params(path, configs)
        encoders += component_params(path / "image_encoder") or 0.0
        defaults = request_defaults(path, PIPELINE_DEFAULTS)
        hidden = heads * head_dim
        # attention 4 h^2 (self) + 4 h^2 (cross), FFN 2 h ffn, per layer
        estimate = float(layers * (8 * hidden * hidden + 2 * hidden * ffn))
        return ModelSpec(
            name=str(path), family=self.name, heads=heads, head_dim=head_dim, layers=layers, ffn_hidden=ffn,
            patch_size=patch_h, patch_size_t=patch_t, text_tokens=self.max_sequence_length, text_in_sequence=False,
            positional="rotary", in_channels=int(cfg.get("in_channels", 16)),
            params=component_params(path / name) or estimate, text_encoder_params=encoders,
            vae_params=component_params(path / "vae") or 0.0,
            **defaults, vae_spatial=int(vae.get("scale_factor_spatial", 8)),
            vae_temporal=int(vae.get("scale_factor_temporal", 4)),
            experts=max(1, experts),
        )

    def transformers(self, pipe) -> list:
        return [t for t in (pipe.transformer, getattr(pipe, "transformer_2", None)) if t is not None]

    def active_transformer(self, pipe, state, t):
        """Wan 2.2 A14B: `transformer` at t >= boundary, `transformer_2` below."""
        return pipe.transformer_2 if _low_noise(pipe, t) else pipe.transformer

    @staticmethod
    def _takes_image(pipe) -> bool:
        # TI2V-5B is saved as a WanPipeline and runs image-to-video too (diffusers loads it
        # with WanImageToVideoPipeline for that; the conditioning is the same).
        return type(pipe).__name__ == "WanImageToVideoPipeline" or bool(pipe.config.get("expand_timesteps"))

    def check_request(self, pipe, request) -> None:
        i2v = type(pipe).__name__ == "WanImageToVideoPipeline"
        if i2v and request.image is None:
            raise ValueError(f"{type(pipe).__name__} is an image-to-video pipeline; give an image (--image PATH)")
        if request.image is not None and not self._takes_image(pipe):
            raise ValueError(
                f"{type(pipe).__name__} is a text-to-video pipeline and takes no image; "
                "drop --image or load an image-to-video (or TI2V) checkpoint"
            )
        if request.guidance_scale_2 is not None and pipe.config.get("boundary_ratio") is None:
            raise ValueError(
                f"guidance_scale_2 {request.guidance_scale_2} needs a two-expert pipeline (Wan 2.2 A14B, "
                "boundary_ratio set); this one has one transformer: drop guidance_scale_2"
            )
        if request.guidance_scale_2 is not None and request.guidance_scale_2 > 1.0 and not request.do_cfg:
            # WanPipeline runs the negative branch only when guidance_scale > 1, for both experts:
            # the second expert's scale would be dropped without a word.
            raise ValueError(
                f"guidance_scale_2 {request.guidance_scale_2:g} has no effect with guidance_scale "
                f"{request.guidance_scale:g}: classifier-free guidance runs (for both experts) only when "
                "guidance_scale > 1, as in WanPipeline; raise guidance_scale or drop guidance_scale_2"
            )
        check_frames(request.num_frames, pipe.vae_scale_factor_temporal)
        patch = self.transformers(pipe)[0].config.patch_size
        multiple = max(16, pipe.vae_scale_factor_spatial * max(patch[1], patch[2]))
        check_size(request, multiple, pipe.vae_scale_factor_spatial, patch[1])

    def token_grid(self, pipe, state):
        # latents [B, C, F, H, W]; WanTransformer3DModel's Conv3d patch (pt, ph, pw) flattens
        # frame-major, then rows, then columns.
        pt, ph, pw = (int(p) for p in self.transformers(pipe)[0].config.patch_size)
        F, H, W = state.latents.shape[-3:]
        return (F // pt, H // ph, W // pw)

    def encode(self, pipe, request, device, dtype):
        positive, negative = pipe.encode_prompt(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt,
            do_classifier_free_guidance=request.do_cfg,
            max_sequence_length=self.max_sequence_length,
            device=device,
        )
        model_dtype = self.transformers(pipe)[0].dtype
        cond = {"encoder_hidden_states": positive.to(model_dtype)}
        uncond = {"encoder_hidden_states": negative.to(model_dtype)} if request.do_cfg else None
        # Wan 2.1 I2V: CLIP tokens of the image, the same for both branches.
        transformer = pipe.transformer
        if request.image is not None and transformer is not None and transformer.config.image_dim is not None:
            image_embeds = pipe.encode_image(png_to_image(request.image), device).to(model_dtype)
            for branch in (cond, uncond):
                if branch is not None:
                    branch["encoder_hidden_states_image"] = image_embeds
        return cond, uncond

    def init(self, pipe, request, generator, device, dtype):
        import torch

        pipe.scheduler.set_timesteps(request.num_inference_steps, device=device)
        timesteps = pipe.scheduler.timesteps
        if type(pipe).__name__ == "WanPipeline":
            pipe.scheduler.set_begin_index(0)  # as WanPipeline does (the I2V pipeline does not)
        # Latents stay float32 whatever the transformer's dtype, as in the pipelines.
        context = {}
        if request.image is None:
            latents = pipe.prepare_latents(
                1, self.transformers(pipe)[0].config.in_channels, request.height, request.width,
                request.num_frames, torch.float32, device, generator,
            )
            if pipe.config.get("expand_timesteps"):
                context["first_frame_mask"] = torch.ones(latents.shape, dtype=torch.float32, device=device)
            return Prepared(latents=latents, timesteps=timesteps, context=context)

        from diffusers import WanImageToVideoPipeline

        image = pipe.video_processor.preprocess(png_to_image(request.image), height=request.height,
                                                width=request.width).to(device, dtype=torch.float32)
        # The image pipeline's own helper (TI2V loaded as a WanPipeline has what it reads).
        out = WanImageToVideoPipeline.prepare_latents(
            pipe, image, 1, pipe.vae.config.z_dim, request.height, request.width, request.num_frames,
            torch.float32, device, generator,
        )
        if pipe.config.get("expand_timesteps"):
            latents, condition, mask = out
            context.update(condition=condition, first_frame_mask=mask)
            latents = self._with_first_frame(latents, context)
        else:
            latents, condition = out
            context.update(condition=condition)
        return Prepared(latents=latents, timesteps=timesteps, context=context)

    @staticmethod
    def _with_first_frame(latents, context):
        """TI2V with an image: the first latent frame is the image's (mask 0), the rest the
        sample (mask 1), exactly as the pipeline forms its model input and its output."""
        if "condition" not in context or "first_frame_mask" not in context:
            return latents  # no image, or Wan 2.1-style I2V (the image joins in the channels)
        mask = context["first_frame_mask"]
        return (1 - mask) * context["condition"] + mask * latents

    # Every input of a call carries its rows first: requests of one geometry share calls.
    batched_inputs = ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image")

    def model_inputs(self, pipe, state, t, branch):
        import torch

        model = self.active_transformer(pipe, state, t)
        ctx, latents = state.context, state.latents
        b = branch["encoder_hidden_states"].shape[0]
        if pipe.config.get("expand_timesteps"):
            x = self._with_first_frame(latents, ctx)
            # A timestep per token: the first frame's are 0 with an image.
            # seq_len: num_latent_frames * latent_height // 2 * latent_width // 2, as the pipeline
            timestep = (ctx["first_frame_mask"][0][0][:, ::2, ::2] * t).flatten().unsqueeze(0).expand(b, -1)
        else:
            x = torch.cat([latents, ctx["condition"]], dim=1) if "condition" in ctx else latents
            timestep = t.expand(b)
        if b > 1:
            x = torch.cat([x] * b)
        return model, dict(
            hidden_states=x.to(model.dtype),
            timestep=timestep,
            encoder_hidden_states=branch["encoder_hidden_states"],
            encoder_hidden_states_image=branch.get("encoder_hidden_states_image"),
        )

    def guidance_scale(self, pipe, state, t) -> float:
        request = state.request
        if _low_noise(pipe, t) and request.guidance_scale_2 is not None:
            return request.guidance_scale_2
        return request.guidance_scale

    def scheduler_step(self, pipe, state, noise, t, generator):
        from raydit.models.schedules import step

        latents = step(pipe.scheduler, noise, t, state.latents, generator)
        return self._with_first_frame(latents, state.context), dict(state.carry)

    def decode_video(self, pipe, state, latents):
        import torch

        vae = pipe.vae
        latents = latents.to(vae.device, vae.dtype)
        z = vae.config.z_dim
        mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1).to(latents.device, latents.dtype)
        video = vae.decode(latents / inv_std + mean, return_dict=False)[0]
        return video

    def reference_latents(self, pipe, request):
        """diffusers' own pipeline, called with its defaults, the request and the seed."""
        kwargs = {}
        if request.image is not None:
            kwargs["image"] = png_to_image(request.image)
            if type(pipe).__name__ != "WanImageToVideoPipeline":  # TI2V saved as a WanPipeline
                from diffusers import WanImageToVideoPipeline

                pipe = WanImageToVideoPipeline(**pipe.components, expand_timesteps=True,
                                               boundary_ratio=pipe.config.get("boundary_ratio"))
        if request.guidance_scale_2 is not None:
            kwargs["guidance_scale_2"] = request.guidance_scale_2
        pipe.set_progress_bar_config(disable=True)
        return pipe(**reference_call(request, **kwargs)).frames


FAMILY = WanFamily()
