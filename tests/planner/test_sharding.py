"""The planner's memory and time model of sharded transformer weights (issue 42), pure Python."""

from __future__ import annotations

import pytest

from raydit.planner import PlanError, model_spec, plan
from raydit.planner.cost import Link
from raydit.planner.sharding import BLOCK_SHARE, block_gb, gather_cost, sharded_gb

WAN14 = "wan2.1-t2v-14b"


def test_sharded_rank_holds_outside_plus_share_plus_two_blocks():
    spec = model_spec(WAN14)
    blocks = BLOCK_SHARE * spec.params * spec.bytes_per_param / 1e9
    for ranks in (2, 4, 8):
        got = sharded_gb(spec, 50.0, ranks, 1)
        assert got == pytest.approx(50.0 - blocks + blocks / ranks + 2 * blocks / spec.layers)
    assert sharded_gb(spec, 50.0, 4, 1) < sharded_gb(spec, 50.0, 2, 1) < 50.0
    assert block_gb(spec, 2) == pytest.approx(2 * block_gb(spec, 1))


def test_gathers_cost_more_on_pcie_and_hide_behind_compute():
    spec = model_spec(WAN14)
    pcie, nvlink = Link(25, 15.0, "pcie"), Link(450, 8.0, "nvlink")
    slow, fast = gather_cost(spec, 4, pcie, compute_s=0.0), gather_cost(spec, 8, nvlink, compute_s=0.0)
    assert slow.per_block_s > 10 * fast.per_block_s
    assert slow.total_s == pytest.approx(spec.layers * slow.per_block_s)
    assert slow.exposed_s == pytest.approx(slow.total_s)  # nothing to hide behind
    hidden = gather_cost(spec, 4, pcie, compute_s=100.0)
    assert hidden.exposed_s == 0.0 and hidden.total_s == pytest.approx(slow.total_s)
    cpu = gather_cost(spec, 4, Link(10, 1.0, "shm"), compute_s=100.0)
    assert cpu.exposed_s == pytest.approx(cpu.total_s)  # a link that takes the core hides nothing


def test_14b_on_four_l4_fits_only_sharded():
    result = plan(WAN14, gpus=4, gpu_type="L4")
    best = result.best
    assert best.shard_weights and best.gather is not None and best.gather.ranks == best.cfg * best.sp
    assert best.memory_gb_per_gpu <= 24
    assert any("block weights sharded over the replica's 4 ranks" in n for n in best.notes)
    assert best.to_dict()["shard_weights"] is True and best.to_dict()["weight_gather"]["ranks"] == 4
    # the step includes what of the gathers the compute does not hide
    assert best.predicted_step_seconds == pytest.approx(best.cost.total)
    with pytest.raises(PlanError, match=r"needs \d+\.\d GB per device .*\(L4\) has 24 GB"):
        plan(WAN14, gpus=4, gpu_type="L4", shard_weights=False)


def test_fits_unsharded_stays_unsharded():
    best = plan(WAN14, gpus=8, gpu_type="H100").best
    assert not best.shard_weights and best.gather is None


def test_too_big_even_sharded_is_refused_with_numbers():
    with pytest.raises(PlanError, match=r"with the block weights sharded over its 2 ranks it would still need "
                                        r"\d+\.\d GB"):
        plan(WAN14, gpus=2, gpu_type="L4")


@pytest.mark.parametrize("kwargs", [dict(gpus=1), dict(gpus=4, world_size=1), dict(gpus=2, replicas=2)])
def test_sharding_one_rank_is_one_line(kwargs):
    with pytest.raises(PlanError, match="sharded weights need 2 or more ranks per replica") as info:
        plan("cogvideox-2b", gpu_type="H100", shard_weights=True, **kwargs)
    assert "\n" not in str(info.value)


def test_forced_sharding_rejects_one_rank_layouts():
    result = plan("cogvideox-2b", gpus=2, gpu_type="H100", shard_weights=True)
    assert all(p.shard_weights for p in result.candidates)
    assert any(r.kind == "shard" for r in result.rejected)


