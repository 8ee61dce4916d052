"""The CogVideoX family: CogVideoX-2b / 5b / 1.5, text- and image-to-video: its adapter and steps.

Its tiny pipelines are in `tiny.py`, its conformance cases in `cases.py`.

Adapter. CogVideoX-2b has sinusoidal positions (added in the patch embedding, before the
split), 5b rotary positions (applied per rank in the processor), 1.5 a temporal patch of 2,
the image-to-video variants image latents joined in the channels (a change of the patch
embedding only, before the split). After the patch embedding the model slices its sequence
into text (encoder_hidden_states) and video (hidden_states) and passes both to each block;
the split hook shards both per the layout, every block works on [text chunk s | video chunk
s], and the gather hook restores both after the last block, before the final norm.

Steps. The pipeline runs both guidance branches as one batch [negative, positive]; DDIM or
the CogVideoX DPM scheduler, whose previous x0 prediction is passed explicitly (`carry`);
CogVideoX1.5 prepends latent frames to fill its temporal patch and cuts them at decode.

Legend: B batch, H heads, L local sequence (text chunk + video chunk), D head dim, C = H*D.
"""

from __future__ import annotations

from pathlib import Path

from raydit.models.adapter import ForwardContext, GatherOutput, ModelAdapter, SequenceParallelPlan, SplitInput
from raydit.models.family import Family, Prepared, patched_grid
from raydit.models.quantize_options import block_linear_params
from raydit.models.requests import png_to_image, reference_call
from raydit.planner.model import DecoderShape

TEXT, VIDEO = 0, 1  # part indices of the layout: text first, then video (docs/design.md)


# -- adapter -------------------------------------------------------------------------------
class CogVideoXSPAttnProcessor:
    """Sequence-parallel replacement for CogVideoX's attention processor.

    Projections, QK layer norms and rotary are per token, so they run on the local chunk as in
    the single-device model; only the attention itself needs the other ranks (sp_attention).
    """

    def __init__(self, context: ForwardContext):
        self.context = context

    def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
        import torch
        from diffusers.models.embeddings import apply_rotary_emb

        from raydit.parallel.attention import sp_attention
        from raydit.parallel.sharding import shard_rotary

        if attention_mask is not None:
            raise ValueError("attention_mask is not supported under sequence parallelism; CogVideoX does not use one")
        mesh, layout = self.context.mesh, self.context.layout
        assert layout is not None, "split hook did not run before attention"
        text_len = encoder_hidden_states.shape[1]  # this rank's text chunk
        x_BLC = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        B, L, _ = x_BLC.shape
        assert L == layout.local_len, (L, layout.local_len)

        def heads(t_BLC):
            # [B, L, C] -> [B, H, L, D]
            return t_BLC.view(B, L, attn.heads, -1).transpose(1, 2)

        q_BHLD, k_BHLD, v_BHLD = heads(attn.to_q(x_BLC)), heads(attn.to_k(x_BLC)), heads(attn.to_v(x_BLC))
        if attn.norm_q is not None:
            q_BHLD = attn.norm_q(q_BHLD)
        if attn.norm_k is not None:
            k_BHLD = attn.norm_k(k_BHLD)

        if image_rotary_emb is not None:
            # Rotary applies to video tokens only; the table covers all video tokens, so take
            # the rows of this rank's video chunk.
            freqs = shard_rotary(image_rotary_emb, layout, mesh.sp_index, VIDEO, dim=0)
            q_BHLD = torch.cat([q_BHLD[:, :, :text_len], apply_rotary_emb(q_BHLD[:, :, text_len:], freqs)], dim=2)
            if not attn.is_cross_attention:
                k_BHLD = torch.cat([k_BHLD[:, :, :text_len], apply_rotary_emb(k_BHLD[:, :, text_len:], freqs)], dim=2)

        out_BHLD = sp_attention(q_BHLD, k_BHLD, v_BHLD, mesh, layout)
        out_BLC = out_BHLD.transpose(1, 2).reshape(B, L, -1)
        out_BLC = attn.to_out[1](attn.to_out[0](out_BLC))  # linear, dropout
        text_out, video_out = out_BLC.split([text_len, L - text_len], dim=1)
        return video_out, text_out


