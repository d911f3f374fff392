"""From logits to tokens: ``sampler`` (penalties, logit bias, temperature, top-k/p, min-p,
seeded sampling, logprobs: one batched pipeline) and ``structured_output`` (grammars for
JSON schemas, regexes and tool calls, compiled by llguidance, applied as token bitmasks).

Contract: a greedy row equals ``argmax`` of its (masked) logits; a seeded row is reproducible
whatever it is batched with.
"""
