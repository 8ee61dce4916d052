"""The Mochi 1 family: text-to-video (`MochiPipeline`, genmo/mochi-1-preview): its adapter and steps.

Its tiny pipeline is in `tiny.py`, its conformance cases in `cases.py`.

Adapter. `MochiTransformer3DModel` runs one list of asymmetric dual-stream blocks: the video
(3072 wide in Mochi 1) and the T5 text (1536 wide) keep their own weights, norms and
feed-forwards, and meet in one joint attention (`MochiAttention`, `MochiAttnProcessor2_0`):
the video's q, k, v and the text's (its own projections to the video's heads) are attended
together over [video ; valid text], the text's T5 padding removed per sample. The last block
is `context_pre_only`: the text is only keys and values there and is not updated.

Under sequence parallelism only the video is split: the split hook cuts `hidden_states`
before the first block, the gather hook restores it after the last. The text stays whole on
every rank (never split, never padded) and every rank runs the text stream itself (the same
numbers everywhere). Inside each attention the *valid* text tokens (the T5 mask is a prefix:
the first n) are laid out as a second part beside the video, each valid text token on
exactly one rank (raydit.models.joint_text), so the attention counts every key exactly once
and never sees a padding token; the attention output of the valid text tokens is then
all-gathered, so every rank holds the whole text again, bit for bit the same. A padding text
token is neither key nor query; its attention output is zero, as diffusers' processor leaves
it (it pads each sample's output with zeros after its valid tokens). Samples whose masks
differ are attended one after the other, as diffusers does. RoPE covers the video only: the
model's table for all video tokens ([Lv, H, D/2] cos and sin) is cut to this rank's chunk.
Uneven video lengths are padded at the end of the video (pad keys are never attended, pad
queries are dropped at the gather).

Steps. As `MochiPipeline`: the guidance branches run as one batch [negative, positive]; the
model output is taken to float32 and guided there, the FlowMatchEulerDiscreteScheduler (the
checkpoint's invert_sigmas=True) steps on float32 latents on the pipeline's own
linear-quadratic sigma schedule (threshold noise 0.025), and the latents go back to the
dtype they were drawn in (the text encoder's, so bf16 in a bf16 run).

Decode. AutoencoderKLMochi (6x in time, 8x in space), the latents denormalized with the
VAE's latents_mean / latents_std as the pipeline does.

Module-level imports stay light (no torch, no diffusers): the planner reads this family
through the registry without importing torch.

Legend: B batch, S local video tokens (this rank's chunk), Lv all video tokens, Lt text tokens
(padded length), n valid text tokens, H heads, D head dim, C = H*D.
"""

from __future__ import annotations


from raydit.models.adapter import ModelAdapter
from raydit.models.family import Family, Prepared, patched_grid
from raydit.models.requests import check_frames, check_size, masked_prompt_branches, reference_call
from raydit.models.joint_text import JointTextProcessor, joint_text_plan
from raydit.models.joint_text import valid_text_counts as valid_text_counts_of
from raydit.models.tiny import request_defaults
from raydit.planner.model import DecoderShape

VIDEO = 0  # the only part split across the blocks

PIPELINE = "MochiPipeline"
# MochiPipeline.__call__'s request defaults (its default_height / default_width, 19 frames); a
# directory may carry its own in DEFAULTS_FILE (the tiny built-in does).
PIPELINE_DEFAULTS = {"num_frames": 19, "height": 480, "width": 848}
MAX_SEQUENCE_LENGTH = 256  # the pipeline's default text length (T5 tokens, padded)
THRESHOLD_NOISE = 0.025  # the pipeline's linear-quadratic schedule


# -- adapter -----------------------------------------------------------------------------------
def apply_rotary(x, cos, sin):
    """Mochi's rotation of interleaved pairs (x[..., 0::2], x[..., 1::2]), computed in float32
    and cast back, the arithmetic of diffusers' MochiAttnProcessor2_0.
    x: [B, S, H, D]; cos, sin: [S, H, D/2]."""
    import torch

    even, odd = x[..., 0::2].float(), x[..., 1::2].float()
    first = (even * cos - odd * sin).to(x.dtype)
    second = (even * sin + odd * cos).to(x.dtype)
    return torch.stack([first, second], dim=-1).flatten(-2)


