"""StreamingLLM eviction through the engine against a torch reference that builds the same kept
set explicitly: transformers' own Llama over a cache whose evicted entries are cut out and whose
kept keys are rotated back (transformers' rotary embedding at minus the delta) at each rebase.

The tiny model's context is 64 positions, the sequences run to 160 tokens: every sequence
evicts, re-rotates (several rebases) and runs prefill chunks that cross an eviction.
"""
from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from engine.kv.int8 import Int8KV, quantize
from engine.model.rope import apply_rope, rope_cos_sin
from engine.model.rope_shift import apply_rope_shifts
from cache.eviction import RopeShift
from kvtypes.sampling_params import SamplingParams
from tests.helpers import require_native_kernel, tiny_engine, tiny_hf_model, tiny_llama_config

BLOCK, CHUNK, CONTEXT = 4, 8, 64


@pytest.fixture(scope="module")
def hf():
    return tiny_hf_model(tiny_llama_config(max_position_embeddings=CONTEXT))


@torch.inference_mode()
def reference_generate(hf, prompt: list[int], max_tokens: int, sinks: int, window: int) -> list[int]:
    """Greedy tokens of ``prompt`` under sinks + window eviction, chunked as the engine's
    scheduler runs it (CHUNK-token prefill chunks, then one token a step). Kept: the text
    positions below the sink blocks and every block holding one of the last ``window`` tokens
    before the chunk; positions: text - shift, the shift moving the kept window right after the
    sinks whenever the chunk would reach the context."""
    sink_tok = -(-sinks // BLOCK) * BLOCK
    cache = DynamicCache()
    kept: list[int] = []  # text positions held, in cache order
    shift = 0
    tokens = list(prompt)
    c = 0
    out: list[int] = []
    while len(out) < max_tokens:
        n = min(CHUNK, len(tokens) - c)
        first_kept = max(0, c - window) // BLOCK * BLOCK
        keep = [i for i, t in enumerate(kept) if t < sink_tok or t >= first_kept]
        if len(keep) < len(kept):
            index = torch.tensor(keep)
            for layer in cache.layers:
                layer.keys, layer.values = layer.keys[:, :, index], layer.values[:, :, index]
            kept = [kept[i] for i in keep]
        evicted = max(0, first_kept - sink_tok)
        if c + n - shift > CONTEXT and evicted > shift:
            delta = evicted - shift
            moved = torch.tensor([i for i, t in enumerate(kept) if t >= sink_tok])
            for layer in cache.layers:
                k = layer.keys[:, :, moved]
                cos, sin = hf.model.rotary_emb(k, torch.full((1, k.shape[2]), -delta))
                _, k = apply_rotary_pos_emb(k, k, cos, sin)
                layer.keys[:, :, moved] = k
            shift = evicted
        ids = torch.tensor([tokens[c:c + n]])
        positions = torch.tensor([[t - shift for t in range(c, c + n)]])
        cache_position = torch.arange(len(kept), len(kept) + n)
        logits = hf(input_ids=ids, position_ids=positions, cache_position=cache_position, past_key_values=cache,
                    use_cache=True).logits
        assert int(positions.max()) < CONTEXT
        kept.extend(range(c, c + n))
        c += n
        if c == len(tokens):
            out.append(int(logits[0, -1].argmax()))
            tokens.append(out[-1])
    return out


PROMPT = [(i * 7) % 120 + 3 for i in range(100)]


@pytest.mark.parametrize("backend", ["torch", "native"])
@pytest.mark.parametrize("sinks", [4, 0])
def test_evicting_engine_equals_the_explicit_kept_set(hf, backend, sinks):
    if backend == "native":
        require_native_kernel()
    engine = tiny_engine(hf, block_size=BLOCK, num_blocks=64, max_num_batched_tokens=CHUNK,
                         attention_backend=backend, kv_eviction="streaming", kv_sink_tokens=sinks,
                         kv_window_tokens=16)
    out = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))[0]
    assert len(PROMPT) + 60 > 2 * CONTEXT  # the sequence runs well past the context
    assert out.token_ids == reference_generate(hf, PROMPT, 60, sinks, 16)
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.num_blocks_held() == 0
    assert engine.kv_cache.num_evicted_blocks_total > 0


