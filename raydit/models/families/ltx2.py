"""The LTX-2 family: video with sound, text-to-video (`LTX2Pipeline`) and image-to-video
(`LTX2ImageToVideoPipeline`).

Model. LTX2VideoTransformer3DModel denoises two token streams in one list of blocks: the video
(packed latents [B, Lv, Cv], patch 1) and the audio (packed mel latents [B, La, Ca]). Each block
runs, per stream, self-attention (rotary), cross-attention to the prompt (the Gemma 3 text
through the pipeline's connectors, one text per stream), then audio-to-video cross-attention
(video queries, audio keys) and video-to-audio (audio queries, video keys), then the FFNs.

Steps. As `LTX2Pipeline.__call__` with its defaults: up to four transformer calls per step,
  1. [negative, positive] as one batch of 2 (classifier-free guidance, video guidance_scale and
     audio_guidance_scale), when either scale is > 1;
  2. positive, self-attention skipped in the blocks `stg_blocks` (spatio-temporal guidance),
     when stg_scale or audio_stg_scale is > 0;
  3. positive, audio<->video cross-attention off (modality guidance), when modality_scale or
     audio_modality_scale is > 1;
each prediction turned into x0 (latents - v sigma), combined as x0_pos + (g - 1)(x0_pos - x0_neg)
+ s_stg (x0_pos - x0_stg) + (m - 1)(x0_pos - x0_mod), rescaled towards the positive prediction's
std (guidance_rescale, per stream) and turned back into a velocity for FlowMatchEuler. The
knobs beyond `guidance_scale` travel in GenerationRequest.guidance_options (OPTION_DEFAULTS:
the pipeline's defaults, with its `audio_x or x` fallbacks). The guidance branches are not the
runner's cond/uncond pair: `predict` runs all of them in the pipeline's order and batching
(needed for bit-equal bf16) and returns the guided velocity, so `do_cfg` is False for the runner
and a cfg = 2 mesh runs the same passes on both groups (correct, not faster).

State. The runner's latents are one tensor [1, Lv*Cv + La*Ca] (float32): the packed video then
the packed audio latents, flattened. FlowMatchEuler's step is elementwise, so one scheduler
stepping both streams gives the numbers of the pipeline's two (its audio scheduler is a copy with
the same sigmas and step index). `output_latents` unpacks and denormalizes both, as
output_type="latent" returns them, flattened the same way.

Image-to-video: the first latent frame holds the image's latents (conditioning mask 1), its
tokens get timestep 0 (per-token video timestep, so temb is [B, Lv, 6C]) and keep their values
through the steps. The pipeline re-compresses the image as H.264 at CRF 33 (Gemma 3
checkpoints) with PyAV before encoding it; guidance option image_crf=0 skips that.

Tiny. `tiny-ltx2` / `tiny-ltx2-i2v`: video 6 heads x 8, audio 6 heads x 4, 2 blocks, split
rotary, perturbed attention (STG), a 2-layer Gemma 3 (16 wide), 1-layer connectors, the LTX-2
video VAE with 32x spatial / 8x temporal compression (8 channels), the audio VAE (2 channels,
8 mel bins) and a vocoder whose upsampling (160) is the mel hop: the sound lasts as the video.

Legend: B batch, Lv / La video / audio tokens, Cv / Ca their latent channels.
"""

from __future__ import annotations

import json
from pathlib import Path

from raydit.models.family import Audio, Family, Prepared

PIPELINE_DEFAULTS = {"num_frames": 121, "height": 512, "width": 768}  # LTX2Pipeline.__call__'s
DEFAULTS_FILE = "raydit_defaults.json"  # a directory's own request defaults (the tiny built-ins')
MAX_SEQUENCE_LENGTH = 1024  # the pipeline's default (a tokenizer with a smaller limit: its own)
FRAME_RATE = 24.0  # the pipeline's default (audio length, rotary positions in time)
STG_BLOCK = 28  # the pipeline's default spatio_temporal_guidance_blocks = [28]

# GenerationRequest.guidance_options this family takes, with LTX2Pipeline's defaults. None: the
# pipeline's fallback (audio_x or x; stg_blocks: [28], or the last block of a transformer with
# fewer, where [28] would name none; image_crf: 33 for Gemma 3 checkpoints, 18 for Gemma 4).
OPTION_DEFAULTS = {
    "stg_scale": 1.0,
    "modality_scale": 3.0,
    "guidance_rescale": 0.7,
    "audio_guidance_scale": 7.0,
    "audio_stg_scale": 1.0,
    "audio_modality_scale": 3.0,
    "audio_guidance_rescale": 0.7,
    "stg_blocks": None,
    "use_cross_timestep": True,
    "image_crf": None,
}


