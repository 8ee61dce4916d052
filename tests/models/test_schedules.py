"""A request's own scheduler, options and step list (raydit.models.schedules) on one worker.

The reference is diffusers' own WanPipeline given the same scheduler, built with
`own_scheduler` (whose `set_timesteps` uses the list, diffusers' semantics). WanPipeline passes
no generator to `scheduler.step`: for a scheduler that draws fresh noise at every step the
reference wraps `step` to pass the pipeline's generator (the one its latents came from), which
is what the runner does with the request's generator.
HunyuanVideo and LTX-2 with a sigma list: the reference is their own pipeline given the list
through its documented `sigmas` argument (LTX-2 shifts it by its `mu`; dropping the `mu` fails it).
Tolerance (float32): rtol 1e-4, atol 1e-4, as the conformance suite's latents.
Every plan against one worker: tests/models/test_schedules_parallel.py.
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from raydit.models import conformance as harness
from raydit.models.requests import GenerationRequest
from raydit.models.loading import load_pipeline
from raydit.models.requests import reference_call
from raydit.models.runner import Runner
from raydit.models.schedules import build_scheduler, fitting_schedulers, own_scheduler

TOL = dict(rtol=1e-4, atol=1e-4)
LIGHTX2V = dict(scheduler="FlowMatchEulerDiscreteScheduler", scheduler_options={"shift": 5.0},
                sigmas=(1.0, 0.75, 0.5, 0.25), num_inference_steps=4)
FASTWAN = dict(scheduler="FlowMatchLCMScheduler", scheduler_options={"shift": 8.0},
               sigmas=(1.0, 0.757, 0.522), num_inference_steps=3)


def _request(**kw):
    base = dict(prompt="a red fox", num_frames=5, height=48, width=80, num_inference_steps=3, guidance_scale=1.0,
                seed=3)
    base.update(kw)
    return GenerationRequest(**base)


@pytest.fixture(scope="module")
def wan():
    return load_pipeline("tiny-wan")


@pytest.fixture(scope="module")
def a14b():
    return load_pipeline("tiny-wan-a14b")


def _with_generator(scheduler, generator):
    """WanPipeline calls scheduler.step without a generator: pass the pipeline's."""
    step = scheduler.step

    def stepping(*args, **kwargs):
        kwargs.setdefault("generator", generator)
        return step(*args, **kwargs)

    scheduler.step = stepping
    return scheduler


def _diffusers(pipe, request, renoise=False):
    """WanPipeline's latents with the request's scheduler and list, the pipeline's own call."""
    from diffusers import WanPipeline

    scheduler = own_scheduler(pipe.scheduler, request)
    call = reference_call(request)
    if renoise:
        _with_generator(scheduler, call["generator"])
    components = dict(pipe.components, scheduler=scheduler)
    reference = WanPipeline(**components, boundary_ratio=pipe.config.get("boundary_ratio"))
    reference.set_progress_bar_config(disable=True)
    if request.guidance_scale_2 is not None:
        call["guidance_scale_2"] = request.guidance_scale_2
    return reference(**call).frames


def _run(runner, request, steps=None, checkpoint=None):
    return harness.run_steps(runner, request, steps, checkpoint)


# -- the schedule semantics --------------------------------------------------------------------
def test_lightx2v_list_is_shifted_as_diffusers_shifts_it(wan):
    """shift 5 on 1, 0.75, 0.5, 0.25 gives the sigmas LightX2V publishes: 1, 0.9375, 0.8333, 0.625."""
    state = Runner(wan).prepare(_request(**LIGHTX2V))
    torch.testing.assert_close(state.timesteps.double(), torch.tensor([1000.0, 937.5, 833.333, 625.0]).double(),
                               rtol=0, atol=1e-2)
    assert type(state.scheduler).__name__ == "FlowMatchEulerDiscreteScheduler"
    assert type(wan.scheduler).__name__ == "UniPCMultistepScheduler"  # the pipeline's own stays


