"""The HunyuanVideo family: HunyuanVideo text-to-video (`HunyuanVideoPipeline`) and
image-to-video (`HunyuanVideoImageToVideoPipeline`).

Its tiny pipelines are in `tiny.py`, its conformance cases in `cases.py`.

Adapter. The model runs dual-stream blocks (`transformer_blocks`: video and text with their
own weights, one joint attention) and then single-stream blocks
(`single_transformer_blocks`: one set of weights over [video ; text]). Every block receives
the video tokens and the text tokens (the Llama hidden states after the token refiner,
padded to a fixed length and masked) and attends jointly over [video ; valid text].

Under sequence parallelism only the video is split: the split hook cuts `hidden_states`
before the first dual-stream block, the gather hook restores it after the last
single-stream block. The text stays whole on every rank (never split, never padded) and
every rank computes the text's projections, norms and feed-forward itself (the same
numbers everywhere). Inside each attention, where text and video tokens are queries and
keys of one softmax, the *valid* text tokens (the mask is a prefix: the first n of them)
are laid out as a second part beside the video, each valid text token on exactly one rank
(`SeqLayout((video, n_valid), sp)`), so that `sp_attention` (Ulysses, ring or both; pad
keys dropped) counts every key exactly once and never sees a masked one. The attention
output of the valid text tokens is then all-gathered over the sp group, so every rank again
holds the whole text, bit for bit the same. A masked text token is neither a key (as in
diffusers, where the mask removes it from every softmax) nor a query here: its attention
output is zero. diffusers computes it, but a masked token never reaches another token
(it is masked as a key in every block, the feed-forwards are per token and the text is
dropped after the last block), so the video output is the same. Samples of a batch whose
masks differ are attended one after the other. RoPE covers the video tokens only; the
model's table for all video tokens is cut to this rank's chunk.

Image-to-video. The text encoder is a Llava (Llama-3 + a CLIP vision tower) whose prompt
template holds an `<image>` token: the image's 576 vision features are expanded into the
Llama sequence, and the pipeline keeps every 4th (token_replace) or 2nd (latent_concat) of
their hidden states in front of the cropped prompt (text of 144 + 252 or 288 + 252 tokens,
whole on every rank as in T2V). The image's VAE latents condition the video by the
transformer's `image_condition_type`:
- "token_replace" (HunyuanVideo-I2V, 16 channels): the first latent frame is replaced by the
  image's latents at every step and never denoised; the transformer gives the first frame's
  tokens their own modulation (shift, scale, gate from the embedding of timestep 0). Which
  tokens those are is the int `num_tokens` every block receives (the first H' x W' video
  tokens, a prefix of the video): under sequence parallelism each rank gets the part of that
  prefix inside its own video chunk (`local_first_frame_tokens`), so the per-token choice of
  modulation is split with the tokens exactly.
- "latent_concat" (HunyuanVideo-I2V-33ch): the image's latents on frame 0 and a frame mask
  are channels of every video token (split with the tokens by the patch embedding); the
  pipeline's latent output drops the first frame, its decode the first 4 frames.
The negative branch of true CFG is encoded, as the pipeline does, with a black image and the
default interleave 2 (so its text is 540 tokens beside the positive branch's 396).

Steps. Guidance is embedded: `guidance_scale` is an input of the transformer (times 1000)
and each step is one transformer call. True classifier-free guidance (`true_cfg_scale` > 1
with a negative prompt) runs the pair as two calls, the pipeline's order and numbers, and
then cfg = 2 runs them on two rank groups. FlowMatchEulerDiscreteScheduler on the
pipeline's sigmas (linspace(1, 0)).

Module-level imports stay light (no torch, no diffusers): the planner reads this family
through the registry without importing torch.

Legend: B batch, S local video tokens (this rank's chunk), Lv all video tokens, Lt text
tokens (padded length), n valid text tokens, H heads, D head dim, C = H*D.
"""

from __future__ import annotations


from raydit.models.adapter import ModelAdapter
from raydit.models.decoders import HUNYUAN_VIDEO_DECODER
from raydit.models.family import Family, Prepared, patched_grid
from raydit.models.requests import check_frames, check_size, linear_sigma_timesteps, png_to_image, reference_call
from raydit.models.joint_text import JointTextProcessor, joint_text_plan
from raydit.models.joint_text import valid_text_counts as valid_text_counts_of
from raydit.models.tiny import request_defaults