def max_sequence_length(pipe) -> int:
    return min(MAX_SEQUENCE_LENGTH, int(getattr(pipe.tokenizer, "model_max_length", MAX_SEQUENCE_LENGTH)
                                        if getattr(pipe, "tokenizer", None) is not None else MAX_SEQUENCE_LENGTH))


def _default_crf(pipe) -> int:
    """The image CRF LTX2ImageToVideoPipeline uses for this checkpoint (by its text encoder)."""
    from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

    encoder = getattr(pipe, "text_encoder", None)
    if encoder is None:  # dropped on a rank that does not encode: its class says the generation
        from types import SimpleNamespace

        from raydit.models.text_encoding import _DROPPED

        cls = getattr(pipe, _DROPPED, {}).get("text_encoder", (type(None), None))[0]
        encoder = SimpleNamespace(config=SimpleNamespace(model_type="gemma4" if "Gemma4" in cls.__name__ else "gemma3"))
    return int(resolve_default_image_crf(encoder))


def guidance(pipe, request) -> dict:
    """Every guidance knob of `request` for this pipeline, resolved as LTX2Pipeline does."""
    o = {name: request.option(name, default) for name, default in OPTION_DEFAULTS.items()}
    g = dict(o, guidance_scale=request.guidance_scale)
    # The pipeline's own fallbacks: `audio_x = audio_x or x`.
    g["audio_guidance_scale"] = o["audio_guidance_scale"] or request.guidance_scale
    g["audio_stg_scale"] = o["audio_stg_scale"] or o["stg_scale"]
    g["audio_modality_scale"] = o["audio_modality_scale"] or o["modality_scale"]
    g["audio_guidance_rescale"] = o["audio_guidance_rescale"] or o["guidance_rescale"]
    layers = len(pipe.transformer.transformer_blocks)
    if o["stg_blocks"] is None:
        g["stg_blocks"] = (STG_BLOCK,) if layers > STG_BLOCK else (layers - 1,)
    g["cfg"] = g["guidance_scale"] > 1.0 or g["audio_guidance_scale"] > 1.0
    g["stg"] = g["stg_scale"] > 0.0 or g["audio_stg_scale"] > 0.0
    g["modality"] = g["modality_scale"] > 1.0 or g["audio_modality_scale"] > 1.0
    return g


