"""Row-parallel VAE decode on N gloo ranks against diffusers' own decode in one process.

Six decoders with the real structure and small channel counts, seeded random weights:
CogVideoX's (8x, group norm, frame batches of 2 latent frames with conv caches), Wan 2.1's
(8x, RMS norm, attention in the middle block, frame-by-frame feat_cache), Wan 2.2's
(16x: residual up blocks with DupUp3D shortcuts, patch size 2), HunyuanVideo's (8x, replicate
row padding, group norm, frame-causal attention over every latent pixel in diffusers'
Attention with its own group norm; 5 latent frames, so diffusers decodes it framewise in two
blended calls), HunyuanVideo 1.5's (16x, replicate padding, RMS norm, channel-to-space
upsampling, frame-causal attention in its own block) and LTX-Video's (32x: patch 4, 0.9.1-style
timestep conditioning, residual upsamplers). 7 latent rows, so bands are uneven on every N
(5 ranks: 2, 2, 1, 1, 1 rows).

Tolerance (issue 13): float32, atol 1e-4, rtol 0 on the decoded video. One group of 5
processes runs everything: N ranks are a sub-group (dist.new_group), the 2-rank group on
global ranks 3 and 4 so that group ranks differ from global ones.
"""

import pytest
import torch
import torch.distributed as dist

from raydit.parallel.testing import run_distributed

TOL = dict(atol=1e-4, rtol=0)
WORLD = 5
GROUPS = {2: (3, 4), 3: (0, 1, 2), 4: (1, 2, 3, 4), 5: (0, 1, 2, 3, 4)}
LATENT_ROWS, LATENT_COLS = 7, 5
VAES = ("cogvideox", "wan2.1", "wan2.2", "hunyuanvideo", "hunyuanvideo15", "ltx", "mochi")


def build_vae(kind: str, **overrides):
    from diffusers import (
        AutoencoderKLCogVideoX,
        AutoencoderKLHunyuanVideo,
        AutoencoderKLHunyuanVideo15,
        AutoencoderKLLTXVideo,
        AutoencoderKLMochi,
        AutoencoderKLWan,
    )

    torch.manual_seed(0)
    if kind == "cogvideox":
        vae = AutoencoderKLCogVideoX(block_out_channels=(8, 8, 16, 16), latent_channels=4, layers_per_block=1,
                                     norm_num_groups=4)
    elif kind == "wan2.1":
        vae = AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                               temperal_downsample=[False, True, True])
    elif kind == "wan2.2":
        vae = AutoencoderKLWan(base_dim=8, decoder_base_dim=12, z_dim=6, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                               temperal_downsample=[False, True, True], is_residual=True, in_channels=12,
                               out_channels=12, patch_size=2, scale_factor_spatial=16)
    elif kind == "hunyuanvideo":
        vae = AutoencoderKLHunyuanVideo(latent_channels=4, block_out_channels=(8, 8, 16, 16), layers_per_block=1,
                                        norm_num_groups=4, spatial_compression_ratio=8, temporal_compression_ratio=4)
    elif kind == "hunyuanvideo15":
        vae = AutoencoderKLHunyuanVideo15(latent_channels=4, block_out_channels=(8, 8, 8, 8, 8), layers_per_block=1,
                                          spatial_compression_ratio=16, temporal_compression_ratio=4,
                                          downsample_match_channel=False, upsample_match_channel=False)
    elif kind == "ltx":
        config = dict(latent_channels=8, block_out_channels=(8, 8, 8, 8), decoder_block_out_channels=(8, 8, 8, 8),
                      layers_per_block=(1, 1, 1, 1, 1), decoder_layers_per_block=(1, 1, 1, 1, 1),
                      timestep_conditioning=True, upsample_residual=(True, True, True, True))
        vae = AutoencoderKLLTXVideo(**{**config, **overrides})
    elif kind == "mochi":
        # Mochi's (6x / 8x: replicate-padded causal convolutions, per-frame group norms of 32
        # groups, channel-to-space up blocks); 2 latent frames decode to 12, less the first 5.
        vae = AutoencoderKLMochi(latent_channels=4, encoder_block_out_channels=(32,) * 4,
                                 decoder_block_out_channels=(32,) * 4, layers_per_block=(1,) * 5,
                                 add_attention_block=(False,) * 5)
    else:
        raise ValueError(kind)
    # Perturb every parameter (norm scales and shifts included) so no layer is the identity.
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in vae.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.1)
        if kind == "mochi":  # unclamped output: keep most of it inside [-1, 1], as a real decoder's
            vae.decoder.proj_out.weight.mul_(0.25)
    return vae.eval()