VIDEO = 0  # the only part split across the blocks

# The pipeline's request defaults (HunyuanVideoPipeline.__call__); a directory may carry its
# own in DEFAULTS_FILE (the tiny built-ins do: 129 x 720 x 1280 is far too big for them).
PIPELINE_DEFAULTS = {"num_frames": 129, "height": 720, "width": 1280}
MAX_SEQUENCE_LENGTH = 256  # the pipeline's default text length (Llama tokens after the crop)
I2V = "HunyuanVideoImageToVideoPipeline"
# The I2V pipeline's default template: 576 image features (CLIP-L/336), kept 1 in `interleave`
# by image_condition_type (the pipeline's own choice when the call gives none).
_IMAGE_EMB_LEN = 576
_INTERLEAVE = {"latent_concat": 2, "token_replace": 4}


def _image_condition(pipe) -> str | None:
    """None for text-to-video; the transformer's image_condition_type for image-to-video."""
    if type(pipe).__name__ != I2V:
        return None
    return pipe.transformer.config.image_condition_type


# -- adapter -----------------------------------------------------------------------------------
def valid_text_counts(attention_mask, video_len: int, text_len: int, batch: int) -> list[int]:
    """Per sample, how many text tokens are valid, from the model's joint mask: [B, 1, 1, Lv + Lt]
    bool (True: a key to attend), or None (all valid), built as a prefix (every video token,
    then the first n text tokens); a mask of any other shape is refused."""
    return valid_text_counts_of(attention_mask, text_len, batch, video_len=video_len,
                                how="as HunyuanVideoTransformer3DModel builds it from encoder_attention_mask")


class HunyuanVideoSPAttnProcessor(JointTextProcessor):
    """Sequence-parallel replacement for HunyuanVideo's attention processor, in both kinds of
    block: dual-stream (text through add_q/k/v_proj and to_add_out) and single-stream (text
    through the video's projections; no output projection)."""

    video_part = VIDEO

    def valid_counts(self, mask, video_len, text_len, batch):
        return valid_text_counts(mask, video_len, text_len, batch)

    def text_projections(self, attn):
        if attn.add_q_proj is not None:  # dual-stream: the text's own projections and norms
            return super().text_projections(attn)
        return (attn.to_q, attn.to_k, attn.to_v), (attn.norm_q, attn.norm_k)  # single-stream: the video's

    def finish(self, attn, video, text):
        if getattr(attn, "to_out", None) is not None:
            video = attn.to_out[1](attn.to_out[0](video))  # linear, dropout
        if getattr(attn, "to_add_out", None) is not None:
            text = attn.to_add_out(text)
        return video, text


class HunyuanVideoAdapter(ModelAdapter):
    name = "hunyuanvideo"
    transformer_classes = ("HunyuanVideoTransformer3DModel",)
    # Dual-stream, then single-stream blocks (HunyuanVideoTransformerBlock.forward(hidden_states,
    # encoder_hidden_states, temb, attention_mask, freqs_cis, ...)): split before the first, gather
    # after the last; both kinds return (hidden_states, encoder_hidden_states).
    plan = joint_text_plan(("transformer_blocks", "single_transformer_blocks"), video_part=VIDEO)
    processor = HunyuanVideoSPAttnProcessor
    block_count = "num_layers + num_single_layers"

    def parallelize(self, transformer, mesh, options=None):
        handle = super().parallelize(transformer, mesh, options)
        if transformer.config.image_condition_type == "token_replace":
            try:
                apply_first_frame_split(handle, self.plan)
            except Exception:
                handle.remove()
                raise
        return handle


def local_first_frame_tokens(layout, first_frame_tokens: int, sp_index: int) -> int:
    """How many of the first frame's tokens (the first `first_frame_tokens` video tokens) lie in
    rank `sp_index`'s video chunk: its chunk is [sp_index * C, sp_index * C + C), so the count is
    that window's overlap with [0, first_frame_tokens), and they are a prefix of the chunk."""
    chunk = layout.chunk_lengths[VIDEO]
    return max(0, min(chunk, first_frame_tokens - sp_index * chunk))