class LTX2Family(Family):
    """LTX2Pipeline's and LTX2ImageToVideoPipeline's steps."""

    name = "ltx2"
    pipelines = ("LTX2Pipeline", "LTX2ImageToVideoPipeline")
    image_pipelines = ("LTX2ImageToVideoPipeline",)
    adapter = None  # set below, once the adapter class exists
    option_names = tuple(OPTION_DEFAULTS)

    def tiny(self):
        return {"tiny-ltx2": tiny_pipeline_dir, "tiny-ltx2-i2v": tiny_i2v_pipeline_dir}

    def spec_from_dir(self, path, configs):
        """Geometry from transformer/, vae/ and tokenizer/ configs; parameters from the weights'
        headers. The planner sees the video stream (its tokens set the attention cost; the audio
        stream, ~La = 25 per second of sound, is small beside them and kept whole per rank) and
        the prompt as cross-attended text (max_sequence_length tokens)."""
        from raydit.planner.model import ModelSpec, component_params, require

        cfg = configs["transformer"]
        where = str(path / "transformer" / "config.json")
        cls = str(cfg.get("_class_name", ""))
        if cls != "LTX2VideoTransformer3DModel":
            raise ValueError(f"{where}: transformer class {cls or '(none)'!r} is not supported by an LTX-2 pipeline")
        heads, head_dim = int(require(cfg, "num_attention_heads", where)), int(require(cfg, "attention_head_dim", where))
        layers = int(cfg.get("num_layers", 48))
        hidden = heads * head_dim
        audio_hidden = int(cfg.get("audio_num_attention_heads", 32)) * int(cfg.get("audio_attention_head_dim", 64))
        vae = configs.get("vae", {})
        scaling = vae.get("spatio_temporal_scaling", [True] * 4)
        scaling = [scaling] * 4 if isinstance(scaling, bool) else scaling
        steps = 2 ** sum(map(bool, scaling))
        vae_spatial = vae.get("spatial_compression_ratio") or int(vae.get("patch_size", 4)) * steps
        vae_temporal = vae.get("temporal_compression_ratio") or int(vae.get("patch_size_t", 1)) * steps
        defaults = dict(PIPELINE_DEFAULTS)
        if (path / DEFAULTS_FILE).is_file():
            defaults.update(json.loads((path / DEFAULTS_FILE).read_text()))
        text = int(configs.get("tokenizer", {}).get("model_max_length", MAX_SEQUENCE_LENGTH))

        def params(*folders):
            counts = [component_params(path / f) for f in folders if (path / f).is_dir()]
            return float(sum(c for c in counts if c is not None))

        # per block: video self/text/a2v attention 12 h^2 + FFN 8 h^2; audio the same at its width
        estimate = float(layers * (20 * hidden * hidden + 20 * audio_hidden * audio_hidden))
        return ModelSpec(
            name=str(path), family=self.name, heads=heads, head_dim=head_dim, layers=layers, ffn_hidden=4 * hidden,
            patch_size=int(cfg.get("patch_size", 1)), patch_size_t=int(cfg.get("patch_size_t", 1)),
            text_tokens=min(text, MAX_SEQUENCE_LENGTH), text_in_sequence=False, positional="rotary",
            in_channels=int(cfg.get("in_channels", 128)),
            params=component_params(path / "transformer") or estimate,
            text_encoder_params=params("text_encoder", "connectors"),
            vae_params=params("vae", "audio_vae", "vocoder"),
            default_frames=int(defaults["num_frames"]), default_height=int(defaults["height"]),
            default_width=int(defaults["width"]), vae_spatial=int(vae_spatial), vae_temporal=int(vae_temporal),
        )

    def conformance_cases(self, base_dirs):
        return {"forward": [], "runner": runner_cases(base_dirs["tiny-ltx2"], base_dirs["tiny-ltx2-i2v"])}

    def encoders(self, pipe) -> list:
        # The connectors only turn the text encoder's states into the two streams' prompts.
        return [m for m in (getattr(pipe, "text_encoder", None), getattr(pipe, "connectors", None)) if m is not None]

    def do_cfg(self, pipe, request) -> bool:
        return False  # predict runs every guidance pass itself (module docstring)

    # -- checks ----------------------------------------------------------------------------
    def check_request(self, pipe, request) -> None:
        super().check_request(pipe, request)
        if request.guidance_scale_2 is not None:
            raise ValueError("guidance_scale_2 is for two-expert pipelines (Wan 2.2 A14B); LTX-2 has one: drop it")
        for name in ("stg_scale", "modality_scale", "guidance_rescale", "audio_guidance_scale", "audio_stg_scale",
                     "audio_modality_scale", "audio_guidance_rescale"):
            value = request.option(name)
            if value is not None and (isinstance(value, (bool, tuple)) or value < 0):
                raise ValueError(f"guidance option {name}={value!r} must be a number >= 0")
        for name in ("guidance_rescale", "audio_guidance_rescale"):
            value = request.option(name)
            if value is not None and value > 1:
                raise ValueError(f"guidance option {name}={value!r} must be in [0, 1] (0 turns rescaling off)")
        cross = request.option("use_cross_timestep")
        if cross is not None and not isinstance(cross, bool):
            raise ValueError(f"guidance option use_cross_timestep={cross!r} must be true or false")
        crf = request.option("image_crf")
        if crf is not None:
            if request.image is None:
                raise ValueError("guidance option image_crf is for image-to-video requests; drop it")
            if isinstance(crf, (bool, tuple, float)) or not 0 <= crf <= 51:
                raise ValueError(f"guidance option image_crf={crf!r} must be an integer in 0..51 (0: no re-compression)")
        layers = len(pipe.transformer.transformer_blocks)
        blocks = request.option("stg_blocks")
        if blocks is not None:
            if not isinstance(blocks, tuple) or not blocks or any(not 0 <= b < layers for b in blocks):
                raise ValueError(f"guidance option stg_blocks={blocks!r} must list block indices in 0..{layers - 1}")
            if not pipe.transformer.config.perturbed_attn:
                raise ValueError("guidance option stg_blocks needs a transformer with perturbed_attn (LTX-2.3); "
                                 "this one has none: set stg_scale=0 and audio_stg_scale=0")
        temporal = pipe.vae_temporal_compression_ratio
        if (request.num_frames - 1) % temporal:
            lower = request.num_frames - (request.num_frames - 1) % temporal
            raise ValueError(f"num_frames {request.num_frames} must be {temporal}k + 1; nearest: {lower} or {lower + temporal}")
        for label, value in (("height", request.height), ("width", request.width)):
            if value % 32:  # the pipeline's check_inputs
                lower = value - value % 32
                raise ValueError(f"{label} {value} must be a multiple of 32; nearest: {f'{lower} or ' if lower else ''}{lower + 32}")

    # -- prepare ---------------------------------------------------------------------------
    def encode(self, pipe, request, device, dtype):
        import torch

        g = guidance(pipe, request)
        embeds, mask, negative, negative_mask = pipe.encode_prompt(
            prompt=request.prompt, negative_prompt=request.negative_prompt, do_classifier_free_guidance=g["cfg"],
            max_sequence_length=max_sequence_length(pipe), device=device)
        if g["cfg"]:  # the pipeline's batch order
            embeds, mask = torch.cat([negative, embeds]), torch.cat([negative_mask, mask])
        side = getattr(pipe.tokenizer, "padding_side", "left")
        video, audio, connector_mask = pipe.connectors(embeds, mask, padding_side=side)
        branch = {"video_embeds": video, "audio_embeds": audio, "mask": connector_mask}
        return branch, None

    def init(self, pipe, request, generator, device, dtype):
        import numpy as np
        import torch
        from diffusers.pipelines.ltx2.pipeline_ltx2 import calculate_shift, retrieve_timesteps
        from diffusers.pipelines.ltx2.utils import conditioning_frame_rate

        g = guidance(pipe, request)
        context = {"guidance": g}
        channels = pipe.transformer.config.in_channels
        if request.image is None:
            video = pipe.prepare_latents(1, channels, request.height, request.width, request.num_frames, 0.0,
                                         torch.float32, device, generator)  # [1, Lv, Cv]
        else:
            from PIL import Image

            from raydit.models.family import png_to_image

            image = png_to_image(request.image)
            crf = _default_crf(pipe) if g["image_crf"] is None else g["image_crf"]
            if crf:
                try:
                    import av  # noqa: F401  (diffusers re-compresses with PyAV)
                except ImportError:
                    raise ValueError(
                        f"image-to-video re-compresses the image at H.264 CRF {crf} as LTX-2 was trained, which "
                        "needs PyAV (pip install av); or set guidance option image_crf=0 to skip it") from None
                from diffusers.pipelines.ltx2.utils import apply_image_conditioning_crf

                image = Image.fromarray(apply_image_conditioning_crf(np.array(image.convert("RGB")), crf))
            image = pipe.video_processor.preprocess(image, height=request.height, width=request.width)
            image = image.to(device=device, dtype=dtype)
            # [1, Lv, Cv], the first latent frame the image's; mask [1, Lv], 1 on those tokens
            video, context["conditioning_mask"] = pipe.prepare_latents(
                image, 1, channels, request.height, request.width, request.num_frames, 0.0, torch.float32, device,
                generator)
        frames = (request.num_frames - 1) // pipe.vae_temporal_compression_ratio + 1
        height = request.height // pipe.vae_spatial_compression_ratio
        width = request.width // pipe.vae_spatial_compression_ratio
        # The sound lasts as the video: its latent frames per second from the audio VAE's hop.
        per_second = pipe.audio_sampling_rate / pipe.audio_hop_length / float(pipe.audio_vae_temporal_compression_ratio)
        audio_frames = round(request.num_frames / FRAME_RATE * per_second)
        mel_bins = pipe.audio_vae.config.mel_bins
        audio = pipe.prepare_audio_latents(1, num_channels_latents=pipe.audio_vae.config.latent_channels,
                                           audio_latent_length=audio_frames, num_mel_bins=mel_bins, noise_scale=0.0,
                                           dtype=torch.float32, device=device, generator=generator)  # [1, La, Ca]
        n = request.num_inference_steps
        config = pipe.scheduler.config
        mu = calculate_shift(video.shape[1], config.get("base_image_seq_len", 1024), config.get("max_image_seq_len", 4096),
                             config.get("base_shift", 0.95), config.get("max_shift", 2.05))
        timesteps, _ = retrieve_timesteps(pipe.scheduler, n, device, None, sigmas=np.linspace(1.0, 1 / n, n), mu=mu)
        if request.image is None:
            pipe.scheduler.set_begin_index(0)  # the text-to-video pipeline does, the image one does not
        fps = conditioning_frame_rate(FRAME_RATE, 1.0)  # motion_speed 1
        video_coords = pipe.transformer.rope.prepare_video_coords(1, frames, height, width, device, fps=fps)
        audio_coords = pipe.transformer.audio_rope.prepare_audio_coords(1, audio_frames, device)
        context.update({
            "video_shape": tuple(video.shape[1:]), "audio_shape": tuple(audio.shape[1:]),
            "latent_frames": frames, "latent_height": height, "latent_width": width, "fps": fps,
            "audio_frames": audio_frames, "latent_mel_bins": mel_bins // pipe.audio_vae_mel_compression_ratio,
            "video_coords": video_coords, "audio_coords": audio_coords,
        })
        latents = torch.cat([video.flatten(1), audio.flatten(1)], dim=1)
        return Prepared(latents=latents, timesteps=timesteps, context=context)

    # -- a step ----------------------------------------------------------------------------
    @staticmethod
    def split(state, latents=None):
        """The runner's latents [1, Lv*Cv + La*Ca] -> video [1, Lv, Cv], audio [1, La, Ca] (views)."""
        latents = state.latents if latents is None else latents
        (lv, cv), (la, ca) = state.context["video_shape"], state.context["audio_shape"]
        return latents[:, :lv * cv].view(1, lv, cv), latents[:, lv * cv:].view(1, la, ca)

    def predict(self, pipe, state, t, branch):
        """Every guidance pass of one step -> the guided velocity, flattened like the latents."""
        import torch
        from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

        c, g, i = state.context, state.context["guidance"], state.step_index
        video, audio = self.split(state)
        # The pipeline's packed video latents are channel-major ([1, Lv, Cv] with strides
        # (Lv Cv, 1, Lv): _pack_latents permutes, and every step's arithmetic keeps the layout);
        # a bf16 GEMM over them differs from one over row-major tokens, so they are laid out so.
        video = video.transpose(1, 2).contiguous().transpose(1, 2)
        embeds, audio_embeds, mask = branch["video_embeds"], branch["audio_embeds"], branch["mask"]
        dtype = embeds.dtype
        b = embeds.shape[0]  # 2 with classifier-free guidance: [negative, positive]
        timestep = t.expand(b)
        video_timestep = timestep
        if "conditioning_mask" in c:  # image-to-video: [b, Lv], 0 on the image's tokens
            video_timestep = timestep.unsqueeze(-1) * (1 - torch.cat([c["conditioning_mask"]] * b))

        def call(x, a, ts, vts, e, ae, m, reps, **kwargs):
            vc = c["video_coords"].repeat((reps,) + (1,) * (c["video_coords"].ndim - 1)) if reps > 1 else c["video_coords"]
            ac = c["audio_coords"].repeat((reps,) + (1,) * (c["audio_coords"].ndim - 1)) if reps > 1 else c["audio_coords"]
            v_out, a_out = pipe.transformer(
                hidden_states=x, audio_hidden_states=a, encoder_hidden_states=e, audio_encoder_hidden_states=ae,
                timestep=vts, audio_timestep=ts if "conditioning_mask" in c else None, sigma=ts,
                encoder_attention_mask=m, audio_encoder_attention_mask=m, num_frames=c["latent_frames"],
                height=c["latent_height"], width=c["latent_width"], fps=c["fps"], audio_num_frames=c["audio_frames"],
                video_coords=vc, audio_coords=ac, perturbation_mask=None, use_cross_timestep=g["use_cross_timestep"],
                return_dict=False, **kwargs)
            return v_out.float(), a_out.float()

        def x0(sample, velocity):
            return pipe.convert_velocity_to_x0(sample, velocity, i, pipe.scheduler)

        x = torch.cat([video] * b) if b > 1 else video
        a = torch.cat([audio] * b) if b > 1 else audio
        v_pred, a_pred = call(x.to(dtype), a.to(dtype), timestep, video_timestep, embeds, audio_embeds, mask, b,
                              isolate_modalities=False, spatio_temporal_guidance_blocks=None)
        v_cfg = a_cfg = v_stg = a_stg = v_mod = a_mod = 0
        if g["cfg"]:
            v_neg, v_pos = v_pred.chunk(2)
            v_pos, v_neg = x0(video, v_pos), x0(video, v_neg)
            v_cfg = (g["guidance_scale"] - 1) * (v_pos - v_neg)
            a_neg, a_pos = a_pred.chunk(2)
            a_pos, a_neg = x0(audio, a_pos), x0(audio, a_neg)
            a_cfg = (g["audio_guidance_scale"] - 1) * (a_pos - a_neg)
            # the positive branch alone for the other passes (coords: one row)
            embeds, audio_embeds, mask = embeds.chunk(2)[1], audio_embeds.chunk(2)[1], mask.chunk(2)[1]
            timestep, video_timestep = timestep.chunk(2)[0], video_timestep.chunk(2)[0]
        else:
            v_pos, a_pos = x0(video, v_pred), x0(audio, a_pred)
        if g["stg"]:
            v_out, a_out = call(video.to(dtype), audio.to(dtype), timestep, video_timestep, embeds, audio_embeds, mask,
                                1, isolate_modalities=False, spatio_temporal_guidance_blocks=list(g["stg_blocks"]))
            v_stg = g["stg_scale"] * (v_pos - x0(video, v_out))
            a_stg = g["audio_stg_scale"] * (a_pos - x0(audio, a_out))
        if g["modality"]:
            v_out, a_out = call(video.to(dtype), audio.to(dtype), timestep, video_timestep, embeds, audio_embeds, mask,
                                1, isolate_modalities=True, spatio_temporal_guidance_blocks=None)
            v_mod = (g["modality_scale"] - 1) * (v_pos - x0(video, v_out))
            a_mod = (g["audio_modality_scale"] - 1) * (a_pos - x0(audio, a_out))
        v_guided = v_pos + v_cfg + v_stg + v_mod
        a_guided = a_pos + a_cfg + a_stg + a_mod
        if g["guidance_rescale"] > 0:
            v_guided = rescale_noise_cfg(v_guided, v_pos, guidance_rescale=g["guidance_rescale"])
        if g["audio_guidance_rescale"] > 0:
            a_guided = rescale_noise_cfg(a_guided, a_pos, guidance_rescale=g["audio_guidance_rescale"])
        v_velocity = pipe.convert_x0_to_velocity(video, v_guided, i, pipe.scheduler)
        a_velocity = pipe.convert_x0_to_velocity(audio, a_guided, i, pipe.scheduler)
        return torch.cat([v_velocity.flatten(1), a_velocity.flatten(1)], dim=1)

    def scheduler_step(self, pipe, state, noise, t, generator):
        latents, carry = super().scheduler_step(pipe, state, noise, t, generator)
        mask = state.context.get("conditioning_mask")
        if mask is not None:  # the image's latent frame (the first Lv tokens of mask 1) is kept
            _, cv = state.context["video_shape"]
            kept = int(mask[0].sum()) * cv
            assert bool(mask[0, : int(mask[0].sum())].all()), "the image's tokens lead the video"
            latents = latents.clone()
            latents[:, :kept] = state.latents[:, :kept].to(latents.dtype)
        return latents, carry

    # -- outputs ---------------------------------------------------------------------------
    def _streams(self, pipe, state, latents=None):
        """Video [1, C, F, H, W] and audio [1, C, L, M] latents, denormalized as the pipeline's
        output_type="latent" returns them."""
        c = state.context
        video, audio = self.split(state, latents)
        video = pipe._unpack_latents(video, c["latent_frames"], c["latent_height"], c["latent_width"],
                                     pipe.transformer_spatial_patch_size, pipe.transformer_temporal_patch_size)
        audio = pipe._denormalize_audio_latents(audio, pipe.audio_vae.latents_mean, pipe.audio_vae.latents_std)
        audio = pipe._unpack_audio_latents(audio, c["audio_frames"], num_mel_bins=c["latent_mel_bins"])
        return video, audio

    def output_latents(self, pipe, state, latents=None):
        import torch

        video, audio = self._streams(pipe, state, latents)
        vae = pipe.vae
        video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)

    def reference_latents(self, pipe, request):
        import torch

        from raydit.models.family import png_to_image

        g = guidance(pipe, request)
        pipe.set_progress_bar_config(disable=True)
        image = {}
        if request.image is not None:
            crf = _default_crf(pipe) if g["image_crf"] is None else g["image_crf"]
            image = {"image": png_to_image(request.image), "image_crf": crf}
        out = pipe(
            **image, prompt=request.prompt, negative_prompt=request.negative_prompt, num_frames=request.num_frames,
            height=request.height, width=request.width, num_inference_steps=request.num_inference_steps,
            guidance_scale=request.guidance_scale, stg_scale=g["stg_scale"], modality_scale=g["modality_scale"],
            guidance_rescale=g["guidance_rescale"], audio_guidance_scale=g["audio_guidance_scale"],
            audio_stg_scale=g["audio_stg_scale"], audio_modality_scale=g["audio_modality_scale"],
            audio_guidance_rescale=g["audio_guidance_rescale"], spatio_temporal_guidance_blocks=list(g["stg_blocks"]),
            use_cross_timestep=g["use_cross_timestep"], max_sequence_length=max_sequence_length(pipe),
            generator=torch.Generator("cpu").manual_seed(request.seed), output_type="latent",
        )
        return torch.cat([out.frames.flatten(1), out.audio.flatten(1)], dim=1)

    def decode_video(self, pipe, state, latents):
        import torch

        video, _ = self._streams(pipe, state, latents)
        vae = pipe.vae
        dtype = pipe.transformer.dtype  # the pipeline casts to the prompt embeddings' dtype first
        video = video.to(dtype)
        video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        video = video.to(vae.dtype)
        # The pipeline's defaults: decode_timestep 0 and noise scale 0 (the latents as they are).
        timestep = torch.zeros(1, device=video.device, dtype=video.dtype) if vae.config.timestep_conditioning else None
        return vae.decode(video, timestep, return_dict=False)[0]

    def decode_audio(self, pipe, state, latents=None):
        _, audio = self._streams(pipe, state, latents)
        mel = pipe.audio_vae.decode(audio.to(pipe.audio_vae.dtype), return_dict=False)[0]
        waveform = pipe.vocoder(mel)[0]  # [channels, samples]
        rate = getattr(pipe.vocoder.config, "output_sampling_rate", None) or pipe.audio_sampling_rate
        return Audio(waveform=waveform.float().clamp(-1, 1).cpu().numpy(), sample_rate=int(rate), frame_rate=FRAME_RATE)


