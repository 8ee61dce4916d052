"""Sparse attention (raydit.planner.sparse, raydit.parallel.kernels.sparse, sparse_ring).

One process: the block-sparse kernel equals dense float64 attention with the method's boolean
mask, built HERE by per-token loops over the published formulas (not by raydit's code), within
1e-5 in float32. Every plan (Ulysses, ring, hybrid, a cfg axis, uneven lengths with pad, text
before or after the video) equals one process within 1e-4 in float32; in bf16 within twice
bf16's own error (one-process bf16 against float64, relative L2). The ring sends fewer bytes
under a sparse mask than dense. One spawned group of 4 gloo processes runs every plan.
"""

import math

import pytest
import torch

from raydit.parallel import SeqLayout, build_mesh, gather_sequence, sp_attention
from raydit.parallel.kernels import sparse as sparse_kernel
from raydit.parallel.kernels.sparse import VideoMask, block_sparse_attention
from raydit.parallel.sparse_ring import block_positions, needs_table, ring_tally
from raydit.parallel.testing import run_distributed
from raydit.planner.sparse import SparseConfig, density

# (name, config, grid, text tokens, text first)
CASES = [
    ("sta", SparseConfig("sta", tile=(2, 2, 2), window=(1, 2, 2)), (4, 6, 8), 0, True),  # even windows clamp
    ("sta+text-before", SparseConfig("sta", tile=(2, 3, 2), window=(2, 1, 1)), (4, 6, 4), 7, True),
    ("radial-wan+text-after", SparseConfig("radial", block=8), (7, 4, 4), 5, False),
    ("radial-hunyuan", SparseConfig("radial", block=8, near=2, decay=0.5), (7, 4, 4), 0, True),
]
# Bands of three widths (16, 8, 4 for frame distances 1-3, 4-6... of 32-token frames): one-process tests.
WIDTHS = ("radial-three-widths", SparseConfig("radial", block=4), (7, 4, 8), 3, True)
HEADS, HEAD_DIM, BATCH = 12, 16, 2  # batch 2: classifier-free guidance without a cfg axis


# -- the independent mask builder ------------------------------------------------------------
def sta_pair(cfg, grid, q, k):
    F, Hp, Wp = grid
    qc = (q // (Hp * Wp), (q // Wp) % Hp, q % Wp)
    kc = (k // (Hp * Wp), (k // Wp) % Hp, k % Wp)
    for axis in range(3):
        n = grid[axis] // cfg.tile[axis]
        W = cfg.window[axis]
        if W >= n:
            continue  # the whole axis
        qt, kt = qc[axis] // cfg.tile[axis], kc[axis] // cfg.tile[axis]
        s = min(max(qt - W // 2, 0), max(n - W, 0))
        if not (s <= kt < s + W):
            return False
    return True


def radial_pair(cfg, grid, q, k):
    F, Hp, Wp = grid
    P = Hp * Wp
    fi, fj, i, j = q // P, k // P, q % P, k % P
    if fj == 0:
        return True  # attention sink
    dist = abs(fi - fj)
    L = 2 ** P.bit_length() / 2 ** dist.bit_length()
    if L < cfg.block and dist % int(cfg.block / L) != 0:
        return False
    if (cfg.near == 1 and dist < 1) or (cfg.near == 2 and dist <= 1):
        width = P
    elif cfg.near == 1 and dist == 1:
        width = P // 2
    else:
        width = max(L * cfg.decay, cfg.block)
    return abs(i - j) <= width


def boolean_mask(cfg, grid, text, text_first):
    n = grid[0] * grid[1] * grid[2]
    S, v0 = n + text, (text if text_first else 0)
    rule = sta_pair if cfg.method == "sta" else radial_pair
    m = torch.ones(S, S, dtype=torch.bool)
    for q in range(v0, v0 + n):
        for k in range(v0, v0 + n):
            m[q, k] = rule(cfg, grid, q - v0, k - v0)
    return m


def make_mask(cfg, grid, text, text_first):
    n = grid[0] * grid[1] * grid[2]
    return VideoMask(cfg, grid, video_start=text if text_first else 0, total_tokens=n + text)


def parts_of(grid, text, text_first):
    n = grid[0] * grid[1] * grid[2]
    if not text:
        return (n,)
    return (text, n) if text_first else (n, text)


def qkv(seed, S, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(BATCH, HEADS, S, HEAD_DIM, generator=g) * (2.0 if i == 0 else 1.0)).to(dtype)
            for i in range(3)]


def masked_float64(q, k, v, m):
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.size(-1))
    return torch.softmax(s.masked_fill(~m, -math.inf), -1) @ v.double()


# -- one process -------------------------------------------------------------------------------
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_one_process_equals_dense_attention_with_the_boolean_mask(case):
    name, cfg, grid, text, first = case
    m = boolean_mask(cfg, grid, text, first)
    assert 0 < m.float().mean() < 1, "the case must actually be sparse"
    S = m.size(0)
    q, k, v = qkv(1, S)
    pos = torch.arange(S)
    out, lse = block_sparse_attention(q, k, v, pos, pos, make_mask(cfg, grid, text, first), query_block=16)
    torch.testing.assert_close(out.double(), masked_float64(q, k, v, m), atol=1e-5, rtol=1e-5)
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(HEAD_DIM)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s.masked_fill(~m, -math.inf), -1), atol=1e-5, rtol=1e-5)
    # The density the planner prices is the mask's, counted over the video pairs.
    n = grid[0] * grid[1] * grid[2]
    v0 = text if first else 0
    assert density(cfg, grid) == pytest.approx(m[v0:v0 + n, v0:v0 + n].double().mean().item(), abs=1e-12)


