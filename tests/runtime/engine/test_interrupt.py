"""Ctrl-C in a `with Engine(...)` block: the running request stops at its next step instead of
running to its end before the Engine shuts down (`raydit generate` waited for every remaining
step, then threw the finished work away). Its last finished step is in its checkpoint
directory, so `resume` finishes it."""

from __future__ import annotations

import threading

import pytest

pytestmark = pytest.mark.long  # an Engine of its own (the second stage)

STEPS = 200  # far more than run before the interrupt is seen (tiny steps take tens of ms)


def test_ctrl_c_stops_the_running_request_at_its_next_step(ray_local, tmp_path):
    from raydit.runtime.engine import Engine
    from raydit.runtime.errors import Interrupted
    from raydit.runtime.queue import load_progress

    stepped, steps = threading.Event(), []

    def callback(engine, step, timestep, kwargs):
        steps.append(step)
        stepped.set()
        return {}

    checkpoint_dir = str(tmp_path / "fox")
    with pytest.raises(KeyboardInterrupt):
        with Engine(model="tiny", workers=1, device="cpu", grow="never", show_plan=False) as engine:
            future = engine.submit("a red fox", num_frames=5, height=32, width=32, num_inference_steps=STEPS,
                                   seed=1, callback_on_step_end=callback, checkpoint_dir=checkpoint_dir)
            assert stepped.wait(300), "no step finished"
            raise KeyboardInterrupt
    with pytest.raises(Interrupted, match=f"interrupted after step {len(steps)} of {STEPS}; finish it with resume"):
        future.result(timeout=0)
    assert 1 <= len(steps) < STEPS
    _, checkpoint = load_progress(checkpoint_dir)
    assert int(checkpoint["step_index"]) == len(steps)  # every finished step is kept for --resume
