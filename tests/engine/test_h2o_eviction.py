"""H2O eviction through the engine (the torch attention backend and the native one, with the
native decode path: both export per-block attention mass from the softmax they compute) against
a torch reference that builds the same kept set
explicitly: transformers' own Llama in eager attention, returning its attention probabilities;
the reference sums them per kept block (over layers, heads and query rows), applies the same
block rule (sinks, recent tokens and the open block kept; the lightest other blocks out over the
budget) and cuts the evicted entries out of its cache. Keys stay at their text positions.

The tiny model's context is 128; the sequence runs 80 + 40 tokens under a 32-token budget, in
8-token prefill chunks: it evicts in prefill and in decode, leaving holes anywhere past the sinks.
"""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from bench.probes.kv_eviction import evict_h2o
from kvtypes.sampling_params import SamplingParams
from tests.helpers import tiny_engine, tiny_hf_model, tiny_llama_config

BLOCK, CHUNK, CONTEXT = 4, 8, 128


@pytest.fixture(scope="module")
def hf():
    model = tiny_hf_model(tiny_llama_config(max_position_embeddings=CONTEXT))
    model.config._attn_implementation = "eager"  # attention probabilities come back
    return model


@torch.inference_mode()
def reference_h2o(hf, prompt: list[int], max_tokens: int, sinks: int, budget: int, recent: int,
                  holes: list[int] | None = None) -> list[int]:
    """Greedy tokens of ``prompt`` under block-granular H2O, chunked as the engine runs it."""
    sink_blocks = -(-sinks // BLOCK)
    cache = DynamicCache()
    kept: list[int] = []  # text positions held, in cache order
    mass: list[float] = []  # accumulated attention per kept block (cache order)
    tokens = list(prompt)
    c = 0
    out: list[int] = []
    while len(out) < max_tokens:
        n = min(CHUNK, len(tokens) - c)
        kept, mass = evict_h2o(cache, kept, mass, BLOCK, sink_blocks, recent, budget)
        ids = torch.tensor([tokens[c:c + n]])
        positions = torch.tensor([list(range(c, c + n))])
        cache_position = torch.arange(len(kept), len(kept) + n)
        result = hf(input_ids=ids, position_ids=positions, cache_position=cache_position, past_key_values=cache,
                    use_cache=True, output_attentions=True)
        kept.extend(range(c, c + n))
        per_key = sum(a[0].float().sum(dim=(0, 1)) for a in result.attentions)  # [len(kept)]
        width = -(-len(kept) // BLOCK)
        mass.extend([0.0] * (width - len(mass)))
        for s, m in enumerate(per_key.tolist()):
            mass[s // BLOCK] += m
        c += n
        if c == len(tokens):
            out.append(int(result.logits[0, -1].argmax()))
            tokens.append(out[-1])
    if holes is not None:
        blocks = sorted({t // BLOCK for t in kept})
        holes.extend(b for b in range(blocks[-1]) if b not in blocks)
    return out


PROMPT = [(i * 7) % 120 + 3 for i in range(80)]


def h2o_engine(hf, backend: str, sinks: int, budget: int, recent: int, **options):
    """A tiny engine under h2o that records every plan's evicted block-table indices
    (``engine.plans``) and each step's block mass as the pool receives it (``engine.masses``);
    with ``native``, also counts the native decode calls that exported mass."""
    if backend == "native":
        from tests.helpers import require_native_kernel
        require_native_kernel()
    engine = tiny_engine(hf, block_size=BLOCK, num_blocks=64, max_num_batched_tokens=CHUNK,
                         attention_backend=backend, kv_eviction="h2o", kv_sink_tokens=sinks,
                         kv_budget_tokens=budget, kv_recent_tokens=recent, **options)
    policy, model = engine.kv_cache.eviction, engine.runner.model
    engine.plans, engine.masses, engine.native_mass_steps = [], [], 0
    plan, add_mass = policy.plan, engine.kv_cache.add_block_mass

    def adding(request_id, mass):
        engine.masses.append(list(mass))
        add_mass(request_id, mass)

    engine.kv_cache.add_block_mass = adding

    def recording(seq):
        result = plan(seq)
        if result.indices:
            engine.plans.append(result.indices)
        return result

    policy.plan = recording
    if backend == "native":
        assert model.attn.name == "native" and model.decode_path == "native"
        run = model.native.run

        def counting(x, cos, sin, meta, *args, **kwargs):
            engine.native_mass_steps += meta.block_mass is not None
            return run(x, cos, sin, meta, *args, **kwargs)

        model.native.run = counting
    return engine


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("sinks, budget, recent", [(4, 32, 8), (0, 24, 4)])
def test_h2o_engine_equals_the_explicit_kept_set(hf, sinks, budget, recent, backend):
    engine = h2o_engine(hf, backend, sinks, budget, recent)
    holes: list[int] = []
    want = reference_h2o(hf, PROMPT, 40, sinks, budget, recent, holes)
    out = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))[0]
    assert out.token_ids == want
    if backend == "native":  # the decode steps ran natively, with torch's mass, and the same blocks left
        assert engine.native_mass_steps >= 39
        torch_engine = h2o_engine(hf, "torch", sinks, budget, recent)
        torch_engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
        assert len(engine.masses) == len(torch_engine.masses) == 10 + 39
        for got, ref in zip(engine.masses, torch_engine.masses):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=1e-4, atol=1e-4)
        assert engine.plans == torch_engine.plans
    # not what streaming would keep: the evicted blocks are not one run right after the sinks
    sink_blocks = -(-sinks // BLOCK)
    assert holes and holes != list(range(sink_blocks, sink_blocks + len(holes)))
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.num_blocks_held() == 0
    assert engine.kv_cache.num_evicted_blocks_total > 0


def test_dense_steps_are_unchanged_by_the_mass_export(hf):
    """A budget the sequence never reaches: the explicit-softmax path equals plain SDPA's tokens."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    dense = tiny_engine(hf, block_size=BLOCK, num_blocks=64, max_num_batched_tokens=CHUNK, attention_backend="torch")
    h2o = tiny_engine(hf, block_size=BLOCK, num_blocks=64, max_num_batched_tokens=CHUNK, attention_backend="torch",
                      kv_eviction="h2o", kv_budget_tokens=CONTEXT)
    assert h2o.generate([PROMPT], params)[0].token_ids == dense.generate([PROMPT], params)[0].token_ids
    assert h2o.kv_cache.num_evicted_blocks_total == 0


def test_backends_without_block_mass_are_refused_naming_why(hf, monkeypatch):
    """Every backend that runs here exports the mass (torch, native, triton); flash_attn cannot,
    and is CUDA-only, so the builder's refusal is checked on torch with its export switched off."""
    from engine.attention.torch_sdpa import TorchAttention
    monkeypatch.setattr(TorchAttention, "exports_block_mass", False)
    monkeypatch.setattr(TorchAttention, "block_mass_refusal", "no probabilities here (test)")
    with pytest.raises(ValueError, match=r"kv_eviction 'h2o' needs the attention mass per block.*torch.*"
                                         r"no probabilities here \(test\)"):
        tiny_engine(hf, block_size=BLOCK, num_blocks=64, max_num_batched_tokens=CHUNK, attention_backend="torch",
                    kv_eviction="h2o", kv_budget_tokens=32, cuda_graphs=False)


def test_h2o_caps_a_request_at_the_context(hf):
    """Keys keep their text positions: a prompt + max_tokens past the context is refused."""
    from engine.core.protocol import PromptTooLongError
    engine = tiny_engine(hf, block_size=BLOCK, num_blocks=64, max_num_batched_tokens=CHUNK, attention_backend="torch",
                         kv_eviction="h2o", kv_budget_tokens=32)
    with pytest.raises(PromptTooLongError):
        engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=CONTEXT, ignore_eos=True))


def test_block_mass_is_each_rows_softmax_per_block_and_the_output_sdpas(monkeypatch):
    """The torch backend's export: with ``block_mass`` set, outputs equal plain SDPA's; each query
    row and head contributes 1 in all, split over the blocks of its own table (padding masked
    out); a prefill chunk sliced into row groups gives the same numbers."""
    import engine.attention.torch_sdpa as sdpa
    from engine.attention.metadata import AttentionMetadata, DecodeGroup, PrefillChunk

    torch.manual_seed(0)
    heads, kv_heads, d, bs, n = 4, 2, 8, 4, 11
    q, k, v = torch.randn(n + 2, heads, d), torch.randn(n + 2, kv_heads, d), torch.randn(n + 2, kv_heads, d)
    pool = torch.randn(2, 16, bs, kv_heads, d)
    # rows 0, 1: decodes over blocks [5, 6] (7 tokens) and [9, 10, 11] (10 tokens); then an 11-token fresh chunk
    slots = torch.tensor([6 * bs + 2, 11 * bs + 1] + list(range(n)))
    lens = torch.tensor([7, 10])
    group = DecodeGroup(0, 2, 10, torch.tensor([5, 6, 0, 9, 10, 11]),
                        (torch.arange(10)[None, :] < lens[:, None])[:, None, None, :], lens)

    def run(mass: bool, rows: int = 256):
        monkeypatch.setattr(sdpa, "MASS_QUERY_ROWS", rows)
        meta = AttentionMetadata(slots, [group], [PrefillChunk(2, n + 2, n, None, None)],
                                 block_mass=torch.zeros(3, 3) if mass else None)
        out = sdpa.TorchAttention().forward(q, k, v, pool[0].clone(), pool[1].clone(), meta)
        return out, meta.block_mass

    plain, _ = run(False)
    out, mass = run(True)
    sliced, mass_sliced = run(True, rows=3)
    assert torch.allclose(out, plain, atol=1e-5) and torch.allclose(sliced, out, atol=1e-5)
    assert torch.allclose(mass, mass_sliced, atol=1e-5)
    assert torch.allclose(mass.sum(-1), torch.tensor([heads, heads, heads * n], dtype=torch.float32), atol=1e-4)
    assert mass[0, 2] == 0  # row 0 holds two blocks: nothing falls on the padding


def test_native_decode_mass_equals_the_python_torch_layers_on_the_default_model():
    """The default model at the CPU defaults (native backend, native decode path, fp16 KV) under
    h2o: every step the native path takes (all-decode steps; mixed steps whose decode rows run
    natively and whose fresh chunk runs in torch; mixed steps whose continuing chunk's tokens are
    native rows too) is also run on the Python layers with the torch backend, and the block mass
    each sequence gets (over 30 layers, 9 heads, its query rows) must agree to fp32 summation
    order (measured within 1e-5). fp32 activations: with int8 ones the two paths quantize inputs
    that differ in summation order, a code rounds the other way now and then, and the mass moved
    by up to 0.6% in one run, which would hide a mistake of that size."""
    import dataclasses

    from cache import CacheConfig
    from engine.attention.torch_sdpa import TorchAttention
    from engine.config import EngineConfig, ModelConfig
    from engine.llm_engine import LLMEngine
    from engine.loader import load_model
    from scheduler.config import SchedulerConfig
    from tests.helpers import require_native_kernel

    require_native_kernel()
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(num_threads=1, max_model_len=256, activation_quant="none"),
        cache=CacheConfig(num_blocks=32, kv_eviction="h2o", kv_sink_tokens=4, kv_budget_tokens=64,
                          kv_recent_tokens=16),
        scheduler=SchedulerConfig(max_num_batched_tokens=16, max_num_seqs=4)), load_model(None, torch.float32, False))
    model = engine.runner.model
    assert model.attn.name == "native" and model.decode_path == "native"
    inner, kinds, failures = model.forward, [], []  # the engine retries a step that raises: keep its failure

    def compared(input_ids, positions, meta, kv_caches):
        decodes = model.native.rows(meta, kv_caches)
        if not decodes:
            return inner(input_ids, positions, meta, kv_caches)
        groups = [dataclasses.replace(g, mask=(torch.arange(g.length)[None] < g.context_lens[:, None])[:, None, None])
                  for g in meta.decode_groups]  # the torch backend masks the padding the native one skips
        ref = dataclasses.replace(meta, decode_groups=groups, block_mass=torch.zeros_like(meta.block_mass))
        native, attn = model.native, model.attn
        model.native, model.attn = None, TorchAttention()
        try:
            inner(input_ids, positions, ref, kv_caches)
        finally:
            model.native, model.attn = native, attn
        hidden = inner(input_ids, positions, meta, kv_caches)
        try:
            torch.testing.assert_close(meta.block_mass, ref.block_mass, rtol=1e-4,
                                       atol=1e-4 * ref.block_mass.max().item())
        except AssertionError as exc:
            failures.append(exc)
            raise
        kinds.append("decode" if not meta.prefills else "chunk rows" if decodes == input_ids.shape[0] else "split")
        return hidden

    model.forward = compared
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    engine.add_request([(5 * j) % 900 + 10 for j in range(70)], params)
    for _ in range(5):
        engine.step()
    engine.add_request([(7 * j) % 900 + 20 for j in range(60)], params)  # chunked beside the first one's decodes
    while engine.has_unfinished():
        engine.step()
    assert not failures, failures[0]
    assert {"decode", "split", "chunk rows"} <= set(kinds), kinds
    assert engine.kv_cache.num_evicted_blocks_total > 0
    engine.kv_cache.check_invariants()
