"""The engine: everything that computes, below the HTTP server and above the scheduler.

One folder or file per concept:

- ``llm_engine``: ``LLMEngine`` (add / abort / one scheduled forward pass per ``step()`` /
  offline ``generate``); ``builder`` turns an ``EngineConfig`` into its parts; ``stats`` its
  counters; ``config`` the engine's dataclass configs; ``paths`` the cache folders on disk;
  ``tokenizer`` chat templates and prompt encoding.
- ``core/``: the engine core loop in its own process, its protocol, the clients, and the
  client-side output processor and detokenizer.
- ``model/``: the Llama-family model over the paged pool and the runner of one step.
- ``loader/``: ``load_model`` from local disk (safetensors directories and GGUF files).
- ``attention/``: step metadata, the backend interface with its registry and backends.
- ``kernels/``: native CPU kernels (``cpu/``, C++ built on first use) and Triton kernels.
- ``kv/``: the pool's tensors, KV dtypes and bytes per token, block transfer for the tiers.
- ``sampling/``: the sampler and structured outputs.
- ``parallel/``: tensor parallelism (process group, rank processes, block copies).
- ``platform/``: process-level host settings (OpenMP threads, malloc arenas).

Contract: no HTTP (never imports FastAPI, ``server``, ``kvserve`` or ``bench``). Only the engine
core's thread touches an ``LLMEngine`` once it serves; everything else talks to it through an
``EngineClient`` and sees it only through ``engine.core.protocol`` messages (token ids, finish
states, ``StepStats``). Detokenization and stop strings happen in
``engine.core.output_processor``, on the client side.
"""