class CogVideoXAdapter(ModelAdapter):
    name = "cogvideox"
    transformer_classes = ("CogVideoXTransformer3DModel",)
    plan = SequenceParallelPlan(
        blocks="transformer_blocks",
        # CogVideoXBlock.forward(hidden_states, encoder_hidden_states, temb, image_rotary_emb, ...)
        split_inputs=(SplitInput("encoder_hidden_states", TEXT), SplitInput("hidden_states", VIDEO)),
        # CogVideoXBlock returns (hidden_states, encoder_hidden_states)
        gather_outputs=(GatherOutput(0, VIDEO), GatherOutput(1, TEXT)),
        attention="attn1",
    )
    processor = CogVideoXSPAttnProcessor



# -- the family ----------------------------------------------------------------------------
# -- the planner's built-in models and decoder (data the registry hands raydit.planner) ----------
# AutoencoderKLCogVideoX (13 latent frames -> 49): 9.30e6 MAC per output pixel-frame, 8291 halo
# values per output frame and column, 18.9 exchanges and 17.1 group norms per latent frame.
DECODER = DecoderShape(2 * 9.30e6, 8291, 18.9, 17.1, 128, 8)


def transformer_params(layers: int, hidden: int, ffn: int) -> float:
    """CogVideoX's transformer parameters, estimated: attention 4h^2, FFN 2h*ffn, two adaptive
    norms ~4h^2 (what the planner counts where no weights are there to count)."""
    return float(layers * (8 * hidden * hidden + 2 * hidden * ffn))


def builtin_models() -> list:
    """The planner's built-in models of this family (raydit.planner.BUILTIN_MODELS)."""
    from raydit.planner.model import T5_XXL_PARAMS, ModelSpec

    # `tiny` / `tiny-i2v`: the geometry of tiny.py's pipelines (2 heads x 16, 2 layers, 16 text
    # tokens, 4 latent channels, 9 x 64 x 64; tests/planner/test_model.py holds the two equal).
    tiny_hidden = 2 * 16
    common = dict(family="cogvideox", patch_size=2, text_in_sequence=True)
    return [
        ModelSpec(name="cogvideox-2b", heads=30, head_dim=64, layers=30, ffn_hidden=7680, patch_size_t=None,
                  text_tokens=226, positional="sinusoidal", in_channels=16, params=1.69e9,
                  text_encoder_params=T5_XXL_PARAMS, vae_params=0.22e9, default_frames=49, default_height=480,
                  default_width=720, **common),
        ModelSpec(name="cogvideox-5b", heads=48, head_dim=64, layers=42, ffn_hidden=12288, patch_size_t=None,
                  text_tokens=226, positional="rotary", in_channels=16, params=5.57e9,
                  text_encoder_params=T5_XXL_PARAMS, vae_params=0.22e9, default_frames=49, default_height=480,
                  default_width=720, **common),
        ModelSpec(name="cogvideox1.5-5b", heads=48, head_dim=64, layers=42, ffn_hidden=12288, patch_size_t=2,
                  text_tokens=226, positional="rotary", in_channels=16, params=5.57e9,
                  text_encoder_params=T5_XXL_PARAMS, vae_params=0.22e9, default_frames=81, default_height=768,
                  default_width=1360, **common),
        ModelSpec(name="tiny", heads=2, head_dim=16, layers=2, ffn_hidden=4 * tiny_hidden, patch_size_t=None,
                  text_tokens=16, positional="sinusoidal", in_channels=4,
                  params=transformer_params(2, tiny_hidden, 4 * tiny_hidden), text_encoder_params=1e5,
                  vae_params=1e5, default_frames=9, default_height=64, default_width=64, **common),
        ModelSpec(name="tiny-i2v", heads=2, head_dim=16, layers=2, ffn_hidden=4 * tiny_hidden,
                  patch_size_t=None, text_tokens=16, positional="rotary", in_channels=8,
                  params=transformer_params(2, tiny_hidden, 4 * tiny_hidden), text_encoder_params=1e5,
                  vae_params=1e5, default_frames=9, default_height=64, default_width=64, **common),
    ]


