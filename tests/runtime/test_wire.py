"""A step's checkpoint as it travels between Ray processes (raydit.runtime.wire), and the
scheduler state the runner keeps on the device between steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from raydit.models import GenerationRequest, Runner
from raydit.models.conformance import run_steps
from raydit.runtime.wire import WireTensor, from_wire, to_wire


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.bool])
def test_every_dtype_travels_as_numpy_and_comes_back_bit_for_bit(dtype):
    x = (torch.randn(3, 4, 5) * 100).to(dtype)
    wire = to_wire({"a": [x, (x[:, 1], 7)], "b": "text", "c": None, "d": x[0, 0, 0]})
    assert isinstance(wire["a"][0], WireTensor) and isinstance(wire["a"][0].array, np.ndarray)
    assert wire["a"][0].shape == (3, 4, 5) and wire["b"] == "text" and wire["c"] is None
    back = from_wire(wire)
    for got, want in ((back["a"][0], x), (back["a"][1][0], x[:, 1]), (back["d"], x[0, 0, 0])):
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.equal(got, want)  # no NaN drawn: equal values are equal bits
    assert back["a"][1][1] == 7


def test_a_received_tensor_is_writable_and_its_own():
    x = torch.arange(6.0)
    wire = to_wire(x)
    wire.array.setflags(write=False)  # what Ray hands a receiver: a read-only view of its store
    y = from_wire(wire)
    y += 1  # writable, no warning about a read-only buffer
    assert torch.equal(x, torch.arange(6.0))


def _wan_runner():
    from raydit.models.families.wan.tiny import TINY_DEFAULTS, tiny_pipeline_dir
    from raydit.models.loading import load_pipeline

    runner = Runner(load_pipeline(tiny_pipeline_dir("tiny-wan")))
    request = GenerationRequest(prompt="a cat", num_inference_steps=5, seed=3, guidance_scale=4.0, **TINY_DEFAULTS)
    return runner, request


def test_a_multistep_history_kept_on_the_device_leaves_every_state_valid():
    """UniPC edits its history list (model_outputs) in place at every step. The runner keeps
    the scheduler's state between steps by reference, without copying it to the host, so a
    state must not share a list the next step edits: stepping twice from the same state
    (its history already filled) gives the same latents, and the step hands over the very
    tensors the scheduler holds (no copies)."""
    runner, request = _wan_runner()
    s2 = run_steps(runner, request, 2)
    s3 = runner.step(s2)
    s3_again = runner.step(s2)
    torch.testing.assert_close(s3_again.latents, s3.latents, rtol=0, atol=0)
    outputs = s3_again.scheduler_state["model_outputs"]
    assert all(t is not None for t in outputs)
    held = s3_again.scheduler  # the request's own scheduler object (the pipeline's is untouched)
    assert held is not None and held is not runner.pipe.scheduler
    assert all(a is b for a, b in zip(outputs, held.model_outputs))  # references, not copies
    assert outputs is not held.model_outputs  # ... in a list of its own


def test_a_checkpoint_that_travelled_resumes_exactly():
    """The driver holds rank 0's checkpoint in its wire form and sends it back on a regroup:
    resuming from it mid-history equals the uninterrupted run bit for bit."""
    runner, request = _wan_runner()
    full = run_steps(runner, request, 5)
    checkpoint = runner.checkpoint(run_steps(runner, request, 3))
    for t in checkpoint["scheduler_state"]["model_outputs"]:
        assert t[1].device.type == "cpu"  # packed for the host: (marker, tensor, device)
    resumed = run_steps(runner, request, 5, checkpoint=from_wire(to_wire(checkpoint)))
    torch.testing.assert_close(resumed.latents, full.latents, rtol=0, atol=0)


def test_a_namedtuple_in_a_checkpoint_travels_and_keeps_its_type():
    """A namedtuple is a tuple: its fields are mapped like a tuple's items, and it comes back
    as the same namedtuple (its constructor takes the fields by position, not one iterable)."""
    import collections

    Pair = collections.namedtuple("Pair", "tensor count")
    x = torch.arange(4.0)
    wire = to_wire({"carry": [Pair(x, 3)]})
    assert isinstance(wire["carry"][0], Pair) and isinstance(wire["carry"][0].tensor, WireTensor)
    back = from_wire(wire)["carry"][0]
    assert isinstance(back, Pair) and back.count == 3 and torch.equal(back.tensor, x)
