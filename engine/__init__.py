"""The engine: model loading (GGUF / safetensors), the Llama-family model over the paged KV pool,
attention and linear backends, the runner and sampler, ``LLMEngine`` (one scheduled forward pass
per ``step()``), the engine core loop (``engine.core.loop``) and its clients (``engine.core.client``).

Contract: no HTTP (never imports FastAPI or ``server``). Only the engine core's thread touches an
``LLMEngine`` once it serves; everything else talks to it through an ``EngineClient`` and sees it
only through ``engine.core.protocol`` messages (token ids, finish states, ``StepStats``).
Detokenization and stop strings happen in ``engine.core.output_processor``, on the client side.
"""