def valid_text_counts(mask, text_len: int, batch: int) -> list[int]:
    """Per sample, how many text tokens are valid, from the model's encoder_attention_mask [B, Lt]
    (True for a token to attend). T5's padding makes it a prefix; any other mask is refused, since
    diffusers' processor places the valid tokens' outputs at the first n positions."""
    return valid_text_counts_of(mask, text_len, batch, name="encoder_attention_mask",
                                how="T5 pads at the end, as MochiPipeline's tokenizer call does; give the mask "
                                    "the tokenizer returns")


class MochiSPAttnProcessor(JointTextProcessor):
    """Sequence-parallel replacement for MochiAttnProcessor2_0: the text stream has its own width
    Ct, and stays un-projected in a context_pre_only block, as there."""

    video_part = VIDEO

    def valid_counts(self, mask, video_len, text_len, batch):
        return valid_text_counts(mask, text_len, batch)

    def rotate(self, q, k, rotary):
        from raydit.parallel.sharding import shard_rotary

        cos, sin = shard_rotary(rotary, self.context.layout, self.context.mesh.sp_index, VIDEO, dim=0)
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)

    def finish(self, attn, video, text):
        video = attn.to_out[1](attn.to_out[0](video))  # linear, dropout
        if hasattr(attn, "to_add_out"):  # absent in the context_pre_only (last) block
            text = attn.to_add_out(text)
        return video, text


class MochiAdapter(ModelAdapter):
    name = "mochi"
    transformer_classes = ("MochiTransformer3DModel",)
    # MochiTransformerBlock.forward(hidden_states, encoder_hidden_states, temb,
    # encoder_attention_mask, image_rotary_emb) -> (hidden_states, encoder_hidden_states); temb
    # [B, C] is per sample, the rotary table is cut in the processor.
    plan = joint_text_plan("transformer_blocks", attention="attn1", video_part=VIDEO)
    processor = MochiSPAttnProcessor
    block_count = "num_layers"




def linear_quadratic_sigmas(num_steps: int, threshold_noise: float = THRESHOLD_NOISE) -> list[float]:
    """The pipeline's sigma schedule (genmo's infer.py): linear from 1 down to 1 - threshold
    over the first half of the steps, quadratic to 0 after. num_steps >= 2."""
    linear_steps = num_steps // 2
    quadratic_steps = num_steps - linear_steps
    step_diff = linear_steps - threshold_noise * num_steps
    quadratic_coef = step_diff / (linear_steps * quadratic_steps**2)
    linear_coef = threshold_noise / linear_steps - 2 * step_diff / quadratic_steps**2
    const = quadratic_coef * linear_steps**2
    sigmas = [i * threshold_noise / linear_steps for i in range(linear_steps)]
    sigmas += [quadratic_coef * i**2 + linear_coef * i + const for i in range(linear_steps, num_steps)]
    return [1.0 - s for s in sigmas]


# -- the family --------------------------------------------------------------------------------
# -- the planner's built-in models and decoder (data the registry hands raydit.planner) ----------
# Mochi 1 (AutoencoderKLMochi(), diffusers' default config = its conversion script's: decoder 768
# ... 128 channels, replicate-padded causal convolutions, per-frame group norms, no attention),
# counted the same way on the meta device: 1.5805e7 FLOP per decoded output pixel-frame (4 x 16 x
# 16 and 8 x 16 x 16 latents alike); the decoder makes 6 T frames for T latent frames, of which
# the VAE drops the first 5 (`dropped_frames`); 4670 halo values per decoded frame and column (5 x
# 16 x 16); 38 convolutions with a 1-row halo per call (9.5 per latent frame at the pipeline's 19
# frames: 4 latent frames) and 16.4 group-norm calls per latent frame (each norm runs per 8
# frames); the whole video in one call at 128 channels at full resolution. raydit splits it by
# rows (issue 34).
DECODER = DecoderShape(1.5805e7, 4670, 9.5, 16.4, 128, 0, dropped_frames=5)


