"""Sequence-parallel attention on torch.distributed; knows nothing of Ray or models."""

from raydit.parallel.attention import merge_attention, sp_attention
from raydit.parallel.kernel_report import describe_kernels
from raydit.parallel.kernels import AttentionKernel, select_kernel
from raydit.parallel.mesh import ParallelMesh, build_mesh, gather_sequence
from raydit.parallel.sharding import SeqLayout

__all__ = [
    "AttentionKernel",
    "ParallelMesh",
    "SeqLayout",
    "build_mesh",
    "describe_kernels",
    "gather_sequence",
    "merge_attention",
    "select_kernel",
    "sp_attention",
]
