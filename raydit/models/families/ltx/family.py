"""The LTX-Video family: text-to-video (`LTXPipeline`) and image-to-video (`LTXImageToVideoPipeline`).

Adapter. LTX-Video's transformer takes its latents packed as tokens ([B, L, C]: patch 1,
each latent pixel a token) and runs one list of blocks, each with self-attention over the
video (attn1, rotary positions) and cross-attention to the T5 text (attn2, the text's
padding as an additive mask). Only the video is in self-attention: the layout has one
part, split before the first block and gathered after the last (before the final norm and
projection). The text reaches the video through cross-attention, so it stays whole on
every rank and attn2 keeps diffusers' own processor (each local query attends to the whole
text, as on one device). attn1 gets `LTXSPAttnProcessor`; the rotary table the model
computes for all video tokens ([B, L, C]) is cut to this rank's chunk there. The timestep
embedding is one per sample ([B, 1, 6C]) and stays whole; image-to-video gives every token its
timestep (the image's first latent frame at 0), so it is [B, L, 6C] and split with the tokens.

Steps. As `LTXPipeline`: the guidance branches run as one batch [negative, positive];
FlowMatchEulerDiscreteScheduler on sigmas linspace(1, 1/n) shifted by the video's token
count (`calculate_shift`); rotary interpolation from the VAE's compression and the frame
rate (25). The latents stay packed as tokens between steps (what output_type="latent"
returns); decode unpacks and denormalizes them. Image-to-video (`LTXImageToVideoPipeline`): the
first latent frame holds the image's latents (conditioning mask 1), the timestep per token is
t * (1 - mask), and the scheduler steps the other frames only; FlowMatchEuler's update is
elementwise, so stepping every token and putting the first frame back gives the same numbers.

Its tiny pipelines are in `tiny.py`, its conformance cases in `cases.py`.

Legend: B batch, L local video tokens, H heads, D head dim, C = H*D.
"""

from __future__ import annotations


from raydit.models.adapter import ForwardContext, GatherOutput, ModelAdapter, SequenceParallelPlan, SplitInput, attend
from raydit.models.family import Family, Prepared
from raydit.models.quantize_options import block_linear_params
from raydit.models.requests import check_frames, check_size, masked_prompt_branches, reference_call
from raydit.models.tiny import request_defaults
from raydit.planner.model import DecoderShape

VIDEO = 0  # the layout's only part

PIPELINE_DEFAULTS = {"num_frames": 161, "height": 512, "width": 704}  # LTXPipeline.__call__'s
MAX_SEQUENCE_LENGTH = 128  # the pipeline's default
FRAME_RATE = 25  # the pipeline's default (rotary interpolation in time)


# -- adapter -----------------------------------------------------------------------------------
class LTXSPAttnProcessor:
    """Sequence-parallel replacement for the processor of an LTX block's self-attention.

    Projections, the QK RMS norms (across heads) and rotary are per token, so they run on the
    local chunk; only the attention itself needs the other ranks (sp_attention).
    """

    def __init__(self, context: ForwardContext):
        self.context = context

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
        from diffusers.models.transformers.transformer_ltx import apply_rotary_emb

        from raydit.parallel.sharding import shard_rotary

        mesh, layout = self.context.self_attention("LTXSPAttnProcessor", hidden_states, encoder_hidden_states,
                                                   attention_mask, " (LTX's pipelines pass none)")

        q = attn.norm_q(attn.to_q(hidden_states))  # [B, L, C]
        k = attn.norm_k(attn.to_k(hidden_states))
        v = attn.to_v(hidden_states)
        if image_rotary_emb is not None:
            freqs = shard_rotary(image_rotary_emb, layout, mesh.sp_index, VIDEO, dim=1)
            q, k = apply_rotary_emb(q, freqs), apply_rotary_emb(k, freqs)

        out_BLC = attend(*(x.unflatten(2, (attn.heads, -1)) for x in (q, k, v)), mesh, layout)
        return attn.to_out[1](attn.to_out[0](out_BLC))  # linear, dropout


