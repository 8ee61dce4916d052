"""The LTX-2 family (the package's docstring says what LTX-2 is): its steps, as the pipeline's.

Its sequence-parallel adapter is in `adapter.py`, the guidance knobs and their combination in
`guidance.py`, its tiny pipelines in `tiny.py`, its conformance cases in `cases.py`.

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
knobs beyond `guidance_scale` travel in GenerationRequest.guidance_options (guidance.OPTION_DEFAULTS:
the pipeline's defaults, with its `audio_x or x` fallbacks).

Branches. A guided step has four guidance branches (`max_branches` 4), in this order: negative,
positive, STG, modality. A branch whose pass is off (its scales at their neutral values) is a
slot that predicts zeros without a transformer call, so every guided request has four and any
branch degree (cfg 1, 2 or 4) shares them out evenly: cfg 2 gives one group the [negative,
positive] pass (a batch of 2, as the pipeline runs it) and the other the STG and modality
passes; cfg 4 gives each group one pass. Each branch predicts x0 as one row [1, N] and
`combine_guidance` (the runner's hook, after the gather on a cfg mesh) puts them together as
above. A request with the positive pass alone (every guidance scale neutral) has one branch,
whose prediction is the velocity itself, run on every group. Each pass keeps the pipeline's
batching (negative and positive as one batch where one group runs both) and input layout, which
bf16 needs to be bit-equal to diffusers.

Step caching (raydit.models.cache): each pass is a guidance branch with its own residuals,
for both output streams (the audio's cut per rank where it is split); the decision is made at
the first call of a one-process step (the [negative, positive] pass, or the positive alone).

State. The runner's latents are one tensor [1, Lv*Cv + La*Ca] (float32): the packed video then
the packed audio latents, flattened. FlowMatchEuler's step is elementwise, so one scheduler
stepping both streams gives the numbers of the pipeline's two (its audio scheduler is a copy with
the same sigmas and step index). `output_latents` unpacks and denormalizes both and returns
them apart, (video [1, Cv, F, H, W], audio [1, Ca, L, M]), what LTX2Pipeline(output_type="latent",
return_dict=False) returns (GenerationResult.latents and .audio_latents). The prompt is padded
to the pipeline's default max_sequence_length (1024), as the pipeline pads it.

Image-to-video: the first latent frame holds the image's latents (conditioning mask 1), its
tokens get timestep 0 (per-token video timestep, so temb is [B, Lv, 6C]) and keep their values
through the steps. The pipeline re-compresses the image as H.264 at CRF 33 (Gemma 3
checkpoints) with PyAV before encoding it; guidance option image_crf=0 skips that.

Legend: B batch, Lv / La video / audio tokens, Cv / Ca their latent channels.
"""

from __future__ import annotations


from raydit.models.families.ltx2.adapter import LTX2Adapter
from raydit.models.families.ltx2.guidance import MAX_SEQUENCE_LENGTH, OPTION_DEFAULTS, default_crf, guidance, guide
from raydit.models.families.ltx2.guidance import max_sequence_length
from raydit.models.family import Audio, Family, Prepared
from raydit.models.requests import check_frames, check_size, reference_call
from raydit.models.tiny import request_defaults
from raydit.planner.model import DecoderShape

PIPELINE_DEFAULTS = {"num_frames": 121, "height": 512, "width": 768}  # LTX2Pipeline.__call__'s
FRAME_RATE = 24.0  # the pipeline's default (audio length, rotary positions in time)
# AutoencoderKLLTX2Audio.temporal_compression_ratio: mel frames per audio latent frame, a constant
# of diffusers' class (LATENT_DOWNSAMPLE_FACTOR), not in its config.
AUDIO_VAE_TEMPORAL_COMPRESSION = 4


# -- the planner's built-in models and decoder (data the registry hands raydit.planner) ----------
# Gemma 3 12B (11.77e9 text with tied embeddings + 0.42e9 SigLIP) and the pipeline's text connectors
# (1.43e9: Linear 49 x 3840 -> 3840 and two 2-layer 30 x 128 transformers, LTX2TextConnectors'
# defaults, which are LTX-2's).
TEXT_ENCODER_PARAMS = 12.19e9 + 1.43e9

