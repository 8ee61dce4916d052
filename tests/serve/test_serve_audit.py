"""Bad inputs found by an audit of raydit serve, each answered with a 4xx in OpenAI's error
shape naming the value and the fix: a body giving `seconds` and `num_frames` that disagree
(num_frames silently won)."""

from __future__ import annotations

import pytest

from raydit.planner import model_spec
from raydit.serve.schema import Limits, RequestError, parse_body, resolve

TINY = model_spec("tiny")  # frames = 1 + 4k
LIMITS = Limits(model="tiny", max_frames=33, max_height=64, max_width=64, max_steps=50, default_steps=2, fps=8,
                vae_temporal=4)


def test_seconds_and_num_frames_that_disagree_are_refused_naming_both():
    with pytest.raises(RequestError) as err:
        resolve(parse_body({"prompt": "x", "seconds": 4, "num_frames": 9}), LIMITS, TINY)
    assert err.value.param == "seconds" and err.value.status == 400
    assert "seconds 4 and num_frames 9 disagree" in err.value.message and "33 frames" in err.value.message
    # Both naming one length, or either alone, are taken as before.
    assert resolve(parse_body({"prompt": "x", "seconds": 2, "num_frames": 17}), LIMITS, TINY)["num_frames"] == 17
    assert resolve(parse_body({"prompt": "x", "seconds": "2"}), LIMITS, TINY)["num_frames"] == 17
    assert resolve(parse_body({"prompt": "x", "num_frames": 9}), LIMITS, TINY)["num_frames"] == 9
