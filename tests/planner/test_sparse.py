"""The planner's price of sparse attention (raydit.planner.sparse.attention_work, Mode.attention_work,
the layout judge) and the request setting's parsing. Pure: no torch, no Ray."""

from __future__ import annotations

import dataclasses

import pytest

from raydit.planner import plan
from raydit.planner.devicemodel import Mode
from raydit.planner.sparse import SPARSE_BLOCK_OVERHEAD, SparseConfig, as_sparse_config, attention_work, density
from raydit.planner.sparse import sparse_config

WAN14B_GRID = (18, 48, 80)  # STA's published Wan 2.1 14B grid (69 x 768 x 1280)


@pytest.mark.parametrize("config, steps, layers, expected", [
    # every step dense: dense attention's work
    (SparseConfig("sta", dense_steps=50), 50, 40, 1.0),
    # STA 3x3x3 of 3x6x10 tiles: density 1 x 1/2 x 3/10 = 0.15; 15 of 50 steps dense (0.3)
    (SparseConfig("sta"), 50, 40, 0.3 + 0.7 * (0.15 + SPARSE_BLOCK_OVERHEAD)),
    # no dense step: the sparse step's price itself
    (SparseConfig("sta", dense_steps=0), 50, 40, 0.15 + SPARSE_BLOCK_OVERHEAD),
    # a 4-step request: the fraction scales (0.3 x 4 -> 1 dense step), never a refusal
    (SparseConfig("sta"), 4, 40, 0.25 + 0.75 * (0.15 + SPARSE_BLOCK_OVERHEAD)),
    # dense layers: 1 of 40 blocks dense in every step
    (SparseConfig("sta", dense_steps=0, dense_layers=1), 50, 40, 1 / 40 + 39 / 40 * (0.15 + SPARSE_BLOCK_OVERHEAD)),
])
def test_attention_work_is_the_mean_steps_share_of_dense_work(config, steps, layers, expected):
    assert density(SparseConfig("sta"), WAN14B_GRID) == pytest.approx(0.15)
    assert attention_work(config, WAN14B_GRID, steps, layers) == pytest.approx(expected)


def test_a_sparse_step_never_costs_more_than_dense():
    whole = SparseConfig("sta", window=(99, 99, 99), dense_steps=0)  # every window the whole axis
    assert attention_work(whole, WAN14B_GRID, 50) == 1.0


def test_the_plan_prices_sparse_attention_and_prefers_other_layouts():
    kw = dict(frames=69, height=768, width=1280, gpus=8, gpu_type="h100")
    dense = plan("wan2.1-t2v-14b", **kw)
    work = attention_work(SparseConfig("sta", dense_steps=0), WAN14B_GRID, 50, 40)
    sparse = plan("wan2.1-t2v-14b", **kw, mode=Mode(attention_work=work))
    assert sparse.best.predicted_step_seconds < 0.6 * dense.best.predicted_step_seconds
    assert "sparse attention (0.20 of dense attention's work)" in sparse.mode.label
    by_layout = lambda r: {(p.cfg, p.ulysses, p.ring): p for p in r.candidates}  # noqa: E731
    d, s = by_layout(dense), by_layout(sparse)
    # Every layout's compute is cheaper; its exchanges (Ulysses' all-to-all, the ring's K/V,
    # priced whole) are not, so the layouts' savings differ and the order changes.
    assert all(s[k].cost.compute < d[k].cost.compute for k in d)
    assert all(s[k].cost.all_to_all == d[k].cost.all_to_all for k in d)
    assert list(d) != list(s)


@pytest.mark.parametrize("work", [0.0, 1.5, True, "half"])
def test_mode_refuses_an_attention_work_outside_0_1(work):
    with pytest.raises(ValueError, match="attention_work must be a share in"):
        Mode(attention_work=work)


def test_the_setting_from_its_parts():
    got = sparse_config("sta", ["tile=1,2,5", "window=1,3,3", "dense_fraction=0.5"], dense_steps=2)
    assert got == SparseConfig("sta", tile=(1, 2, 5), window=(1, 3, 3), dense_fraction=0.5, dense_steps=2)
    assert sparse_config(None) is None
    # a checkpoint's JSON form (lists) and a form's mapping give the same setting back
    assert as_sparse_config(dataclasses.asdict(got) | {"tile": [1, 2, 5], "window": [1, 3, 3]}) == got
    assert as_sparse_config("radial") == SparseConfig("radial")
    assert as_sparse_config('{"method": "sta", "window": [1, 3, 3]}') == SparseConfig("sta", window=(1, 3, 3))
    assert as_sparse_config("none") is None and as_sparse_config("off") is None


@pytest.mark.parametrize("args, needle", [
    ((None, ["window=3,3,3"]), "sparse options ['window'] need a method: add --sparse-attention sta or radial"),
    (("sta", ["window"]), "--sparse-option 'window' must be KEY=VALUE"),
    (("sta", ["tile=a,b,c"]), "sparse option tile='a,b,c' must be t,h,w integers"),
    (("sta", ["near=1", "near=2"]), "--sparse-option 'near' is given twice"),
    (("sta", ["dense_steps=1"], 2), "dense steps are given twice"),
    (("sta", ["speed=9"]), "sparse option(s) speed unknown"),
])
def test_bad_parts_are_one_line(args, needle):
    with pytest.raises(ValueError) as err:
        sparse_config(*args)
    assert needle in str(err.value) and "\n" not in str(err.value)
