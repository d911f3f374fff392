"""OpenAI-compatible HTTP frontend of kvserve: the FastAPI app, the OpenAI protocol, response
formatting and SSE, errors, auth and limits, metrics.

Contract: it talks to the engine only through an ``engine.core.client.EngineClient`` (requests in,
``RequestOutput``s and ``StepStats`` snapshots out); it never touches blocks, tensors or an
``LLMEngine``, and never imports ``bench`` or ``kvserve`` (the CLI and composition root sit above).
Clients see generic engine error messages; the details go to the log.
"""

__version__ = "0.1.0"
