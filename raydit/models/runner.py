"""Step-wise CogVideoX denoising: prepare -> step ... step -> decode, resumable anywhere.

Built from the pipeline's components (encode_prompt, prepare_latents, the scheduler, the
transformer, decode_latents and the video processor); the loop itself is ours so the Ray
runtime can run one step at a time, checkpoint between steps, and resume on another set of
ranks. Everything between steps is plain tensors: latents, the step index, the DPM
scheduler's previous x0 prediction and the noise generator's state.

With a mesh of cfg = 2, ranks with cfg_rank 0 run the conditional branch and ranks with
cfg_rank 1 the unconditional one; they all-gather noise predictions over the cfg group, so
every rank does the same scheduler step and holds the same latents.

Legend: B batch, F latent frames, C latent channels, H/W latent height/width.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist

COND, UNCOND = 0, 1  # cfg_rank of each guidance branch


@dataclass(frozen=True, kw_only=True)
class GenerationRequest:
    prompt: str
    negative_prompt: str = ""
    num_frames: int
    height: int
    width: int
    num_inference_steps: int = 50
    guidance_scale: float = 6.0
    seed: int = 0

    def __post_init__(self):
        if not isinstance(self.prompt, str):
            raise ValueError(f"prompt {self.prompt!r} must be a string")
        if not isinstance(self.negative_prompt, str):
            raise ValueError(f"negative_prompt {self.negative_prompt!r} must be a string")
        for name in ("num_frames", "height", "width", "num_inference_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} {value!r} must be a positive integer")
        if self.height % 8 or self.width % 8:
            raise ValueError(f"height {self.height} and width {self.width} must be multiples of 8 (the VAE's scale)")
        if not isinstance(self.guidance_scale, (int, float)) or not np.isfinite(self.guidance_scale) or self.guidance_scale < 0:
            raise ValueError(f"guidance_scale {self.guidance_scale!r} must be a finite number >= 0 (1 disables guidance)")
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**63:
            raise ValueError(f"seed {self.seed!r} must be an integer in [0, 2**63)")

    @property
    def do_cfg(self) -> bool:
        return self.guidance_scale > 1.0


@dataclass(frozen=True)
class DenoiseState:
    """Everything one step needs. `step` returns a new state; an old one stays valid."""

    request: GenerationRequest
    latents: torch.Tensor  # [B, F, C, H, W], F padded to patch_size_t (CogVideoX1.5)
    step_index: int
    timesteps: torch.Tensor  # [num_steps]
    prompt_embeds: torch.Tensor  # [b, text, text_dim]: the branch(es) this rank runs
    image_rotary_emb: tuple[torch.Tensor, torch.Tensor] | None
    old_pred_original_sample: torch.Tensor | None  # CogVideoXDPMScheduler's previous x0
    generator_state: torch.Tensor  # torch.Generator state (the DPM scheduler draws noise)
    additional_frames: int  # latent frames prepended for the temporal patch, cut at decode

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    @property
    def done(self) -> bool:
        return self.step_index >= self.num_steps


class CogVideoXRunner:
    def __init__(self, pipe, mesh=None, device="cpu", dtype: torch.dtype = torch.float32):
        from diffusers import CogVideoXPipeline

        if not isinstance(pipe, CogVideoXPipeline):
            raise ValueError(
                f"CogVideoXRunner needs a CogVideoXPipeline, got {type(pipe).__name__}; "
                "load the checkpoint with CogVideoXPipeline.from_pretrained"
            )
        if mesh is not None and mesh.cfg not in (1, 2):
            raise ValueError(f"cfg_degree {mesh.cfg} is not supported; classifier-free guidance has 2 branches, use 1 or 2")
        self.cfg_parallel = mesh is not None and mesh.cfg == 2
        self.pipe = pipe.to(device)
        # Cast only when needed: diffusers warns on any .to(dtype) after loading.
        if pipe.transformer.dtype != dtype:
            self.pipe = pipe.to(dtype=dtype)
        self.device = torch.device(device)
        self.dtype = dtype
        self.mesh = mesh
        self.handle = None
        self._additional_frames = 0  # of the last prepared request (see decode)
        if mesh is not None and mesh.sp > 1:
            from raydit.models.registry import parallelize

            self.handle = parallelize(pipe.transformer, mesh)

    @property
    def transformer(self):
        return self.pipe.transformer

    def close(self) -> None:
        """Restore the unparallelized transformer."""
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    # -- prepare -------------------------------------------------------------------------
    def _dpm(self) -> bool:
        from diffusers import CogVideoXDPMScheduler

        return isinstance(self.pipe.scheduler, CogVideoXDPMScheduler)

    def _set_timesteps(self, num_steps: int) -> torch.Tensor:
        self.pipe.scheduler.set_timesteps(num_steps, device=self.device)
        return self.pipe.scheduler.timesteps

    @torch.no_grad()
    def prepare(self, request: GenerationRequest, checkpoint: dict | None = None) -> DenoiseState:
        pipe, config = self.pipe, self.transformer.config
        if not isinstance(request, GenerationRequest):
            raise ValueError(f"request must be a GenerationRequest, got {type(request).__name__}")
        positive, negative = pipe.encode_prompt(
            request.prompt,
            request.negative_prompt,
            do_classifier_free_guidance=request.do_cfg,
            max_sequence_length=config.max_text_seq_length,
            device=self.device,
            dtype=self.dtype,
        )
        if not request.do_cfg:
            prompt_embeds = positive
        elif self.cfg_parallel:
            prompt_embeds = positive if self.mesh.cfg_rank == COND else negative
        else:
            prompt_embeds = torch.cat([negative, positive], dim=0)  # the pipeline's order

        timesteps = self._set_timesteps(request.num_inference_steps)

        # CogVideoX1.5 patches 2 latent frames at once: prepend latent frames (as the
        # pipeline does, 4 pixel frames each) and cut them at decode.
        num_frames = request.num_frames
        latent_frames = (num_frames - 1) // pipe.vae_scale_factor_temporal + 1
        p_t = config.patch_size_t
        additional = (p_t - latent_frames % p_t) % p_t if p_t else 0
        num_frames += additional * pipe.vae_scale_factor_temporal

        # The generator lives on the CPU so latents and scheduler noise are the same on
        # every device and every world size.
        generator = torch.Generator("cpu").manual_seed(request.seed)
        latents = pipe.prepare_latents(
            1, config.in_channels, num_frames, request.height, request.width, self.dtype, self.device, generator
        )
        patch = pipe.vae_scale_factor_spatial * config.patch_size
        if (request.height // pipe.vae_scale_factor_spatial) % config.patch_size or (
            request.width // pipe.vae_scale_factor_spatial
        ) % config.patch_size:
            raise ValueError(
                f"height {request.height} and width {request.width} must be multiples of {patch} "
                f"(VAE scale {pipe.vae_scale_factor_spatial} x patch {config.patch_size})"
            )
        rotary = None
        if config.use_rotary_positional_embeddings:
            rotary = pipe._prepare_rotary_positional_embeddings(request.height, request.width, latents.size(1), self.device)

        self._additional_frames = additional
        state = DenoiseState(
            request=request,
            latents=latents,
            step_index=0,
            timesteps=timesteps,
            prompt_embeds=prompt_embeds,
            image_rotary_emb=rotary,
            old_pred_original_sample=None,
            generator_state=generator.get_state(),
            additional_frames=additional,
        )
        if checkpoint is not None:
            state = self._resume(state, checkpoint)
        return state

    def _resume(self, state: DenoiseState, checkpoint: dict) -> DenoiseState:
        saved = checkpoint.get("request")
        if saved is not None and GenerationRequest(**saved) != state.request:
            raise ValueError(f"checkpoint belongs to request {saved}, not {dataclasses.asdict(state.request)}")
        latents = checkpoint["latents"]
        if tuple(latents.shape) != tuple(state.latents.shape):
            raise ValueError(f"checkpoint latents {tuple(latents.shape)} do not match the request's {tuple(state.latents.shape)}")
        step_index = int(checkpoint["step_index"])
        if not 0 <= step_index <= state.num_steps:
            raise ValueError(f"checkpoint step_index {step_index} is outside 0..{state.num_steps}")
        old = checkpoint.get("old_pred_original_sample")
        return dataclasses.replace(
            state,
            latents=latents.to(self.device, self.dtype),
            step_index=step_index,
            old_pred_original_sample=None if old is None else old.to(self.device, torch.float32),
            generator_state=checkpoint["generator_state"].clone(),
        )

    # -- step ----------------------------------------------------------------------------
    def _exchange_branches(self, noise_local: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cfg = 2: all-gather the two branches' predictions -> (uncond, cond) on every rank."""
        noise_local = noise_local.contiguous()
        gathered = [torch.empty_like(noise_local) for _ in range(2)]
        # The cfg group's ranks ascend with cfg_rank, so position c holds cfg_rank c's branch.
        dist.all_gather(gathered, noise_local, group=self.mesh.cfg_group)
        return gathered[UNCOND], gathered[COND]

    @torch.no_grad()
    def step(self, state: DenoiseState) -> DenoiseState:
        """One denoising step. Collective: every rank of the mesh calls it with its state."""
        if state.done:
            raise ValueError(f"all {state.num_steps} steps are done; call decode(state.latents)")
        scheduler, request = self.pipe.scheduler, state.request
        if scheduler.num_inference_steps != state.num_steps:
            self._set_timesteps(state.num_steps)  # the scheduler is shared; re-arm it for this request
        t = state.timesteps[state.step_index]

        # [B, F, C, H, W] -> [b, F, C, H, W]: b = 2 when this rank runs both guidance branches
        branches = state.prompt_embeds.shape[0]
        x = torch.cat([state.latents] * branches) if branches > 1 else state.latents
        x = scheduler.scale_model_input(x, t)
        noise = self.transformer(
            hidden_states=x,
            encoder_hidden_states=state.prompt_embeds,
            timestep=t.expand(x.shape[0]),
            image_rotary_emb=state.image_rotary_emb,
            return_dict=False,
        )[0].float()

        if request.do_cfg:
            if self.cfg_parallel:
                uncond, cond = self._exchange_branches(noise)
            else:
                uncond, cond = noise.chunk(2)
            noise = uncond + request.guidance_scale * (cond - uncond)

        generator = torch.Generator("cpu")
        generator.set_state(state.generator_state)
        old = state.old_pred_original_sample
        if self._dpm():
            prev_t = state.timesteps[state.step_index - 1] if state.step_index > 0 else None
            latents, old = scheduler.step(
                noise, old, t, prev_t, state.latents, eta=0.0, generator=generator, return_dict=False
            )
        else:
            latents = scheduler.step(noise, t, state.latents, eta=0.0, generator=generator, return_dict=False)[0]
        return dataclasses.replace(
            state,
            latents=latents.to(state.prompt_embeds.dtype),
            step_index=state.step_index + 1,
            old_pred_original_sample=old,
            generator_state=generator.get_state(),
        )

    # -- checkpoint / decode -------------------------------------------------------------
    def checkpoint(self, state: DenoiseState) -> dict:
        """Plain CPU tensors and Python values; enough to resume on any mesh."""
        old = state.old_pred_original_sample
        return {
            "request": dataclasses.asdict(state.request),
            "latents": state.latents.detach().to("cpu").clone(),
            "step_index": state.step_index,
            "num_steps": state.num_steps,
            "old_pred_original_sample": None if old is None else old.detach().to("cpu").clone(),
            "generator_state": state.generator_state.clone(),
        }

    @torch.no_grad()
    def decode(self, latents: torch.Tensor, additional_frames: int | None = None) -> np.ndarray:
        """Latents [1, F, C, H, W] -> uint8 frames [frames, height, width, 3].

        `additional_frames`: latent frames prepended for CogVideoX1.5's temporal patch, cut
        before decoding; None takes them from the last prepare() of this runner.
        """
        if additional_frames is None:
            additional_frames = self._additional_frames
        latents = latents[:, additional_frames:].to(self.device, self.pipe.vae.dtype)
        video = self.pipe.decode_latents(latents)
        frames = self.pipe.video_processor.postprocess_video(video=video, output_type="np")[0]  # [F, H, W, 3] in [0, 1]
        return (np.clip(frames, 0.0, 1.0) * 255.0).round().astype(np.uint8)

    def decode_state(self, state: DenoiseState) -> np.ndarray:
        """decode(), cutting the frames prepended for CogVideoX1.5's temporal patch."""
        return self.decode(state.latents, state.additional_frames)
