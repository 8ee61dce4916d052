"""The model-family plug-in: what one family of video pipelines declares to raydit.

A family (CogVideoX, Wan, ...) is ONE module or package in `raydit/models/families/`, found by the
registry without being named anywhere else. It defines `FAMILY`, an instance of a `Family`
subclass, which declares as data and small functions:

- which diffusers pipelines it serves (`pipelines`, the `_class_name` of model_index.json)
  and which of them take an image (`image_pipelines`);
- its sequence-parallel adapter (`adapter`, a `ModelAdapter`: where the sequence is split
  and gathered, which tensors belong to which part, the attention processor);
- how a request is prepared (`encode`: prompt embeddings per guidance branch; `init`:
  initial latents, timesteps and the per-request context such as rotary tables or image
  conditioning), one denoising step (`predict`: which transformer and which inputs;
  `guidance_scale`, or `combine_guidance` for branches that are not a cond/uncond pair;
  `scheduler_step`), the per-step state beyond the scheduler's own (`carry`, e.g. the DPM
  scheduler's previous x0), the decode (`decode_audio` too, for a pipeline that makes sound)
  and, where the pipeline's output_type="latent" layout is not the runner's, `output_latents`;
  guidance knobs beyond the common ones arrive as `GenerationRequest.guidance_options`, the
  names the family lists in `option_names`;
- its tiny built-in pipelines (`tiny`: name -> builder), its planner geometry from the
  pipeline's own config files (`spec_from_dir`) and its conformance cases.

The generic runner (`raydit.models.runner.Runner`) owns the loop, classifier-free guidance
across ranks, checkpoints and resume; the family never sees a process group.

Module-level imports stay light (no torch, no diffusers): the planner reads
`spec_from_dir` through the registry without importing torch.

Legend: B batch (guidance branches), F latent frames, C channels, H/W latent height/width.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from raydit.models.requests import GenerationRequest, to_uint8_frames


# Classifier-free guidance's two branches in the pipeline's order (uncond, cond): their index in
# `Family.guidance_branches`, and the cfg rank that evaluates each on a mesh of cfg 2.
UNCOND, COND = 0, 1


def patched_grid(frames: int, height: int, width: int, patch: tuple[int, int, int]) -> tuple[int, int, int]:
    """The (frames, rows, columns) token grid of latents of that size under a (t, h, w) patch,
    for a transformer that flattens its patches frame-major, then rows, then columns (a Conv3d
    patch's flatten(2), or a per-frame Conv2d's): Family.token_grid's answer."""
    return (frames // patch[0], height // patch[1], width // patch[2])


def cat_branches(branches: list) -> dict:
    """[{k: [1, ...]}, ...] -> {k: [n, ...]}: branches as one batch, in their order (tensors
    concatenated, other values taken from the first)."""
    import torch

    return {k: torch.cat([b[k] for b in branches]) if isinstance(branches[0][k], torch.Tensor) else branches[0][k]
            for k in branches[0]}


@dataclass(frozen=True)
class DenoiseState:
    """Everything one step needs. `Runner.step` returns a new state; an old one stays valid.

    Per request and fixed (rebuilt by prepare, never checkpointed): `timesteps`, `branches`
    (the model inputs of the transformer calls that evaluate this rank's guidance branches),
    `branch_count` (the branches of a step on all groups) and `context` (the family's
    per-request tensors: rotary tables, image conditioning, masks, frames to cut at decode).
    Per step (checkpointed): `latents`, `step_index`, `scheduler_state` (the scheduler's own
    attributes: UniPC's multistep history, step index ...), `carry` (family state passed to
    the scheduler explicitly, e.g. CogVideoX DPM's previous x0) and the generator state.
    """

    request: GenerationRequest
    latents: Any  # torch.Tensor, as the pipeline's loop keeps them (Family.output_latents: as it returns them)
    step_index: int
    timesteps: Any  # torch.Tensor [num_steps]
    branches: tuple  # of dicts of model inputs, one per transformer call this rank makes (group_calls)
    context: Mapping[str, Any]
    scheduler_state: Mapping[str, Any]
    carry: Mapping[str, Any]
    generator_state: Any  # torch.Generator state (CPU)
    branch_count: int = 1  # guidance branches of a step on all groups (Family.guidance_branches)
    # The request's own scheduler object (raydit.models.schedules.own_scheduler), built by
    # prepare, never checkpointed (its state is `scheduler_state`); None: the pipeline's.
    scheduler: Any = None

    @property
    def num_steps(self) -> int:
        return len(self.timesteps)

    @property
    def done(self) -> bool:
        return self.step_index >= self.num_steps


@dataclass(frozen=True)
class Prepared:
    """What `Family.init` returns for a fresh request."""

    latents: Any
    timesteps: Any
    context: dict = field(default_factory=dict)
    carry: dict = field(default_factory=dict)


class Family:
    """Base of every family. Subclasses set the class attributes and override the hooks."""

    name: str = ""
    pipelines: tuple[str, ...] = ()  # model_index.json _class_name values served
    image_pipelines: tuple[str, ...] = ()  # those of `pipelines` that need an image
    adapter: type | None = None  # ModelAdapter subclass for the pipeline's transformers
    # True: the guidance branches a rank evaluates run as one batch (CogVideoX's pipeline runs
    # [uncond, cond] as a batch of 2); False: one forward call each, as Wan's pipeline makes them
    # (the same numbers as diffusers). `group_calls` decides; a family may override it.
    batch_branches: bool = True
    # The most guidance branches one step runs (`guidance_branches`): 2 for classifier-free
    # guidance; LTX-2 declares 4 (its cfg pair, STG and modality passes). A mesh's cfg degree,
    # the branch degree, must divide it: each of its groups evaluates an equal share.
    max_branches: int = 2
    # The latents keep the dtype the scheduler's step returns (HunyuanVideo's pipelines: a
    # flow-matching step returns the model output's dtype, so bf16 latents from step 1 on, and
    # the next timestep is cast to it); False: they are cast back to the dtype init gave them,
    # as the other pipelines' loops leave them. diffusers' own choice is the reference.
    keeps_scheduler_dtype: bool = False
    # True: guidance is embedded in the model and `true_cfg_scale` turns on the cond/uncond pair
    # (HunyuanVideo); other families refuse a true_cfg_scale other than 1.
    true_cfg: bool = False
    # The names of GenerationRequest.guidance_options this family takes; the runner refuses others.
    option_names: tuple[str, ...] = ()
    # quantize (raydit.models.quantize): inside a transformer block, the linear layers under a
    # submodule whose name matches one of these patterns stay in the run's dtype. "norm*":
    # diffusers' adaptive norms (norm1.linear ...), the blocks' modulation in most families; a
    # family whose modulation lives under another name adds it.
    quantize_keep: tuple[str, ...] = ("norm*",)
    # The VAE decoder as the planner prices it (a raydit.planner.model.DecoderShape, counted on
    # diffusers' decoder with its real config); None: not counted, decoded on one rank.
    decoder = None
    # Bytes per token and channel one block's non-GEMM, non-attention ops (norms, modulation,
    # rotary, residuals, activations) move in eager bf16, counted on diffusers' block at real width
    # on the meta device (a TorchDispatchMode summing every op's input and output bytes, views,
    # GEMMs and the attention kernel excluded; bench/bench_opsweep.py --count-blocks); 0: not
    # counted (raydit.planner.devicemodel's default stands in). The planner's ModelSpec.elementwise_bytes.
    elementwise_bytes: float = 0.0
    # Kernels those ops launch per block and transformer call in eager mode, counted with them
    # (ModelSpec.elementwise_launches; 0: raydit.planner.devicemodel's default stands in).
    elementwise_launches: int = 0
    # The FFN's input projection is 2 x ffn_hidden wide, value and gate (SwiGLU; ModelSpec.gated_ffn).
    gated_ffn: bool = False
    # The pipeline passes a boolean text-padding mask to every self-attention call
    # (ModelSpec.masked_attention: priced at the table's masked-attention rate).
    masked_attention: bool = False

    def fp8_weight_params(self, spec) -> float:
        """Weight elements of one of `spec`'s transformers that quantize "fp8" keeps in one byte:
        the blocks' linears raydit.models.quantize selects, from the spec's widths (the planner's
        ModelSpec.fp8_params; tests/models/test_fp8_params.py holds each family's count to the
        selection on diffusers' model). 0.0: not counted, FP8 weights priced at bf16 bytes."""
        return 0.0

    # What raydit asks for when a request leaves these out and the pipeline's call has no
    # numeric default for them.
    FALLBACK_CALL_DEFAULTS = {"num_inference_steps": 50, "guidance_scale": 6.0}

    def call_defaults(self, model_dir) -> dict:
        """{"num_inference_steps": n, "guidance_scale": g}: what the directory's diffusers pipeline
        runs when its caller gives neither, read from the pipeline class's own `__call__` defaults
        (Wan 5.0, LTX 3, Mochi 4.5 and 64 steps, LTX-2 30 steps, ...), so that raydit's default
        request is diffusers' default call; FALLBACK_CALL_DEFAULTS where the call has none."""
        import inspect

        import diffusers

        from raydit.models.loading import pipeline_class

        cls = getattr(diffusers, pipeline_class(Path(model_dir)), None)
        params = inspect.signature(cls.__call__).parameters if cls is not None else {}
        out = {}
        for name, fallback in self.FALLBACK_CALL_DEFAULTS.items():
            default = getattr(params.get(name), "default", None)
            usable = isinstance(default, (int, float)) and not isinstance(default, bool)
            out[name] = type(fallback)(default) if usable else fallback
        return out

    @staticmethod
    def round_frames(num_frames: int, vae_temporal: int) -> int:
        """The frame count the family's diffusers pipeline runs for `num_frames` when (num_frames
        - 1) is not a multiple of the VAE's temporal factor: CogVideoX, HunyuanVideo and LTX take
        (num_frames - 1) // t + 1 latent frames, i.e. the count rounded down to t k + 1."""
        return (num_frames - 1) // vae_temporal * vae_temporal + 1

    # -- what the registry and the planner read -------------------------------------------
    def models(self) -> list:
        """The planner's built-in models of this family: ModelSpecs, as data (the registry
        registers them with raydit.planner, with `decoder_for` each)."""
        return []

    def decoder_for(self, spec):
        """The decoder of one of this family's models (`decoder` unless the family has several)."""
        return self.decoder

    def tiny(self) -> dict[str, Callable[[], Path]]:
        """Built-in tiny pipelines: name -> function building (once) and returning its dir. A
        family package declares them in its tiny.py (TINY_PIPELINES)."""
        part = self._package_part("tiny")
        return dict(getattr(part, "TINY_PIPELINES", {})) if part is not None else {}

    def _package_part(self, name: str):
        """The module `name` (tiny, cases) of the package this family's class lives in, or None
        where the family is one module. Imported by name: the family's own code imports neither,
        they import it (no circle)."""
        import importlib

        module = type(self).__module__
        if not module.endswith(".family"):
            return None
        target = f"{module.rpartition('.')[0]}.{name}"
        try:
            return importlib.import_module(target)
        except ModuleNotFoundError as exc:
            if exc.name != target:
                raise
            return None

    def spec_from_dir(self, path: Path, configs: Mapping[str, dict]):
        """A raydit.planner.ModelSpec from the pipeline's config files. `configs` maps a
        component folder ('transformer', 'vae', 'text_encoder', 'tokenizer', 'scheduler', and
        '' for model_index.json) to its parsed config.json (tokenizer_config.json for
        tokenizers); absent components are missing keys."""
        raise NotImplementedError

    def load_components(self, path: Path) -> dict:
        """Components the pipeline gets in place of the ones it would load from `path` (a saved
        component this machine cannot load as saved, e.g. Kandinsky 5's Qwen2VLProcessor without
        torchvision): name -> object, set on the pipeline after from_pretrained, which skips
        them (raydit.models.loading.load_pipeline); default: none."""
        return {}

    def reference_latents(self, pipe, request: GenerationRequest):
        """What diffusers' own pipeline returns for `request` with its defaults, the same seed
        (a CPU generator) and output_type="latent" (the same structure as output_latents)."""
        raise NotImplementedError

    def output_latents(self, pipe, state: "DenoiseState", latents=None):
        """The runner's latents (default: the state's) as `reference_latents` returns them (output_type="latent"):
        GenerationResult.latents, or (video, audio) where the pipeline makes sound too (LTX-2). Most families
        keep that layout between steps; one whose pipeline unpacks or denormalizes at the end does it here."""
        return state.latents if latents is None else latents

    def conformance_cases(self, base_dirs: Mapping[str, str]) -> dict[str, list]:
        """{'forward': [ForwardCase...], 'runner': [RunnerCase...]}; `base_dirs` maps tiny names
        to their built directories. A family package declares them in its cases.py
        (conformance_cases(base_dirs))."""
        part = self._package_part("cases")
        return part.conformance_cases(base_dirs) if part is not None else {"forward": [], "runner": []}

    # -- the runner's hooks ------------------------------------------------------------------
    def load_lora(self, pipe, state_dict: dict, name: str, components: tuple[str, ...] = ("transformer",)) -> None:
        """Load one LoRA (a diffusers-format state dict, already checked) into `components`
        with diffusers' own loader; "transformer_2" is Wan 2.2's second expert
        (`load_into_transformer_2`). A family whose pipeline loads LoRAs otherwise overrides."""
        for component in components:
            kwargs = {"load_into_transformer_2": True} if component == "transformer_2" else {}
            pipe.load_lora_weights(dict(state_dict), adapter_name=name, **kwargs)

    def transformers(self, pipe) -> list:
        """Every transformer the pipeline holds that a step may call (both experts)."""
        return [pipe.transformer]

    def active_transformer(self, pipe, state: "DenoiseState", t):
        """The transformer step `t` runs (the expert above or below a boundary)."""
        return self.transformers(pipe)[0]

    def encoders(self, pipe) -> list:
        """Modules used only while preparing a request (text and image encoders)."""
        return [m for m in (getattr(pipe, n, None) for n in ("text_encoder", "text_encoder_2", "image_encoder"))
                if m is not None]

    def has_token_grid(self, pipeline_class: str) -> bool:
        """Whether `token_grid` answers for this pipeline class: sparse requests are refused on
        the driver, before any worker loads the model, where it does not."""
        return type(self).token_grid is not Family.token_grid

    def token_grid(self, pipe, state: "DenoiseState") -> tuple[int, int, int] | None:
        """The (frames, rows, columns) grid of `state`'s video tokens after patching, in the
        raster order the transformer flattens them (sparse attention's masks are defined on
        it, raydit.planner.sparse); None: this family has no sparse attention."""
        return None

    def check_request(self, pipe, request: GenerationRequest) -> None:
        """Raise ValueError (one line) for a request this pipeline cannot take."""
        takes_image = type(pipe).__name__ in self.image_pipelines
        if takes_image and request.image is None:
            raise ValueError(f"{type(pipe).__name__} is an image-to-video pipeline; give an image (--image PATH)")
        if not takes_image and request.image is not None:
            raise ValueError(
                f"{type(pipe).__name__} is a text-to-video pipeline and takes no image; "
                "drop --image or load an image-to-video checkpoint"
            )
        if request.guidance_scale_2 is not None and len(self.transformers(pipe)) < 2:
            raise ValueError(f"guidance_scale_2 is for two-expert pipelines (Wan 2.2 A14B); {type(pipe).__name__} "
                             f"has one transformer: drop it (got {request.guidance_scale_2})")

    def encode(self, pipe, request: GenerationRequest, device, dtype) -> tuple[dict, dict | None]:
        """Model inputs of the conditional and (with guidance) the unconditional branch, each
        a dict of tensors with batch 1: e.g. {"encoder_hidden_states": [1, L, D]}.

        Runs on the replica's rank 0 alone, the only rank holding `encoders(pipe)`; the
        runner broadcasts what it returns (raydit.models.text_encoding). Whatever needs an
        encoder belongs here: `init` and `predict` run on every rank, where they are absent."""
        raise NotImplementedError

    def init(self, pipe, request: GenerationRequest, generator, device, dtype) -> Prepared:
        raise NotImplementedError

    def predict(self, pipe, state: DenoiseState, t, branch: dict):
        """One transformer call for `branch` (batched inputs) at timestep t -> noise [b, ...].
        The default calls `model_inputs`' transformer with its arguments."""
        model, kwargs = self.model_inputs(pipe, state, t, branch)
        return self.model_output(model(**kwargs, return_dict=False)[0])

    def model_output(self, out):
        """The transformer's output as the pipeline keeps it (CogVideoX: float32)."""
        return out

    def model_inputs(self, pipe, state: DenoiseState, t, branch: dict) -> tuple[Any, dict]:
        """(transformer, its keyword arguments) of one call, every tensor named in
        `batched_inputs` with the call's rows first: what lets requests share a call
        (`predict_batch`). A family that builds its call otherwise overrides `predict`."""
        raise NotImplementedError

    # Step-level batching (raydit.models.runner.Runner.step_batch): the keyword arguments of
    # `model_inputs` that carry the call's rows first (concatenated across requests); every
    # other argument must be the same for the requests that share a call. Empty: this family's
    # requests never share a call.
    batched_inputs: tuple[str, ...] = ()

    def batch_key(self, pipe, request: GenerationRequest):
        """Requests with equal keys can share the transformer calls of a step (module
        raydit.models.runner: step_batch); None: this request runs alone. The default: the
        geometry, the guidance branches, the LoRA choice and no step caching, where the
        family declares `batched_inputs`."""
        if not self.batched_inputs or request.cache is not None:
            return None
        return (request.num_frames, request.height, request.width, request.image is not None,
                self.do_cfg(pipe, request), request.lora, request.guidance_options, request.sparse_attention)

    def predict_batch(self, pipe, states: list, ts: list, branches: list):
        """One transformer call for several requests (equal `batch_key`, the same transformer
        at their own timesteps `ts`): their `model_inputs` concatenated -> the rows of every
        request in order, as `predict` returns them one at a time."""
        import torch

        calls = [self.model_inputs(pipe, s, t, b) for s, t, b in zip(states, ts, branches)]
        model = calls[0][0]
        if any(m is not model for m, _ in calls):
            raise ValueError("requests sharing a call must run the same transformer at their steps")
        kwargs = dict(calls[0][1])
        for name in self.batched_inputs:
            if kwargs.get(name) is not None:
                kwargs[name] = torch.cat([c[1][name] for c in calls])
        return self.model_output(model(**kwargs, return_dict=False)[0])

    def do_cfg(self, pipe, request: GenerationRequest) -> bool:
        """Whether `request` runs more than one guidance branch each step (the default: the
        cond/uncond pair). A family whose guidance is embedded in the model (HunyuanVideo) runs
        a pair only for true CFG."""
        return request.do_cfg

    def guidance_branches(self, pipe, request: GenerationRequest, positive: dict, negative: dict | None) -> list:
        """The model inputs of every guidance branch of a step, in the order `combine_guidance`
        takes their predictions: [negative, positive] with guidance, [positive] alone without
        (that one branch's prediction is then the model output, not combined). On a mesh of
        cfg C, group g evaluates the g-th of C equal consecutive shares; one branch runs on
        every group. At most `max_branches`."""
        if self.do_cfg(pipe, request) and negative is not None:
            return [negative, positive]
        return [positive]

    def group_calls(self, branches: list) -> list:
        """One rank's share of `guidance_branches` (consecutive) -> the transformer calls that
        evaluate it, in order; `predict` on each returns one row per branch it covers. The
        default batches them into one call where `batch_branches` says the pipeline does."""
        if self.batch_branches and len(branches) > 1:
            return [cat_branches(branches)]
        return list(branches)

    def call_branch_counts(self, calls: list, branches: int) -> list[int]:
        """How many of the `branches` consecutive guidance branches each of `group_calls`'
        `calls` covers, in order (the default's calls: one with all of them, or one each)."""
        if len(calls) == branches:
            return [1] * branches
        if len(calls) == 1:
            return [branches]
        raise NotImplementedError(f"{type(self).__name__} groups {branches} branches into {len(calls)} calls: "
                                  "it must say how many each covers (call_branch_counts)")

    def call_runs_model(self, call: dict) -> bool:
        """Whether `predict` on this call runs the transformer (LTX-2's pass turned off does not)."""
        return True

    def guidance_scale(self, pipe, state: DenoiseState, t) -> float:
        return state.request.guidance_scale

    def combine_guidance(self, pipe, state: DenoiseState, t, *predictions):
        """Every branch's prediction (one row each, in `guidance_branches` order, gathered over
        the cfg group when it is split) -> the model output the scheduler steps with; the
        default is classifier-free guidance uncond + s (cond - uncond). A family whose branches
        are other passes (LTX-2: its cfg pair, STG and modality) combines them its own way."""
        uncond, cond = predictions
        return uncond + self.guidance_scale(pipe, state, t) * (cond - uncond)

    def scheduler_step(self, pipe, state: DenoiseState, noise, t, generator) -> tuple[Any, dict]:
        """-> (new latents, new carry). The scheduler's own attributes are saved and restored
        around this call by the runner; `generator` (the request's, checkpointed) goes to a
        scheduler that draws noise (raydit.models.schedules.step)."""
        from raydit.models.schedules import step

        return step(pipe.scheduler, noise, t, state.latents, generator), dict(state.carry)

    def decode_video(self, pipe, state: DenoiseState, latents):
        """Latents -> what the VAE decodes them to, as the pipeline does before post-processing:
        video [1, 3, frames, height, width] in [-1, 1]. A parallel decode (raydit.models.
        vae_parallel) runs this on every rank; only the rank whose frames are kept post-processes."""
        raise NotImplementedError

    def postprocess(self, pipe, state: DenoiseState, video):
        """The decoded video -> uint8 frames [frames, height, width, 3], with the pipeline's own
        video processor."""
        frames = pipe.video_processor.postprocess_video(video=video, output_type="np")[0]  # [F, H, W, 3] in [0, 1]
        return to_uint8_frames(frames)

    def decode(self, pipe, state: DenoiseState, latents=None):
        """Latents -> uint8 frames [frames, height, width, 3]."""
        return self.postprocess(pipe, state, self.decode_video(pipe, state, latents))

    def decode_audio(self, pipe, state: DenoiseState, latents=None) -> "Audio | None":
        """Latents -> the sound the pipeline generates with the video, or None for a family
        whose pipelines make none (every family but those with an audio stream)."""
        return None


@dataclass(frozen=True)
class Audio:
    """Decoded sound: `waveform` float32 [channels, samples] in [-1, 1], `sample_rate` in Hz,
    `frame_rate`: the video frame rate it was made for (an mp4 played at that rate is in sync)."""

    waveform: Any  # numpy array
    sample_rate: int
    frame_rate: float | None = None

    def __post_init__(self):
        import numpy as np

        wave = np.asarray(self.waveform)
        if wave.ndim != 2 or wave.shape[0] not in (1, 2) or wave.shape[1] == 0:
            raise ValueError(f"audio waveform must be [1 or 2 channels, samples], got shape {wave.shape}")
        if isinstance(self.sample_rate, bool) or not isinstance(self.sample_rate, int) or self.sample_rate <= 0:
            raise ValueError(f"audio sample_rate {self.sample_rate!r} must be a positive integer (Hz)")
        object.__setattr__(self, "waveform", wave.astype(np.float32, copy=False))

    @property
    def seconds(self) -> float:
        return self.waveform.shape[1] / self.sample_rate
