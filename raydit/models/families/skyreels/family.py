"""SkyReels-V2 family: text-to-video, image-to-video and diffusion forcing (long videos).

diffusers' SkyReelsV2Transformer3DModel is Wan 2.1's transformer with two additions: a
timestep per latent frame (diffusion forcing: `enable_diffusion_forcing`, the blocks' `temb`
is then [B, 6, L, C], one row per video token) and a block-causal attention mask over
groups of `num_frame_per_block` latent frames (`causal_block_size`). What is shared with
the Wan family (raydit.models.families.wan, imported, not copied): the self-attention
processor (`WanSPAttnProcessor`: projections, QK norms, Wan's rotary cut to the local chunk,
sp_attention), the rotary helpers, the prompt and image encoding, the VAE decode, the frame
rounding, the tiny VAE and CLIP image encoder, and the planner geometry (the same
transformer layout). SkyReels-V2 adds here:

- `SkyReelsSPAttnProcessor`: Wan's processor, plus the block-causal mask under sequence
  parallelism: this rank's queries attend to the gathered keys and values of the whole
  video with their rows of the mask (exact; sp_attention takes no mask).
- the per-token `temb` [B, 6, L, C] is split with the video along dim 2 before every block.
- diffusion forcing's loop (SkyReelsV2DiffusionForcingPipeline): a per-frame timestep
  matrix (synchronous, or asynchronous with `ar_step` and `causal_block_size`), one UniPC
  scheduler per latent frame, and long videos (num_frames > base_num_frames) in windows
  that overlap by `overlap_history` frames, the overlap optionally re-noised
  (`addnoise_condition`). Every iteration of every window is one runner step, so a long
  video is one request the queue checkpoints between any two steps, windows included.

Module-level imports stay light (no torch, no diffusers): the planner reads this family
through the registry without importing torch.

Legend: B batch, L local video tokens, F latent frames, H heads, D head dim, C = H*D.
"""

from __future__ import annotations

import dataclasses

from raydit.models.adapter import ModelAdapter, SplitInput
from raydit.models.families.wan.family import VIDEO, WanAdapter, WanFamily, WanSPAttnProcessor
from raydit.models.family import Prepared
from raydit.models.requests import png_to_image, reference_call
from raydit.models.tiny import DEFAULTS_FILE


# -- adapter -----------------------------------------------------------------------------------
class SkyReelsSPAttnProcessor(WanSPAttnProcessor):
    """Wan's sequence-parallel self-attention, and the block-causal case.

    With a mask (causal_block_size > 1: [1, 1, L_video, L_video], True = attend), each rank
    all-gathers the keys and values of the video and attends with its own queries to all of
    them under its rows of the mask. Exact, and the same on every plan; pad query rows (no
    key allowed by the sharded mask) attend to everything: their outputs are dropped at the
    gather, and a fully masked row would only give NaN.
    """

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
        if attention_mask is None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, None, rotary_emb)
        import torch.nn.functional as F

        from raydit.parallel.mesh import gather_sequence

        if encoder_hidden_states is not None:
            raise ValueError("SkyReelsSPAttnProcessor serves self-attention (attn1) only; cross-attention keeps its own")
        mesh, layout = self.context.mesh, self.context.layout
        assert layout is not None, "split hook did not run before attention"
        L = layout.part_lengths[VIDEO]
        if tuple(attention_mask.shape[-2:]) != (L, L):
            raise ValueError(f"attention mask {tuple(attention_mask.shape)} does not cover the {L} video tokens")
        q, k, v = self.qkv(attn, hidden_states, rotary_emb)  # [B, L_local, H, D]
        k_full = gather_sequence(k, mesh, layout, VIDEO, dim=1)  # [B, L, H, D]
        v_full = gather_sequence(v, mesh, layout, VIDEO, dim=1)
        rows = layout.shard(attention_mask, VIDEO, mesh.sp_index, dim=-2)  # [1, 1, L_local, L]
        rows = rows | ~rows.any(dim=-1, keepdim=True)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k_full.transpose(1, 2), v_full.transpose(1, 2),
                                             attn_mask=rows)
        out_BLC = out.transpose(1, 2).flatten(2, 3).type_as(q)
        return attn.to_out[1](attn.to_out[0](out_BLC))


