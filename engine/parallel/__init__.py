"""Tensor parallelism over torch.distributed: one process per rank (see tensor_parallel.py)."""