def apply_first_frame_split(handle, plan) -> None:
    """Token-replace blocks take `num_tokens`, the count of first-frame video tokens (a prefix
    of the video that gets the timestep-0 modulation). The model passes every block the global
    count; a pre-hook on each block, after the split hook on the first, replaces it with this
    rank's share (`local_first_frame_tokens`)."""
    import inspect

    ctx = handle.context

    def hook(module, args, kwargs):
        if "num_tokens" in kwargs:
            kwargs["num_tokens"] = local_first_frame_tokens(ctx.layout, int(kwargs["num_tokens"]), ctx.mesh.sp_index)
            return args, kwargs
        pos = list(inspect.signature(module.forward).parameters).index("num_tokens")
        if pos >= len(args):
            raise ValueError(f"{type(module).__name__} was called without `num_tokens`; cannot split the first frame")
        args = list(args)
        args[pos] = local_first_frame_tokens(ctx.layout, int(args[pos]), ctx.mesh.sp_index)
        return tuple(args), kwargs

    for block in plan.block_list(handle.transformer):
        handle._hooks.append(block.register_forward_pre_hook(hook, with_kwargs=True))


# -- the family --------------------------------------------------------------------------------
# -- the planner's built-in models and decoder (data the registry hands raydit.planner) ----------
# LLaVA-Llama-3-8B + CLIP-L text: the text encoders' parameters; HunyuanVideo-I2V's LLaVA with its
# CLIP ViT-L/14-336 vision tower (0.30e9) and projector (0.02e9), + CLIP-L text.
TEXT_ENCODER_PARAMS = 8.03e9 + 0.12e9
I2V_TEXT_ENCODER_PARAMS = 8.03e9 + 0.30e9 + 0.02e9 + 0.12e9


def builtin_models() -> list:
    """The planner's built-in models of this family (raydit.planner.BUILTIN_MODELS)."""
    from raydit.planner.model import ModelSpec

    common = dict(family="hunyuanvideo", patch_size=2, patch_size_t=1, text_in_sequence=True,
                  positional="rotary", cfg_branches=1)
    return [
        # 20 dual-stream + 40 single-stream blocks, counted as 60 attention layers.
        # Guidance is embedded (a guidance-scale input): one transformer pass per step.
        ModelSpec(name="hunyuanvideo", heads=24, head_dim=128, layers=60, ffn_hidden=12288, text_tokens=256,
                  in_channels=16, params=12.8e9, text_encoder_params=TEXT_ENCODER_PARAMS, vae_params=0.25e9,
                  default_frames=129, default_height=720, default_width=1280, **common),
        # HunyuanVideo-I2V (hunyuanvideo-community/HunyuanVideo-I2V): the same transformer with
        # token_replace blocks (16 channels; the image's latents replace the first latent frame).
        # Text: 576 image features of the LLaVA kept 1 in 4 (144) + 252 prompt tokens = 396;
        # HunyuanVideoImageToVideoPipeline's defaults 129 x 720 x 1280.
        ModelSpec(name="hunyuanvideo-i2v", heads=24, head_dim=128, layers=60, ffn_hidden=12288,
                  text_tokens=396, in_channels=16, params=12.8e9, text_encoder_params=I2V_TEXT_ENCODER_PARAMS,
                  vae_params=0.25e9, default_frames=129, default_height=720, default_width=1280, **common),
        # tiny-hunyuan: HunyuanVideo's layout (one dual- and one single-stream block) at 6 heads.
        ModelSpec(name="tiny-hunyuan", heads=6, head_dim=16, layers=2, ffn_hidden=192, text_tokens=256,
                  in_channels=4, params=6.4e5, text_encoder_params=4.2e4, vae_params=7.1e4, default_frames=9,
                  default_height=64, default_width=64, **common),
        # tiny-hunyuan-i2v: the same with token_replace blocks; a tiny Llava: 144 image + 252 text tokens.
        ModelSpec(name="tiny-hunyuan-i2v", heads=6, head_dim=16, layers=2, ffn_hidden=192, text_tokens=396,
                  in_channels=4, params=6.4e5, text_encoder_params=6.3e4, vae_params=7.1e4, default_frames=9,
                  default_height=64, default_width=64, **common),
    ]