class SkyReelsAdapter(ModelAdapter):
    name = "skyreels"
    transformer_classes = ("SkyReelsV2Transformer3DModel",)
    # Wan's plan (SkyReelsV2TransformerBlock.forward(hidden_states, encoder_hidden_states, temb,
    # rotary_emb, attention_mask)) but for temb: diffusion forcing's is [B, 6, L, C], a row per
    # token, split on dim 2; [B, 6, C] (one timestep) stays whole.
    plan = dataclasses.replace(WanAdapter.plan, split_inputs=(
        SplitInput("hidden_states", VIDEO), SplitInput("temb", VIDEO, dim=2, ndim=4, every_block=True)))
    processor = SkyReelsSPAttnProcessor


# -- diffusion forcing: the schedule -----------------------------------------------------------
DF_PIPELINE = "SkyReelsV2DiffusionForcingPipeline"
# SkyReelsV2DiffusionForcingPipeline's own knobs (GenerationRequest.guidance_options), with
# the pipeline's defaults; causal_block_size None: the transformer's num_frame_per_block.
DF_OPTIONS = {"ar_step": 0, "causal_block_size": None, "base_num_frames": 97, "overlap_history": None,
              "addnoise_condition": 0, "fps": 24}
FPS_EMBEDDINGS = (16, 24)  # the fps values the transformer's fps embedding tells apart (0 and 1)
_ORIGINAL_BLOCK = "_raydit_num_frame_per_block"  # the checkpoint's num_frame_per_block, kept on the model


def _checkpoint_block(transformer) -> int:
    """The transformer's num_frame_per_block as loaded (diffusers' pipeline rewrites the config
    when a call names causal_block_size; raydit sets it per call and remembers the original)."""
    if not hasattr(transformer, _ORIGINAL_BLOCK):
        setattr(transformer, _ORIGINAL_BLOCK, int(transformer.config.num_frame_per_block))
    return getattr(transformer, _ORIGINAL_BLOCK)


def _int_option(request, name, low):
    value = request.option(name, DF_OPTIONS[name])
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"guidance option {name}={value!r} must be an integer >= {low}")
    return value


