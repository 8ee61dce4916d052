"""Sequence-parallel attention on torch.distributed; knows nothing of Ray or models."""