FAMILY = LTX2Family()


# -- the tiny pipelines ------------------------------------------------------------------------
TINY_VERSION = "1"  # bump when the saved files change, so stale caches are not reused
TINY_HEADS = 6  # video and audio (the cross-attention rotary table has the video's head count)
TINY_HEAD_DIM = 8
TINY_AUDIO_HEAD_DIM = 4
TINY_TEXT_DIM = 16  # Gemma 3 hidden size == connectors' caption_channels == transformer's
TINY_TEXT_LAYERS = 2
TINY_LATENT_CHANNELS = 8
TINY_MAX_TEXT = 32  # the tiny tokenizer's limit: the prompt length the pipeline pads to
TINY_DEFAULTS = {"num_frames": 17, "height": 32, "width": 416}


def tiny_transformer(seed: int, **overrides):
    """An LTX2VideoTransformer3DModel of the tiny geometry (or `overrides`), parameters from `seed`."""
    import torch
    from diffusers import LTX2VideoTransformer3DModel

    from raydit.models.tiny import randomize

    config = dict(in_channels=TINY_LATENT_CHANNELS, out_channels=TINY_LATENT_CHANNELS, num_attention_heads=TINY_HEADS,
                  attention_head_dim=TINY_HEAD_DIM, audio_in_channels=4, audio_out_channels=4,
                  audio_num_attention_heads=TINY_HEADS, audio_attention_head_dim=TINY_AUDIO_HEAD_DIM, num_layers=2,
                  caption_channels=TINY_TEXT_DIM, rope_type="split", perturbed_attn=True, rope_double_precision=False)
    config.update(overrides)
    config.setdefault("cross_attention_dim", config["num_attention_heads"] * config["attention_head_dim"])
    config.setdefault("audio_cross_attention_dim", config["audio_num_attention_heads"] * config["audio_attention_head_dim"])
    torch.manual_seed(seed)
    return randomize(LTX2VideoTransformer3DModel(**config), seed)


