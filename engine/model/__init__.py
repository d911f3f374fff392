"""The Llama-family model over the paged KV pool, and how its steps run.

``arch`` (the architecture spec read from a config), ``llama`` (the model: embeddings, the
decoder layer, the LM head), ``block_linear`` (linear layers from GGUF blocks), ``runner``
(one scheduled step: inputs, attention metadata, forward, sampling) and ``cuda_graphs``
(captured decode steps on CUDA).

Contract: the model computes what transformers computes from the same weights, up to
floating-point summation order (tests/engine/model). It reads and writes KV only through an
attention backend (``engine.attention``) and knows nothing of requests or HTTP.
"""