def builtin_models() -> list:
    """The planner's built-in models of this family (raydit.planner.BUILTIN_MODELS)."""
    from raydit.planner.model import T5_XXL_PARAMS, ModelSpec

    common = dict(family="mochi", patch_size=2, patch_size_t=1, text_tokens=256, text_in_sequence=True,
                  positional="rotary", in_channels=12, vae_temporal=6)
    return [
        # Mochi 1 (genmo/mochi-1-preview): MochiTransformer3DModel's defaults, which its conversion
        # script builds (24 heads x 128, 48 asymmetric dual-stream blocks, a 1536-wide text
        # stream, SwiGLU of inner width 8192, patch 2, 12 latent channels: 1.0028e10 parameters
        # on the meta device); the T5 text (256 tokens, padded) joins the attention.
        # AutoencoderKLMochi(latent_channels=12): 6x in time, 8x in space, 4.6e8 parameters.
        # MochiPipeline's defaults: 19 frames at 480 x 848.
        ModelSpec(name="mochi-1", heads=24, head_dim=128, layers=48, ffn_hidden=8192, params=10.03e9,
                  text_encoder_params=T5_XXL_PARAMS, vae_params=0.46e9, default_frames=19, default_height=480,
                  default_width=848, **common),
        # tiny-mochi: Mochi's layout (asymmetric dual-stream blocks, 6x / 8x VAE, joint T5 text) at 6 heads.
        ModelSpec(name="tiny-mochi", heads=6, head_dim=16, layers=2, ffn_hidden=256, params=4.2e5,
                  text_encoder_params=2.5e4, vae_params=6.1e5, default_frames=7, default_height=32,
                  default_width=48, **common),
    ]