def df_settings(pipe, request) -> dict:
    """The diffusion-forcing knobs of `request` with the pipeline's defaults, checked: one
    ValueError line for a value the pipeline would fail on or silently ignore."""
    vt = pipe.vae_scale_factor_temporal
    original = _checkpoint_block(pipe.transformer)  # before any request of this runner sets it
    ar_step = _int_option(request, "ar_step", 0)
    block = _int_option(request, "causal_block_size", 1)
    block = original if block is None else block
    base = _int_option(request, "base_num_frames", 1)
    overlap = _int_option(request, "overlap_history", 1)
    fps = _int_option(request, "fps", 1)
    if fps not in FPS_EMBEDDINGS:
        # The transformer has one fps embedding for 16 and one for 24; the pipeline gives any
        # other value 24's without a word.
        raise ValueError(f"guidance option fps={fps} is not one SkyReels-V2 is conditioned on: its fps embedding "
                         f"knows {' and '.join(map(str, FPS_EMBEDDINGS))} only (the pipeline runs any other value as "
                         "24); give fps=16 or fps=24")
    addnoise = request.option("addnoise_condition", 0)
    if isinstance(addnoise, bool) or not isinstance(addnoise, (int, float)) or addnoise < 0:
        raise ValueError(f"guidance option addnoise_condition={addnoise!r} must be a number >= 0 (20 is the "
                         "pipeline's recommendation)")
    if (base - 1) % vt:
        raise ValueError(f"guidance option base_num_frames={base} must be {vt}k + 1 (97 for 540P, 121 for 720P)")
    long_video = request.num_frames > base
    if long_video and overlap is None:
        raise ValueError(f"num_frames {request.num_frames} exceeds base_num_frames {base}: give overlap_history "
                         "(17 or 37 recommended) to generate it in overlapping windows")
    if not long_video and (overlap is not None or addnoise):
        raise ValueError(f"overlap_history and addnoise_condition apply to long videos only (num_frames "
                         f"{request.num_frames} > base_num_frames {base}); drop them or raise num_frames")
    n_latent = (request.num_frames - 1) // vt + 1
    windows = []
    if long_video:
        base_latent, overlap_latent = (base - 1) // vt + 1, (overlap - 1) // vt + 1
        if overlap_latent >= base_latent:
            raise ValueError(f"overlap_history {overlap} must leave new frames in a window of base_num_frames "
                             f"{base} (overlap in latent frames {overlap_latent} < {base_latent})")
        count = 1 + (n_latent - base_latent - 1) // (base_latent - overlap_latent) + 1
        for w in range(count):
            if w == 0:
                windows.append(dict(start=0, frames=base_latent, prefix=0))
                continue
            finished = w * (base_latent - overlap_latent) + overlap_latent
            frames = min(n_latent - finished + overlap_latent, base_latent)
            windows.append(dict(start=finished - overlap_latent, frames=frames,
                                prefix=overlap_latent - overlap_latent % block))
    else:
        overlap_latent = 0
        windows.append(dict(start=0, frames=n_latent, prefix=0))
    for w in windows:
        if w["frames"] % block:
            raise ValueError(f"causal_block_size {block} must divide the {w['frames']} latent frames of every window; "
                             f"choose a divisor of {w['frames']}")
    return dict(ar_step=ar_step, block=block, long=long_video, overlap=overlap_latent, windows=windows,
                addnoise=addnoise, fps=fps, base=base, overlap_frames=overlap)


def _to_device(value, device, key=None):
    """A frame scheduler's saved state on `device` (UniPC keeps `sigmas` on the CPU)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value if key == "sigmas" else value.to(device)
    if isinstance(value, dict):
        return {k: _to_device(v, device, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_to_device(v, device) for v in value]
    return value


# -- the planner's built-in models and decoder (data the registry hands raydit.planner) ----------
def builtin_models() -> list:
    """The planner's built-in models of this family (raydit.planner.BUILTIN_MODELS)."""
    from raydit.planner.model import CLIP_VIT_H_PARAMS, UMT5_XXL_PARAMS, ModelSpec

    common = dict(family="skyreels", head_dim=128, patch_size=2, patch_size_t=1, text_tokens=512,
                  text_in_sequence=False, positional="rotary", vae_params=0.13e9)
    b14 = dict(heads=40, layers=40, ffn_hidden=13824)
    b1_3 = dict(heads=12, layers=30, ffn_hidden=8960)
    p540 = dict(default_frames=97, default_height=544, default_width=960)
    p720 = dict(default_frames=121, default_height=720, default_width=1280)
    t2v = dict(in_channels=16, text_encoder_params=UMT5_XXL_PARAMS)
    i2v = dict(in_channels=36, text_encoder_params=UMT5_XXL_PARAMS + CLIP_VIT_H_PARAMS)
    return [
        # SkyReels-V2 (Skywork/SkyReels-V2-*-Diffusers): Wan 2.1's transformer layout (1.3B: 12
        # heads x 128, 30 layers; 14B: 40 x 128, 40 layers) as diffusers' conversion script
        # configures it; parameters counted on the meta device (1.3B DF 1.436e9 with its fps
        # embedding, I2V 1.3B 1.564e9, 14B 14.29e9, I2V 14B 16.39e9). Defaults: 540P 97 x 544 x
        # 960 (the pipelines'), 720P 121 x 720 x 1280 (base_num_frames 121 for diffusion forcing).
        # DF: a timestep per latent frame, long videos in windows of base_num_frames.
        ModelSpec(name="skyreels-v2-t2v-14b-540p", params=14.29e9, **b14, **t2v, **p540, **common),
        ModelSpec(name="skyreels-v2-t2v-14b-720p", params=14.29e9, **b14, **t2v, **p720, **common),
        ModelSpec(name="skyreels-v2-i2v-1.3b-540p", params=1.564e9, **b1_3, **i2v, **p540, **common),
        ModelSpec(name="skyreels-v2-i2v-14b-540p", params=16.39e9, **b14, **i2v, **p540, **common),
        ModelSpec(name="skyreels-v2-i2v-14b-720p", params=16.39e9, **b14, **i2v, **p720, **common),
        ModelSpec(name="skyreels-v2-df-1.3b-540p", params=1.436e9, **b1_3, **t2v, **p540, **common),
        ModelSpec(name="skyreels-v2-df-14b-540p", params=14.29e9, **b14, **t2v, **p540, **common),
        ModelSpec(name="skyreels-v2-df-14b-720p", params=14.29e9, **b14, **t2v, **p720, **common),
    ]


