"""Compatibility alias: the output value types live in :mod:`kvtypes.outputs`."""
from kvtypes.outputs import RequestOutput, TokenLogprob

__all__ = ["RequestOutput", "TokenLogprob"]
