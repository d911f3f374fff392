"""The engine's side of the KV cache: the pool's tensors and what moves them.

``pool`` (allocating the pool's tensors, and ``kv_bytes_per_token``: the one formula for what a
token costs in every KV dtype, which the engine sizes the pool with), ``int8`` (the int8 KV
format: codes plus a scale per token and head, its writer and reader), ``budget`` (how much GPU
memory the pool may take, by profiling a step) and ``transfer`` (copying blocks between the
pool and the host / disk tiers of ``cache.tiers``).

Contract: the block bookkeeping (ids, hashes, ref counts) is ``cache``'s; this package only
holds and moves the bytes behind the block ids it is given.
"""