@pytest.mark.parametrize("case", CASES + [WIDTHS], ids=[c[0] for c in CASES + [WIDTHS]])
def test_keys_and_rows_copied_run_by_run_give_the_same_result(case, monkeypatch):
    # MIN_RUN 1: every index set of several runs is copied by slices (the path the benchmark's
    # frames of hundreds of tokens take), here on grids whose runs are a few tokens long; radial's
    # bands in uneven in-frame ranges of 3 (5 or 6 per 16-token frame), several frames a task.
    name, cfg, grid, text, first = case
    m = boolean_mask(cfg, grid, text, first)
    S = m.size(0)
    q, k, v = qkv(3, S)
    pos = torch.arange(S)
    monkeypatch.setattr(sparse_kernel, "MIN_RUN", 1)
    sparse_kernel.schedules.clear()
    mask = make_mask(cfg, grid, text, first)
    schedule = sparse_kernel._build_schedule(mask, pos, pos, 3)
    assert any(isinstance(t.keys, tuple) or isinstance(t.rows, tuple) for t in schedule.tasks)
    out, lse = block_sparse_attention(q, k, v, pos, pos, mask, query_block=3)
    sparse_kernel.schedules.clear()
    torch.testing.assert_close(out.double(), masked_float64(q, k, v, m), atol=1e-5, rtol=1e-5)
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(HEAD_DIM)
    torch.testing.assert_close(lse.double(), torch.logsumexp(s.masked_fill(~m, -math.inf), -1), atol=1e-5, rtol=1e-5)


def test_unsorted_subsets_of_tokens_merge_into_the_whole():
    # What a ring rank does: its queries against a scattered subset of keys, merged by lse.
    name, cfg, grid, text, first = CASES[1]
    m = boolean_mask(cfg, grid, text, first)
    S = m.size(0)
    q, k, v = qkv(2, S)
    mask = make_mask(cfg, grid, text, first)
    keys = torch.randperm(S, generator=torch.Generator().manual_seed(0))
    from raydit.parallel.attention import merge_attention

    out = lse = None
    for part in keys.chunk(3):
        o, l = block_sparse_attention(q, k[:, :, part], v[:, :, part], torch.arange(S), part, mask, query_block=4)
        out, lse = merge_attention(out, lse, o, l)
    torch.testing.assert_close(out.double(), masked_float64(q, k, v, m), atol=1e-5, rtol=1e-5)


def _pairs(task_part, n):
    return _indices(task_part, n).numel()


def _indices(task_part, n):
    # A task's rows or keys (slice, tuple of slices, index tensor) as an index tensor.
    if isinstance(task_part, tuple):
        return torch.cat([torch.arange(n)[run] for run in task_part])
    return torch.arange(n)[task_part]