def _tiny_text_encoder(vocab_size: int, seed: int):
    import torch
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3TextConfig, SiglipVisionConfig

    text = Gemma3TextConfig(vocab_size=vocab_size, hidden_size=TINY_TEXT_DIM, intermediate_size=32,
                            num_hidden_layers=TINY_TEXT_LAYERS, num_attention_heads=2, num_key_value_heads=1,
                            head_dim=8, max_position_embeddings=64, sliding_window=16, pad_token_id=0,
                            eos_token_id=1, bos_token_id=1)
    vision = SiglipVisionConfig(hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
                                image_size=8, patch_size=4)
    # image tokens beyond the vocabulary: text prompts never contain them
    config = Gemma3Config(text_config=text.to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                          boi_token_index=vocab_size + 1, eoi_token_index=vocab_size + 2,
                          image_token_index=vocab_size + 3)
    torch.manual_seed(seed)
    return Gemma3ForConditionalGeneration(config).eval()


def _tiny_connectors(seed: int):
    import torch
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    from raydit.models.tiny import randomize

    torch.manual_seed(seed)
    connectors = LTX2TextConnectors(
        caption_channels=TINY_TEXT_DIM, text_proj_in_factor=TINY_TEXT_LAYERS + 1,
        video_connector_num_attention_heads=2, video_connector_attention_head_dim=8, video_connector_num_layers=1,
        video_connector_num_learnable_registers=None, audio_connector_num_attention_heads=2,
        audio_connector_attention_head_dim=8, audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=None, connector_rope_base_seq_len=32, rope_type="split",
        rope_double_precision=False)
    return randomize(connectors, seed)