def test_flow_shift_is_carried_over_with_one_line(wan, caplog):
    assert wan.scheduler.config.flow_shift == 3.0
    with caplog.at_level(logging.INFO, logger="raydit.models.schedules"):
        carried = build_scheduler(wan.scheduler, "FlowMatchEulerDiscreteScheduler")
    assert carried.config.shift == 3.0
    lines = [r.getMessage() for r in caplog.records if r.name == "raydit.models.schedules"]
    assert len(lines) == 1 and "flow_shift=3 as shift" in lines[0]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="raydit.models.schedules"):
        chosen = build_scheduler(wan.scheduler, "FlowMatchEulerDiscreteScheduler", {"shift": 5.0})
    assert chosen.config.shift == 5.0 and not caplog.records


def test_every_request_has_its_own_scheduler(wan):
    runner = Runner(wan)
    a, b = runner.prepare(_request()), runner.prepare(_request())
    assert a.scheduler is not b.scheduler and a.scheduler is not wan.scheduler


# -- one worker equals diffusers ---------------------------------------------------------------
@pytest.mark.parametrize("recipe", ["lightx2v", "fastwan", "timesteps"])
def test_one_worker_equals_wan_pipeline(wan, recipe):
    request = _request(**{"lightx2v": LIGHTX2V, "fastwan": FASTWAN,
                          "timesteps": dict(scheduler="FlowMatchEulerDiscreteScheduler",
                                            timesteps=(1000.0, 757.0, 522.0), num_inference_steps=3)}[recipe])
    expected = _diffusers(wan, request, renoise=recipe == "fastwan")
    got = _run(Runner(wan), request).latents
    torch.testing.assert_close(got, expected, **TOL)


def test_two_experts_switch_at_the_requests_own_timesteps(a14b):
    """boundary 875: the list's timesteps 1000, 937.5 run `transformer`, 833.3, 625 `transformer_2`."""
    request = _request(**LIGHTX2V, guidance_scale=1.0)
    runner = Runner(a14b)
    state = runner.prepare(request)
    experts = [runner.family.active_transformer(a14b, state, t) for t in state.timesteps]
    assert experts == [a14b.transformer, a14b.transformer, a14b.transformer_2, a14b.transformer_2]
    torch.testing.assert_close(_run(runner, request).latents, _diffusers(a14b, request), **TOL)


def test_renoising_scheduler_follows_the_seed(wan):
    """Fresh noise every step comes from the request's seed: the same seed twice gives the same
    latents, another seed other ones, and the noise matters (the same initial latents with the
    step's noise from another generator give other latents)."""
    runner = Runner(wan)
    first = _run(runner, _request(**FASTWAN)).latents
    assert torch.equal(_run(runner, _request(**FASTWAN)).latents, first)
    assert (_run(runner, _request(**FASTWAN, seed=4)).latents - first).abs().max() > 1e-2
    state = runner.prepare(_request(**FASTWAN))
    other = torch.Generator("cpu").manual_seed(99)
    import dataclasses

    state = dataclasses.replace(state, generator_state=other.get_state())
    while not state.done:
        state = runner.step(state)
    assert (state.latents - first).abs().max() > 1e-2


def test_renoising_resumes_bit_for_bit(wan):
    """A checkpoint after step 1, resumed on a fresh runner, gives the uninterrupted latents
    exactly: the generator's state travels in the checkpoint."""
    request = _request(**FASTWAN)
    whole = _run(Runner(wan), request).latents
    checkpoint = Runner(wan).checkpoint(_run(Runner(wan), request, 1))
    assert torch.equal(_run(Runner(wan), request, checkpoint=checkpoint).latents, whole)


def test_interleaved_and_batched_requests_keep_their_schedulers(wan):
    """Two requests on other schedulers, stepped alternately and as one batch, equal each alone."""
    euler, lcm = _request(**LIGHTX2V, seed=1), _request(**FASTWAN, seed=2, num_frames=5)
    runner = Runner(wan)
    alone = [_run(runner, r).latents for r in (euler, lcm)]
    a, b = runner.prepare(euler), runner.prepare(lcm)
    a, b = runner.step(a), runner.step(b)
    while not (a.done and b.done):
        if not a.done and not b.done and runner.family.batch_key(wan, a.request) == runner.family.batch_key(wan, b.request):
            a, b = runner.step_batch([a, b])
        else:
            a = a if a.done else runner.step(a)
            b = b if b.done else runner.step(b)
    torch.testing.assert_close(a.latents, alone[0], **TOL)
    torch.testing.assert_close(b.latents, alone[1], **TOL)