def latents(kind: str) -> torch.Tensor:
    # CogVideoX: 5 latent frames = a batch of 3, then one of 2 (the conv cache crosses batches).
    # Wan: 3 latent frames, decoded one by one through feat_cache (first chunk, then cached).
    # HunyuanVideo: 5 latent frames > 4, so two framewise calls (frames 0-4 and 3-4), blended.
    channels, frames = {"cogvideox": (4, 5), "wan2.1": (4, 3), "wan2.2": (6, 2), "hunyuanvideo": (4, 5),
                        "hunyuanvideo15": (4, 2), "ltx": (8, 2), "mochi": (4, 2)}[kind]
    g = torch.Generator().manual_seed(2)
    return torch.randn(1, channels, frames, LATENT_ROWS, LATENT_COLS, generator=g)


def decode_kwargs(kind: str) -> dict:
    """LTX's timestep-conditioned decoder takes the decode timestep (temb)."""
    return {"temb": torch.tensor([0.05])} if kind == "ltx" else {}


def decode(vae, kind: str) -> torch.Tensor:
    return vae.decode(latents(kind), **decode_kwargs(kind)).sample


def decode_worker(rank, world, states):
    from raydit.models.vae_parallel import decode_on_ranks, decode_rows

    vaes = {}
    for kind in VAES:
        vaes[kind] = build_vae(kind)
        vaes[kind].load_state_dict(states[kind])
    out = {}
    if rank == 0:
        with torch.no_grad():
            for kind in VAES:
                out[(kind, "before")] = decode(vaes[kind], kind)
    for n, ranks in GROUPS.items():
        group = dist.new_group(list(ranks))
        if rank not in ranks:
            continue
        for kind in VAES:
            vae = vaes[kind]
            if n == 3 and kind == "cogvideox":
                # A blended tile decode must not run inside a parallel decode.
                vae.enable_tiling(tile_sample_min_height=16, tile_sample_min_width=16)
            with torch.no_grad():
                video = decode_rows(vae, latents(kind), group=group, dst=0 if n != 4 else None, **decode_kwargs(kind))
            if n == 3 and kind == "cogvideox":
                assert vae.use_tiling  # restored
                vae.disable_tiling()
            if dist.get_rank(group) == 0 or n == 4:
                out[(kind, n, dist.get_rank(group))] = video
            else:
                assert video is None
            if n == 2:
                # The runner's hook: a family's own vae.decode(z) call becomes the row-parallel decode.
                with torch.no_grad(), decode_on_ranks(vae, group) as info:
                    # LTX's family passes the timestep by position: vae.decode(z, temb, return_dict=False).
                    extra = tuple(decode_kwargs(kind).values())
                    hooked = vae.decode(latents(kind), *extra, return_dict=False)[0]
                    sample = decode(vae, kind)
                assert info["ranks"] == 2 and "decode" not in vae.__dict__
                torch.testing.assert_close(hooked, sample, atol=0, rtol=0)
                if dist.get_rank(group) == 0:
                    out[(kind, "hooked")] = hooked
                else:
                    assert not hooked.any()  # a placeholder of the video's shape
    # The hooks are gone: a plain decode afterwards equals the one before, bit for bit.
    if rank == 0:
        with torch.no_grad():
            for kind in VAES:
                out[(kind, "after")] = decode(vaes[kind], kind)
    return out


@pytest.fixture(scope="module")
def states():
    return {kind: build_vae(kind).state_dict() for kind in VAES}


@pytest.fixture(scope="module")
def references(states):
    refs = {}
    for kind in VAES:
        vae = build_vae(kind)
        with torch.no_grad():
            refs[kind] = decode(vae, kind)
    return refs