class MochiFamily(Family):
    """MochiPipeline's steps: [negative, positive] as one transformer call, guidance and the
    flow-matching step in float32."""

    name = "mochi"
    pipelines = (PIPELINE,)
    adapter = MochiAdapter
    batch_branches = True  # the pipeline runs [negative, positive] as one batch
    gated_ffn = True  # SwiGLU (FeedForward(activation_fn="swiglu")): value and gate, 2 x 8192 wide
    # Per video token and channel, and kernels per block and call, of the block's ops besides GEMMs and
    # attention in eager bf16: bench/bench_blockcounts.py (the family's tiny forward case, FFN at the released ratio; its attention loops over the batch's samples, so at the pipeline's batch of two).
    elementwise_bytes = 406.7
    elementwise_launches = 145
    batched_inputs = ("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask")
    decoder = DECODER
    models = staticmethod(builtin_models)

    def fp8_weight_params(self, spec) -> float:
        # Mochi's blocks are asymmetric: the text stream is h / 2 wide (1536 at 3072). Per block:
        # video q, k, v, out (4 h^2), text q, k, v into h (1.5 h^2), the video SwiGLU FFN (up 2f,
        # down f: 3 h f); all but the last block also the text's out (0.5 h^2) and its SwiGLU
        # FFN at half the widths (0.75 h f).
        h, f, n = spec.hidden, spec.ffn_hidden, spec.layers
        return float(n * (5.5 * h * h + 3 * h * f) + (n - 1) * (0.5 * h * h + 0.75 * h * f))

    def spec_from_dir(self, path, configs):
        """Geometry from transformer/config.json and vae/config.json; the request defaults are
        the pipeline's (19 frames, 480 x 848) unless the directory says otherwise
        (DEFAULTS_FILE); sizes from the weights' headers."""
        from raydit.planner.model import ModelSpec
        from raydit.planner.pipeline_dir import attention_shape, component_params, t5_encoder_params, transformer_config

        cfg, where = transformer_config(path, configs, "MochiTransformer3DModel", "a Mochi pipeline")
        heads, head_dim = attention_shape(cfg, where)
        layers = int(cfg.get("num_layers", 48))
        hidden = heads * head_dim
        text_hidden = int(cfg.get("pooled_projection_dim", 1536))
        vae = configs.get("vae", {})
        temporal = 1
        for factor in vae.get("temporal_expansions", (1, 2, 3)):
            temporal *= int(factor)
        spatial = 1
        for factor in vae.get("spatial_expansions", (2, 2, 2)):
            spatial *= int(factor)
        defaults = request_defaults(path, PIPELINE_DEFAULTS)
        encoder = t5_encoder_params(path, configs)
        ffn = (4 * hidden * 2) // 3  # MochiTransformerBlock's SwiGLU inner width
        text_ffn = (4 * text_hidden * 2) // 3
        # video: q, k, v, out 4 h^2, SwiGLU 3 h ffn, adaptive norm 4 h^2; text: q, k, v to the
        # video's width 3 t h, out h t, SwiGLU 3 t tffn, adaptive norm 4 t h.
        estimate = float(layers * (8 * hidden * hidden + 3 * hidden * ffn + 8 * text_hidden * hidden
                                   + 3 * text_hidden * text_ffn))
        return ModelSpec(
            name=str(path), family=self.name, heads=heads, head_dim=head_dim, layers=layers, ffn_hidden=ffn,
            patch_size=int(cfg.get("patch_size", 2)), patch_size_t=1,
            text_tokens=int(cfg.get("max_sequence_length", MAX_SEQUENCE_LENGTH)), text_in_sequence=True,
            positional="rotary", in_channels=int(cfg.get("in_channels", 12)),
            params=component_params(path / "transformer") or estimate, text_encoder_params=encoder,
            vae_params=component_params(path / "vae") or 0.0,
            **defaults, vae_spatial=spatial, vae_temporal=temporal,
        )

    def reference_latents(self, pipe, request):
        pipe.set_progress_bar_config(disable=True)
        return pipe(**reference_call(request, max_sequence_length=MAX_SEQUENCE_LENGTH)).frames

    # -- hooks ---------------------------------------------------------------------------------
    def check_request(self, pipe, request) -> None:
        super().check_request(pipe, request)
        if request.num_inference_steps < 2:
            raise ValueError(
                f"num_inference_steps {request.num_inference_steps} is too few for Mochi's linear-quadratic "
                "sigma schedule (half its steps are linear); give 2 or more"
            )
        temporal = pipe.vae_temporal_scale_factor
        check_frames(request.num_frames, temporal)
        multiple = pipe.vae_spatial_scale_factor * pipe.transformer.config.patch_size
        check_size(request, multiple, pipe.vae_spatial_scale_factor, pipe.transformer.config.patch_size)

    def encode(self, pipe, request, device, dtype):
        """The T5 embeddings and masks of both branches (the negative prompt "" when none is
        given), in the text encoder's dtype, as the pipeline encodes them."""
        return masked_prompt_branches(pipe, request, device, MAX_SEQUENCE_LENGTH)

    def init(self, pipe, request, generator, device, dtype):
        """Noise drawn in float32 and cast to the run's dtype (the pipeline's latents take the
        prompt embeddings' dtype); timesteps from the linear-quadratic sigmas."""
        import numpy as np
        from diffusers.pipelines.mochi.pipeline_mochi import retrieve_timesteps

        latents = pipe.prepare_latents(1, pipe.transformer.config.in_channels, request.height, request.width,
                                       request.num_frames, dtype, device, generator)
        n = request.num_inference_steps
        sigmas = np.array(linear_quadratic_sigmas(n))
        timesteps, _ = retrieve_timesteps(pipe.scheduler, n, device, None, sigmas)
        pipe.scheduler.set_begin_index(0)
        return Prepared(latents=latents, timesteps=timesteps)

    def token_grid(self, pipe, state):
        # MochiTransformer3DModel: each frame patched by a Conv2d, flatten(1, 2) frame-major;
        # the joint sequence is [video ; valid text].
        p = pipe.transformer.config.patch_size
        return patched_grid(*state.latents.shape[-3:], (1, p, p))

    def model_inputs(self, pipe, state, t, branch):
        import torch

        latents = state.latents
        b = branch["encoder_hidden_states"].shape[0]  # 2 when this rank runs both guidance branches
        return pipe.transformer, dict(
            hidden_states=torch.cat([latents] * b) if b > 1 else latents,
            encoder_hidden_states=branch["encoder_hidden_states"],
            timestep=t.expand(b).to(latents.dtype),
            encoder_attention_mask=branch["encoder_attention_mask"],
        )

    def model_output(self, out):
        return out.float()  # "Mochi CFG + Sampling runs in FP32"

    def scheduler_step(self, pipe, state, noise, t, generator):
        import torch

        from raydit.models.schedules import step

        latents = step(pipe.scheduler, noise, t, state.latents.to(torch.float32), generator)
        return latents.to(state.latents.dtype), dict(state.carry)

    def decode_video(self, pipe, state, latents):
        import torch

        vae = pipe.vae
        latents = latents.to(vae.device, vae.dtype)
        mean, std = getattr(vae.config, "latents_mean", None), getattr(vae.config, "latents_std", None)
        if mean is not None and std is not None:
            channels = latents.shape[1]
            mean = torch.tensor(mean).view(1, channels, 1, 1, 1).to(latents.device, latents.dtype)
            std = torch.tensor(std).view(1, channels, 1, 1, 1).to(latents.device, latents.dtype)
            latents = latents * std / vae.config.scaling_factor + mean
        else:
            latents = latents / vae.config.scaling_factor
        return vae.decode(latents, return_dict=False)[0]


FAMILY = MochiFamily()
