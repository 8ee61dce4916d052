"""The elastic runtime with the other families (issue 18): a rank killed mid-generation on
tiny-hunyuan (HunyuanVideo, true CFG on cfg 2), tiny-ltx (LTX-Video, ring 2), tiny-ltx2 (LTX-2
with its audio, cfg 2), tiny-kandinsky5 (Kandinsky 5, cfg 2), tiny-mochi (Mochi 1, Ulysses 2) and
tiny-skyreels-df (SkyReels-V2 diffusion forcing in windows, Ulysses 2) and tiny-wan with a
scheduler that draws fresh noise every step (FlowMatchLCM, ring 2), and the run
resumes from the last step's checkpoint and returns the fault-free latents (rtol 1e-4,
atol 1e-4, the runtime tests' tolerance). The runtime has no family-specific code: the same
Engine, pool and checkpoints as CogVideoX's (tests/runtime/test_elastic.py, test_faults.py).
"""

from __future__ import annotations

import pytest
import torch

from support.actors import kill_and_wait

STEPS = 3
TOL = dict(rtol=1e-4, atol=1e-4)
CASES = {
    # model: (Engine options, generate options)
    "tiny-hunyuan": (dict(workers=2, cfg=2), dict(negative_prompt="blur", true_cfg_scale=4.0)),
    "tiny-ltx": (dict(workers=2, ring=2), dict()),
    # LTX-2: its guidance branches on two groups; its video and its audio latents.
    "tiny-ltx2": (dict(workers=2, cfg=2), dict()),
    # Kandinsky 5: cond and uncond on two groups, the visual-conditioning channels in the context.
    "tiny-kandinsky5": (dict(workers=2, cfg=2), dict(negative_prompt="blur")),
    # Mochi: sequence parallel on 2 ranks (the valid text laid out across them in every block).
    "tiny-mochi": (dict(workers=2, ulysses=2), dict()),
    # SkyReels-V2 diffusion forcing, Ulysses 2: a 17-frame video in three windows (9 steps), the
    # kill in the first window, the rest (both window changes) run on the regrouped rank.
    "tiny-skyreels-df": (dict(workers=2, ulysses=2), dict(num_frames=17, guidance_options=dict(
        base_num_frames=9, overlap_history=5, addnoise_condition=20))),
    # Wan with FastWan's re-noising schedule (issue 54): every step draws fresh noise from the
    # request's generator, which the checkpoint restores, so the regrouped ring draws the same.
    "tiny-wan-lcm": (dict(workers=2, ring=2), dict(guidance_scale=1.0, scheduler="FlowMatchLCMScheduler",
                                                   scheduler_options={"shift": 8.0}, sigmas=(1.0, 0.757, 0.522))),
}
MODELS = {"tiny-wan-lcm": "tiny-wan"}  # a case's model where its name is not one


# Stage one kills a rank of a ring plan (LTX-Video) and of a cfg plan (Kandinsky 5); the other
# families run in stage two (`long`: ~40-80 s each on 2 cores).
STAGE_ONE = ("tiny-ltx", "tiny-kandinsky5")


@pytest.mark.slow
@pytest.mark.parametrize("model", [m if m in STAGE_ONE else pytest.param(m, marks=pytest.mark.long) for m in sorted(CASES)])
def test_rank_killed_mid_generation_resumes_with_the_same_latents(ray_local, model):
    from raydit.runtime.engine import Engine

    options, extra = CASES[model]
    with Engine(model=MODELS.get(model, model), device="cpu", grow="never", show_plan=False, **options) as engine:
        request = dict(num_inference_steps=STEPS, seed=7, progress=False, **extra)
        reference = engine.generate("a paper boat", **request)
        victim = engine.group.active[0].actor  # rank 0: the holder of the text encoders

        def kill_rank_0(eng, step, timestep, kwargs):
            if step == 2:
                kill_and_wait(victim)
            return kwargs

        result = engine.generate("a paper boat", callback_on_step_end=kill_rank_0, **request)
        assert victim not in [m.actor for m in engine.group.members]
    kinds = [e["event"] for e in result.events]
    assert "regrouped" in kinds, result.events
    torch.testing.assert_close(torch.from_numpy(result.latents), torch.from_numpy(reference.latents), **TOL)
    assert (result.audio_latents is None) == (reference.audio_latents is None) == (model != "tiny-ltx2")
    if reference.audio_latents is not None:
        torch.testing.assert_close(torch.from_numpy(result.audio_latents), torch.from_numpy(reference.audio_latents),
                                   **TOL)
    assert result.frames.shape == reference.frames.shape
    if reference.audio is not None:  # the sound decoded from the recovered latents too
        assert result.audio is not None and result.audio.sample_rate == reference.audio.sample_rate
        torch.testing.assert_close(torch.as_tensor(result.audio.waveform), torch.as_tensor(reference.audio.waveform),
                                   **TOL)
