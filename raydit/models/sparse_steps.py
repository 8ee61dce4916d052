"""A request's sparse attention (raydit.planner.sparse) in the Runner's steps.

- which steps run sparse: all but the request's first `dense_step_count(steps)` (a step counts
  once, however many transformer calls CFG makes in it);
- which calls: the video self-attention of the blocks past the setting's `dense_layers`; a
  joint sequence's text rows and columns stay whole (the mask is placed at the video part of
  the call's layout, raydit.parallel.kernels.sparse.VideoMask);
- how the mask reaches the kernel: raydit.parallel.attention.sparse_attention hands it to every
  sp_attention of the step, so the families' processors stay as they are. A Runner without
  processors (one rank, bf16) gets them for the step on a one-rank mesh, removed after it.

The token grid is the family's (`Family.token_grid`: its latents after patching); a family
that does not say has no sparse attention and its sparse requests are refused.
"""

from __future__ import annotations

import contextlib
from typing import Any

# Said in the refusal; each is a family whose Family.token_grid answers (README, Sparse attention).
SPARSE_FAMILIES = ("Wan 2.1 / 2.2, SkyReels-V2 (not diffusion forcing), HunyuanVideo, CogVideoX, Mochi and "
                   "LTX-Video")


def sparse_setting(state) -> Any:
    """The SparseConfig `state`'s current step runs, or None (dense request, or a dense step)."""
    config = state.request.sparse_attention
    if config is None or state.step_index < config.dense_step_count(state.request.num_inference_steps):
        return None
    return config


def _not_available(pipeline_class: str, family) -> ValueError:
    return ValueError(f"sparse attention is not available for {pipeline_class} (family {family.name!r}) yet; it "
                      f"runs on {SPARSE_FAMILIES}: drop sparse_attention")


def check_sparse_request(family, pipe, state) -> None:
    """Refuse (one line) a sparse request this family or this geometry cannot run."""
    config = state.request.sparse_attention
    if config is None:
        return
    grid = family.token_grid(pipe, state)
    if grid is None:
        raise _not_available(type(pipe).__name__, family)
    config.check_grid(grid)


def check_sparse_for_model(model_dir, config, grid: tuple[int, int, int]) -> None:
    """On the driver, before any worker loads the model: refuse (one line) sparse setting
    `config` for a model directory whose pipeline has no token grid, or whose `grid` (the
    planner's geometry of the request) the setting's tiles do not divide."""
    from pathlib import Path

    from raydit.models.loading import pipeline_class
    from raydit.models.registry import family_for_class

    name = pipeline_class(Path(model_dir))
    family = family_for_class(name)
    if not family.has_token_grid(name):
        raise _not_available(name, family)
    config.check_grid(grid)


def _video_part(family) -> int:
    plan = family.adapter.plan
    for split in plan.split_inputs:
        if split.arg == "hidden_states":
            return split.part
    return 0


class _Source:
    """source(layout) -> the VideoMask of one sp_attention call, or None (dense)."""

    def __init__(self, config, grid: tuple[int, int, int], video_part: int):
        self.config, self.grid, self.video_part = config, grid, video_part
        self.tokens = grid[0] * grid[1] * grid[2]
        self.block = 0  # the block running now (a pre-hook on every block sets it)
        self._masks: dict = {}
        self.sparse_calls = self.masked = 0  # calls past the dense layers; of them, given a mask

    def __call__(self, layout):
        from raydit.parallel.kernels.sparse import VideoMask

        parts = layout.part_lengths
        if self.block < self.config.dense_layers or len(parts) <= self.video_part:
            return None
        self.sparse_calls += 1
        if parts[self.video_part] != self.tokens:
            return None  # another stream's attention (an audio part): no video grid to mask
        self.masked += 1
        mask = self._masks.get(parts)
        if mask is None:  # one per layout: its class table and block order are built once
            mask = self._masks[parts] = VideoMask(self.config, self.grid, sum(parts[:self.video_part]), sum(parts))
        return mask


@contextlib.contextmanager
def sparse_step(family, pipe, config, grid, attention_mode: str, parallelized: bool):
    """The context of one step's transformer calls under `config` (None: nothing to do)."""
    if config is None:
        yield
        return
    from raydit.models.registry import parallelize
    from raydit.parallel.attention import sparse_attention
    from raydit.parallel.mesh import with_attention

    source = _Source(config, grid, _video_part(family))
    with contextlib.ExitStack() as stack:
        for transformer in family.transformers(pipe):
            if not parallelized:
                handle = parallelize(transformer, with_attention(None, attention_mode))
                stack.callback(handle.remove)
            for index, block in enumerate(family.adapter.plan.block_list(transformer)):
                def enter(module, args, index=index):
                    source.block = index
                stack.callback(block.register_forward_pre_hook(enter).remove)
        stack.enter_context(sparse_attention(source))
        yield
    if source.sparse_calls and not source.masked:
        # Never a silently dense step: a grid that matches no call is the family's mistake.
        raise RuntimeError(f"sparse attention: none of this step's {source.sparse_calls} attention calls has the "
                           f"{source.tokens} video tokens of the grid {grid} ({type(family).__name__}.token_grid)")