def _tiny_vaes(seed: int):
    import torch
    from diffusers import AutoencoderKLLTX2Audio, AutoencoderKLLTX2Video
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(seed)
    vae = AutoencoderKLLTX2Video(
        latent_channels=TINY_LATENT_CHANNELS, block_out_channels=(8, 8, 8), decoder_block_out_channels=(8, 8, 8),
        layers_per_block=(1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1),
        spatio_temporal_scaling=(True, True, True), decoder_spatio_temporal_scaling=(True, True, True),
        decoder_inject_noise=(False, False, False, False), downsample_type=("spatiotemporal",) * 3,
        upsample_type=("spatiotemporal",) * 3, upsample_residual=(False,) * 3, upsample_factor=(1,) * 3,
        timestep_conditioning=False, patch_size=4, decoder_spatial_padding_mode="zeros",
    ).eval()  # patch 4 x 2^3 = 32x spatial, 2^3 = 8x temporal
    audio_vae = AutoencoderKLLTX2Audio(
        base_channels=4, output_channels=2, ch_mult=(1,), num_res_blocks=1, attn_resolutions=None, in_channels=2,
        resolution=32, latent_channels=2, norm_type="pixel", causality_axis="height", dropout=0.0,
        mid_block_add_attention=False, sample_rate=16000, mel_hop_length=160, is_causal=True, mel_bins=8,
    ).eval()
    # 8 x 5 x 4 = 160 samples per mel frame: the hop, so the waveform lasts as the video
    vocoder = LTX2Vocoder(in_channels=2 * 8, hidden_channels=32, out_channels=2, upsample_kernel_sizes=[16, 10, 8],
                          upsample_factors=[8, 5, 4], resnet_kernel_sizes=[3], resnet_dilations=[[1, 3, 5]],
                          leaky_relu_negative_slope=0.1, output_sampling_rate=16000).eval()
    return vae, audio_vae, vocoder


