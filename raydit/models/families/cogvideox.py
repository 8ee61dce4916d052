"""The CogVideoX family: CogVideoX-2b / 5b / 1.5, text- and image-to-video.

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

Tiny. `tiny` is the CogVideoX-2b architecture (sinusoidal, DDIM) with seeded random weights.

Legend: B batch, H heads, L local sequence (text chunk + video chunk), D head dim, C = H*D.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from raydit.models.adapter import ForwardContext, GatherOutput, ModelAdapter, SequenceParallelPlan, SplitInput
from raydit.models.family import Family, Prepared
from raydit.models.requests import png_to_image, reference_call
from raydit.models.tiny import SEED, cache_root, randomize, t5_encoder, tokenizer, write_pipeline, quiet_hub
from raydit.planner.model import DecoderShape

TEXT, VIDEO = 0, 1  # part indices of the layout: text first, then video (docs/design.md)

# -- the built-in tiny pipeline's geometry (the planner's `tiny` entry repeats it; a test
# checks the two against each other through the directory this module writes) ----------
TINY_VERSION = "1"  # bump when the saved files change, so stale caches are not reused
TINY_HEADS = 2
TINY_HEAD_DIM = 16
TINY_LAYERS = 2
TINY_TEXT_TOKENS = 16  # transformer max_text_seq_length == pipeline max_sequence_length
TINY_TEXT_EMBED_DIM = 32  # T5 d_model == transformer text_embed_dim
TINY_TIME_EMBED_DIM = 16
TINY_LATENT_CHANNELS = 4
TINY_PATCH_SIZE = 2
TINY_VAE_SPATIAL = 8  # pixels per latent pixel (4 VAE blocks: 2**3)
TINY_VAE_TEMPORAL = 4  # latent frames = (frames - 1) // 4 + 1
TINY_FRAMES = 9
TINY_HEIGHT = 64
TINY_WIDTH = 64


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

    tiny_hidden = TINY_HEADS * TINY_HEAD_DIM
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
    # CogVideoXBlock at 1920 wide, 1024 + 226 tokens: 202.3 MB (Family.elementwise_bytes).
    elementwise_bytes = 84.0
    models = staticmethod(builtin_models)

    def tiny(self):
        return {"tiny": tiny_pipeline_dir, "tiny-i2v": tiny_i2v_pipeline_dir}

    def spec_from_dir(self, path: Path, configs):
        from raydit.planner.model import ModelSpec, attention_shape, component_params, require, t5_params, transformer_config

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
        te = component_params(path / "text_encoder")
        if te is None:
            te = t5_params(configs["text_encoder"]) if "text_encoder" in configs else 0.0
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

    def conformance_cases(self, base_dirs):
        return {"forward": forward_cases(), "runner": runner_cases(base_dirs["tiny"])}

    # -- hooks ----------------------------------------------------------------------------
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


# -- the tiny pipeline ---------------------------------------------------------------------
def _transformer_config(**overrides) -> dict:
    config = dict(
        num_attention_heads=TINY_HEADS,
        attention_head_dim=TINY_HEAD_DIM,
        in_channels=TINY_LATENT_CHANNELS,
        out_channels=TINY_LATENT_CHANNELS,
        time_embed_dim=TINY_TIME_EMBED_DIM,
        text_embed_dim=TINY_TEXT_EMBED_DIM,
        num_layers=TINY_LAYERS,
        sample_width=TINY_WIDTH // TINY_VAE_SPATIAL,
        sample_height=TINY_HEIGHT // TINY_VAE_SPATIAL,
        sample_frames=TINY_FRAMES,
        patch_size=TINY_PATCH_SIZE,
        temporal_compression_ratio=TINY_VAE_TEMPORAL,
        max_text_seq_length=TINY_TEXT_TOKENS,
        use_rotary_positional_embeddings=False,
    )
    config.update(overrides)
    return config


def tiny_transformer(seed: int = SEED, **overrides):
    """A CogVideoXTransformer3DModel with the tiny geometry (or `overrides`), seeded weights."""
    import torch
    from diffusers import CogVideoXTransformer3DModel

    torch.manual_seed(seed)
    return randomize(CogVideoXTransformer3DModel(**_transformer_config(**overrides)), seed)


def tiny_vae():
    import torch
    from diffusers import AutoencoderKLCogVideoX

    torch.manual_seed(SEED + 2)
    return AutoencoderKLCogVideoX(
        block_out_channels=(8, 8, 8, 8),
        latent_channels=TINY_LATENT_CHANNELS,
        layers_per_block=1,
        norm_num_groups=4,
        temporal_compression_ratio=TINY_VAE_TEMPORAL,
        sample_height=TINY_HEIGHT,
        sample_width=TINY_WIDTH,
    ).eval()


def build_tiny_pipeline(directory, scheduler: str = "ddim", image: bool = False, **transformer_overrides) -> Path:
    """Write the tiny pipeline (optionally with a variant transformer / the DPM scheduler;
    `image=True`: the image-to-video pipeline, image latents joined in the channels)."""

    def make():
        from diffusers import (CogVideoXDDIMScheduler, CogVideoXDPMScheduler, CogVideoXImageToVideoPipeline,
                               CogVideoXPipeline)

        scheduler_cls = CogVideoXDPMScheduler if scheduler == "dpm" else CogVideoXDDIMScheduler
        tok = tokenizer(TINY_TEXT_TOKENS)
        if image:
            # CogVideoX-5b-I2V's layout: doubled input channels, learned + rotary positions.
            transformer_overrides.setdefault("in_channels", 2 * TINY_LATENT_CHANNELS)
            transformer_overrides.setdefault("use_learned_positional_embeddings", True)
            transformer_overrides.setdefault("use_rotary_positional_embeddings", True)
        pipeline_cls = CogVideoXImageToVideoPipeline if image else CogVideoXPipeline
        return pipeline_cls(
            tokenizer=tok,
            text_encoder=t5_encoder(len(tok), TINY_TEXT_EMBED_DIM),
            vae=tiny_vae(),
            transformer=tiny_transformer(**transformer_overrides),
            scheduler=scheduler_cls(),
        )

    return write_pipeline(directory, make)


def tiny_pipeline_dir() -> Path:
    """The directory of the built-in `tiny` pipeline, building it on first use."""
    return build_tiny_pipeline(cache_root() / f"tiny-{TINY_VERSION}")


def tiny_i2v_pipeline_dir() -> Path:
    """The built-in `tiny-i2v` (CogVideoXImageToVideoPipeline, 64 x 64, 9 frames)."""
    return build_tiny_pipeline(cache_root() / f"tiny-i2v-{TINY_VERSION}", image=True)


def load_tiny_pipeline(dtype=None):
    """`CogVideoXPipeline.from_pretrained(tiny_pipeline_dir())`."""
    import torch
    from diffusers import CogVideoXPipeline

    with quiet_hub():
        return CogVideoXPipeline.from_pretrained(tiny_pipeline_dir(), dtype=dtype or torch.float32)


# -- conformance cases ---------------------------------------------------------------------
# Builders are module-level so spawned ranks rebuild identical models: weights from
# tiny_transformer's fixed seed, inputs from a fixed generator. The geometry hits the hard
# cases: 30 heads at 30 patch rows (the 480p height, where xDiT refuses 4 and 8 ranks), a
# 13-token text that no world size > 1 divides, rotary tables cut per rank (5b), a temporal
# patch of 2 (1.5), image latents in the channels (I2V, learned positions or the ofs embedding).
TEXT_LEN = 13  # divides no world size in 2..6
_BUILD_FORWARD = "raydit.models.families.cogvideox:cogvideox_forward"
_BUILD_PIPELINE = "raydit.models.families.cogvideox:cogvideox_pipeline"


def rotary_table(transformer, latent_frames: int, latent_height: int, latent_width: int, vae_scale: int = 1):
    """The rotary table diffusers' pipeline builds, from its own helper (no copy of its logic)."""
    import torch
    from diffusers import CogVideoXPipeline

    fake_pipe = SimpleNamespace(vae_scale_factor_spatial=vae_scale, transformer=transformer)
    return CogVideoXPipeline._prepare_rotary_positional_embeddings(
        fake_pipe, latent_height * vae_scale, latent_width * vae_scale, latent_frames, torch.device("cpu")
    )


