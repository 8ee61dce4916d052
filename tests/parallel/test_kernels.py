"""Which attention kernel runs: the float64 check, the choice by measured rate, per head dim (CPU)."""

import logging
import math

import pytest
import torch

from raydit.parallel import SeqLayout, build_mesh, sp_attention
from raydit.parallel import kernels
from raydit.parallel.kernels import (
    KERNELS,
    choose_kernel,
    default_kernel,
    kernel_choice,
    measure_kernels,
    select_kernel,
    use_measured_rates,
)
from raydit.parallel.testing import run_distributed


@pytest.fixture(autouse=True)
def fresh_choices():
    # Verdicts and choices live for the process; each test starts without them.
    kernels.forget_choices()
    yield
    kernels.forget_choices()


# -- the rule, pure ----------------------------------------------------------------------------
@pytest.mark.parametrize("rates, verified, chosen", [
    ({"a": 300, "b": 500}, ["a", "b"], "b"),                 # fastest wins over preference
    ({"a": 300, "b": 500}, ["a"], "a"),                      # a faster kernel that failed the check loses
    ({"a": 300}, ["b", "a"], "a"),                           # measured beats unmeasured
    ({}, ["b", "a"], "b"),                                   # nothing measured: preference order
    ({"a": 400, "b": 400}, ["b", "a"], "b"),                 # tie: preference order
    ({"a": float("nan"), "b": 0.0, "c": -1}, ["a", "b", "c"], "a"),  # no usable rate: order
    ({"a": float("inf"), "b": 1.0}, ["a", "b"], "b"),        # a non-finite rate is no measurement
    ({"x": 900, "b": 10}, ["a", "b"], "b"),                  # rates of kernels not verified ignored
])
def test_choose_kernel_by_measured_rate(rates, verified, chosen):
    assert choose_kernel(rates, verified) == chosen


def test_choose_kernel_without_candidates_is_a_value_error():
    with pytest.raises(ValueError, match="no attention kernel passed"):
        choose_kernel({"a": 1.0}, [])


# -- the float64 check ---------------------------------------------------------------------------
def _zero_lse(q, k, v, scale):
    out, lse = KERNELS["torch-cpu"](q, k, v, scale)
    return out, torch.zeros_like(lse)  # yunchang's torch path


def _log2_lse(q, k, v, scale):
    out, lse = KERNELS["torch-cpu"](q, k, v, scale)
    return out, lse / math.log(2)  # a kernel that keeps the lse in base 2


def _raises(q, k, v, scale):
    raise RuntimeError("no kernel image is available for execution on the device")


def _slow(q, k, v, scale):
    # Four times the work of torch-cpu (four of its calls: four ticks of the work clock).
    for _ in range(3):
        KERNELS["torch-cpu"](q, k, v, scale)
    return KERNELS["torch-cpu"](q, k, v, scale)


@pytest.fixture
def fakes(monkeypatch):
    for name, fn in (("fake-zero-lse", _zero_lse), ("fake-log2-lse", _log2_lse), ("fake-raises", _raises),
                     ("fake-slow", _slow)):
        monkeypatch.setitem(KERNELS, name, fn)

    def candidates(*names):
        monkeypatch.setattr(kernels.choice, "candidate_kernels", lambda device, dtype=None, mode="bf16": list(names))

    return candidates


class WorkClock:
    """The probe's timer, reading work done instead of the wall (a loaded machine does not
    order microsecond kernels by their work): each read advances it by one second, each
    call of torch-cpu by CALL_S. A timed call of torch-cpu reads 1 + CALL_S seconds,
    fake-slow's 1 + 4 CALL_S, SDPA's (not counted) 1."""

    CALL_S = 10.0

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now

    def counted(self, fn):
        def call(*args):
            self.now += self.CALL_S
            return fn(*args)

        return call


@pytest.fixture
def work_clock(monkeypatch):
    clock = WorkClock()
    monkeypatch.setitem(KERNELS, "torch-cpu", clock.counted(KERNELS["torch-cpu"]))
    return clock


def _rate(tokens, head_dim, seconds):
    heads = kernels.PROBE_HIDDEN // head_dim
    return 4 * heads * tokens * tokens * head_dim / seconds / 1e12


def test_broken_kernels_are_dropped_with_one_line_each_and_the_next_runs(fakes, caplog):
    fakes("fake-zero-lse", "fake-raises", "fake-log2-lse", "torch-cpu")
    with caplog.at_level(logging.WARNING, logger="raydit.parallel.kernels"):
        choice = kernel_choice("cpu", torch.float32, 64)
        again = kernel_choice("cpu", torch.float32, 64)
        assert select_kernel("cpu", torch.float32, head_dim=64).name == "torch-cpu"
    assert choice.name == again.name == "torch-cpu"
    assert choice.why == "only candidate"
    assert set(choice.dropped) == {"fake-zero-lse", "fake-raises", "fake-log2-lse"}
    assert "lse off by" in choice.dropped["fake-zero-lse"] and "lse off by" in choice.dropped["fake-log2-lse"]
    assert "no kernel image" in choice.dropped["fake-raises"]
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines  # one line per dropped kernel, not one per call
    for name in ("fake-zero-lse", "fake-raises", "fake-log2-lse"):
        [line] = [ln for ln in lines if repr(name) in ln]
        assert "dropped on cpu float32 head dim 64" in line and "\n" not in line


def test_forcing_a_broken_kernel_is_a_value_error(fakes):
    fakes("fake-zero-lse", "torch-cpu")
    with pytest.raises(ValueError, match="'fake-zero-lse' failed the float64 check.*lse off by"):
        select_kernel("cpu", torch.float32, prefer="fake-zero-lse", head_dim=64)