def tiny_pipeline():
    """The tiny LTX2Pipeline, built in memory."""
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2Pipeline

    from raydit.models.tiny import SEED, tokenizer

    tok = tokenizer(TINY_MAX_TEXT)
    vae, audio_vae, vocoder = _tiny_vaes(SEED + 2)
    # LTX-2's scheduler: dynamic shift by the video token count.
    scheduler = FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True, base_image_seq_len=1024,
                                                max_image_seq_len=4096, base_shift=0.95, max_shift=2.05,
                                                shift_terminal=0.1)
    return LTX2Pipeline(scheduler=scheduler, vae=vae, audio_vae=audio_vae,
                        text_encoder=_tiny_text_encoder(len(tok), SEED + 1), tokenizer=tok,
                        connectors=_tiny_connectors(SEED + 3), transformer=tiny_transformer(SEED + 10), vocoder=vocoder)


def tiny_i2v_pipeline():
    """The tiny LTX2ImageToVideoPipeline: the text-to-video one's components."""
    from diffusers import LTX2ImageToVideoPipeline

    components = {k: v for k, v in tiny_pipeline().components.items() if v is not None}
    return LTX2ImageToVideoPipeline(**components)


class _WithDefaults:
    """Saves a pipeline and, beside its model_index.json, the request defaults spec_from_dir reads."""

    def __init__(self, pipe, defaults: dict):
        self.pipe, self.defaults = pipe, defaults

    def save_pretrained(self, directory) -> None:
        self.pipe.save_pretrained(directory)
        (Path(directory) / DEFAULTS_FILE).write_text(json.dumps(self.defaults, indent=1) + "\n")


