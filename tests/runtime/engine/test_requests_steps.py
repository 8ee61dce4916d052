"""Engine.submit's step count with an explicit step list (raydit.runtime.engine.api.Requests):
without ray, on the keywords submit passes on."""

from __future__ import annotations

import pytest


def test_a_step_list_sets_the_steps_the_model_default_never_overrides_it():
    from raydit.models.requests import GenerationRequest
    from raydit.runtime.engine.api import Requests

    given = {"num_inference_steps": None, "sigmas": [1.0, 0.75, 0.5], "timesteps": None}
    assert Requests.steps_of_list(given) == {"num_inference_steps": 3}
    assert Requests.steps_of_list({**given, "sigmas": None, "timesteps": (900, 500)}) == {"num_inference_steps": 2}
    assert Requests.steps_of_list({**given, "sigmas": None}) == {}  # no list: the model's default applies
    # A count given is the request's, held to the list's length there.
    assert Requests.steps_of_list({**given, "num_inference_steps": 4}) == {}
    with pytest.raises(ValueError, match="num_inference_steps 4 disagrees with the 3 sigmas given"):
        GenerationRequest(prompt="x", num_frames=9, height=16, width=16, num_inference_steps=4, sigmas=(1, 0.75, 0.5))