class LTXAdapter(ModelAdapter):
    name = "ltx"
    transformer_classes = ("LTXVideoTransformer3DModel",)
    plan = SequenceParallelPlan(
        blocks="transformer_blocks",
        # LTXVideoTransformerBlock.forward(hidden_states, encoder_hidden_states, temb,
        # image_rotary_emb, encoder_attention_mask); temb [B, 1, 6C] is per sample.
        split_inputs=(SplitInput("hidden_states", VIDEO), SplitInput("temb", VIDEO, every_block=True, min_len=2)),
        gather_outputs=(GatherOutput(0, VIDEO),),  # the block returns hidden_states alone
        attention="attn1",
    )
    processor = LTXSPAttnProcessor



# -- the family --------------------------------------------------------------------------------
# -- the planner's built-in models and decoder (data the registry hands raydit.planner) ----------
# LTX-Video (AutoencoderKLLTXVideo, default config = 0.9.0's: decoder 512 ... 128 channels,
# patch 4), 5 x 16 x 16 latents (33 x 512 x 512 out): 8.92e5 FLOP per output pixel-frame
# (3 x 8 x 8: 9.17e5), 590 halo values per output frame and column, 8.6 exchanges per latent
# frame, RMS norms only; its 128 channels at a quarter of the resolution hold as much as 8 at
# full resolution; the whole video in one call.
DECODER = DecoderShape(2 * 4.46e5, 590, 8.6, 0.0, 8, 0)


def builtin_models() -> list:
    """The planner's built-in models of this family (raydit.planner.BUILTIN_MODELS)."""
    from raydit.planner.model import T5_XXL_PARAMS, ModelSpec

    common = dict(family="ltx", patch_size=1, patch_size_t=1, text_tokens=128, text_in_sequence=False,
                  positional="rotary", vae_spatial=32, vae_temporal=8)
    return [
        # LTX-Video's VAE compresses 32x spatially and 8x in time; its patch is 1.
        ModelSpec(name="ltx-video", heads=32, head_dim=64, layers=28, ffn_hidden=8192, in_channels=128,
                  params=1.92e9, text_encoder_params=T5_XXL_PARAMS, vae_params=0.4e9, default_frames=161,
                  default_height=512, default_width=704, **common),
        # The same 2B model under its sized name; LTX-Video 13B (0.9.7): 32 heads x 128, 48 layers,
        # 4096-wide cross-attention; both with LTXPipeline's defaults (161 x 512 x 704). Shapes and
        # parameter counts (1.923e9, 13.04e9) are what diffusers builds from the configs its
        # conversion script writes for those checkpoints (tests/planner/test_model.py).
        ModelSpec(name="ltx-video-2b", heads=32, head_dim=64, layers=28, ffn_hidden=8192, in_channels=128,
                  params=1.92e9, text_encoder_params=T5_XXL_PARAMS, vae_params=0.4e9, default_frames=161,
                  default_height=512, default_width=704, **common),
        ModelSpec(name="ltx-video-13b", heads=32, head_dim=128, layers=48, ffn_hidden=16384, in_channels=128,
                  params=13.04e9, text_encoder_params=T5_XXL_PARAMS, vae_params=0.4e9, default_frames=161,
                  default_height=512, default_width=704, **common),
        # tiny-ltx: LTX-Video's layout (patch 1, 32x / 8x VAE, T5 cross-attention) at 6 heads.
        ModelSpec(name="tiny-ltx", heads=6, head_dim=12, layers=2, ffn_hidden=288, in_channels=8, params=2.3e5,
                  text_encoder_params=2.5e4, vae_params=1.1e5, default_frames=9, default_height=64,
                  default_width=96, **common),
    ]