def builtin_models() -> list:
    """The planner's built-in models of this family (raydit.planner.BUILTIN_MODELS)."""
    from raydit.planner.model import ModelSpec

    common = dict(family="ltx2")
    return [
        # LTX-2 (Lightricks/LTX-2, LTX2Pipeline): the 19B audio-video transformer, diffusers'
        # LTX2VideoTransformer3DModel defaults (its LTX-2 config): video 32 heads x 128, 48
        # blocks, 128 latent channels, patch 1; the audio stream (32 x 64 = 2048 wide, FFN 4 x) runs
        # in the same blocks and is counted in the parameters (1.888e10 on the meta device), not in
        # the split sequence: its tokens (AutoencoderKLLTX2Audio's defaults: 16000 Hz / hop 160 /
        # 4x temporal compression = 25 a second, read at the pipeline's 24 fps) stay whole on every
        # rank, costed apart (raydit.planner.cost). Gemma 3 text reaches both streams by
        # cross-attention, 1024 tokens (max_sequence_length). VAEs: video 32x / 8x (the pipeline's),
        # 1.22e9 + audio VAE 0.05e9 + vocoder 0.06e9. LTX2Pipeline's defaults: 121 x 512 x 768.
        # Guidance: four branches per step (the negative and positive passes, STG, modality), shared
        # out over cfg 1, 2 or 4 groups.
        ModelSpec(name="ltx-2", heads=32, head_dim=128, layers=48, ffn_hidden=16384, patch_size=1,
                  patch_size_t=1, text_tokens=1024, text_in_sequence=False, positional="rotary",
                  in_channels=128, params=18.88e9, text_encoder_params=TEXT_ENCODER_PARAMS, vae_params=1.33e9,
                  default_frames=121, default_height=512, default_width=768, vae_spatial=32, vae_temporal=8,
                  cfg_branches=4, audio_heads=32, audio_head_dim=64, audio_ffn_hidden=4 * 32 * 64,
                  audio_tokens_per_second=25.0, frame_rate=24.0, **common),
    ]