class CogVideoXFamily(Family):
    name = "cogvideox"
    pipelines = ("CogVideoXPipeline", "CogVideoXImageToVideoPipeline")
    image_pipelines = ("CogVideoXImageToVideoPipeline",)
    adapter = CogVideoXAdapter
    batch_branches = True
    decoder = DECODER
    # CogVideoXBlock at 1920 wide, 1024 + 226 tokens (bench_opsweep --count-blocks): 84.3 bytes a token
    # and channel through the ops a dispatch mode sees, + 8 that its per-head LayerNorm of q and k moves
    # copying the [B, heads, S, 64] views contiguous inside the kernel (bench_opsweep.hidden_copy_bytes).
    elementwise_bytes = 92.3
    elementwise_launches = 32  # per block and call (bench/bench_blockcounts.py; one call runs the batch of two)
    models = staticmethod(builtin_models)

    def fp8_weight_params(self, spec) -> float:
        # per block: the joint attention's q, k, v, out (4 h^2) and the FFN (2 h f)
        return block_linear_params(spec, 4, 2)

    def spec_from_dir(self, path: Path, configs):
        from raydit.planner.model import ModelSpec
        from raydit.planner.pipeline_dir import (attention_shape, component_params, require, t5_encoder_params,
                                                 transformer_config)

        cfg, where = transformer_config(path, configs, lambda cls: cls.startswith("CogVideoX"), "a CogVideoX pipeline")
        heads, head_dim = attention_shape(cfg, where)
        layers = int(require(cfg, "num_layers", where))
        hidden = heads * head_dim
        vae = configs.get("vae", {})
        blocks = vae.get("block_out_channels")
        vae_spatial = 2 ** (len(blocks) - 1) if isinstance(blocks, list) and blocks else 8
        vae_temporal = int(vae.get("temporal_compression_ratio", cfg.get("temporal_compression_ratio", 4)))
        if cfg.get("use_rotary_positional_embeddings"):
            positional = "rotary"
        elif cfg.get("use_learned_positional_embeddings"):
            positional = "learned"
        else:
            positional = "sinusoidal"
        te = t5_encoder_params(path, configs)
        patch_t = cfg.get("patch_size_t")
        return ModelSpec(
            name=str(path), family=self.name, heads=heads, head_dim=head_dim, layers=layers,
            ffn_hidden=4 * hidden, patch_size=int(require(cfg, "patch_size", where)),
            patch_size_t=int(patch_t) if patch_t else None,
            text_tokens=int(require(cfg, "max_text_seq_length", where)), text_in_sequence=True,
            positional=positional, in_channels=int(cfg.get("in_channels", 16)),
            params=component_params(path / "transformer") or transformer_params(layers, hidden, 4 * hidden),
            text_encoder_params=te, vae_params=component_params(path / "vae") or 0.0,
            default_frames=int(cfg.get("sample_frames", 49)),
            default_height=int(cfg.get("sample_height", 60)) * vae_spatial,
            default_width=int(cfg.get("sample_width", 90)) * vae_spatial,
            vae_spatial=vae_spatial, vae_temporal=vae_temporal,
        )

    def reference_latents(self, pipe, request):
        kwargs = {} if request.image is None else {"image": png_to_image(request.image)}
        return pipe(**reference_call(request, max_sequence_length=pipe.transformer.config.max_text_seq_length,
                                     **kwargs)).frames

    # -- hooks ----------------------------------------------------------------------------
    def check_request(self, pipe, request) -> None:
        super().check_request(pipe, request)
        config = pipe.transformer.config
        if config.get("use_learned_positional_embeddings"):
            # CogVideoXPatchEmbed raises at the first step (naming neither size) for any other size:
            # learned positions (CogVideoX-5b-I2V) exist for the sample size alone.
            scale = pipe.vae_scale_factor_spatial
            height, width = config.sample_height * scale, config.sample_width * scale
            if (request.height, request.width) != (height, width):
                raise ValueError(
                    f"height {request.height} and width {request.width}: {type(pipe).__name__}'s transformer has "
                    f"learned positional embeddings for {height} x {width} only (its sample size, as "
                    f"CogVideoX-5b-I2V); ask for height {height} and width {width}")

    def encode(self, pipe, request, device, dtype):
        positive, negative = pipe.encode_prompt(
            request.prompt,
            request.negative_prompt,
            do_classifier_free_guidance=request.do_cfg,
            max_sequence_length=pipe.transformer.config.max_text_seq_length,
            device=device,
            dtype=dtype,
        )
        return ({"encoder_hidden_states": positive},
                {"encoder_hidden_states": negative} if request.do_cfg else None)

    def init(self, pipe, request, generator, device, dtype):
        config = pipe.transformer.config
        scale = pipe.vae_scale_factor_spatial
        if (request.height // scale) % config.patch_size or (request.width // scale) % config.patch_size:
            raise ValueError(
                f"height {request.height} and width {request.width} must be multiples of "
                f"{scale * config.patch_size} (VAE scale {scale} x patch {config.patch_size})"
            )
        pipe.scheduler.set_timesteps(request.num_inference_steps, device=device)
        timesteps = pipe.scheduler.timesteps
        # CogVideoX1.5 patches 2 latent frames at once: prepend latent frames (as the
        # pipeline does, 4 pixel frames each) and cut them at decode.
        num_frames = request.num_frames
        latent_frames = (num_frames - 1) // pipe.vae_scale_factor_temporal + 1
        p_t = config.patch_size_t
        additional = (p_t - latent_frames % p_t) % p_t if p_t else 0
        num_frames += additional * pipe.vae_scale_factor_temporal
        context = {"additional_frames": additional}
        if request.image is not None:
            image = pipe.video_processor.preprocess(png_to_image(request.image), height=request.height,
                                                    width=request.width).to(device, dtype=dtype)
            latents, image_latents = pipe.prepare_latents(
                image, 1, config.in_channels // 2, num_frames, request.height, request.width, dtype, device,
                generator)
            context["image_latents"] = image_latents
        else:
            latents = pipe.prepare_latents(1, config.in_channels, num_frames, request.height, request.width, dtype,
                                           device, generator)
        if config.use_rotary_positional_embeddings:
            context["image_rotary_emb"] = pipe._prepare_rotary_positional_embeddings(
                request.height, request.width, latents.size(1), device)
        if getattr(config, "ofs_embed_dim", None) is not None:
            context["ofs"] = latents.new_full((1,), fill_value=2.0)
        return Prepared(latents=latents, timesteps=timesteps, context=context,
                        carry={"old_pred_original_sample": None} if self._dpm(pipe) else {})

    @staticmethod
    def _dpm(pipe) -> bool:
        from diffusers import CogVideoXDPMScheduler

        return isinstance(pipe.scheduler, CogVideoXDPMScheduler)

    # The rows of a call lead these inputs (the rotary table and ofs follow the geometry, which
    # requests sharing a call have in common): requests of one geometry share calls.
    batched_inputs = ("hidden_states", "encoder_hidden_states", "timestep")

    def token_grid(self, pipe, state):
        # CogVideoXPatchEmbed: latents [B, F, C, H, W] patched per frame (a Conv2d; 1.5's
        # patch_size_t groups frames first), frame-major; the joint sequence is [text ; video].
        config = pipe.transformer.config
        F, _, H, W = state.latents.shape[-4:]
        return patched_grid(F, H, W, (config.patch_size_t or 1, config.patch_size, config.patch_size))

    def model_inputs(self, pipe, state, t, branch):
        import torch

        embeds = branch["encoder_hidden_states"]
        b = embeds.shape[0]  # 2 when this rank runs both guidance branches
        # [1, F, C, H, W] -> [b, F, C(+C_image), H, W]
        x = torch.cat([state.latents] * b) if b > 1 else state.latents
        x = pipe.scheduler.scale_model_input(x, t)  # the identity for CogVideoX's schedulers
        if "image_latents" in state.context:
            image = state.context["image_latents"]
            x = torch.cat([x, torch.cat([image] * b) if b > 1 else image], dim=2)
        kwargs = {}
        if "ofs" in state.context:
            kwargs["ofs"] = state.context["ofs"]
        return pipe.transformer, dict(
            hidden_states=x,
            encoder_hidden_states=embeds,
            timestep=t.expand(b),
            image_rotary_emb=state.context.get("image_rotary_emb"),
            **kwargs,
        )

    def model_output(self, out):
        return out.float()

    def scheduler_step(self, pipe, state, noise, t, generator):
        if "old_pred_original_sample" in state.carry:
            i = state.step_index
            prev_t = state.timesteps[i - 1] if i > 0 else None
            latents, old = pipe.scheduler.step(
                noise, state.carry["old_pred_original_sample"], t, prev_t, state.latents, eta=0.0,
                generator=generator, return_dict=False)
            return latents, {"old_pred_original_sample": old}
        latents = pipe.scheduler.step(noise, t, state.latents, eta=0.0, generator=generator, return_dict=False)[0]
        return latents, {}

    def decode_video(self, pipe, state, latents):
        latents = latents[:, state.context.get("additional_frames", 0):].to(pipe.vae.device, pipe.vae.dtype)
        video = pipe.decode_latents(latents)
        return video


FAMILY = CogVideoXFamily()
