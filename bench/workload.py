"""The requests the suite sends: chat prompts, and token-id requests of set or mixed lengths.

A ``BenchRequest`` is a prompt of token ids and the exact number of tokens to generate (EOS
ignored or masked), so every side of a comparison produces the same tokens' worth of work.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any


# Chat-style requests (short questions, as a chat UI sends them). Rendered with the model's
# chat template when it has one.
CHAT_QUESTIONS = [
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain how a hash table works in simple terms.",
    "Give me three tips for learning to play the guitar.",
    "What is the difference between a list and a tuple in Python?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do vaccines train the immune system?",
    "Write a Python function that reverses a string.",
    "What are the main causes of climate change?",
    "Describe a healthy breakfast.",
    "Why is the sky blue?",
    "Translate 'good morning, how are you?' into Spanish.",
    "What is photosynthesis?",
    "Give me a recipe for pancakes.",
    "How does a bicycle stay upright?",
    "List five famous painters and one work by each.",
    "What is machine learning?",
    "Explain recursion to a ten year old.",
    "What should I pack for a weekend hiking trip?",
    "How do I make a good cup of coffee?",
    "Tell me a fun fact about octopuses.",
    "What is the Pythagorean theorem?",
    "Write an email asking my manager for a day off.",
    "How does the internet work?",
]


def chat_prompts(tokenizer: Any, n: int, offset: int = 0, vocab_size: int | None = None,
                 seed: int = 0, length: int = 24) -> list[list[int]]:
    """``n`` chat-style prompts as token ids (``offset`` picks a disjoint set of questions).

    Without a tokenizer (tiny test models) the prompts are random ids of ``length`` tokens.
    """
    if tokenizer is None:
        rng = random.Random(seed * 7919 + offset)
        low = min(3, vocab_size - 1)
        return [[rng.randrange(low, vocab_size) for _ in range(length)] for _ in range(n)]
    from engine.tokenizer import encode_chat, encode_prompt

    prompts = []
    for i in range(n):
        question = CHAT_QUESTIONS[(offset + i) % len(CHAT_QUESTIONS)]
        if (offset + i) >= len(CHAT_QUESTIONS):
            question += f" (variant {(offset + i) // len(CHAT_QUESTIONS)})"
        messages = [{"role": "user", "content": question}]
        if getattr(tokenizer, "chat_template", None):
            prompts.append(encode_chat(tokenizer, messages))
        else:
            prompts.append(encode_prompt(tokenizer, question))
    return prompts


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def make_requests(num_requests: int = 64, prompt_len: tuple[int, int] = (50, 1000),
                  output_len: tuple[int, int] = (16, 256), vocab_size: int = 49152, seed: int = 0,
                  low_token_id: int = 100) -> list[BenchRequest]:
    """Deterministic mixed workload: uniform prompt and output lengths, random token ids."""
    rng = random.Random(seed)
    low = min(low_token_id, vocab_size - 1)
    requests = []
    for _ in range(num_requests):
        n = rng.randint(*prompt_len)
        requests.append(BenchRequest([rng.randrange(low, vocab_size) for _ in range(n)], rng.randint(*output_len)))
    return requests


def synthetic_requests(num: int, prompt_len: int, output_len: int, vocab_size: int, seed: int,
                       shared_prefix: int = 0, low_token_id: int = 100) -> list[BenchRequest]:
    """``num`` prompts of exactly ``prompt_len`` token ids; the first ``shared_prefix`` are common
    to every prompt of every seed (ids drawn from ``[low_token_id, vocab)`` to avoid specials)."""
    low = min(low_token_id, vocab_size - 1)
    shared_rng = random.Random(1_000_003)
    prefix = [shared_rng.randrange(low, vocab_size) for _ in range(min(shared_prefix, prompt_len - 1))]
    rng = random.Random(seed)
    return [BenchRequest(prefix + [rng.randrange(low, vocab_size) for _ in range(prompt_len - len(prefix))], output_len)
            for _ in range(num)]
