"""Compatibility alias: ``SamplingParams`` lives in :mod:`kvtypes.sampling_params`."""
from kvtypes.sampling_params import GREEDY_TEMPERATURE_EPS, MAX_LOGIT_BIAS, MAX_TOP_LOGPROBS, SamplingParams

__all__ = ["GREEDY_TEMPERATURE_EPS", "MAX_LOGIT_BIAS", "MAX_TOP_LOGPROBS", "SamplingParams"]
