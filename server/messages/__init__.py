"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``) on the chat pipeline.

Contract: a Messages request is validated strictly (``protocol``: unknown fields are a 400
naming them), translated into a ``ChatCompletionRequest`` (``translate``) and run through
``OpenAIServing.prepare_chat`` and its job merger, so it shares the scheduler, prefix cache,
pins, grammars and tool calls with chat completions; ``serving`` formats the result as a
``message`` or as Anthropic's SSE events, and ``errors`` gives every error on these routes
Anthropic's shape. What each request field does is one table (``fields``), also rendered into
docs/api.md. ``routes`` adds the two routes and their auth (``x-api-key`` or bearer).
"""