@pytest.fixture(scope="module")
def parallel(states):
    merged = {}
    for part in run_distributed(decode_worker, WORLD, states, timeout=600):
        merged.update(part)
    return merged


def test_references_are_not_degenerate(references):
    for kind, ref in references.items():
        assert ref.shape[1] == 3 and ref.std() > 0.05, kind
        assert (ref.abs() < 0.999).float().mean() > 0.5, kind  # Wan clamps to [-1, 1]: most values inside


@pytest.mark.parametrize("n", sorted(GROUPS))
@pytest.mark.parametrize("kind", VAES)
def test_parallel_decode_equals_one_rank(references, parallel, kind, n):
    ref = references[kind]
    got = parallel[(kind, n, 0)]
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, **TOL)
    if n == 4:  # gathered to every rank
        for r in range(1, n):
            torch.testing.assert_close(parallel[(kind, n, r)], got, atol=0, rtol=0)


@pytest.mark.parametrize("kind", VAES)
def test_decode_hook_equals_one_rank(references, parallel, kind):
    torch.testing.assert_close(parallel[(kind, "hooked")], references[kind], **TOL)


@pytest.mark.parametrize("kind", VAES)
def test_decode_after_parallel_is_untouched(parallel, kind):
    torch.testing.assert_close(parallel[(kind, "after")], parallel[(kind, "before")], atol=0, rtol=0)


def test_bad_input_is_one_clear_value_error():
    from diffusers import AutoencoderKL

    from raydit.models.vae_parallel import latent_split, spatial_factor

    vae = build_vae("cogvideox")
    with pytest.raises(ValueError, match="3 rows cannot be split over 4 ranks"):
        latent_split(vae, 3, 4)
    with pytest.raises(ValueError, match="AutoencoderKLLTXVideo, not AutoencoderKL$"):
        spatial_factor(AutoencoderKL(block_out_channels=(8,), norm_num_groups=4))
    assert spatial_factor(vae) == 8 and spatial_factor(build_vae("wan2.2")) == 16
    assert [spatial_factor(build_vae(k)) for k in ("hunyuanvideo", "hunyuanvideo15", "ltx")] == [8, 16, 32]
    assert spatial_factor(build_vae("mochi")) == 8
    assert latent_split(vae, 60, 8).sizes == (8, 8, 8, 8, 7, 7, 7, 7)


def test_supported_decoders_and_refusals():
    """Every decoder above is split by rows; an LTX decoder that injects noise drawn over the
    whole frame is not (the runner then decodes on one rank), nor one with reflect padding."""
    from raydit.models.vae_parallel import _plan, supports_vae

    for kind in VAES:
        assert supports_vae(build_vae(kind)), kind
    noisy = build_vae("ltx", decoder_inject_noise=(True, False, False, False, False))
    assert not supports_vae(noisy)
    with pytest.raises(ValueError, match="decoder_inject_noise"):
        _plan(noisy, None)
    hunyuan = build_vae("hunyuanvideo")
    hunyuan.decoder.conv_out.pad_mode = "reflect"
    assert not supports_vae(hunyuan)


def test_frame_causal_mask_is_read_or_refused():
    from diffusers.models.autoencoders.autoencoder_kl_hunyuan_video import prepare_causal_attention_mask

    from raydit.models.vae_parallel import _frame_of_each_token

    mask = prepare_causal_attention_mask(3, 10, torch.float32, "cpu", batch_size=2)[:, None]  # [B, heads, S, S]
    assert _frame_of_each_token(mask).tolist() == [f for f in range(3) for _ in range(10)]
    assert _frame_of_each_token(mask[0, 0] == 0).tolist() == [f for f in range(3) for _ in range(10)]
    within = mask.clone()
    within[..., 5, 5:10] = float("-inf")  # a query of frame 0 that does not see all of frame 0
    with pytest.raises(ValueError, match="not frame-causal"):
        _frame_of_each_token(within)
    padded = mask.clone()
    padded[1, 0, :, -1] = float("-inf")  # a padding mask that differs per batch item
    with pytest.raises(ValueError, match="shared by the batch"):
        _frame_of_each_token(padded)
    with pytest.raises(ValueError, match="0 and -inf only"):
        _frame_of_each_token(torch.full_like(mask, 0.5))