def test_triton_kernels_agree_on_an_evicting_sequence(hf):
    """The Triton paged kernels (Triton's interpreter on the CPU, as tests/engine/attention runs
    them): a shorter run, still crossing evictions in prefill and a rebase (70 + 10 > 64)."""
    pytest.importorskip("triton")
    engine = tiny_engine(hf, block_size=BLOCK, num_blocks=64, max_num_batched_tokens=CHUNK, attention_backend="triton",
                         kv_eviction="streaming", kv_sink_tokens=4, kv_window_tokens=16, cuda_graphs=False)
    out = engine.generate([PROMPT[:70]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0]
    assert out.token_ids == reference_generate(hf, PROMPT[:70], 10, 4, 16)
    assert engine.kv_cache.num_evicted_blocks_total > 0


@pytest.mark.parametrize("kv_dtype", ["float32", "float16", "int8"])
def test_re_rotated_keys_equal_keys_rotated_at_the_new_position(kv_dtype):
    """A rebase's rotation of pool keys: keys written at position p and shifted back by delta
    equal the same keys rotated at p - delta (fp16 / int8 pools within their rounding)."""
    torch.manual_seed(0)
    head_dim, blocks, bs, heads = 16, 3, 4, 2
    cos, sin = rope_cos_sin(tiny_llama_config(), head_dim, 256)
    raw = torch.randn(blocks * bs, heads, head_dim)
    p = torch.arange(100, 100 + blocks * bs)
    delta = 37
    at_p = apply_rope(raw, cos[p].unsqueeze(1), sin[p].unsqueeze(1))
    want = apply_rope(raw, cos[p - delta].unsqueeze(1), sin[p - delta].unsqueeze(1))
    shape = (blocks + 1, bs, heads, head_dim)
    if kv_dtype == "int8":
        k = Int8KV.zeros(shape, torch.float32, torch.device("cpu"))
        codes, scale = quantize(at_p)
        k.data[1:] = codes.view(blocks, bs, heads, head_dim)
        k.scale[1:] = scale.view(blocks, bs, heads, 2)
    else:
        k = torch.zeros(shape, dtype=getattr(torch, kv_dtype))
        k[1:] = at_p.view(blocks, bs, heads, head_dim).to(k.dtype)
    v = torch.zeros(shape)
    apply_rope_shifts([(k, v)], [RopeShift(tuple(range(1, blocks + 1)), delta)], cos, sin)
    if kv_dtype == "int8":
        from engine.kv.int8 import dequantize
        got = dequantize(k.data[1:], k.scale[1:], torch.float32).view_as(want)
        tol = 2 * 2 * (want.amax(-1) - want.amin(-1)).max().item() / 255  # two quantizations
    else:
        got = k[1:].float().view_as(want)
        tol = 1e-5 if kv_dtype == "float32" else 4e-3
    assert (got - want).abs().max().item() <= tol
    assert k.data[0].abs().sum() == 0 if kv_dtype == "int8" else k[0].abs().sum() == 0  # other blocks untouched


def test_copy_on_write_moves_shared_blocks_before_rotating():
    cos, sin = rope_cos_sin(tiny_llama_config(), 16, 64)
    k = torch.randn(4, 4, 2, 16)
    v = torch.randn(4, 4, 2, 16)
    k0, v0 = k.clone(), v.clone()
    apply_rope_shifts([(k, v)], [RopeShift((3,), 5, copies=((1, 3),))], cos, sin)
    assert torch.equal(k[1], k0[1]) and torch.equal(v[3], v0[1])  # the source stays, values copied
    c, s = cos[5], sin[5]
    half = 8
    rot = torch.cat((-k0[1][..., half:], k0[1][..., :half]), dim=-1)
    assert torch.allclose(k[3], k0[1] * c - rot * s, atol=1e-6)


def test_int4_kv_is_refused_with_eviction_naming_both(hf):
    """KIVI keys share one range per channel across a block, so re-rotating kept keys would mean
    requantizing whole blocks: refused at build, not run wrong."""
    with pytest.raises(ValueError, match="kv_eviction 'streaming' does not run with kv_cache_dtype int4"):
        tiny_engine(hf, block_size=BLOCK, num_blocks=64, max_num_batched_tokens=CHUNK, kv_eviction="streaming",
                    kv_sink_tokens=4, kv_window_tokens=16, kv_cache_dtype="int4")