def cogvideox_forward(latent_frames: int, latent_height: int, latent_width: int, text_len: int = TEXT_LEN,
                      batch: int = 2, **overrides):
    """A tiny-weight CogVideoXTransformer3DModel and the kwargs of one forward call.

    hidden_states [batch, F, C_in, H, W], encoder_hidden_states [batch, text_len, text_dim].
    """
    import torch

    config = dict(
        sample_frames=(latent_frames - 1) * 4 + 1,
        sample_height=latent_height,
        sample_width=latent_width,
        max_text_seq_length=text_len,
    )
    config.update(overrides)
    transformer = tiny_transformer(**config)
    g = torch.Generator().manual_seed(7)
    kwargs = dict(
        hidden_states=torch.randn(batch, latent_frames, transformer.config.in_channels, latent_height, latent_width, generator=g),
        encoder_hidden_states=torch.randn(batch, text_len, TINY_TEXT_EMBED_DIM, generator=g),
        timestep=torch.tensor([999, 421][:batch] + [1] * max(0, batch - 2)),
        image_rotary_emb=None,
    )
    if transformer.config.use_rotary_positional_embeddings:
        kwargs["image_rotary_emb"] = rotary_table(transformer, latent_frames, latent_height, latent_width)
    if transformer.config.ofs_embed_dim:
        kwargs["ofs"] = torch.full((batch,), 2.0)
    return transformer, kwargs