# -- refusals ----------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, match", [
    (dict(sigmas=(1.0, 0.5), timesteps=(1000.0, 500.0), num_inference_steps=2), "not both"),
    (dict(sigmas=(), num_inference_steps=1), "empty list"),
    (dict(sigmas=(1.0, 0.5, 0.5), num_inference_steps=3), "fall step by step"),
    (dict(sigmas=(1.0, 0.75, 0.9), num_inference_steps=3), "fall step by step"),
    (dict(sigmas=(1.5, 0.5), num_inference_steps=2), "outside \\(0, 1\\]"),
    (dict(sigmas=(1.0, 0.0), num_inference_steps=2), "outside \\(0, 1\\]"),
    (dict(sigmas=(1.0, 0.75, 0.5, 0.25), num_inference_steps=50), "disagrees with the 4 sigmas"),
    (dict(timesteps=(1000.0, -1.0), num_inference_steps=2), "must be > 0"),
    (dict(scheduler_options={"shift": float("nan")}), "finite"),
])
def test_bad_lists_are_refused_in_one_line(fields, match):
    with pytest.raises(ValueError, match=match) as info:
        _request(**fields)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("fields, match", [
    (dict(scheduler="NoSuchScheduler"), "FlowMatchEulerDiscreteScheduler.*FlowMatchLCMScheduler"),
    (dict(scheduler="DDIMScheduler", sigmas=(1.0, 0.5), num_inference_steps=2), "takes no sigmas list"),
    (dict(scheduler="FlowMatchEulerDiscreteScheduler", scheduler_options={"flow_shiftt": 5}), "takes no option flow_shiftt"),
    # diffusers lists it for UniPC but cannot import it without torchsde (KeyError before)
    (dict(scheduler="DPMSolverSDEScheduler"), "not importable.*torchsde.*FlowMatchEulerDiscreteScheduler"),
    # Wan's config lacks its sigma_min (a TypeError inside its __init__ before)
    (dict(scheduler="EDMEulerScheduler"), "EDMEulerScheduler cannot be built from UniPCMultistepScheduler's config"),
    # a list the class takes by name but cannot run with a step count (a ValueError in every worker before)
    (dict(scheduler="EulerDiscreteScheduler", timesteps=(999.0, 500.0), num_inference_steps=2), "cannot run the timesteps"),
])
def test_bad_schedulers_are_refused_in_one_line(wan, fields, match):
    with pytest.raises(ValueError, match=match) as info:
        Runner(wan).prepare(_request(**fields))
    assert "\n" not in str(info.value)


def test_fitting_schedulers_of_a_flow_pipeline(wan):
    fits = fitting_schedulers(wan.scheduler)
    assert {"UniPCMultistepScheduler", "FlowMatchEulerDiscreteScheduler", "FlowMatchLCMScheduler"} <= set(fits)


def test_checkpoint_request_round_trips():
    request = _request(**FASTWAN)
    assert GenerationRequest(**request.to_dict()) == request
    import json

    assert GenerationRequest(**json.loads(json.dumps(request.to_dict()))) == request


# -- other families: diffusers' own `sigmas` argument is the reference --------------------------
class _GivenSigmas:
    """Within the block, `pipe(...)` is diffusers' own pipeline call with `sigmas=` added (its
    documented argument: HunyuanVideoPipeline and LTX2Pipeline take a custom sigma list; LTX-2
    applies its `mu` shift to it), so the family's reference call runs unchanged."""

    def __init__(self, pipe, sigmas):
        self.pipe, self.sigmas, self.cls = pipe, list(sigmas), type(pipe)

    def __enter__(self):
        sigmas = self.sigmas

        class Given(self.cls):
            def __call__(self, *args, **kwargs):
                return super().__call__(*args, sigmas=sigmas, **kwargs)

        self.pipe.__class__ = Given
        return self.pipe

    def __exit__(self, *exc):
        self.pipe.__class__ = self.cls


