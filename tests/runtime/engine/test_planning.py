"""The Engine's planning part (raydit.runtime.engine.planning.Planning) without Ray: planned
on a fixed cluster spec (a stand-in for the live cluster's `plan`, the planner itself), an
Engine made for requests without guidance plans no cfg degree."""

from __future__ import annotations

import pytest

from raydit.planner import ClusterSpec, model_spec
from raydit.planner import plan as make_plan


class FixedCluster:
    """The live cluster's planning on a fixed spec of `n` H100s (RayCluster.plan's keywords)."""

    def __init__(self, n: int):
        self.spec = ClusterSpec.uniform(n, "H100")

    def plan(self, spec, *, device, counts=None, workers=None, **kwargs):
        return make_plan(spec, cluster=self.spec, replicas=1, **kwargs)


@pytest.mark.parametrize("guidance, cfg", [(True, 2), (False, 1)])
def test_an_engine_without_guidance_plans_no_cfg_degree(guidance, cfg):
    """Wan 1.3B on 8 devices: with guidance the best plan splits the two branches (cfg 2);
    made for one branch (Engine(guidance=False), --no-cfg) it gives those devices to Ulysses
    and ring."""
    from raydit.runtime.engine.planning import Planning

    planning = Planning(FixedCluster(8), model_spec("wan2.1-t2v-1.3b"), "cuda", (None, None, None), None,
                        {"ulysses": None, "ring": None, "cfg": None}, None, "auto", lambda *a, **k: None,
                        guidance=guidance)
    best = planning.plan_start().best
    assert best.cfg == cfg and best.world_size == 8
    assert planning.plan_result.branches == (2 if guidance else 1)
    if not guidance:
        assert best.ulysses * best.ring == 8 // best.replicas


def test_engine_config_refuses_a_cfg_degree_without_guidance():
    from raydit.runtime.engine import EngineConfig
    from raydit.runtime.options import engine_kwargs

    with pytest.raises(ValueError, match="cfg 2 runs guidance branches on separate groups, but guidance is False"):
        EngineConfig(cfg=2, guidance=False)
    assert engine_kwargs({"no_cfg": True}, "serve")["guidance"] is False
    assert engine_kwargs({}, "generate")["guidance"] is True


@pytest.mark.parametrize("guidance_scale, cfg, said", [(1.0, 2, True), (5.0, 2, False), (1.0, 1, False)])
def test_a_guidance_1_request_on_a_cfg_plan_is_said_in_one_line(caplog, guidance_scale, cfg, said):
    """Issue 54 item 6: such a request runs its one branch on every cfg group; one logged line
    says so and names the fix. The replicas are a stand-in (their plans only), no Ray."""
    import logging
    from types import SimpleNamespace

    from raydit.models.requests import GenerationRequest
    from raydit.runtime.engine.api import Requests

    replicas = SimpleNamespace(items=[SimpleNamespace(plan=SimpleNamespace(cfg=cfg)), SimpleNamespace(plan=None)])
    requests = Requests(model="m", model_dir="d", takes_image=False, call_defaults={}, cache=None, cache_threshold=None,
                        checkpoint_dir=None, num_train_timesteps=1000, model_identity={}, planning=None, loras=None,
                        replicas=replicas, queue=None, events=None)
    request = GenerationRequest(prompt="a fox", num_frames=5, height=48, width=80, guidance_scale=guidance_scale)
    with caplog.at_level(logging.WARNING, logger="raydit"):
        requests.say_one_branch_on_cfg(request)
    lines = [r.getMessage() for r in caplog.records if r.name == "raydit"]
    if said:
        assert len(lines) == 1 and "\n" not in lines[0]
        assert f"guidance_scale 1 runs one guidance branch, but the plan has cfg {cfg}" in lines[0]
        assert "guidance=False (--no-cfg)" in lines[0]
    else:
        assert lines == []
