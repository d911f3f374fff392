"""Token logprobs in the OpenAI shapes: chat's ``logprobs.content`` and completions'
``tokens`` / ``token_logprobs`` / ``top_logprobs`` / ``text_offset`` (prompt logprobs for
``echo`` included, the first prompt token's being null, as in vLLM).

Contract: a logprob is clamped at ``MIN_LOGPROB`` (JSON has no -inf); a token's text is its
own ``tokenizer.decode([id])``, cached per id.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from kvtypes.outputs import TokenLogprob

MIN_LOGPROB = -9999.0


class LogprobFormatter:
    def __init__(self, tokenizer: Any) -> None:
        self.token_text = lru_cache(maxsize=65536)(lambda token_id: tokenizer.decode([token_id]))

    def chat(self, entries: list[TokenLogprob]) -> dict[str, Any]:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": max(logprob, MIN_LOGPROB), "bytes": list(text.encode("utf-8"))}

        return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]}
                            for e in entries], "refusal": None}

    def prompt(self, prompt_ids: list[int], entries: list[TokenLogprob]) -> dict[str, Any]:
        """Completion-style logprobs of the prompt: the first token has none (null), as in vLLM."""
        rest = self.completion(entries, len(self.token_text(prompt_ids[0])))
        first = self.token_text(prompt_ids[0])
        return {"tokens": [first] + rest["tokens"], "token_logprobs": [None] + rest["token_logprobs"],
                "top_logprobs": [None] + rest["top_logprobs"], "text_offset": [0] + rest["text_offset"]}

    def completion(self, entries: list[TokenLogprob], offset: int = 0) -> dict[str, Any]:
        tokens = [self.token_text(e.token_id) for e in entries]
        text_offset = []
        for token in tokens:
            text_offset.append(offset)
            offset += len(token)
        return {"tokens": tokens, "token_logprobs": [max(e.logprob, MIN_LOGPROB) for e in entries],
                "top_logprobs": [{self.token_text(t): max(lp, MIN_LOGPROB) for t, lp in e.top} for e in entries],
                "text_offset": text_offset}


def concat_logprobs(first: dict[str, Any], second: dict[str, Any]) -> dict[str, Any]:
    """Completion logprobs of the prompt then of the output (the output's offsets shifted)."""
    shift = sum(len(t) for t in first["tokens"])
    return {"tokens": first["tokens"] + second["tokens"],
            "token_logprobs": first["token_logprobs"] + second["token_logprobs"],
            "top_logprobs": first["top_logprobs"] + second["top_logprobs"],
            "text_offset": first["text_offset"] + [o + shift for o in second["text_offset"]]}
