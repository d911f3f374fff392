"""OpenAI's Responses API (``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``) on the
chat pipeline.

Contract: a Responses request is validated here (``protocol``, ``fields``), translated into a
``ChatCompletionRequest`` (``translate``) and run through ``OpenAIServing.prepare_chat`` and its
job runner, so it shares the scheduler, prefix cache, grammars and tool calls with chat
completions and costs the same engine work. ``serving`` formats the result as a Response
object or its typed SSE events; ``store`` keeps finished responses (bounded, LRU) for
``previous_response_id`` and retrieval. Nothing here touches the engine directly.
"""