def test_every_candidate_dropped_falls_back_to_reference(fakes, caplog):
    fakes("fake-raises")
    with caplog.at_level(logging.WARNING, logger="raydit.parallel.kernels"):
        choice = kernel_choice("cpu", torch.float32, 32)
    assert (choice.name, choice.why) == ("reference", "fallback")
    assert any("running float64 reference math" in r.getMessage() for r in caplog.records)


def test_probe_chooses_the_measured_fastest_not_the_first(fakes, work_clock):
    fakes("fake-slow", "torch-cpu")  # preference order says fake-slow; the probe measures it slower
    choice = kernel_choice("cpu", torch.float32, 64, timer=work_clock)
    assert choice.why == "probe" and set(choice.rates) == {"fake-slow", "torch-cpu"}
    tokens, call = kernels.CPU_PROBE_TOKENS, WorkClock.CALL_S
    assert choice.rates == {"torch-cpu": pytest.approx(_rate(tokens, 64, 1 + call)),
                            "fake-slow": pytest.approx(_rate(tokens, 64, 1 + 4 * call))}
    assert choice.name == "torch-cpu"


def test_measure_kernels_times_what_passes_and_names_the_fastest(fakes, work_clock):
    choice = measure_kernels("cpu", torch.float32, 64, names=["fake-zero-lse", "fake-slow", "torch-cpu"],
                             tokens=128, warmup=1, iters=2, plain=True, timer=work_clock)
    assert set(choice.rates) == {"fake-slow", "torch-cpu"} and set(choice.dropped) == {"fake-zero-lse"}
    assert choice.rates == {"torch-cpu": pytest.approx(_rate(128, 64, 1 + WorkClock.CALL_S)),
                            "fake-slow": pytest.approx(_rate(128, 64, 1 + 4 * WorkClock.CALL_S))}
    assert choice.name == "torch-cpu" and choice.plain_rate == pytest.approx(_rate(128, 64, 1.0))
    assert "torch-cpu" in choice.describe() and "fake-zero-lse dropped" in choice.describe()


def test_cpu_has_one_candidate_and_no_probe():
    choice = kernel_choice("cpu", torch.float32, 128)
    assert (choice.name, choice.why, dict(choice.rates)) == ("torch-cpu", "only candidate", {})


# -- per head dim ------------------------------------------------------------------------------
def test_choice_follows_measured_rates_per_head_dim(fakes):
    fakes("fake-slow", "torch-cpu")
    use_measured_rates("cpu", torch.float32, 64, {"fake-slow": 500.0, "torch-cpu": 300.0})
    use_measured_rates("cpu", torch.float32, 128, {"fake-slow": 200.0, "torch-cpu": 300.0})
    assert default_kernel("cpu", torch.float32, 64).name == "fake-slow"
    assert default_kernel("cpu", torch.float32, 128).name == "torch-cpu"
    assert kernel_choice("cpu", torch.float32, 64).why == "calibration"
    # Another dtype was not seeded: decided on its own (probe).
    assert kernel_choice("cpu", torch.bfloat16, 64).why == "probe"


def _recording(tag, calls):
    def fn(q, k, v, scale):
        calls.append((tag, q.size(-1)))
        return KERNELS["torch-cpu"](q, k, v, scale)

    return fn


def _per_head_dim_worker(rank, world, ulysses, ring):
    # In the child: two kernels that record their use; the measured rates favour tag-a at
    # head dim 16 and tag-b at head dim 32.
    calls = []
    KERNELS["tag-a"], KERNELS["tag-b"] = _recording("a", calls), _recording("b", calls)
    use_measured_rates("cpu", torch.float32, 16, {"tag-a": 2.0, "tag-b": 1.0}, names=["tag-a", "tag-b"])
    use_measured_rates("cpu", torch.float32, 32, {"tag-a": 1.0, "tag-b": 2.0}, names=["tag-a", "tag-b"])
    mesh = build_mesh(ulysses=ulysses, ring=ring)
    parts = (21, 14)  # 35 tokens over 2 ranks: pad keys that must be dropped
    layout = SeqLayout(parts, world)
    out = {}
    for d in (16, 32):
        g = torch.Generator().manual_seed(d)
        full = [torch.randn(3, 1, 4, n, d, generator=g) for n in parts]  # per part (3, B, H, n, D)
        qkv = layout.shard_parts(full, mesh.sp_index, dim=3)
        calls.clear()
        got = sp_attention(qkv[0], qkv[1], qkv[2], mesh, layout)
        used = sorted(set(calls))
        # Single-process float64 answer over the real tokens, sharded like the output.
        q, k, v = torch.cat(full, dim=3).double()
        ref, _ = KERNELS["reference"](q, k, v, 1 / math.sqrt(d))
        expect = layout.shard_parts(list(torch.split(ref, parts, dim=2)), mesh.sp_index, dim=2)
        err = (got.double() - expect).abs()
        real = layout.key_valid(mesh.sp_index)
        out[d] = (used, float((err if real is None else err[:, :, real]).max()))
    return out


@pytest.mark.parametrize("ulysses, ring, used", [
    (1, 2, {16: [("a", 16)], 32: [("b", 32)]}),  # ring: the LSE kernel chosen per head dim
    (2, 1, {16: [], 32: []}),                    # ring 1: torch's SDPA, no LSE kernel at all
])
def test_sp_attention_runs_the_kernel_chosen_for_its_head_dim(ulysses, ring, used):
    results = run_distributed(_per_head_dim_worker, 2, ulysses, ring, timeout=120)
    for rank_out in results:
        for d, (calls, err) in rank_out.items():
            assert calls == used[d], (d, calls)
            assert err < 1e-5, (d, err)