def tiny_pipeline_dir() -> Path:
    """The directory of `tiny-ltx2`, written once to the cache."""
    from raydit.models.tiny import cache_root, write_pipeline

    return write_pipeline(cache_root() / f"tiny-ltx2-{TINY_VERSION}", lambda: _WithDefaults(tiny_pipeline(), TINY_DEFAULTS))


def tiny_i2v_pipeline_dir() -> Path:
    """The directory of `tiny-ltx2-i2v`, written once to the cache."""
    from raydit.models.tiny import cache_root, write_pipeline

    return write_pipeline(cache_root() / f"tiny-ltx2-i2v-{TINY_VERSION}",
                          lambda: _WithDefaults(tiny_i2v_pipeline(), TINY_DEFAULTS))


def ltx2_pipeline(base_dir: str):
    """The tiny LTX-2 pipeline loaded from its directory (as a real checkpoint is)."""
    from diffusers import DiffusionPipeline

    from raydit.models.tiny import quiet_hub

    with quiet_hub():
        pipe = DiffusionPipeline.from_pretrained(base_dir)
    pipe.set_progress_bar_config(disable=True)
    return pipe


# -- conformance -------------------------------------------------------------------------------
_BUILD_PIPELINE = "raydit.models.families.ltx2:ltx2_pipeline"

# 17 frames at 32 x 416: 3 x 1 x 13 = 39 video tokens, 18 audio tokens; block 1 of 2 is STG's.
TINY_REQUEST = dict(prompt="a red fox barks", negative_prompt="blur", num_frames=17, height=32, width=416,
                    num_inference_steps=3, guidance_scale=3.0, seed=11, guidance_options={"stg_blocks": (1,)})
SP_WORLDS = ()  # no sequence parallelism yet: one process only
NO_STG_NO_MODALITY = {"stg_scale": 0.0, "audio_stg_scale": 0.0, "modality_scale": 1.0, "audio_modality_scale": 1.0}


def runner_cases(base_dir: str, i2v_dir: str | None = None) -> list:
    from raydit.models.conformance import RunnerCase

    cases = [
        RunnerCase("ltx2-t2v", _BUILD_PIPELINE, TINY_HEADS, dict(TINY_REQUEST), dict(base_dir=base_dir), cfg=False,
                   worlds=SP_WORLDS),
        RunnerCase("ltx2-t2v-cfg-only", _BUILD_PIPELINE, TINY_HEADS,
                   dict(TINY_REQUEST, seed=12, guidance_options=NO_STG_NO_MODALITY), dict(base_dir=base_dir),
                   cfg=False, worlds=SP_WORLDS),
    ]
    if i2v_dir is not None:
        cases.append(RunnerCase(
            "ltx2-i2v", _BUILD_PIPELINE, TINY_HEADS,
            dict(TINY_REQUEST, prompt="a kite climbs", seed=13, guidance_options={"stg_blocks": (0,), "image_crf": 0}),
            dict(base_dir=i2v_dir), image="checker", cfg=False, worlds=SP_WORLDS))
    return cases