PIPELINE_DEFAULTS = {"num_frames": 97, "height": 544, "width": 960}  # the pipelines' (540P)


# -- the family --------------------------------------------------------------------------------
class SkyReelsFamily(WanFamily):
    """SkyReels-V2's steps, as diffusers' SkyReelsV2Pipeline, SkyReelsV2ImageToVideoPipeline
    and SkyReelsV2DiffusionForcingPipeline take them (Wan's steps where they agree: the
    inherited encode and decode).

    T2V and I2V: Wan 2.1's loop (UniPC, two guidance calls; I2V joins a mask and the image's
    latents to the noise in the channels and gives CLIP tokens by cross-attention).

    Diffusion forcing: `state.timesteps` counts the iterations of every window (a step is
    one iteration: the window's row of per-frame timesteps, its frames to update);
    `state.latents` holds the whole video (window after window, the frames not generated yet
    zero), the carry the current window's latents ("window"), each latent frame's UniPC
    state ("frames": the pipeline runs one scheduler per frame) and the generator of the
    re-noised overlap ("addnoise_rng"). diffusers draws that noise from torch's global
    generator of the latents' device: raydit from a generator of that device seeded with the
    request's seed, and the reference seeds the global ones the same (`reference_latents`).
    """

    name = "skyreels"
    pipelines = ("SkyReelsV2Pipeline", "SkyReelsV2ImageToVideoPipeline", DF_PIPELINE)
    image_pipelines = ("SkyReelsV2ImageToVideoPipeline",)
    adapter = SkyReelsAdapter
    batch_branches = False
    option_names = tuple(DF_OPTIONS)

    models = staticmethod(builtin_models)

    def transformers(self, pipe) -> list:
        return [pipe.transformer]

    def active_transformer(self, pipe, state, t):
        return pipe.transformer

    @staticmethod
    def _takes_image(pipe) -> bool:
        return type(pipe).__name__ == "SkyReelsV2ImageToVideoPipeline"

    @staticmethod
    def _forcing(pipe) -> bool:
        return type(pipe).__name__ == DF_PIPELINE

    def has_token_grid(self, pipeline_class: str) -> bool:
        return pipeline_class != DF_PIPELINE

    def token_grid(self, pipe, state):
        # Diffusion forcing calls the transformer on a window of the latents, not the whole:
        # no grid for it yet (its sparse requests are refused in one line).
        return None if self._forcing(pipe) else super().token_grid(pipe, state)

    def check_request(self, pipe, request) -> None:
        from raydit.models.family import Family

        Family.check_request(self, pipe, request)  # image for I2V, none for T2V and DF; one expert
        WanFamily.check_request(self, pipe, request)  # num_frames 4k + 1, height and width
        if self._forcing(pipe):
            df_settings(pipe, request)
        elif request.guidance_options:
            names = ", ".join(name for name, _ in request.guidance_options)
            raise ValueError(f"guidance option(s) {names} are diffusion forcing's; {type(pipe).__name__} takes "
                             "none: drop them or load a SkyReels-V2 DF checkpoint")

    def batch_key(self, pipe, request):
        # Diffusion forcing's calls carry a timestep per frame and a window of their own.
        return None if self._forcing(pipe) else super().batch_key(pipe, request)

    # -- prepare --------------------------------------------------------------------------
    def init(self, pipe, request, generator, device, dtype):
        import torch

        pipe.scheduler.set_timesteps(request.num_inference_steps, device=device)
        if self._forcing(pipe):
            # The state in float32, as the pipeline keeps it; in a float64 run, float64 (UniPC
            # returns each frame in its sample's dtype: a float32 state would round every step).
            # The noise is drawn in float32 either way (the same draws as a float32 run).
            state = torch.float64 if dtype == torch.float64 else torch.float32
            return self._init_forcing(pipe, request, generator, device, state)
        timesteps = pipe.scheduler.timesteps
        if request.image is None:
            latents = pipe.prepare_latents(1, pipe.transformer.config.in_channels, request.height, request.width,
                                           request.num_frames, torch.float32, device, generator)
            return Prepared(latents=latents, timesteps=timesteps)
        image = pipe.video_processor.preprocess(png_to_image(request.image), height=request.height,
                                                width=request.width).to(device, dtype=torch.float32)
        latents, condition = pipe.prepare_latents(image, 1, pipe.vae.config.z_dim, request.height, request.width,
                                                  request.num_frames, torch.float32, device, generator)
        return Prepared(latents=latents, timesteps=timesteps, context=dict(condition=condition))

    def _init_forcing(self, pipe, request, generator, device, state_dtype):
        import torch

        from raydit.models.scheduler_state import live_scheduler_state

        s = df_settings(pipe, request)
        template = pipe.scheduler.timesteps
        fresh = live_scheduler_state(pipe.scheduler)  # a frame's scheduler: the pipeline's, after set_timesteps
        schedule = []  # per window: its timestep matrix, update mask and intervals
        for w, win in enumerate(s["windows"]):
            matrix, _, update, valid = pipe.generate_timestep_matrix(
                win["frames"], template, win["frames"], s["ar_step"], win["prefix"], s["block"])
            schedule.append(dict(matrix=matrix.to(device), update=update.tolist(), valid=list(valid)))
        steps = [(w, i) for w, sched in enumerate(schedule) for i in range(len(sched["matrix"]))]
        first = s["windows"][0]
        window = pipe.prepare_latents(1, pipe.transformer.config.in_channels, request.height, request.width,
                                      request.num_frames, torch.float32, device, generator,
                                      base_latent_num_frames=first["frames"] if s["long"] else None)[0].to(state_dtype)
        total = s["windows"][0]["frames"] + sum(w["frames"] - s["overlap"] for w in s["windows"][1:])
        latents = torch.zeros(window.shape[:2] + (total,) + window.shape[3:], dtype=state_dtype, device=device)
        latents[:, :, :first["frames"]] = window
        carry = dict(window=window, frames=[fresh] * first["frames"])
        if s["addnoise"] > 0:  # on the latents' device, as the pipeline draws it (torch.randn_like)
            carry["addnoise_rng"] = torch.Generator(device).manual_seed(request.seed).get_state()
            carry["addnoise_device"] = torch.device(device).type
        context = dict(forcing=s, schedule=schedule, steps=steps, fresh_scheduler=fresh)
        return Prepared(latents=latents, timesteps=torch.arange(len(steps)), context=context, carry=carry)

    # -- a step ---------------------------------------------------------------------------
    batched_inputs = ("hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image")

    def model_inputs(self, pipe, state, t, branch):
        import torch

        model = pipe.transformer
        b = branch["encoder_hidden_states"].shape[0]
        if self._forcing(pipe):
            return model, self._forcing_inputs(pipe, state, t, branch)
        latents, ctx = state.latents, state.context
        x = torch.cat([latents, ctx["condition"]], dim=1) if "condition" in ctx else latents
        if b > 1:
            x = torch.cat([x] * b)
        return model, dict(hidden_states=x.to(model.dtype), timestep=t.expand(b),
                           encoder_hidden_states=branch["encoder_hidden_states"],
                           encoder_hidden_states_image=branch.get("encoder_hidden_states_image"))

    def _where(self, state, t):
        w, i = state.context["steps"][int(t)]
        return w, i, state.context["schedule"][w], state.context["forcing"]["windows"][w]

    def _addnoise(self, state, t, dtype):
        """(the noise that re-noises the overlap at step t, or None; the generator state after)."""
        import torch

        s = state.context["forcing"]
        w, i, sched, win = self._where(state, t)
        start, _ = sched["valid"][i]
        rng = state.carry.get("addnoise_rng")
        if not s["addnoise"] or start >= win["prefix"]:
            return None, rng
        window = state.carry["window"]
        drawn_on = state.carry.get("addnoise_device", "cpu")
        if drawn_on != window.device.type:
            raise ValueError(f"this long video re-noises its overlap with a {drawn_on} generator (as diffusers draws "
                             f"it on the latents' device); resume its checkpoint on a {drawn_on} device, not "
                             f"{window.device.type}")
        shape = window.shape[:2] + (win["prefix"] - start,) + window.shape[3:]
        generator = torch.Generator(window.device)
        generator.set_state(rng.cpu())
        noise = torch.randn(shape, generator=generator, dtype=dtype, device=window.device)
        return noise, generator.get_state()

    def _forcing_inputs(self, pipe, state, t, branch):
        model = pipe.transformer
        s = state.context["forcing"]
        w, i, sched, win = self._where(state, t)
        start, end = sched["valid"][i]
        x = state.carry["window"][:, :, start:end].to(model.dtype).clone()
        timestep = sched["matrix"][i].expand(1, -1)[:, start:end].clone()
        noise, _ = self._addnoise(state, t, model.dtype)
        if noise is not None:
            factor = 0.001 * s["addnoise"]
            x[:, :, start:win["prefix"]] = x[:, :, start:win["prefix"]] * (1.0 - factor) + noise * factor
            timestep[:, start:win["prefix"]] = s["addnoise"]
        if model.config.num_frame_per_block != s["block"]:
            model.register_to_config(num_frame_per_block=s["block"])
        b = branch["encoder_hidden_states"].shape[0]
        return dict(hidden_states=x, timestep=timestep.expand(b, -1),
                    encoder_hidden_states=branch["encoder_hidden_states"], enable_diffusion_forcing=True,
                    fps=[0 if s["fps"] == 16 else 1] * b)

    def scheduler_step(self, pipe, state, noise, t, generator):
        if not self._forcing(pipe):
            from raydit.models.schedules import step

            return step(pipe.scheduler, noise, t, state.latents, generator), dict(state.carry)
        import copy

        import torch

        from raydit.models.scheduler_state import live_scheduler_state, load_scheduler_state

        s, ctx = state.context["forcing"], state.context
        w, i, sched, win = self._where(state, t)
        start, end = sched["valid"][i]
        window = state.carry["window"].clone()
        frames = list(state.carry["frames"])
        scheduler = copy.copy(pipe.scheduler)  # a frame's scheduler: the pipeline's config, each frame's state
        row, update = sched["matrix"][i], sched["update"][i]
        for idx in range(start, end):
            if update[idx]:
                load_scheduler_state(scheduler, _to_device(frames[idx], window.device))
                # In place, as the pipeline does: UniPC keeps the sample it was given (a view of
                # this frame) as its last_sample, so the second step's corrector reads the frame
                # the first step wrote. Passing a copy gives another video (6.5% off diffusers).
                window[:, :, idx] = scheduler.step(noise[:, :, idx - start], row[idx], window[:, :, idx],
                                                   return_dict=False)[0]
                frames[idx] = live_scheduler_state(scheduler)
        carry = dict(state.carry, window=window, frames=frames)
        _, rng = self._addnoise(state, t, pipe.transformer.dtype)
        if rng is not None:
            carry["addnoise_rng"] = rng
        latents = state.latents.clone()
        if w == 0:
            latents[:, :, :win["frames"]] = window
        else:
            keep = win["start"] + s["overlap"]
            latents[:, :, keep:keep + win["frames"] - s["overlap"]] = window[:, :, s["overlap"]:]
        last = i == len(sched["matrix"]) - 1
        if last and w + 1 < len(s["windows"]):  # the next window: its noise, the overlap as its prefix
            nxt = s["windows"][w + 1]
            finished = nxt["start"] + s["overlap"]
            request = state.request
            new, frames_n, prefix, prefix_frames = pipe.prepare_latents(
                1, pipe.transformer.config.in_channels, request.height, request.width, request.num_frames,
                torch.float32, window.device, generator, video_latents=latents[:, :, :finished],
                base_latent_num_frames=s["windows"][0]["frames"], causal_block_size=s["block"],
                overlap_history_latent_frames=s["overlap"], long_video_iter=w + 1)
            assert frames_n == nxt["frames"] and prefix_frames == nxt["prefix"], (frames_n, prefix_frames, nxt)
            new = new.to(window.dtype)  # float64 in a float64 run, as the first window
            if prefix_frames:
                new[:, :, :prefix_frames] = prefix.to(pipe.transformer.dtype)
            carry.update(window=new, frames=[ctx["fresh_scheduler"]] * frames_n)
        return latents, carry

    # -- decode and reference -------------------------------------------------------------
    def reference_latents(self, pipe, request):
        """diffusers' own pipeline, called with its defaults, the request, the seed, and (for
        diffusion forcing) its options; the global generator (the overlap's re-noising) is
        seeded with the request's seed."""
        import torch

        kwargs = {}
        if request.image is not None:
            kwargs["image"] = png_to_image(request.image)
        if self._forcing(pipe):
            kwargs.update(dict(request.guidance_options))
            if kwargs.get("causal_block_size") is None:  # the checkpoint's, whatever an earlier call set
                kwargs["causal_block_size"] = _checkpoint_block(pipe.transformer)
            torch.manual_seed(request.seed)
        pipe.set_progress_bar_config(disable=True)
        block = pipe.transformer.config.get("num_frame_per_block", 1)
        try:
            return pipe(**reference_call(request, **kwargs)).frames
        finally:
            pipe.transformer.register_to_config(num_frame_per_block=block)  # the pipeline rewrites it

    def spec_from_dir(self, path, configs):
        """Wan's geometry (the same transformer layout) read from the SkyReels-V2 configs; the
        request defaults are the pipelines' (97 frames, 544 x 960) unless the directory says
        otherwise (DEFAULTS_FILE)."""
        from raydit.planner.pipeline_dir import transformer_config

        cfg, _ = transformer_config(path, configs, "SkyReelsV2Transformer3DModel", "a SkyReels-V2 pipeline")
        as_wan = dict(configs, transformer=dict(cfg, _class_name="WanTransformer3DModel"))
        spec = WanFamily.spec_from_dir(self, path, as_wan)
        if not (path / DEFAULTS_FILE).is_file():
            spec = dataclasses.replace(spec, default_frames=PIPELINE_DEFAULTS["num_frames"],
                                       default_height=PIPELINE_DEFAULTS["height"],
                                       default_width=PIPELINE_DEFAULTS["width"])
        return dataclasses.replace(spec, family=self.name)


FAMILY = SkyReelsFamily()