@pytest.mark.parametrize("case", CASES + [WIDTHS], ids=[c[0] for c in CASES + [WIDTHS]])
def test_the_schedule_computes_only_what_the_mask_keeps(case):
    # The block skipping is real: STA's tasks carry no mask and multiply exactly the allowed
    # pairs; radial's masked tasks keep only live rows and columns (each attends / is attended
    # at least once), and its unmasked ones only allowed pairs.
    name, cfg, grid, text, first = case
    m = boolean_mask(cfg, grid, text, first)
    S = m.size(0)
    pos = torch.arange(S)
    schedule = sparse_kernel._build_schedule(make_mask(cfg, grid, text, first), pos, pos, 16)
    computed, seen = 0, torch.zeros(S, S, dtype=torch.int64)
    for task in schedule.tasks:
        rows, keys = _indices(task.rows, S), _indices(task.keys, S)
        block = m[rows][:, keys]
        if task.allowed is None:
            assert bool(block.all())
        else:
            assert torch.equal(task.allowed, block)
            assert bool(block.any(0).all()) and bool(block.any(1).all())
            # A radial band task: one key frame, keys no wider than its rows' in-frame range plus
            # the widest band it holds on either side (rows of one band width a task).
            P, v0 = grid[1] * grid[2], (text if first else 0)
            assert len(set(((keys - v0) // P).tolist())) == 1
            i, j = (rows - v0) % P, (keys - v0) % P
            reach = torch.where(block, (i[:, None] - j[None, :]).abs(), -1).amax(1)  # each row's band
            frames = (rows - v0) // P
            widths = {int(reach[frames == f].max()) for f in frames.unique()}
            assert len(widths) == 1, f"frames of band widths {widths} in one task"
            assert int(j.max() - j.min()) <= int(i.max() - i.min()) + 2 * widths.pop()
        computed += rows.numel() * keys.numel()
        seen[rows[:, None], keys[None, :]] += 1
    assert int(seen.max()) == 1, "a pair is computed twice"
    assert bool((seen[m] == 1).all()), "an allowed pair is missed"
    if cfg.method == "sta":
        assert all(t.allowed is None for t in schedule.tasks)
        assert computed == int(m.sum())
    else:
        assert computed < 1.5 * int(m.sum())


def test_the_schedule_is_built_once_per_mask_and_positions():
    name, cfg, grid, text, first = CASES[2]
    S = grid[0] * grid[1] * grid[2] + text
    q, k, v = qkv(4, S)
    mask, pos = make_mask(cfg, grid, text, first), torch.arange(S)
    sparse_kernel.schedules.clear()
    built = sparse_kernel.schedules.built
    first_out = block_sparse_attention(q, k, v, pos, pos, mask)
    again = block_sparse_attention(q, k, v, pos.clone(), pos.clone(), mask)
    assert sparse_kernel.schedules.built == built + 1
    torch.testing.assert_close(again, first_out, atol=0, rtol=0)
    half = pos[: S // 2]  # other keys: another schedule, not the cached one
    o, _ = block_sparse_attention(q, k[:, :, : S // 2], v[:, :, : S // 2], pos, half, mask)
    assert sparse_kernel.schedules.built == built + 2
    m = boolean_mask(cfg, grid, text, first)[:, : S // 2]
    live = m.any(1)
    ref = masked_float64(q, k[:, :, : S // 2], v[:, :, : S // 2], m)
    torch.testing.assert_close(o.double()[:, :, live], ref[:, :, live], atol=1e-5, rtol=1e-5)
    assert bool((o[:, :, ~live] == 0).all())


@pytest.mark.parametrize("keys", [range(50, 53), range(60, 64), range(16, 20)])
def test_rows_with_no_key_in_a_band_subset_get_zero_and_minus_infinity(keys):
    # Keys: a few tokens of one band frame (no sink, no text), so most queries attend none of
    # them: those rows must come out 0 with lse -inf, the others as the boolean mask says.
    name, cfg, grid, text, first = CASES[3]
    m = boolean_mask(cfg, grid, text, first)
    S = m.size(0)
    q, k, v = qkv(6, S)
    kp = torch.tensor(list(keys))
    out, lse = block_sparse_attention(q, k[:, :, kp], v[:, :, kp], torch.arange(S), kp,
                                      make_mask(cfg, grid, text, first), query_block=4)
    sub = m[:, kp]
    live = sub.any(1)
    assert 0 < int(live.sum()) < S
    assert bool((out[:, :, ~live] == 0).all()) and bool(torch.isneginf(lse[:, :, ~live]).all())
    ref = masked_float64(q, k[:, :, kp], v[:, :, kp], sub)
    torch.testing.assert_close(out.double()[:, :, live], ref[:, :, live], atol=1e-5, rtol=1e-5)
    s = (q.double() @ k[:, :, kp].double().transpose(-1, -2)) / math.sqrt(HEAD_DIM)
    torch.testing.assert_close(lse.double()[:, :, live], torch.logsumexp(s.masked_fill(~sub, -math.inf), -1)[:, :, live],
                               atol=1e-5, rtol=1e-5)


def test_masks_past_the_cache_budget_are_rebuilt_with_the_same_result(monkeypatch):
    name, cfg, grid, text, first = CASES[3]
    m = boolean_mask(cfg, grid, text, first)
    S = m.size(0)
    q, k, v = qkv(5, S)
    monkeypatch.setattr(sparse_kernel, "BIAS_CACHE_BYTES", 0)
    sparse_kernel.schedules.clear()
    for _ in range(2):
        out, _ = block_sparse_attention(q, k, v, torch.arange(S), torch.arange(S), make_mask(cfg, grid, text, first),
                                        query_block=8)
        torch.testing.assert_close(out.double(), masked_float64(q, k, v, m), atol=1e-5, rtol=1e-5)
    sparse_kernel.schedules.clear()


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_the_ring_transfer_rule_equals_the_token_rule(case):
    # any_allowed works on the class tables (and radial's band distances); the token rule is
    # the independent boolean mask. Subsets: ring blocks of Ulysses x ring layouts with pad,
    # and scattered random subsets, small enough to miss each other.
    name, cfg, grid, text, first = case
    m = boolean_mask(cfg, grid, text, first)
    mask = make_mask(cfg, grid, text, first)
    parts = parts_of(grid, text, first)

    def token_rule(qp, kp):
        qp, kp = qp[qp >= 0], kp[kp >= 0]
        return bool(m[qp][:, kp].any())

    subsets = []
    for ulysses, ring in ((1, 2), (1, 3), (2, 2), (1, 4), (1, 7)):
        layout = SeqLayout(parts, ulysses * ring)
        subsets += [block_positions(layout, ulysses, r) for r in range(ring)]
    g = torch.Generator().manual_seed(7)
    for size in (1, 2, 3, 5, 9):
        subsets += [torch.randperm(m.size(0), generator=g)[:size] for _ in range(12)]
    outcomes = set()
    for qp in subsets:
        for kp in subsets[::3]:
            got = mask.any_allowed(qp, kp)
            assert got == token_rule(qp, kp), (qp.tolist(), kp.tolist())
            outcomes.add(got)
    assert outcomes == {True, False}
    layout = SeqLayout(parts, 4)
    pos = [block_positions(layout, 1, r) for r in range(4)]
    assert needs_table(mask, layout, 1, 4) == tuple(tuple(token_rule(pos[r], pos[o]) for r in range(4))
                                                     for o in range(4))


# -- every plan --------------------------------------------------------------------------------
def plans(world):
    return [(u, world // u, 1) for u in range(1, world + 1) if world % u == 0]


def run_plan(mesh, cfg, grid, text, first, seed, dtype, sparse=True):
    parts = parts_of(grid, text, first)
    layout = SeqLayout(parts, mesh.sp)
    full = qkv(seed, sum(parts), dtype)
    split = [list(t.split(list(parts), dim=2)) for t in full]
    q, k, v = (layout.shard_parts(x, mesh.sp_index, dim=2) for x in split)
    before = ring_tally.bytes_sent
    out = sp_attention(q, k, v, mesh, layout, sparse=make_mask(cfg, grid, text, first) if sparse else None)
    sent = ring_tally.bytes_sent - before
    return torch.cat([gather_sequence(out, mesh, layout, p, dim=2) for p in range(len(parts))], dim=2), sent


def plan_worker(rank, world):
    report = {"f32": {}, "bf16": {}, "bytes": {}}
    shapes = [(u, r, 1) for w in (1, 2, 3, 4) for (u, r, _) in plans(w)] + [(1, 2, 2), (2, 1, 2)]
    for shape in shapes:
        w = shape[0] * shape[1] * shape[2]
        mesh = build_mesh(*shape, ranks=list(range(w)))  # collective: every rank calls it
        if mesh is None:
            continue
        for i, (name, cfg, grid, text, first) in enumerate(CASES):
            report["f32"][(shape, name)] = run_plan(mesh, cfg, grid, text, first, 10 + i, torch.float32)[0]
            if name.startswith("radial-wan"):
                report["bf16"][(shape, name)] = run_plan(mesh, cfg, grid, text, first, 10 + i, torch.bfloat16)[0]
        if shape[1] > 1:
            name, cfg, grid, text, first = CASES[0]
            report["bytes"][shape] = (run_plan(mesh, cfg, grid, text, first, 10, torch.float32)[1],
                                      run_plan(mesh, cfg, grid, text, first, 10, torch.float32, sparse=False)[1])
    return report


@pytest.fixture(scope="module")
def suite():
    return run_distributed(plan_worker, 4, timeout=600)


@pytest.mark.long  # one group of 4 processes for every plan: ~55 s on 2 loaded cores
def test_every_plan_equals_one_process_in_float32(suite):
    got = suite[0]["f32"]
    shapes = sorted({s for s, _ in got})
    assert len(shapes) >= 8
    for i, (name, cfg, grid, text, first) in enumerate(CASES):
        one = got[((1, 1, 1), name)]
        ref = masked_float64(*qkv(10 + i, one.size(2)), boolean_mask(cfg, grid, text, first))
        torch.testing.assert_close(one.double(), ref, atol=1e-5, rtol=1e-5)
        for shape in shapes:
            torch.testing.assert_close(got[(shape, name)], one, atol=1e-4, rtol=1e-4,
                                       msg=lambda m: f"{name} on (ulysses, ring, cfg) {shape}: {m}")


def _rel(x, ref):
    return float((x.double() - ref.double()).norm() / ref.double().norm())


@pytest.mark.long  # one group of 4 processes for every plan: ~55 s on 2 loaded cores
def test_every_plan_in_bf16_is_within_twice_bf16_noise(suite):
    name, cfg, grid, text, first = CASES[2]
    got = suite[0]["bf16"]
    one = got[((1, 1, 1), name)]
    q, k, v = qkv(12, one.size(2), torch.bfloat16)
    noise = _rel(one, masked_float64(q, k, v, boolean_mask(cfg, grid, text, first)))
    assert 0 < noise < 1e-2
    for (shape, _), out in got.items():
        assert out.dtype == torch.bfloat16
        assert _rel(out, one) <= 2 * noise, (shape, _rel(out, one), noise)


@pytest.mark.long  # one group of 4 processes for every plan: ~55 s on 2 loaded cores
def test_the_ring_sends_fewer_bytes_under_a_sparse_mask(suite):
    seen = suite[0]["bytes"]
    assert (1, 4, 1) in seen and (2, 2, 1) in seen
    for shape, (sparse, dense) in seen.items():
        assert dense > 0 and sparse < dense, (shape, sparse, dense)
    # STA case 0: frames 0-1 never attend frames 2-3, so on a ring of 4 each rank sends
    # to 1 peer instead of 3.
    sparse, dense = seen[(1, 4, 1)]
    assert sparse * 3 == dense


# -- bad settings --------------------------------------------------------------------------------
@pytest.mark.parametrize("kwargs, message", [
    (dict(method="nsa"), "sparse attention method 'nsa' is unknown; choose one of sta, radial"),
    (dict(method="sta", tile=(0, 2, 2)), "must be three integers >= 1"),
    (dict(method="sta", window="big"), "must be three integers"),
    (dict(method="radial", near=3), "near=3 must be 1"),
    (dict(method="radial", decay=0), "decay=0 must be a number > 0"),
    (dict(method="sta", dense_steps=-1), "dense steps -1 must be an integer >= 0"),
    (dict(method="sta", dense_fraction=1.5), "dense_fraction=1.5 must be a number in [0, 1]"),
])
def test_bad_settings_are_one_line_value_errors(kwargs, message):
    with pytest.raises(ValueError) as info:
        SparseConfig(**kwargs)
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_tile_that_does_not_divide_the_grid_names_the_divisors():
    with pytest.raises(ValueError, match=r"sta tile 6 does not divide the 21 tokens of axis t; tile sizes that "
                                         r"do: 1, 3, 7, 21"):
        VideoMask(SparseConfig("sta"), (21, 48, 80))


def test_dense_steps_scale_or_are_refused_above_the_step_count():
    assert SparseConfig("sta").dense_step_count(4) == 1  # the published fraction, never a refusal
    assert SparseConfig("radial", dense_steps=0).dense_step_count(4) == 0
    with pytest.raises(ValueError, match="dense steps 5 is above the request's 4 steps; give 0..4"):
        SparseConfig("sta", dense_steps=5).dense_step_count(4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlexAttention's compiled block-sparse kernel needs CUDA")
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_flex_attention_on_cuda_equals_the_boolean_mask(case):
    from raydit.parallel.kernels.sparse import flex_block_sparse_attention

    name, cfg, grid, text, first = case
    m = boolean_mask(cfg, grid, text, first)
    S = m.size(0)
    q, k, v = qkv(3, S)
    pos = torch.arange(S)
    out, lse = flex_block_sparse_attention(q.cuda(), k.cuda(), v.cuda(), pos, pos, make_mask(cfg, grid, text, first))
    torch.testing.assert_close(out.double().cpu(), masked_float64(q, k, v, m), atol=1e-4, rtol=1e-4)
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(HEAD_DIM)
    torch.testing.assert_close(lse.double().cpu(), torch.logsumexp(s.masked_fill(~m, -math.inf), -1), atol=1e-4, rtol=1e-4)
