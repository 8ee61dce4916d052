"""raydit.planner.decode: decode time and memory per rank, text encoder placement (pure, table-driven)."""

import pytest

from raydit.planner import BUILTIN_MODELS, plan
from raydit.planner.decode import decode_cost, decode_ranks, rank_memory_gb, text_encoder_gb

H100 = dict(flops_per_s=989e12 * 0.35, link_gb_s=450, link_latency_us=8)


@pytest.mark.parametrize("model, ranks, split", [
    ("cogvideox-5b", 8, 8), ("cogvideox-5b", 1, 1), ("wan2.1-t2v-14b", 8, 8),
    ("wan2.2-ti2v-5b", 8, 8),       # 16x VAE: 44 latent rows at 704 px
    ("hunyuanvideo", 8, 1),         # its VAE is not split: every rank decodes the whole video
    ("tiny", 16, 1),                # 8 latent rows cannot feed 16 ranks
])
def test_decode_ranks(model, ranks, split):
    spec = BUILTIN_MODELS[model]
    assert decode_ranks(spec, spec.geometry(), ranks) == split


def test_wan_16x_vae_has_its_own_shape():
    from raydit.planner.decode import WAN_16X, decoder_shape

    assert decoder_shape(BUILTIN_MODELS["wan2.2-ti2v-5b"]) is WAN_16X
    assert decoder_shape(BUILTIN_MODELS["wan2.1-t2v-14b"]) is not WAN_16X


def test_more_ranks_decode_faster_and_hold_less():
    spec = BUILTIN_MODELS["cogvideox-5b"]
    geo = spec.geometry()
    costs = [decode_cost(spec, geo, n, **H100) for n in (1, 2, 4, 8)]
    for a, b in zip(costs, costs[1:]):
        assert b.seconds < a.seconds and b.peak_gb < a.peak_gb
        assert b.halo > 0 and b.gather > 0
    assert costs[0].halo == costs[0].gather == 0
    # 60 latent rows on 8 ranks: bands of 8 and 7 rows, the 8-row band paces the compute.
    assert costs[3].compute == pytest.approx(costs[0].compute * 8 / 60)


def test_text_encoder_counted_where_it_lives():
    spec = BUILTIN_MODELS["wan2.1-t2v-14b"]
    dec = decode_cost(spec, spec.geometry(), 8, **H100)
    te = text_encoder_gb(spec)
    assert te == pytest.approx(11.36)  # umT5-XXL in bf16
    every = rank_memory_gb(spec, 40.0, dec, "every-rank", holds_text_encoder=False)
    holder = rank_memory_gb(spec, 40.0, dec, "one-rank", holds_text_encoder=True)
    other = rank_memory_gb(spec, 40.0, dec, "one-rank", holds_text_encoder=False)
    cpu = rank_memory_gb(spec, 40.0, dec, "cpu", holds_text_encoder=True)
    assert every == holder == pytest.approx(40.0 + te) and other == cpu == pytest.approx(40.0)
    with pytest.raises(ValueError, match="text_encoder 'gpu' is not one of every-rank, one-rank, cpu"):
        rank_memory_gb(spec, 40.0, dec, "gpu", True)


def test_plans_carry_their_decode():
    best = plan("cogvideox-5b", gpus=8, gpu_type="H100").best
    d = best.to_dict()["decode"]
    assert d["ranks"] == best.world_size // best.replicas and d["seconds"] > 0 and d["peak_gb"] > 0