class HunyuanVideoFamily(Family):
    """HunyuanVideoPipeline's and HunyuanVideoImageToVideoPipeline's steps: one transformer
    call per step with the guidance scale embedded, two (negative, positive) for true
    classifier-free guidance."""

    name = "hunyuanvideo"
    pipelines = ("HunyuanVideoPipeline", I2V)
    image_pipelines = (I2V,)
    adapter = HunyuanVideoAdapter
    batch_branches = False  # true CFG: two calls, as the pipeline makes them
    keeps_scheduler_dtype = True  # the pipelines' latents turn bf16 after the first step
    true_cfg = True
    decoder = HUNYUAN_VIDEO_DECODER  # shared with Kandinsky 5 (raydit.models.decoders)
    # The dual-stream block at 3072 wide, 1024 + 256 tokens: 912.9 MB -> 232; the single-stream
    # block 936.3 MB -> 238, taken (Family.elementwise_bytes).
    elementwise_bytes = 238.0
    # bench/bench_blockcounts.py: 82 launches a dual-stream block, 49 a single-stream one; 20 and 40 of them.
    elementwise_launches = 60
    # HunyuanVideoTransformer3DModel.forward builds a (B, 1, 1, N) boolean mask (the text's padding)
    # and passes it to every block's attention.
    masked_attention = True
    models = staticmethod(builtin_models)

    def fp8_weight_params(self, spec) -> float:
        # A double-stream block: video and text q, k, v, out (8 h^2) and both FFNs (4 h f); a
        # single-stream block: q, k, v (3 h^2), the MLP's input (h f) and the fused output
        # ((h + f) h). The spec counts blocks, not kinds: the published 1 double : 2 single
        # (20 + 40) is taken.
        h, f = spec.hidden, spec.ffn_hidden
        double, single = spec.layers / 3, spec.layers * 2 / 3
        return float(double * (8 * h * h + 4 * h * f) + single * (4 * h * h + 2 * h * f))

    def spec_from_dir(self, path, configs):
        """Geometry from transformer/config.json and vae/config.json; the request defaults are
        the pipeline's (129 frames, 720 x 1280) unless the directory says otherwise
        (DEFAULTS_FILE); sizes from the weights' headers."""
        from raydit.planner.model import ModelSpec
        from raydit.planner.pipeline_dir import attention_shape, component_params, transformer_config

        cfg, where = transformer_config(path, configs, "HunyuanVideoTransformer3DModel", "a HunyuanVideo pipeline")
        heads, head_dim = attention_shape(cfg, where)
        dual, single = int(cfg.get("num_layers", 20)), int(cfg.get("num_single_layers", 40))
        hidden = heads * head_dim
        ffn = int(hidden * float(cfg.get("mlp_ratio", 4.0)))
        vae = configs.get("vae", {})
        text_tokens = MAX_SEQUENCE_LENGTH
        if configs.get("", {}).get("_class_name") == I2V:
            # 576 image features kept 1 in `interleave`, then the prompt less the 4 cropped
            # assistant-header tokens (the pipeline's default template).
            interleave = _INTERLEAVE.get(cfg.get("image_condition_type"), 1)
            text_tokens = _IMAGE_EMB_LEN // interleave + MAX_SEQUENCE_LENGTH - 4
        defaults = request_defaults(path, PIPELINE_DEFAULTS)
        # dual: attention 8 h^2 (video and text), two FFNs 4 h ffn, two adaptive norms 12 h^2;
        # single: qkv + mlp-in 3 h^2 + h ffn, out (h + ffn) h, adaptive norm 3 h^2.
        estimate = float(dual * (20 * hidden * hidden + 4 * hidden * ffn) + single * (7 * hidden * hidden + 2 * hidden * ffn))
        encoders = sum(component_params(path / c) or 0.0 for c in ("text_encoder", "text_encoder_2"))
        return ModelSpec(
            name=str(path), family=self.name, heads=heads, head_dim=head_dim, layers=dual + single, ffn_hidden=ffn,
            patch_size=int(cfg.get("patch_size", 2)), patch_size_t=int(cfg.get("patch_size_t", 1)),
            text_tokens=text_tokens, text_in_sequence=True, positional="rotary",
            in_channels=int(cfg.get("in_channels", 16)),
            params=component_params(path / "transformer") or estimate, text_encoder_params=encoders,
            vae_params=component_params(path / "vae") or 0.0,
            **defaults, vae_spatial=int(vae.get("spatial_compression_ratio", 8)),
            vae_temporal=int(vae.get("temporal_compression_ratio", 4)),
            cfg_branches=1,
        )

    def reference_latents(self, pipe, request):
        pipe.set_progress_bar_config(disable=True)
        kwargs = {}
        if _image_condition(pipe) is not None:
            kwargs["image"] = png_to_image(request.image)
        return pipe(**reference_call(request, negative_none=True, true_cfg_scale=request.true_cfg_scale,
                                     **kwargs)).frames

    def output_latents(self, pipe, state, latents=None):
        """latent_concat: the latents less frame 0 (the image's frame), as the I2V pipeline's
        output_type="latent" returns them; the runner keeps all frames, as its loop does."""
        latents = state.latents if latents is None else latents
        if state.context.get("condition") == "latent_concat":
            return latents[:, :, 1:]
        return latents

    # -- hooks ---------------------------------------------------------------------------------
    def do_cfg(self, pipe, request) -> bool:
        return request.true_cfg_scale > 1.0 and bool(request.negative_prompt)

    def check_request(self, pipe, request) -> None:
        super().check_request(pipe, request)
        if request.true_cfg_scale > 1.0 and not request.negative_prompt:
            raise ValueError(
                f"true_cfg_scale {request.true_cfg_scale} needs a negative prompt (true classifier-free guidance "
                "runs against it); give a negative prompt or drop true_cfg_scale"
            )
        condition = pipe.transformer.config.image_condition_type
        if type(pipe).__name__ == I2V and condition not in _INTERLEAVE:
            raise ValueError(
                f"{I2V} needs a transformer with image_condition_type 'token_replace' or 'latent_concat', not "
                f"{condition!r}; load an image-to-video checkpoint (HunyuanVideo-I2V)"
            )
        temporal = pipe.vae_scale_factor_temporal
        check_frames(request.num_frames, temporal)
        multiple = max(16, pipe.vae_scale_factor_spatial * pipe.transformer.config.patch_size)
        check_size(request, multiple, pipe.vae_scale_factor_spatial, pipe.transformer.config.patch_size)

    def encode(self, pipe, request, device, dtype):
        """I2V: the Llava encodes the prompt with the image (its features join the text); the
        negative prompt with a black image of the video's size and the pipeline's default
        interleave (2), as the pipeline encodes it."""
        model_dtype = pipe.transformer.dtype
        condition = _image_condition(pipe)

        def branch(prompt, **image):
            embeds, pooled, mask = pipe.encode_prompt(prompt=prompt, device=device,
                                                      max_sequence_length=MAX_SEQUENCE_LENGTH, **image)
            return {"encoder_hidden_states": embeds.to(model_dtype), "encoder_attention_mask": mask.to(model_dtype),
                    "pooled_projections": pooled.to(model_dtype)}

        if condition is None:
            positive = branch(request.prompt)
            negative = branch(request.negative_prompt) if self.do_cfg(pipe, request) else None
            return positive, negative
        from PIL import Image

        positive = branch(request.prompt, image=png_to_image(request.image),
                          image_embed_interleave=_INTERLEAVE.get(condition, 1))
        negative = None
        if self.do_cfg(pipe, request):
            black = Image.new("RGB", (request.width, request.height), 0)
            negative = branch(request.negative_prompt, image=black)
        return positive, negative

    def init(self, pipe, request, generator, device, dtype):
        import torch
        from diffusers.pipelines.hunyuan_video.pipeline_hunyuan_video import retrieve_timesteps

        timesteps = linear_sigma_timesteps(pipe, request.num_inference_steps, device, retrieve_timesteps)
        config = pipe.transformer.config
        condition = _image_condition(pipe)
        context = {"condition": condition}
        if condition is None:
            latents = pipe.prepare_latents(1, config.in_channels, request.height, request.width,
                                           request.num_frames, torch.float32, device, generator)
        else:
            # The image's latents (the VAE's mode: no draw from the generator), then the noise
            # from the generator, mixed 0.999 : 0.001 by the pipeline.
            image = pipe.video_processor.preprocess(png_to_image(request.image), request.height, request.width)
            channels = config.in_channels if condition == "token_replace" else (config.in_channels - 1) // 2
            latents, image_latents = pipe.prepare_latents(
                image.to(device, pipe.vae.dtype), 1, channels, request.height, request.width, request.num_frames,
                torch.float32, device, generator, None, condition)
            if condition == "latent_concat":
                image_latents[:, :, 1:] = 0  # [1, C, F, H, W]: the image on frame 0 only
                mask = image_latents.new_zeros(1, 1, *image_latents.shape[2:])
                mask[:, :, 0] = 1
                context["mask"] = mask
            context["image_latents"] = image_latents  # token_replace: [1, C, 1, H, W]
        guidance = None
        if condition is None or config.guidance_embeds:  # the T2V pipeline always passes it
            guidance = torch.tensor([request.guidance_scale], dtype=pipe.transformer.dtype, device=device) * 1000.0
        context["guidance"] = guidance
        return Prepared(latents=latents, timesteps=timesteps, context=context)

    # Step-level batching: requests of one geometry share a call, each with its own timestep,
    # embedded guidance and prompt (its own mask: the joint attention takes each sample's valid
    # text apart).
    batched_inputs = ("hidden_states", "timestep", "encoder_hidden_states", "encoder_attention_mask",
                      "pooled_projections", "guidance")

    def token_grid(self, pipe, state):
        # HunyuanVideoPatchEmbed: a Conv3d of (patch_size_t, patch_size, patch_size), flatten(2);
        # the joint sequence is [video ; valid text], the text's rows and columns stay whole.
        config = pipe.transformer.config
        return patched_grid(*state.latents.shape[-3:], (config.patch_size_t, config.patch_size, config.patch_size))

    def model_inputs(self, pipe, state, t, branch):
        import torch

        transformer, context, latents = pipe.transformer, state.context, state.latents
        b = branch["encoder_hidden_states"].shape[0]
        if context["condition"] == "token_replace":  # frame 0 is the image's latents, every step
            latents = torch.cat([context["image_latents"], latents[:, :, 1:]], dim=2)
        elif context["condition"] == "latent_concat":  # [noise ; image on frame 0 ; mask] channels
            latents = torch.cat([latents, context["image_latents"], context["mask"]], dim=1)
        guidance = context["guidance"]
        return transformer, dict(
            hidden_states=latents.to(transformer.dtype).expand(b, *latents.shape[1:]),
            timestep=t.expand(b).to(state.latents.dtype),
            encoder_hidden_states=branch["encoder_hidden_states"],
            encoder_attention_mask=branch["encoder_attention_mask"],
            pooled_projections=branch["pooled_projections"],
            guidance=None if guidance is None else guidance.expand(b),
        )

    def scheduler_step(self, pipe, state, noise, t, generator):
        """token_replace: only frames 1.. are denoised; frame 0 becomes the image's latents."""
        import torch

        if state.context["condition"] != "token_replace":
            return super().scheduler_step(pipe, state, noise, t, generator)
        from raydit.models.schedules import step

        rest = step(pipe.scheduler, noise[:, :, 1:], t, state.latents[:, :, 1:], generator)
        return torch.cat([state.context["image_latents"], rest], dim=2), dict(state.carry)

    def guidance_scale(self, pipe, state, t) -> float:
        return state.request.true_cfg_scale

    def decode_video(self, pipe, state, latents):
        vae = pipe.vae
        latents = latents.to(vae.device, vae.dtype) / vae.config.scaling_factor
        video = vae.decode(latents, return_dict=False)[0]
        if state.context.get("condition") == "latent_concat":
            video = video[:, :, 4:]  # the image's frame and its 3 temporal neighbours, as the pipeline drops
        return video


FAMILY = HunyuanVideoFamily()
