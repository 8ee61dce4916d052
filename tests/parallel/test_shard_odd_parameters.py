"""Weight sharding (raydit.parallel.shard_weights) on parameters that are not one block's own
contiguous tensors: a parameter shared by two blocks (or used outside them), and a dense
non-contiguous (transposed) weight. Rule: the sharded forward equals the unsharded one bit
for bit (torch.equal), in float32 and bf16, on 2 gloo ranks; remove() gives back the very
values and strides, so the model computes as before it was sharded."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from raydit.parallel.shard_weights import shard_blocks
from raydit.parallel.testing import run_distributed

WIDTH = 64


class Block(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.a = nn.Linear(WIDTH, WIDTH, dtype=dtype)
        self.b = nn.Linear(WIDTH, WIDTH, bias=False, dtype=dtype)
        self.norm = nn.LayerNorm(WIDTH, dtype=dtype)

    def forward(self, x):
        return self.norm(self.b(torch.relu(self.a(x)))) + x


class Model(nn.Module):
    def __init__(self, dtype, case):
        super().__init__()
        self.blocks = nn.ModuleList(Block(dtype) for _ in range(4))
        self.head = nn.LayerNorm(WIDTH, dtype=dtype)
        if case == "shared":  # one norm weight in every block, and the head's bias in block 2
            for block in self.blocks[1:]:
                block.norm.weight = self.blocks[0].norm.weight
            self.blocks[2].norm.bias = self.head.bias
        elif case == "transposed":  # a weight stored transposed: its GEMM reads it with other strides
            for block in self.blocks:
                block.a.weight = nn.Parameter(block.a.weight.data.t().contiguous().t())

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def shard_worker(rank, world, dtype_name, case):
    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    model = Model(dtype, case)
    with torch.no_grad():
        for p in model.parameters():  # norms' weights and biases away from 1 and 0
            p.add_(torch.randn_like(p) * 0.1)
    strides = [tuple(b.a.weight.stride()) for b in model.blocks]
    x = torch.randn(5, WIDTH, dtype=dtype)
    with torch.no_grad():
        reference = model(x)
        handle = shard_blocks(list(model.blocks), dist.group.WORLD, root=model)
        try:
            sharded = [model(x) for _ in range(2)]
        finally:
            handle.remove(None)
        after = model(x)
    return {
        "sharded": [torch.equal(out, reference) for out in sharded],
        "after": torch.equal(after, reference),
        "strides": strides == [tuple(b.a.weight.stride()) for b in model.blocks],
    }


@pytest.mark.parametrize("case", ["shared", "transposed"])
def test_sharded_blocks_equal_unsharded_bit_for_bit_on_odd_parameters(case):
    for dtype_name in ("float32", "bfloat16"):
        for result in run_distributed(shard_worker, 2, dtype_name, case, timeout=120):
            assert result == {"sharded": [True, True], "after": True, "strides": True}, (dtype_name, result)
