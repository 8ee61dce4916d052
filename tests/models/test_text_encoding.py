"""Text encoding once per request (raydit.models.text_encoding): the replica's rank 0 encodes,
the other ranks drop their encoders and receive the embeddings by broadcast.

One spawned group of 3 gloo ranks runs the tiny CogVideoX and the tiny Wan pipeline (loaded
from their directories, as a worker loads them) on 2 ranks (ring 2; cfg 2) and 3 ranks (ring
3), then a "recovery": global rank 0 leaves and ranks 1, 2 form a new mesh, so the new rank 0
is a rank that dropped its encoders and must reload them to encode.

Tolerance (float32): the model inputs each rank holds equal one process's at rtol 1e-4, atol
1e-5 (the encoding rank runs the same encoder as one process; receivers get its bits). The
denoising that follows is the conformance suite's (tests/models/test_conformance.py: every
family, every plan against one process, through the same prepare).
"""

import functools

import pytest
import torch

from raydit.parallel.testing import run_distributed

MODELS = ("tiny", "tiny-wan")
PLANS = ((1, 2, 1), (1, 1, 2), (1, 3, 1))  # (ulysses, ring, cfg)
DECODE_PLAN = (1, 3, 1)
EMBED_TOL = dict(rtol=1e-4, atol=1e-5)


def _request(name):
    from raydit.models import GenerationRequest

    # 8 and 6 latent rows: the decode splits over 3 ranks (bands of 3, 3, 2 and 2, 2, 2)
    size = dict(num_frames=5, height=64, width=64) if name == "tiny" else dict(num_frames=5, height=48, width=80)
    return GenerationRequest(prompt="a red fox runs", negative_prompt="blurry", num_inference_steps=2,
                             guidance_scale=6.0, seed=7, **size)


def _encoder_params(pipe) -> int:
    return sum(p.numel() for name in ("text_encoder", "text_encoder_2", "image_encoder")
               for p in (getattr(pipe, name, None) or torch.nn.Module()).parameters())


def _branches(runner, request):
    return runner.prepare(request).branches


def encoding_worker(rank, world, dirs):
    import gc
    import weakref

    from raydit.models import Runner
    from raydit.models.loading import load_pipeline
    from raydit.parallel.mesh import build_mesh, release_mesh

    out = {}
    for name in MODELS:
        pipe = load_pipeline(dirs[name])
        request = _request(name)
        encoder_ref = weakref.ref(pipe.text_encoder)
        for plan in PLANS:
            mesh = build_mesh(*plan, ranks=list(range(plan[0] * plan[1] * plan[2])))
            if mesh is not None:
                runner = Runner(pipe, mesh)
                gc.collect()
                state = runner.prepare(request)
                out[(name, plan)] = {"params": _encoder_params(runner.pipe), "freed": encoder_ref() is None,
                                     "cfg_rank": mesh.cfg_rank, "branches": state.branches}
                if plan == DECODE_PLAN:  # the initial latents, decoded over the 3 ranks
                    out[(name, "decode")] = {"frames": runner.decode(state, on_ranks=True),
                                             "ranks": runner.decode_ranks}
                runner.close()
            release_mesh(mesh)
        # Recovery: global rank 0 is gone; ranks 1 and 2 form ring 2 and the new rank 0
        # (global 1) dropped its encoders under the meshes above.
        mesh = build_mesh(1, 2, 1, ranks=[1, 2])
        if mesh is not None:
            runner = Runner(pipe, mesh)
            out[(name, "recovered")] = {"params": _encoder_params(runner.pipe),
                                        "branches": _branches(runner, request)}
            runner.close()
        release_mesh(mesh)
    return out


@functools.cache
def _reference(name):
    from raydit.models import Runner
    from raydit.models.loading import load_pipeline

    pipe = load_pipeline(name)
    request = _request(name)
    runner = Runner(pipe)
    positive, negative = runner.family.encode(pipe, request, torch.device("cpu"), torch.float32)
    state = runner.prepare(request)
    return {"branches": state.branches, "positive": positive, "negative": negative,
            "params": _encoder_params(pipe), "frames": runner.decode(state)}