class LTX2Family(Family):
    """LTX2Pipeline's and LTX2ImageToVideoPipeline's steps."""

    name = "ltx2"
    pipelines = ("LTX2Pipeline", "LTX2ImageToVideoPipeline")
    image_pipelines = ("LTX2ImageToVideoPipeline",)
    adapter = LTX2Adapter
    batch_branches = False  # different passes, not one batch (group_calls batches the cfg pair alone)
    # Per video token and channel, and kernels per block and call, of the block's ops besides GEMMs and
    # attention in eager bf16: bench/bench_blockcounts.py (the family's tiny forward case, FFN at the released ratio; the audio stream's ops in the launches, its bytes not (they do not grow with the video)).
    elementwise_bytes = 494.5
    elementwise_launches = 248
    max_branches = 4  # negative, positive, STG, modality (module docstring)
    # LTX-2's video VAE (AutoencoderKLLTX2Video, diffusers' default config = LTX-2's), counted with
    # torch.utils.flop_counter on the meta device, 3 x 8 x 8 latents (17 x 256 x 256 out): 1.5030e12
    # FLOP, 1.349e6 per output pixel-frame. raydit runs it whole on one rank (this family does not
    # split it), so it is priced whole; the halo and memory figures are the uncounted stand-in's.
    decoder = DecoderShape(1.349e6, 6320, 33.0, 0.0, 128, 4, parallel=False)
    option_names = tuple(OPTION_DEFAULTS)

    models = staticmethod(builtin_models)

    def fp8_weight_params(self, spec) -> float:
        # per block: video self- and cross-attention (8 h^2) and FFN (2 h f); the audio stream's
        # the same at its width a (8 a^2 + 2 a fa); the two cross-modal attentions, each q / k / v
        # / out between the widths (4 a^2 + 4 h a)
        h, f, a, fa = spec.hidden, spec.ffn_hidden, spec.audio_hidden, spec.audio_ffn_hidden
        return float(spec.layers * (8 * h * h + 2 * h * f + 12 * a * a + 2 * a * fa + 4 * h * a))

    def spec_from_dir(self, path, configs):
        """Geometry from transformer/, vae/ and audio_vae/ configs; parameters from the weights'
        headers. The planner sees the video stream as the split sequence, the prompt as
        cross-attended text (the pipeline's default max_sequence_length, 1024 tokens) and the audio stream apart, whole on every
        rank: its heads and width (transformer/ audio_*; FFN 4 x, diffusers' FeedForward) and its
        tokens per second as `init` makes them (audio_vae/ sample_rate / mel_hop_length /
        AUDIO_VAE_TEMPORAL_COMPRESSION, read at FRAME_RATE; without audio_vae/, the pipeline's
        16000 / 160). The vocoder turns mel frames into samples and sets no token count."""
        from raydit.planner.model import ModelSpec
        from raydit.planner.pipeline_dir import attention_shape, component_params, transformer_config

        cfg, where = transformer_config(path, configs, "LTX2VideoTransformer3DModel", "an LTX-2 pipeline")
        heads, head_dim = attention_shape(cfg, where)
        layers = int(cfg.get("num_layers", 48))
        hidden = heads * head_dim
        # diffusers' defaults where the config leaves them out (LTX-2's: 32 x 64)
        audio_heads = int(cfg.get("audio_num_attention_heads", 32))
        audio_head_dim = int(cfg.get("audio_attention_head_dim", 64))
        audio_hidden = audio_heads * audio_head_dim
        audio_vae = configs.get("audio_vae", {})
        audio_per_second = (float(audio_vae.get("sample_rate", 16000)) / float(audio_vae.get("mel_hop_length", 160))
                            / AUDIO_VAE_TEMPORAL_COMPRESSION)
        vae = configs.get("vae", {})
        scaling = vae.get("spatio_temporal_scaling", [True] * 4)
        scaling = [scaling] * 4 if isinstance(scaling, bool) else scaling
        steps = 2 ** sum(map(bool, scaling))
        vae_spatial = vae.get("spatial_compression_ratio") or int(vae.get("patch_size", 4)) * steps
        vae_temporal = vae.get("temporal_compression_ratio") or int(vae.get("patch_size_t", 1)) * steps
        defaults = request_defaults(path, PIPELINE_DEFAULTS)

        def params(*folders):
            counts = [component_params(path / f) for f in folders if (path / f).is_dir()]
            return float(sum(c for c in counts if c is not None))

        # per block: video self/text/a2v attention 12 h^2 + FFN 8 h^2; audio the same at its width
        estimate = float(layers * (20 * hidden * hidden + 20 * audio_hidden * audio_hidden))
        return ModelSpec(
            name=str(path), family=self.name, heads=heads, head_dim=head_dim, layers=layers, ffn_hidden=4 * hidden,
            patch_size=int(cfg.get("patch_size", 1)), patch_size_t=int(cfg.get("patch_size_t", 1)),
            text_tokens=MAX_SEQUENCE_LENGTH, text_in_sequence=False, positional="rotary",
            in_channels=int(cfg.get("in_channels", 128)),
            params=component_params(path / "transformer") or estimate,
            text_encoder_params=params("text_encoder", "connectors"),
            vae_params=params("vae", "audio_vae", "vocoder"),
            **defaults, vae_spatial=int(vae_spatial), vae_temporal=int(vae_temporal),
            cfg_branches=self.max_branches, audio_heads=audio_heads, audio_head_dim=audio_head_dim,
            audio_ffn_hidden=4 * audio_hidden, audio_tokens_per_second=audio_per_second, frame_rate=FRAME_RATE,
        )

    def encoders(self, pipe) -> list:
        # The connectors only turn the text encoder's states into the two streams' prompts.
        return [m for m in (getattr(pipe, "text_encoder", None), getattr(pipe, "connectors", None)) if m is not None]

    def do_cfg(self, pipe, request) -> bool:
        """Whether the step runs more than the positive pass (module docstring: then four branches)."""
        g = guidance(pipe, request)
        return g["cfg"] or g["stg"] or g["modality"]

    # -- checks ----------------------------------------------------------------------------
    def check_request(self, pipe, request) -> None:
        super().check_request(pipe, request)
        for name in ("stg_scale", "modality_scale", "guidance_rescale", "audio_guidance_scale", "audio_stg_scale",
                     "audio_modality_scale", "audio_guidance_rescale"):
            value = request.option(name)
            if value is not None and (isinstance(value, (bool, tuple)) or value < 0):
                raise ValueError(f"guidance option {name}={value!r} must be a number >= 0")
        for name in ("guidance_rescale", "audio_guidance_rescale"):
            value = request.option(name)
            if value is not None and value > 1:
                raise ValueError(f"guidance option {name}={value!r} must be in [0, 1] (0 turns rescaling off)")
        # LTX2Pipeline reads an audio knob of 0 as unset (`audio_x = audio_x or x`): a 0 the request
        # gives would silently become the video's value. Refused where that value is not 0 itself.
        resolved = guidance(pipe, request)
        for name, fallback, hint in (
                ("audio_guidance_scale", "guidance_scale", "1 turns the audio's classifier-free guidance off"),
                ("audio_stg_scale", "stg_scale", "set stg_scale=0 too to turn STG off"),
                ("audio_modality_scale", "modality_scale", "1 turns the audio's modality guidance off"),
                ("audio_guidance_rescale", "guidance_rescale", "set guidance_rescale=0 too to turn rescaling off")):
            value = request.option(name)
            if value is not None and value == 0 and resolved[name] != 0:
                raise ValueError(
                    f"guidance option {name}=0 would run as {fallback} ({resolved[name]:g}): LTX2Pipeline takes 0 as "
                    f"unset ({name} or {fallback}); {hint}, or give {name} a value other than 0")
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
        check_frames(request.num_frames, temporal)
        check_size(request, 32)  # the pipeline's check_inputs

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
        # The connectors run on the pipeline's batch; their rows are the two prompts' inputs.
        video, audio, connector_mask = pipe.connectors(embeds, mask, padding_side=side)
        rows = [{"video_embeds": v, "audio_embeds": a, "mask": m}
                for v, a, m in zip(video.split(1), audio.split(1), connector_mask.split(1))]
        return rows[-1], (rows[0] if g["cfg"] else None)

    def guidance_branches(self, pipe, request, positive, negative):
        """[negative, positive, STG, modality] with guidance (a pass that is off: a slot of
        zeros), the positive pass alone without (module docstring)."""
        g = guidance(pipe, request)
        if not self.do_cfg(pipe, request):
            return [{**positive, "pass": "alone"}]
        off = {"pass": None}
        return [{**negative, "pass": "neg"} if g["cfg"] else off, {**positive, "pass": "pos"},
                {**positive, "pass": "stg"} if g["stg"] else off, {**positive, "pass": "mod"} if g["modality"] else off]

    def group_calls(self, branches):
        """One call per pass; the negative and positive passes as one batch where both are here."""
        from raydit.models.family import cat_branches

        calls = []
        for branch in branches:
            if branch["pass"] == "pos" and calls and calls[-1]["pass"] == "neg":
                calls[-1] = {**cat_branches([calls[-1], branch]), "pass": "cfg"}
            else:
                calls.append(branch)
        return calls

    def call_branch_counts(self, calls, branches):
        return [2 if call["pass"] == "cfg" else 1 for call in calls]

    def call_runs_model(self, call):
        return call["pass"] is not None  # an off slot predicts zeros without the transformer

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

            from raydit.models.requests import png_to_image

            image = png_to_image(request.image)
            crf = default_crf(pipe) if g["image_crf"] is None else g["image_crf"]
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
        """One call's x0 predictions as rows [k, N] (N = Lv Cv + La Ca): "cfg" the negative and
        positive rows, one batch; "neg", "pos", "stg", "mod" one row; an off slot a row of zeros.
        The positive pass "alone" (no guidance): the velocity [1, N] itself."""
        import torch

        kind = branch["pass"]
        if kind is None:
            return state.latents.new_zeros(1, state.latents.shape[1])
        video, audio = self._call(pipe, state, t, branch)
        if kind == "alone":
            return self._guide(pipe, state, {"pos": (video, audio)})
        return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)

    def combine_guidance(self, pipe, state, t, *predictions):
        """The four branches' x0 rows (negative, positive, STG, modality) -> the guided velocity,
        as the pipeline combines them."""
        g = state.context["guidance"]

        def streams(flat):
            video, audio = self.split(state, flat)
            return video.transpose(1, 2).contiguous().transpose(1, 2), audio  # the pipeline's layout

        neg, pos, stg, mod = predictions
        x0 = {"pos": streams(pos)}
        for name, row, on in (("neg", neg, g["cfg"]), ("stg", stg, g["stg"]), ("mod", mod, g["modality"])):
            if on:
                x0[name] = streams(row)
        return self._guide(pipe, state, x0)

    def _call(self, pipe, state, t, branch) -> tuple:
        """One transformer call of the step, as the pipeline makes it -> x0 predictions, video
        [b, Lv, Cv] and audio [b, La, Ca]: "cfg" the [negative, positive] batch, "stg" with
        self-attention skipped in the STG blocks, "mod" with audio<->video attention off, the
        others plain, each on its branch's prompt."""
        import torch

        c, g, i = state.context, state.context["guidance"], state.step_index
        video, audio = self.split(state)
        # The pipeline's packed video latents are channel-major ([1, Lv, Cv] with strides
        # (Lv Cv, 1, Lv): _pack_latents permutes, and every step's arithmetic keeps the layout);
        # a bf16 GEMM over them differs from one over row-major tokens, so they are laid out so.
        video = video.transpose(1, 2).contiguous().transpose(1, 2)
        embeds, audio_embeds, mask = branch["video_embeds"], branch["audio_embeds"], branch["mask"]
        dtype = embeds.dtype
        reps = embeds.shape[0]  # 2 for the [negative, positive] batch
        timestep = t.expand(reps)
        video_timestep = timestep
        if "conditioning_mask" in c:  # image-to-video: [reps, Lv], 0 on the image's tokens
            video_timestep = timestep.unsqueeze(-1) * (1 - torch.cat([c["conditioning_mask"]] * reps))
        vc = c["video_coords"].repeat((reps,) + (1,) * (c["video_coords"].ndim - 1)) if reps > 1 else c["video_coords"]
        ac = c["audio_coords"].repeat((reps,) + (1,) * (c["audio_coords"].ndim - 1)) if reps > 1 else c["audio_coords"]
        x = torch.cat([video] * reps) if reps > 1 else video
        a = torch.cat([audio] * reps) if reps > 1 else audio
        v_out, a_out = pipe.transformer(
            hidden_states=x.to(dtype), audio_hidden_states=a.to(dtype), encoder_hidden_states=embeds,
            audio_encoder_hidden_states=audio_embeds, timestep=video_timestep,
            audio_timestep=timestep if "conditioning_mask" in c else None, sigma=timestep,
            encoder_attention_mask=mask, audio_encoder_attention_mask=mask, num_frames=c["latent_frames"],
            height=c["latent_height"], width=c["latent_width"], fps=c["fps"], audio_num_frames=c["audio_frames"],
            video_coords=vc, audio_coords=ac, perturbation_mask=None, use_cross_timestep=g["use_cross_timestep"],
            isolate_modalities=branch["pass"] == "mod",
            spatio_temporal_guidance_blocks=list(g["stg_blocks"]) if branch["pass"] == "stg" else None,
            return_dict=False)
        # x0 = latents - v sigma (the pipeline's convert_velocity_to_x0)
        return (pipe.convert_velocity_to_x0(video, v_out.float(), i, pipe.scheduler),
                pipe.convert_velocity_to_x0(audio, a_out.float(), i, pipe.scheduler))

    def _guide(self, pipe, state, x0: dict):
        """x0 predictions -> the guided velocity [1, N] (guidance.guide) on this step's latents."""
        video, audio = self.split(state)
        video = video.transpose(1, 2).contiguous().transpose(1, 2)  # the pipeline's layout (see _call)
        return guide(pipe, state.context["guidance"], state.step_index, video, audio, x0)

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
        """(video [1, Cv, F, H, W], audio [1, Ca, L, M]): the pipeline's two latent outputs, both
        denormalized (module docstring, State)."""
        video, audio = self._streams(pipe, state, latents)
        vae = pipe.vae
        video = pipe._denormalize_latents(video, vae.latents_mean, vae.latents_std, vae.config.scaling_factor)
        return video, audio

    def reference_latents(self, pipe, request):
        """LTX2Pipeline's (frames, audio) with output_type="latent" and its own defaults (the
        request's guidance options where it sets them)."""
        from raydit.models.requests import png_to_image

        g = guidance(pipe, request)
        pipe.set_progress_bar_config(disable=True)
        image = {}
        if request.image is not None:
            crf = default_crf(pipe) if g["image_crf"] is None else g["image_crf"]
            image = {"image": png_to_image(request.image), "image_crf": crf}
        out = pipe(**reference_call(
            request, **image, stg_scale=g["stg_scale"], modality_scale=g["modality_scale"],
            guidance_rescale=g["guidance_rescale"], audio_guidance_scale=g["audio_guidance_scale"],
            audio_stg_scale=g["audio_stg_scale"], audio_modality_scale=g["audio_modality_scale"],
            audio_guidance_rescale=g["audio_guidance_rescale"], spatio_temporal_guidance_blocks=list(g["stg_blocks"]),
            use_cross_timestep=g["use_cross_timestep"]))
        return out.frames, out.audio

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
