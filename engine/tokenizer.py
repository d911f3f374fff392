"""Prompt encoding: plain text and chat messages through the tokenizer's own chat template."""
from __future__ import annotations

from typing import Any, Sequence


class TemplateError(ValueError):
    """The chat messages cannot be rendered by this model's template."""


def encode_prompt(tokenizer: Any, text: str) -> list[int]:
    """Plain-text prompt -> ids, with the model's special prefix (e.g. BOS) as HF adds it."""
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


# apply_chat_template's own arguments: a template kwarg of one of these names would replace them
RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "chat_template",
                                      "add_generation_prompt", "continue_final_message", "tokenize", "padding",
                                      "truncation", "max_length", "return_tensors", "return_dict",
                                      "return_assistant_tokens_mask", "tokenizer_kwargs"})


def encode_chat(tokenizer: Any, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict[str, Any]] | None = None,
                template_kwargs: dict[str, Any] | None = None) -> list[int]:
    """Render ``messages`` with the tokenizer's chat template and tokenize the result.

    The template text already holds the special tokens it needs, so no extra BOS is added.
    ``template_kwargs`` are variables for the template (e.g. ``enable_thinking``); none may be
    one of ``RESERVED_TEMPLATE_KWARGS`` (the caller checks).
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise TemplateError("this model has no chat template; use /v1/completions")
    try:
        extra = dict(template_kwargs or {})
        if tools:  # only for templates with a tools section
            extra["tools"] = tools
        text = tokenizer.apply_chat_template(list(messages), add_generation_prompt=add_generation_prompt,
                                             tokenize=False, **extra)
    except Exception as exc:  # jinja raises TemplateError subclasses with useful messages
        raise TemplateError(f"chat template failed: {exc}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