@pytest.fixture(scope="module")
def results():
    from raydit.models.loading import resolve_model_dir

    # Built here once: three ranks building the same tiny directory at once would race.
    dirs = {name: str(resolve_model_dir(name)) for name in MODELS}
    return run_distributed(encoding_worker, 3, dirs, timeout=600)


@pytest.mark.parametrize("name", MODELS)
def test_n_ranks_encode_once_and_equal_one_process(results, name):
    ref = _reference(name)
    for plan in PLANS:
        world = plan[0] * plan[1] * plan[2]
        for rank in range(world):
            got = results[rank][(name, plan)]
            where = f"{name} {plan} rank {rank}"
            expected = ref["branches"]
            if plan[2] == 2:  # cfg 2: each cfg rank holds its own branch (pipeline order: uncond, cond)
                expected = (ref["negative"] if got["cfg_rank"] == 0 else ref["positive"],)
            assert len(got["branches"]) == len(expected), where
            for mine, theirs in zip(got["branches"], expected):
                assert mine.keys() == theirs.keys(), where
                for key in mine:
                    torch.testing.assert_close(mine[key], theirs[key], **EMBED_TOL, msg=lambda m: f"{where} {key}: {m}")


@pytest.mark.parametrize("name", MODELS)
def test_only_rank_0_holds_the_text_encoder(results, name):
    ref_params = _reference(name)["params"]
    for plan in PLANS:
        world = plan[0] * plan[1] * plan[2]
        assert results[0][(name, plan)]["params"] == ref_params > 0
        for rank in range(1, world):
            got = results[rank][(name, plan)]
            # No parameter left, and the module itself gone (its weights freed), not moved.
            assert got["params"] == 0 and got["freed"], f"{name} {plan} rank {rank}"


@pytest.mark.parametrize("name", MODELS)
def test_a_recovery_without_rank_0_still_encodes(results, name):
    ref = _reference(name)
    new_rank0, other = results[1][(name, "recovered")], results[2][(name, "recovered")]
    assert new_rank0["params"] == ref["params"] and other["params"] == 0
    for got in (new_rank0, other):
        for mine, theirs in zip(got["branches"], ref["branches"]):
            for key in mine:
                torch.testing.assert_close(mine[key], theirs[key], **EMBED_TOL)


@pytest.mark.parametrize("name", MODELS)
def test_only_the_rank_whose_frames_are_kept_postprocesses(results, name):
    """After the parallel decode rank 0 post-processes the gathered video; the others return
    None instead of post-processing a placeholder. Frames within one uint8 level of one
    process (the row-parallel decode sums in another order: tests/models/test_vae_parallel.py)."""
    import numpy as np

    frames = [results[rank][(name, "decode")] for rank in range(3)]
    assert [f["ranks"] for f in frames] == [3, 3, 3]
    assert frames[1]["frames"] is None and frames[2]["frames"] is None
    reference = _reference(name)["frames"]
    got = frames[0]["frames"]
    assert got.dtype == np.uint8 and got.shape == reference.shape
    assert np.abs(got.astype(np.int16) - reference.astype(np.int16)).max() <= 1


def test_drop_and_restore_round_trip_and_a_pipeline_without_a_directory_is_refused():
    """Single process: restore reloads exactly the weights dropped, from the pipeline's own
    directory; a pipeline with no directory to reload from gets one clear ValueError."""
    from raydit.models.loading import load_pipeline
    from raydit.models.registry import family_for_pipeline
    from raydit.models.text_encoding import drop_encoders, restore_encoders

    pipe = load_pipeline("tiny")
    family = family_for_pipeline(pipe)
    weights = {k: v.clone() for k, v in pipe.text_encoder.state_dict().items()}
    assert drop_encoders(pipe, family) == ["text_encoder"] and pipe.text_encoder is None
    assert family.encoders(pipe) == []
    assert restore_encoders(pipe) == ["text_encoder"] and restore_encoders(pipe) == []
    restored = pipe.text_encoder.state_dict()
    assert restored.keys() == weights.keys() and all(torch.equal(restored[k], v) for k, v in weights.items())
    drop_encoders(pipe, family)
    with pytest.raises(ValueError, match="'/nonexistent' has no text_encoder folder to reload them from"):
        restore_encoders(pipe, "/nonexistent")
