"""Plain value types shared by every layer: ``SamplingParams`` (with the ``StructuredOutputSpec``
and ``CachePolicy`` it may carry) and the per-request outputs.

Contract: this package imports nothing from the rest of kvserve (no cache, scheduler, engine
or server), and nothing here touches tensors, threads or I/O, so any layer may depend on it
and every value pickles across the engine-core process boundary.
"""
from kvtypes.cache_policy import CachePolicy
from kvtypes.outputs import RequestOutput, TokenLogprob
from kvtypes.sampling_params import SamplingParams
from kvtypes.structured_spec import StructuredOutputSpec

__all__ = ["CachePolicy", "RequestOutput", "SamplingParams", "StructuredOutputSpec", "TokenLogprob"]
