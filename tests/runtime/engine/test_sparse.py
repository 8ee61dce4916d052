"""Sparse attention through the Engine (issue 55 item 1): an Engine made with a default
setting runs it on its plan (ring 2 on 2 workers) and returns one process's Runner latents for
the same request; a request's own setting replaces the default, `"none"` runs dense; a request
the family cannot run sparse is refused on the driver, in one line, before any worker sees it.
Tolerance (float32): rtol 1e-4, atol 1e-4, the runtime tests'."""

from __future__ import annotations

import pytest
import torch

from raydit.models.conformance import run_steps
from raydit.models.loading import load_pipeline
from raydit.models.requests import GenerationRequest
from raydit.models.runner import Runner
from raydit.planner.sparse import SparseConfig

TOL = dict(rtol=1e-4, atol=1e-4)
REQUEST = dict(num_frames=9, height=48, width=80, num_inference_steps=3, guidance_scale=1.0, seed=7)
DEFAULT = SparseConfig("sta", tile=(1, 1, 1), window=(1, 3, 3), dense_steps=1)
OTHER = {"method": "radial", "block": 4, "dense_steps": 0}


def _one_process(sparse) -> torch.Tensor:
    runner = Runner(load_pipeline("tiny-wan"))
    try:
        return run_steps(runner, GenerationRequest(prompt="a paper boat", **REQUEST, sparse_attention=sparse),
                         None).latents
    finally:
        runner.close()


@pytest.mark.slow
@pytest.mark.long  # an Engine on 2 workers: ~1 min on 2 cores
def test_the_engines_default_and_a_requests_own_setting_equal_one_process(ray_local):
    from raydit.runtime.engine import Engine

    with Engine(model="tiny-wan", device="cpu", workers=2, ring=2, grow="never", show_plan=False,
                sparse_attention=DEFAULT) as engine:
        default = engine.generate("a paper boat", progress=False, **REQUEST)
        other = engine.generate("a paper boat", progress=False, sparse_attention=OTHER, **REQUEST)
        dense = engine.generate("a paper boat", progress=False, sparse_attention="none", **REQUEST)
    for got, sparse in ((default, DEFAULT), (other, OTHER), (dense, None)):
        torch.testing.assert_close(torch.from_numpy(got.latents), _one_process(sparse), **TOL)
    assert float((torch.from_numpy(default.latents) - torch.from_numpy(dense.latents)).abs().max()) > 1e-3


def test_a_family_without_a_token_grid_is_refused_on_the_driver():
    """raydit.models.sparse_steps.check_sparse_for_model, which Requests.check and the command
    line call before any worker loads the model."""
    from raydit.models.loading import resolve_model_dir
    from raydit.models.sparse_steps import check_sparse_for_model

    grid = (3, 3, 5)
    check_sparse_for_model(resolve_model_dir("tiny-wan"), DEFAULT, grid)
    check_sparse_for_model(resolve_model_dir("tiny-hunyuan"), DEFAULT, grid)
    for name, pipeline in (("tiny-kandinsky5", "Kandinsky5T2VPipeline"), ("tiny-ltx2", "LTX2Pipeline"),
                           ("tiny-skyreels-df", "SkyReelsV2DiffusionForcingPipeline")):
        with pytest.raises(ValueError, match=f"sparse attention is not available for {pipeline}") as err:
            check_sparse_for_model(resolve_model_dir(name), DEFAULT, grid)
        assert "\n" not in str(err.value)
