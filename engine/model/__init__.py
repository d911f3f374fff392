"""The Llama-family model over the paged KV pool, and how its steps run.

Modules, one concept each:

- ``arch``: the architecture numbers read from a checkpoint's config.
- ``llama``: the model (``LlamaForCausalLM``): embeddings, the layer stack, the LM head, GGUF
  block attachment and weight accounting, and the engine's binding of its matmuls.
- ``decoder_layer``: the one Python definition of a decoder layer (``DecoderLayer``).
- ``rope``: rotary position embeddings (cos/sin tables, their application).
- ``linear``: the dense matmul kernels (``PackedLinear`` on oneDNN, ``F.linear``), the linear
  backend choice and the activation-quantization policy.
- ``block_linear``: linear layers computed from GGUF blocks.
- ``native_decode``: the native decode path (every layer of an all-decode step in one C++
  call): the one place that decides whether it runs, and its binding.
- ``parallel_linear``: the layers under tensor parallelism (row-parallel all-reduce,
  vocab-parallel embedding and LM head) for a ``ModelShard``.
- ``ranks``: the processes that compute the model, as the engine drives them (``ModelRanks``;
  rank 0 of a tensor-parallel group has ``engine.parallel``'s).
- ``runner``: one scheduled step: inputs, attention metadata, forward, sampling.
- ``cuda_graphs``: captured decode steps on CUDA.

Contract: the model computes what transformers computes from the same weights, up to
floating-point summation order (tests/engine/model); a tensor-parallel rank runs the same
model code on its shard. It reads and writes KV only through an attention backend
(``engine.attention``) and knows nothing of requests or HTTP.
"""