def cogvideox_pipeline(base_dir: str, scheduler: str = "ddim", image: bool = False, **overrides):
    """The tiny pipeline (from disk, as a real checkpoint) with a variant transformer and
    scheduler; `image=True` makes it the image-to-video pipeline (channels doubled)."""
    from diffusers import (CogVideoXDDIMScheduler, CogVideoXDPMScheduler, CogVideoXImageToVideoPipeline,
                           CogVideoXPipeline)

    with quiet_hub():
        pipe = CogVideoXPipeline.from_pretrained(base_dir)
    scheduler_cls = {"ddim": CogVideoXDDIMScheduler, "dpm": CogVideoXDPMScheduler}[scheduler]
    if image:
        overrides.setdefault("in_channels", 2 * TINY_LATENT_CHANNELS)
        overrides.setdefault("use_learned_positional_embeddings", True)
        overrides.setdefault("use_rotary_positional_embeddings", True)
    pipeline_cls = CogVideoXImageToVideoPipeline if image else CogVideoXPipeline
    return pipeline_cls(
        tokenizer=pipe.tokenizer,
        text_encoder=pipe.text_encoder,
        vae=pipe.vae,
        transformer=tiny_transformer(**overrides),
        scheduler=scheduler_cls.from_config(pipe.scheduler.config),
    )