@pytest.mark.parametrize("name, fields", [
    ("tiny-hunyuan", dict(num_frames=9, guidance_scale=6.0)),
    ("tiny-ltx2", dict(num_frames=9, height=64, width=64, guidance_scale=3.0)),
])
def test_one_worker_with_a_sigma_list_equals_the_pipelines_own_sigmas(name, fields):
    from raydit.models.registry import family_for_pipeline

    pipe = load_pipeline(name)
    sigmas = (1.0, 0.8, 0.45, 0.2)  # not either pipeline's own 4-step spacing (1, 0.75, 0.5, 0.25)
    request = _request(**dict(fields, sigmas=sigmas, num_inference_steps=len(sigmas)))
    runner = Runner(pipe)
    got = runner.family.output_latents(pipe, _run(runner, request))
    family = family_for_pipeline(pipe)
    with _GivenSigmas(pipe, sigmas):
        expected = family.reference_latents(pipe, request)
    for g, e in zip(harness.latent_streams(got), harness.latent_streams(expected)):
        torch.testing.assert_close(g, e, **TOL)
    # The list matters: the pipeline's own spacing at 4 steps gives other latents.
    own = family.reference_latents(pipe, _request(**dict(fields, num_inference_steps=len(sigmas))))
    assert (harness.latent_streams(own)[0] - harness.latent_streams(got)[0]).abs().max() > 1e-3


class _ListedScheduler:
    """Within the block, the pipeline's scheduler is one of a class written here: the pipeline's
    own class whose `set_timesteps` takes the list whatever spacing the pipeline asks for (its
    device and `mu` kept), for pipelines whose call takes no sigma list. The list goes as an
    array, as diffusers' pipelines pass their own (UniPC's flow shift takes no Python list)."""

    def __init__(self, pipe, sigmas):
        self.pipe, self.sigmas, self.base = pipe, list(sigmas), pipe.scheduler

    def __enter__(self):
        listed = self.sigmas

        class Listed(type(self.base)):
            def set_timesteps(self, num_inference_steps=None, device=None, sigmas=None, mu=None, **kwargs):
                if mu is not None:
                    kwargs["mu"] = mu
                return super().set_timesteps(num_inference_steps=len(listed), device=device, sigmas=np.array(listed),
                                             **kwargs)

        # As the runner swaps it: DiffusionPipeline.__setattr__ would rewrite the pipeline's config.
        object.__setattr__(self.pipe, "scheduler", Listed.from_config(self.base.config))
        return self.pipe

    def __exit__(self, *exc):
        object.__setattr__(self.pipe, "scheduler", self.base)


@pytest.mark.parametrize("case_name", ["ltx-t2v", "mochi-t2v", "kandinsky5-t2v", "hunyuanvideo15-t2v",
                                       "skyreels-df-causal"])
def test_one_worker_with_a_sigma_list_equals_the_pipeline_on_that_list(case_name):
    """LTX-Video (its mu shift on the list), Mochi (a list in place of its linear-quadratic
    sigmas), Kandinsky 5, HunyuanVideo 1.5 and SkyReels-V2's diffusion forcing (every frame's
    scheduler a copy of the listed one)."""
    from raydit.models.registry import family_for_pipeline

    (case,) = [c for c in harness.family_cases(build=True)["runner"] if c.name == case_name]
    pipe = case.make()
    sigmas = (1.0, 0.8, 0.45)
    fields = dict(case.request, sigmas=sigmas, num_inference_steps=len(sigmas))
    runner = Runner(pipe)
    got = runner.family.output_latents(pipe, _run(runner, GenerationRequest(**fields)))
    family = family_for_pipeline(pipe)
    with _ListedScheduler(pipe, sigmas):
        expected = family.reference_latents(pipe, GenerationRequest(**dict(case.request, num_inference_steps=3)))
    for g, e in zip(harness.latent_streams(got), harness.latent_streams(expected)):
        torch.testing.assert_close(g, e, **TOL)
    own = family.reference_latents(pipe, GenerationRequest(**dict(case.request, num_inference_steps=3)))
    assert (harness.latent_streams(own)[0] - harness.latent_streams(got)[0]).abs().max() > 1e-3