def test_cli_plan_says_what_fits_and_refuses_one_rank(capsys):
    from raydit.cli import main

    assert main(["plan", "--model", WAN14, "--gpus", "4", "--gpu-type", "L4", "--top", "2"]) == 0
    out = capsys.readouterr().out
    assert "block weights sharded over the replica's 4 ranks" in out and "GB/device" in out
    assert main(["plan", "--model", WAN14, "--gpus", "1", "--gpu-type", "L4", "--shard-weights"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "sharded weights need 2 or more ranks per replica" in err


def test_mixed_cluster_small_devices_join_only_sharded():
    from raydit.planner.cluster import ClusterSpec, NodeSpec

    cluster = ClusterSpec([NodeSpec("h", "H100", 8), NodeSpec("t", "T4", 4)])
    result = plan(WAN14, cluster=cluster)
    combo = next(p for p in result.candidates if p.kind == "per-type")
    by_type = {p.placement[0].gpu_type: p for p in combo.parts}
    assert not by_type["H100"].shard_weights  # fits whole: no gathers to pay
    assert by_type["T4"].shard_weights and by_type["T4"].memory_gb_per_gpu <= 16
    # a uniform layout on the H100s alone leaves the T4s out rather than shard for nothing
    uniform = [p for p in result.candidates if p.kind == "uniform"]
    assert uniform and not any(p.shard_weights for p in uniform if all(r.gpu_type == "H100" for r in p.placement))


def test_fp8_blocks_shard_at_one_byte_per_weight():
    """Under quantize fp8 the blocks hold their FP8 weights at one byte (ModelSpec.fp8_params),
    sharded or whole: block_gb, the per-rank share and the per-block gather all shrink by
    those bytes. Wan 14B on 2 L4 is refused in bf16 even sharded and fits under fp8 only
    sharded; on 4 L4 it fits fp8 unsharded, which is kept (no gathers to pay) unless sharding
    is forced; HunyuanVideo on 2 L4 fits sharded in both, with less memory and half-size
    gathers under fp8."""
    import dataclasses

    from raydit.planner.devicemodel import Mode

    fp8 = Mode(quantize="fp8")
    spec = model_spec(WAN14)
    quantized = dataclasses.replace(spec, fp8_weights=True)
    saved = spec.fp8_params * (spec.bytes_per_param - 1) / 1e9
    assert spec.fp8_params > 0.9 * BLOCK_SHARE * spec.params
    assert block_gb(quantized, 2) == pytest.approx(block_gb(spec, 2) - 2 * saved, rel=1e-12)
    link = Link(25, 15.0, "pcie")
    assert gather_cost(quantized, 4, link, 0.0).block_mb == pytest.approx(
        block_gb(quantized, 1) / spec.layers * 1e3, rel=1e-12)

    with pytest.raises(PlanError, match="with the block weights sharded over its 2 ranks it would still need"):
        plan(WAN14, gpus=2, gpu_type="L4")
    with pytest.raises(PlanError, match=r"needs \d+\.\d GB per device"):
        plan(WAN14, gpus=2, gpu_type="L4", mode=fp8, shard_weights=False)
    best = plan(WAN14, gpus=2, gpu_type="L4", mode=fp8).best
    assert best.shard_weights and best.memory_gb_per_gpu <= 24 and best.gather.ranks == 2
    assert best.gather.block_mb == pytest.approx(block_gb(quantized, 1) / spec.layers * 1e3, rel=1e-12)

    assert not plan(WAN14, gpus=4, gpu_type="L4", mode=fp8).best.shard_weights
    assert all(p.shard_weights for p in plan(WAN14, gpus=4, gpu_type="L4", mode=fp8, shard_weights=True).candidates)

    bf16, small = (plan("hunyuanvideo", gpus=2, gpu_type="L4", mode=m).best for m in (None, fp8))
    assert bf16.shard_weights and small.shard_weights
    assert small.memory_gb_per_gpu < bf16.memory_gb_per_gpu - 4
    hy = model_spec("hunyuanvideo")
    assert small.gather.block_mb == pytest.approx(
        bf16.gather.block_mb - hy.fp8_params * (hy.bytes_per_param - 1) / hy.layers / 1e6, rel=1e-9)


def test_full_precision_steps_price_the_kept_bf16_weights_and_never_shard():
    """Mode(keep_bf16=True) (a quantized run with full-precision steps): every rank keeps the
    blocks' linears in bf16 beside their FP8 bytes, bytes_per_param more per FP8 weight, and
    those are never sharded. Wan 14B on 8 H100: +28.1 GB per device; on 4 L4, where fp8 alone
    fits unsharded, refused with the numbers; forced sharding is refused in one line."""
    from raydit.planner.devicemodel import Mode

    spec = model_spec(WAN14)
    fp8, kept = Mode("fp8"), Mode("fp8", keep_bf16=True)
    a, b = (plan(WAN14, gpus=8, gpu_type="H100", mode=m) for m in (fp8, kept))
    assert b.model.weight_bytes == pytest.approx(a.model.weight_bytes + spec.bytes_per_param * spec.fp8_params,
                                                 rel=1e-12)
    same = [c for c in b.candidates if (c.ulysses, c.ring, c.cfg, c.replicas) == (a.best.ulysses, a.best.ring,
                                                                                  a.best.cfg, a.best.replicas)]
    assert same and same[0].memory_gb_per_gpu == pytest.approx(
        a.best.memory_gb_per_gpu + spec.bytes_per_param * spec.fp8_params / 1e9, rel=1e-6)
    assert not any(c.shard_weights for c in b.candidates)
    assert "bf16 weights kept" in kept.label
    with pytest.raises(PlanError, match=r"needs \d+\.\d GB per device"):
        plan(WAN14, gpus=4, gpu_type="L4", mode=kept)
    with pytest.raises(PlanError, match="sharded weights do not hold; drop full_precision_steps or shard_weights"):
        plan(WAN14, gpus=4, gpu_type="L4", mode=kept, shard_weights=True)