def forward_cases() -> list:
    from raydit.models.conformance import ForwardCase

    # The 2b case runs on every world size; the variants on a few (the suite's time).
    rotary = dict(use_rotary_positional_embeddings=True)
    return [
        # 2b style: sinusoidal positions; 30 heads, 30 patch rows (480p), 13 text tokens.
        ForwardCase("cogvideox-2b-h30-rows30", _BUILD_FORWARD, 30,
                    dict(latent_frames=2, latent_height=60, latent_width=4,
                         num_attention_heads=30, attention_head_dim=8)),
        # 5b style: rotary on video tokens only; 27 video tokens (odd).
        ForwardCase("cogvideox-5b-rotary", _BUILD_FORWARD, 6,
                    dict(latent_frames=3, latent_height=6, latent_width=6,
                         num_attention_heads=6, attention_head_dim=16, **rotary), worlds=(2, 3, 4)),
        # 1.5 style: temporal patch 2 (4 latent frames -> 2 patch frames), rotary "slice" grid.
        ForwardCase("cogvideox-1.5-patch_t2", _BUILD_FORWARD, 4,
                    dict(latent_frames=4, latent_height=6, latent_width=8, patch_size_t=2,
                         num_attention_heads=4, attention_head_dim=16, **rotary), worlds=(2, 4)),
        # 5b-I2V style: image latents joined in the channels, learned + rotary positions.
        ForwardCase("cogvideox-5b-i2v", _BUILD_FORWARD, 2,
                    dict(latent_frames=3, latent_height=4, latent_width=6, in_channels=8,
                         use_learned_positional_embeddings=True, **rotary), worlds=(2, 3)),
        # 1.5-I2V style: channels doubled, temporal patch 2, ofs embedding.
        ForwardCase("cogvideox-1.5-i2v-ofs", _BUILD_FORWARD, 2,
                    dict(latent_frames=2, latent_height=4, latent_width=4, in_channels=8, patch_size_t=2,
                         ofs_embed_dim=16, **rotary), worlds=(2, 4)),
    ]


def runner_cases(base_dir: str) -> list:
    from raydit.models.conformance import RunnerCase

    rotary = dict(use_rotary_positional_embeddings=True)
    return [
        # 2b: DDIM; 480 x 16 pixels -> 60 x 2 latents -> 30 patch rows; 30 heads.
        RunnerCase("cogvideox-2b-h30-rows30", _BUILD_PIPELINE, 30,
                   dict(prompt="a red fox runs", num_frames=5, height=480, width=16, num_inference_steps=3, seed=11),
                   dict(base_dir=base_dir, num_attention_heads=30, attention_head_dim=8, max_text_seq_length=TEXT_LEN,
                        sample_height=60, sample_width=2, sample_frames=5)),
        # 5b: rotary, DPM (stochastic: the generator state travels in the checkpoint).
        RunnerCase("cogvideox-5b-rotary-dpm", _BUILD_PIPELINE, 6,
                   dict(prompt="waves at dusk", num_frames=9, height=48, width=48, num_inference_steps=3, seed=5),
                   dict(base_dir=base_dir, scheduler="dpm", num_attention_heads=6, attention_head_dim=16,
                        max_text_seq_length=TEXT_LEN, sample_height=6, sample_width=6, **rotary), worlds=(2, 3, 5)),
        # 1.5: temporal patch 2; 3 latent frames padded to 4 as the pipeline does.
        RunnerCase("cogvideox-1.5-patch_t2-dpm", _BUILD_PIPELINE, 4,
                   dict(prompt="a paper boat", num_frames=9, height=48, width=64, num_inference_steps=3, seed=2),
                   dict(base_dir=base_dir, scheduler="dpm", patch_size_t=2, num_attention_heads=4,
                        attention_head_dim=16, max_text_seq_length=TEXT_LEN, sample_height=6, sample_width=8,
                        **rotary), worlds=(2, 4)),
        # I2V: image latents joined in the channels, learned positions; an image in the request.
        RunnerCase("cogvideox-i2v", _BUILD_PIPELINE, 2,
                   dict(prompt="a kite", num_frames=5, height=32, width=48, num_inference_steps=3, seed=4),
                   dict(base_dir=base_dir, image=True, max_text_seq_length=TEXT_LEN, sample_height=4,
                        sample_width=6, sample_frames=5),
                   image="checker", worlds=(2, 3)),
    ]
