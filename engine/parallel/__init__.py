"""Tensor parallelism over torch.distributed: one process per rank.

``tensor_parallel`` (sharding the weights, launching and serving the rank processes, rank 0's
``TensorParallelRanks``), ``comm`` (the process groups and their collectives) and
``block_copy`` (KV tier payloads gathered from and scattered to every rank's heads). The model
itself is the single-rank one with its matmuls bound for a shard (engine/model/parallel_linear.py).
"""