class LTXFamily(Family):
    """LTXPipeline's and LTXImageToVideoPipeline's steps."""

    name = "ltx"
    pipelines = ("LTXPipeline", "LTXImageToVideoPipeline")
    image_pipelines = ("LTXImageToVideoPipeline",)
    adapter = LTXAdapter
    batch_branches = True  # the pipeline runs [negative, positive] as one batch
    # Per video token and channel, and kernels per block and call, of the block's ops besides GEMMs and
    # attention in eager bf16: bench/bench_blockcounts.py (the family's tiny forward case, FFN at the released ratio).
    elementwise_bytes = 359.7
    elementwise_launches = 76
    decoder = DECODER
    models = staticmethod(builtin_models)

    def fp8_weight_params(self, spec) -> float:
        # per block: self- and cross-attention's q, k, v, out (8 h^2; the caption is projected to
        # h before the blocks) and the FFN (2 h f)
        return block_linear_params(spec, 8, 2)

    def spec_from_dir(self, path, configs):
        """Geometry from transformer/config.json and vae/config.json; the request defaults are
        the pipeline's (161 frames, 512 x 704) unless the directory says otherwise."""
        from raydit.planner.model import ModelSpec
        from raydit.planner.pipeline_dir import attention_shape, component_params, t5_encoder_params, transformer_config

        cfg, where = transformer_config(path, configs, "LTXVideoTransformer3DModel", "an LTX pipeline")
        heads, head_dim = attention_shape(cfg, where)
        layers = int(cfg.get("num_layers", 28))
        hidden = heads * head_dim
        vae = configs.get("vae", {})
        scaling = vae.get("spatio_temporal_scaling", [True, True, True, False])
        vae_spatial = vae.get("spatial_compression_ratio") or int(vae.get("patch_size", 4)) * 2 ** sum(map(bool, scaling))
        vae_temporal = vae.get("temporal_compression_ratio") or int(vae.get("patch_size_t", 1)) * 2 ** sum(map(bool, scaling))
        defaults = request_defaults(path, PIPELINE_DEFAULTS)
        encoder = t5_encoder_params(path, configs)
        # self- and cross-attention 8 h^2, FFN (4h) 8 h^2, per layer
        estimate = float(layers * 16 * hidden * hidden)
        return ModelSpec(
            name=str(path), family=self.name, heads=heads, head_dim=head_dim, layers=layers, ffn_hidden=4 * hidden,
            patch_size=int(cfg.get("patch_size", 1)), patch_size_t=int(cfg.get("patch_size_t", 1)),
            text_tokens=MAX_SEQUENCE_LENGTH, text_in_sequence=False, positional="rotary",
            in_channels=int(cfg.get("in_channels", 128)),
            params=component_params(path / "transformer") or estimate, text_encoder_params=encoder,
            vae_params=component_params(path / "vae") or 0.0,
            **defaults, vae_spatial=int(vae_spatial), vae_temporal=int(vae_temporal),
        )

    def reference_latents(self, pipe, request):
        from raydit.models.requests import png_to_image

        pipe.set_progress_bar_config(disable=True)
        image = {} if request.image is None else {"image": png_to_image(request.image)}
        return pipe(**reference_call(request, **image)).frames

    # -- hooks ---------------------------------------------------------------------------------
    def check_request(self, pipe, request) -> None:
        super().check_request(pipe, request)
        if request.true_cfg_scale != 1.0:
            raise ValueError(
                f"true_cfg_scale {request.true_cfg_scale} is for pipelines with embedded guidance (HunyuanVideo); "
                "LTX-Video's guidance_scale is classifier-free already: drop true_cfg_scale"
            )
        temporal = pipe.vae_temporal_compression_ratio
        check_frames(request.num_frames, temporal)
        multiple = pipe.vae_spatial_compression_ratio * pipe.transformer_spatial_patch_size
        check_size(request, multiple, pipe.vae_spatial_compression_ratio, pipe.transformer_spatial_patch_size)

    def encode(self, pipe, request, device, dtype):
        return masked_prompt_branches(pipe, request, device, MAX_SEQUENCE_LENGTH)

    def init(self, pipe, request, generator, device, dtype):
        import numpy as np
        import torch
        from diffusers.pipelines.ltx.pipeline_ltx import calculate_shift, retrieve_timesteps

        channels = pipe.transformer.config.in_channels
        context = {}
        if request.image is None:
            latents = pipe.prepare_latents(1, channels, request.height, request.width, request.num_frames,
                                           torch.float32, device, generator)  # [1, L, C] packed
        else:
            from raydit.models.requests import png_to_image

            image = pipe.video_processor.preprocess(png_to_image(request.image), height=request.height,
                                                    width=request.width).to(device=device, dtype=dtype)
            # [1, L, C] packed, the first latent frame the image's; mask [1, L], 1 on those tokens
            latents, context["conditioning_mask"] = pipe.prepare_latents(
                image, 1, channels, request.height, request.width, request.num_frames, torch.float32, device,
                generator)
        frames = (request.num_frames - 1) // pipe.vae_temporal_compression_ratio + 1
        height = request.height // pipe.vae_spatial_compression_ratio
        width = request.width // pipe.vae_spatial_compression_ratio
        n = request.num_inference_steps
        config = pipe.scheduler.config
        mu = calculate_shift(frames * height * width, config.get("base_image_seq_len", 256),
                             config.get("max_image_seq_len", 4096), config.get("base_shift", 0.5),
                             config.get("max_shift", 1.15))
        timesteps, _ = retrieve_timesteps(pipe.scheduler, n, device, None, sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
        context.update({
            "latent_frames": frames, "latent_height": height, "latent_width": width,
            "rope_interpolation_scale": (pipe.vae_temporal_compression_ratio / FRAME_RATE,
                                         pipe.vae_spatial_compression_ratio, pipe.vae_spatial_compression_ratio),
        })
        return Prepared(latents=latents, timesteps=timesteps, context=context)

    # Step-level batching: requests of one geometry share a call, each with its own timestep
    # rows (per sample, or per token with an image); the rotary inputs follow the geometry.
    batched_inputs = ("hidden_states", "encoder_hidden_states", "timestep", "encoder_attention_mask")

    def token_grid(self, pipe, state):
        # The pipeline packs [B, C, F, H, W] latents into (F / pt, H / p, W / p) patches,
        # frame-major (_pack_latents); self-attention (attn1) sees only the video.
        c = state.context
        return (c["latent_frames"] // pipe.transformer_temporal_patch_size,
                c["latent_height"] // pipe.transformer_spatial_patch_size,
                c["latent_width"] // pipe.transformer_spatial_patch_size)

    def model_inputs(self, pipe, state, t, branch):
        import torch

        embeds = branch["encoder_hidden_states"]
        b = embeds.shape[0]  # 2 when this rank runs both guidance branches
        x = torch.cat([state.latents] * b) if b > 1 else state.latents
        c = state.context
        timestep = t.expand(b)
        if "conditioning_mask" in c:  # image-to-video: [b, L], 0 on the image's tokens
            timestep = timestep.unsqueeze(-1) * (1 - torch.cat([c["conditioning_mask"]] * b))
        return pipe.transformer, dict(
            hidden_states=x.to(embeds.dtype),
            encoder_hidden_states=embeds,
            timestep=timestep,
            encoder_attention_mask=branch["encoder_attention_mask"],
            num_frames=c["latent_frames"],
            height=c["latent_height"],
            width=c["latent_width"],
            rope_interpolation_scale=c["rope_interpolation_scale"],
        )

    def model_output(self, out):
        return out.float()  # as LTXPipeline: the noise prediction in float32

    def scheduler_step(self, pipe, state, noise, t, generator):
        latents, carry = super().scheduler_step(pipe, state, noise, t, generator)
        mask = state.context.get("conditioning_mask")
        if mask is not None:  # the image's first latent frame is kept as it is
            keep = mask[0].bool()
            latents = latents.clone()
            latents[:, keep] = state.latents[:, keep].to(latents.dtype)
        return latents, carry

    def decode_video(self, pipe, state, latents):
        import torch

        c, vae = state.context, pipe.vae
        latents = pipe._unpack_latents(latents, c["latent_frames"], c["latent_height"], c["latent_width"],
                                       pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
        latents = pipe._denormalize_latents(latents, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        latents = latents.to(vae.device, vae.dtype)
        # The pipeline's defaults: decode_timestep 0 and a noise scale of 0 (the latents as they are).
        timestep = torch.zeros(1, device=latents.device, dtype=latents.dtype) if vae.config.timestep_conditioning else None
        video = vae.decode(latents, timestep, return_dict=False)[0]
        return video


FAMILY = LTXFamily()
