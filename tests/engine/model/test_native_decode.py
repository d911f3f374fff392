"""The native decode path (one ``decode_layer`` C++ call per layer) against the Python path
(``DecoderLayer.forward``) on the same step: GGUF models in block formats and dense fp32,
Llama and Qwen2 (biases), GQA and MHA, one sequence and ragged batches crossing block edges.

Every all-decode step is run twice on the same pool, Python first, then native (both write the
same new K/V slot before attending, so the second run sees what the first did), and the logits
must agree to fp32 summation order: rtol 1e-4 and atol 1e-4 of the largest logit. The two
paths sum dot products of up to 512 terms in different orders (eps 1.2e-7 each, ~1e-6
relative after a layer) through 2-3 layers and a softmax; a wrong bias, RoPE, slot or head
mapping moves logits by O(1), four orders of magnitude above the tolerance.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bench.make_gguf import GGUFShape, q4_k_m, write_gguf
from engine.loader.gguf.blocks import BlockFormat
from kvtypes.sampling_params import SamplingParams
from tests.helpers import require_native_kernel, tiny_engine, tiny_hf_model, tiny_llama_config
from tests.engine.loader.test_gguf_formats import TINY, cache_dir, gguf_engine, uniform  # noqa: F401 (fixture)


@pytest.fixture(scope="module", autouse=True)
def kernel():
    require_native_kernel()


class PathComparer:
    """Wraps the model's forward: a step whose decode rows the native path takes (an all-decode
    step, or a mixed one: decode rows native, then the prefill chunks in Python) runs on both
    paths and their logits are compared, every row; the native result goes on. The engine answers
    a step that raises by retrying its requests alone, so mismatches are also kept in ``failures``.

    int4 pools (``Int4PoolCheck``): the pool after each path's run is compared too, and the blocks
    the step completed are checked against the torch quantizer."""

    def __init__(self, model, rtol: float = 1e-4) -> None:
        self.model, self.inner, self.rtol = model, model.forward, rtol
        self.native_steps: list[int] = []  # decode rows of each compared all-decode step
        self.mixed_steps: list[tuple[int, int]] = []  # (decode rows, prefill rows) of each compared mixed step
        self.chunk_steps: list[int] = []  # rows of each compared step whose chunks ran natively too
        self.failures: list[AssertionError] = []
        self.int4: Int4PoolCheck | None = None
        model.forward = self

    def __call__(self, input_ids, positions, meta, kv_caches):
        m = self.model
        decodes = m.native.rows(meta, kv_caches) if m.native is not None else 0
        if not decodes:
            return self.inner(input_ids, positions, meta, kv_caches)
        native, m.native = m.native, None  # the Python path for the reference run
        try:
            want = m.compute_logits(self.inner(input_ids, positions, meta, kv_caches))
        finally:
            m.native = native
        reference_pool = self.int4.snapshot(kv_caches) if self.int4 is not None else None
        hidden = self.inner(input_ids, positions, meta, kv_caches)
        got = m.compute_logits(hidden)
        try:
            if self.int4 is None or self.int4.logits_comparable(kv_caches):
                torch.testing.assert_close(got, want, rtol=self.rtol,
                                           atol=self.rtol * max(1.0, want.abs().max().item()))
            if self.int4 is not None:
                self.int4.compare(reference_pool, kv_caches)
        except AssertionError as exc:
            self.failures.append(exc)
            raise
        if decodes == input_ids.shape[0] and meta.prefills:
            self.chunk_steps.append(decodes)
        elif decodes == input_ids.shape[0]:
            self.native_steps.append(decodes)
        else:
            self.mixed_steps.append((decodes, input_ids.shape[0] - decodes))
        return hidden


class Int4PoolCheck:
    """An int4 pool after the native path's run of a step against the same pool after the Python
    path's (both start from the same pool: the reference run writes only the step's rows and the
    blocks it completes, which the native run writes again). The two paths' K/V rows differ in
    fp32 summation order (~1e-6 relative), so the residual rows agree to that, a scale to one fp16
    rounding, and a code may round to its neighbour where a value sits on a rounding edge: at most
    ``max_code_flips`` of the codes the steps wrote, none by more than 1. Exactly: every block the
    step completed holds the torch quantizer's (engine/kv/int4.py) codes and scales of its
    residual rows, which the block keeps until its slot is reused.

    ``layers``: compare only the first ones. A code flip moves a key or value by a whole step, so
    later layers (and the logits) of a step that quantizes a block take the two paths' code
    flips as input, amplified: on a deep model (SmolLM2, 30 layers) only layer 0, whose inputs
    the paths share, is compared, and the logits only of steps that quantize no block (a step that
    only writes residual rows and reads codes can flip nothing, so those must agree to summation
    order)."""

    def __init__(self, max_code_flips: float = 1e-3, layers: int | None = None) -> None:
        self.max_code_flips, self.layers = max_code_flips, layers
        self.codes_written = self.code_flips = self.blocks_checked = self.logit_steps = 0

    def logits_comparable(self, kv_caches) -> bool:
        plan = kv_caches[0][0].state.plan_
        comparable = self.layers is None or not (plan.done_blocks.numel() or plan.direct_blocks.numel())
        self.logit_steps += comparable
        return comparable

    def snapshot(self, kv_caches) -> list[torch.Tensor]:
        return [t.clone() for k, v in kv_caches[:self.layers]
                for t in (k.codes, k.scale, k.residual, v.codes, v.scale, v.residual)]

    def compare(self, reference: list[torch.Tensor], kv_caches) -> None:
        from engine.kv import int4

        got = self.snapshot(kv_caches)
        for i, (a, b) in enumerate(zip(reference, got)):
            if i % 3 == 2:  # residual
                torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-4 * max(1.0, a.abs().max().item()))
            elif i % 3 == 1:  # scales
                torch.testing.assert_close(b.float(), a.float(), rtol=2e-3, atol=1e-3)
            else:
                ca, cb = int4.unpack(a), int4.unpack(b)
                changed = (ca != cb)
                assert (ca - cb).abs().max() <= 1
                self.code_flips += int(changed.sum())
        state = kv_caches[0][0].state
        plan = state.plan_
        self.codes_written += 2 * plan.num_rows * kv_caches[0][0].codes[0, 0].numel() * 2 * len(got) // 6
        for k, v in kv_caches:
            if plan.done_blocks.numel():
                self.blocks_checked += plan.done_blocks.numel()
                codes, scale = int4.quantize_keys(k.residual[plan.done_slots])
                assert torch.equal(k.codes[plan.done_blocks], codes) and torch.equal(k.scale[plan.done_blocks], scale)
                codes, scale = int4.quantize_values(v.residual[plan.done_slots])
                assert torch.equal(v.codes[plan.done_blocks], codes) and torch.equal(v.scale[plan.done_blocks], scale)
        assert self.code_flips <= self.max_code_flips * max(self.codes_written, 1), (self.code_flips, self.codes_written)


# prompt lengths around the test pools' 4-token blocks; 9 new tokens move every context across an edge
RAGGED = [3, 4, 7, 9]


def run_and_compare(engine, lengths: list[int], tokens: int = 9, int4: Int4PoolCheck | None = None) -> list[int]:
    model = engine.runner.model
    assert model.decode_path == "native"
    comparer = PathComparer(model)
    comparer.int4 = int4
    prompts = [[(7 * i + 3 * j) % 120 + 3 for j in range(n)] for i, n in enumerate(lengths)]
    outputs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True))
    assert not comparer.failures, comparer.failures[0]
    assert [len(o.token_ids) for o in outputs] == [tokens] * len(prompts)
    assert engine.kv_cache.usage == 0, "a block is still held after every request finished"
    return comparer.native_steps


GGUF_CASES = {
    "llama-Q4_1-gqa": (TINY, uniform(BlockFormat.Q4_1)),
    "llama-Q8_0-mha": (GGUFShape(**{**TINY.__dict__, "kv_heads": 4}), uniform(BlockFormat.Q8_0)),
    "llama-Q4_K_M-mix": (GGUFShape(**{**TINY.__dict__, "layers": 3}), q4_k_m),
    "qwen2-Q4_K-bias": (GGUFShape(**{**TINY.__dict__, "arch": "qwen2"}), uniform(BlockFormat.Q4_K)),
}


@pytest.mark.parametrize("case", list(GGUF_CASES))
@pytest.mark.parametrize("resident", ["blocks", "dense"])
def test_gguf_native_decode_equals_python(case, resident, cache_dir, tmp_path):  # noqa: F811
    shape, formats = GGUF_CASES[case]
    path = write_gguf(tmp_path / f"{case}.gguf", shape, formats, seed=len(case))
    engine = gguf_engine(path, resident)
    if case == "llama-Q4_K_M-mix":  # q, k Q4_K and v Q6_K in one fused matrix: two groups in one call
        assert any(len(layer.blocks["qkv"].parts) == 2 for layer in engine.runner.model.layers)
    assert engine.runner.model.arch.attention_bias == (shape.arch == "qwen2")
    assert run_and_compare(engine, [5]) == [1] * 8  # one stream: every decode step native
    steps = run_and_compare(engine, RAGGED)
    assert steps and max(steps) == len(RAGGED)


def test_int8_blocks_only_native_decode_takes_more_than_16_rows(cache_dir, tmp_path):  # noqa: F811
    """With int8 activations a block-only model keeps its block kernels at any row count
    (BlockLinear.max_rows unbounded), so the native path takes steps of 20 decode rows, and they
    match the Python path on the same int8 kernels (tolerance 1e-3: the two paths quantize
    activations that differ in fp32 summation order, so a code can round the other way)."""
    from cache import CacheConfig
    from engine.config import ModelConfig
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from scheduler.config import SchedulerConfig

    shape, formats = GGUF_CASES["llama-Q4_K_M-mix"]
    path = write_gguf(tmp_path / "mix.gguf", shape, formats, seed=5)
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(model=str(path), num_threads=1, weights_resident="blocks", activation_quant="int8"),
        cache=CacheConfig(block_size=4, num_blocks=256),
        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=24)))
    model = engine.runner.model
    assert model.native.max_rows > 16
    comparer = PathComparer(model, rtol=1e-3)
    prompts = [[(7 * i + 3 * j) % 120 + 3 for j in range(3 + i % 5)] for i in range(20)]
    outputs = engine.generate(prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    assert not comparer.failures, comparer.failures[0]
    assert [len(o.token_ids) for o in outputs] == [4] * 20 and engine.kv_cache.usage == 0
    assert max(comparer.native_steps) == 20


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16"])
@pytest.mark.parametrize("heads", [2, 4], ids=["gqa", "mha"])
def test_dense_fp32_native_decode_equals_python(heads, kv_cache_dtype):
    """float16: the pools hold fp16 rows, which the python path rounds with ``.to()`` and the
    native one with F16C (c10::Half's rounding, to nearest even) as it writes, and widens as it
    reads."""
    engine = tiny_engine(tiny_hf_model(tiny_llama_config(num_key_value_heads=heads)), block_size=4,
                         kv_cache_dtype=kv_cache_dtype)
    assert engine.runner.kv_caches[0][0].dtype == (torch.float16 if kv_cache_dtype == "float16" else torch.float32)
    assert engine.runner.model.linear_backend != "gguf" and engine.runner.model.native.max_rows == 4
    assert run_and_compare(engine, [6]) == [1] * 8
    assert max(run_and_compare(engine, RAGGED)) == 4


@pytest.mark.parametrize("heads", [2, 4], ids=["gqa", "mha"])
def test_int4_native_decode_equals_python(heads):
    """int4 pools (KIVI): the native path writes each row to its block's residual slot, quantizes
    the blocks a step completes before any row attends (engine/kv/int4.py's arithmetic, checked
    bit for bit against its torch quantizer) and reads quantized blocks as codes; logits and
    pool contents equal the Python path's (Int4PoolCheck) over ragged contexts crossing 4-token
    blocks, on one and on two threads (two share each step's block quantization)."""
    hf = tiny_hf_model(tiny_llama_config(num_key_value_heads=heads))
    threads = torch.get_num_threads()
    for n in (1, 2):
        try:
            engine = tiny_engine(hf, block_size=4, kv_cache_dtype="int4")
            torch.set_num_threads(n)  # after the build, which sets ModelConfig.num_threads (1)
            assert torch.get_num_threads() == n
            assert engine.runner.model.decode_path == "native"
            check = Int4PoolCheck()
            assert run_and_compare(engine, [6], int4=check) == [1] * 8
            assert max(run_and_compare(engine, RAGGED, int4=check)) == 4
            assert check.blocks_checked >= 8 and check.codes_written
        finally:
            torch.set_num_threads(threads)


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16"])
def test_long_contexts_attended_in_chunks_equal_python(kv_cache_dtype):
    """Rows of more than 256 tokens (paged_attention.h kAttnChunk) are attended in chunks of every
    head, merged after (a softmax over chunk statistics), beside rows of one work item per kv head:
    contexts of 600, 300 and 40 tokens decoding together and one alone equal the Python path's
    single softmax, on one thread and on two (set after the build, which sets one)."""
    hf = tiny_hf_model(tiny_llama_config(max_position_embeddings=1024))
    if torch.ops.kvserve.attention_chunk_tokens(hf.config.head_dim) == 0:
        pytest.skip("no AVX2 on this CPU: the native layer attends whole contexts")
    assert torch.ops.kvserve.attention_chunk_tokens(hf.config.head_dim) == 256
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            engine = tiny_engine(hf, block_size=16, num_blocks=128, max_num_batched_tokens=256,
                                 kv_cache_dtype=kv_cache_dtype)
            torch.set_num_threads(n)
            assert max(run_and_compare(engine, [600, 300, 40], tokens=4)) == 3
            assert run_and_compare(engine, [520], tokens=3) == [1] * 2
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16", "int4"])
def test_mixed_steps_run_their_decode_rows_natively(kv_cache_dtype):
    """Requests arriving while others decode make mixed steps: the decode rows take the native path,
    the new prompts' chunks (a chunked 30-token prompt, and one that reuses a cached prefix) the
    Python one, unless the whole step fits in the native rows (then the chunk's tokens are native
    rows too), and every row's logits equal the all-Python step's (int4: and the pools,
    Int4PoolCheck; the prefix hit reads quantized blocks)."""
    engine = tiny_engine(tiny_hf_model(), block_size=4, max_num_batched_tokens=12, kv_cache_dtype=kv_cache_dtype)
    comparer = PathComparer(engine.runner.model)
    if kv_cache_dtype == "int4":
        comparer.int4 = Int4PoolCheck()
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    first = [[(5 * i + j) % 120 + 3 for j in range(n)] for i, n in enumerate((6, 9))]
    for p in first:
        engine.add_request(p, params)
    for _ in range(4):
        engine.step()
    engine.add_request([(11 * j) % 120 + 3 for j in range(30)], params)  # chunked over several steps
    engine.add_request(first[1][:8] + [77, 78], params)  # two cached blocks of the second prompt
    while engine.has_unfinished():
        engine.step()
    assert not comparer.failures, comparer.failures[0]
    assert len(comparer.mixed_steps) >= 3 and all(d >= 1 and p >= 1 for d, p in comparer.mixed_steps)
    assert comparer.native_steps
    # a mixed step within native.max_rows (4) whose chunk continues a pooled context: all native
    assert comparer.chunk_steps
    if comparer.int4 is not None:
        assert comparer.int4.blocks_checked
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.usage == 0


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16"])
def test_mixed_steps_with_prefix_hits_and_preemption_equal_the_python_path(kv_cache_dtype):
    """Issue 39's mixed-batch check on the float pools: four requests on a pool too small for
    three of them (preemptions, each resumed by re-prefilling beside decode rows), a 12-token
    budget (chunked prompts in mixed steps), and a prompt that shares two cached blocks with the
    first. Every compared step's logits equal the all-Python step's (PathComparer), and the greedy
    tokens equal an engine held to the Python layers."""
    hf = tiny_hf_model()
    prompts = [[(7 * i + 3 * j) % 120 + 3 for j in range(n)] for i, n in enumerate((10, 10, 18))]
    prompts.append(prompts[0][:8] + [91, 92])  # the first prompt's first two blocks
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    runs = {}
    for path in ("python", "native"):
        engine = tiny_engine(hf, num_blocks=14, block_size=4, max_num_batched_tokens=12, max_num_seqs=3,
                             kv_cache_dtype=kv_cache_dtype)
        if path == "python":
            engine.runner.model.select_decode_path("python", kv_cache_dtype)
        else:
            assert engine.runner.model.decode_path == "native"
            comparer = PathComparer(engine.runner.model)
        runs[path] = [o.token_ids for o in engine.generate(prompts, params)]
        stats = engine.scheduler.stats
        assert stats.num_preemptions > 0 and stats.prefix_cache_hits >= 8, (path, stats)
        engine.kv_cache.check_invariants()
        assert engine.kv_cache.usage == 0
    assert not comparer.failures, comparer.failures[0]
    assert comparer.mixed_steps and comparer.native_steps
    assert runs["native"] == runs["python"]


@pytest.mark.parametrize("kv_cache_dtype", ["float32", "float16"])
def test_speculative_verify_rows_run_natively(kv_cache_dtype):
    """A verify row (1 + k tokens of one sequence, engine/sampling/verification.py) is a chunk whose
    context is in the pool: the native path takes its tokens as rows of their own, each attending
    to the ones before it (the kernel writes every row's K/V before any row attends), and every
    row's logits equal the Python layers'. Greedy output stays plain greedy's, and so does a step
    of two verify rows with a decode row beside them."""
    from scheduler.config import SpeculativeConfig

    hf = tiny_hf_model()
    passage = [(13 * j) % 120 + 3 for j in range(9)]
    prompts = [passage * 3, passage[:5] * 2 + passage]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    plain = tiny_engine(hf, kv_cache_dtype=kv_cache_dtype).generate(prompts, params)
    for k, rows in ((3, 4), (1, 4)):  # one verify row of 4 tokens; two of 2 (or one beside a decode row)
        engine = tiny_engine(hf, kv_cache_dtype=kv_cache_dtype, max_num_seqs=2 if k == 1 else 1)
        engine.scheduler.config.speculative_config = SpeculativeConfig(
            num_speculative_tokens=k, prompt_lookup_min=1, prompt_lookup_max=3, verify_cost_ratio=0,
            disable_by_batch_size=None)
        comparer = PathComparer(engine.runner.model)
        out = engine.generate(prompts, params)
        assert not comparer.failures, comparer.failures[0]
        assert [o.token_ids for o in out] == [o.token_ids for o in plain]
        assert comparer.chunk_steps and max(comparer.chunk_steps) == rows
        assert engine.scheduler.stats.spec_accepted_tokens > 0
        engine.kv_cache.check_invariants()
        assert engine.kv_cache.usage == 0


def test_which_chunk_steps_the_native_path_takes():
    """Chunks the decode kernel attends (all of them without ``chunk_tiles``; with it, those of at
    most ``tiles_chunk_rows`` rows, as verify rows are) are bounded by their (query, key) pairs,
    ``max_chunk_attention`` in all; with ``chunk_tiles`` the larger chunks attend on the tiles and
    are bounded by their rows, ``tiles_step_rows`` in all."""
    from engine.attention import PrefillChunk

    native = tiny_engine(tiny_hf_model()).runner.model.native
    assert native.chunk_tiles is False  # fp32 prefill attention (and a head size the tiles do not take)

    def chunks(*shapes: tuple[int, int]) -> list[PrefillChunk]:  # (rows, context length) each
        return [PrefillChunk(0, rows, ctx, torch.zeros(1, dtype=torch.long), None) for rows, ctx in shapes]

    hit, verify = chunks((48, 1000)), chunks((5, 3000), (5, 3000))
    assert native.chunks_fit(hit) and native.chunks_fit(verify)
    assert not native.chunks_fit(chunks((70, 1000)))  # 70,000 pairs
    native.chunk_tiles = True
    assert native.chunks_fit(hit) and native.chunks_fit(verify) and native.chunks_fit(chunks((70, 1000)))
    assert native.chunks_fit(chunks((128, 6000))) and not native.chunks_fit(chunks((100, 500), (29, 500)))
    assert native.chunks_fit(verify + chunks((120, 3000)))  # 30,000 pairs on the decode kernel, 120 tiled rows
    assert not native.chunks_fit(chunks(*[(5, 3000)] * 5))  # verify-sized: past max_chunk_attention


@pytest.mark.parametrize("kv_cache_dtype", ["float16", "float32"])  # the default pool, and fp32 rounded to bf16
def test_chunk_rows_on_the_tiles_equal_the_python_layers(tmp_path, kv_cache_dtype):
    """Where prefill chunks attend on the AMX tiles (int8 activations, so ``prefill_attention_dtype``
    auto is bf16), the native path takes a chunk's rows (more than ``tiles_chunk_rows`` of one
    sequence) onto the tiles inside its call (``DecodeStack.set_chunk_tiles``): every row's logits
    equal the Python layers' (the same kernel and bf16 rounding over the same pool; tolerance
    1e-3 as for int8 activations, whose codes may round apart), for two prefix hits of 14 and 22
    rows in one step, and greedy output is the Python path's. Elsewhere the stack refuses the
    tiles and the test says so."""
    from cache import CacheConfig
    from engine.config import EngineConfig, ModelConfig
    from engine.llm_engine import LLMEngine
    from scheduler.config import SchedulerConfig

    path = write_gguf(tmp_path / "q4_1.gguf", TINY, uniform(BlockFormat.Q4_1), seed=7)
    prefix = [(11 * j) % 120 + 3 for j in range(30)]  # 28 tokens in whole 4-token blocks, cached
    hits = [prefix + [(7 * j) % 120 + 3 for j in range(12)], prefix + [(5 * j) % 120 + 3 for j in range(20)]]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    outputs = {}
    for native in (False, True):
        engine = LLMEngine(EngineConfig(
            model=ModelConfig(model=str(path), num_threads=1, weights_resident="blocks", activation_quant="int8"),
            cache=CacheConfig(block_size=4, num_blocks=256, kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8)))
        model = engine.runner.model
        if not model.native.chunk_tiles:
            pytest.skip("the AMX-BF16 tiles do not run on this CPU (prefill_attention_dtype auto is float32 here)")
        comparer = PathComparer(model, rtol=1e-3) if native else None
        if not native:
            model.native.max_chunk_attention = 0  # every chunk step on the Python layers
        engine.generate([prefix], params)
        outputs[native] = [o.token_ids for o in engine.generate(hits, params)]
        if native:
            assert not comparer.failures, comparer.failures[0]
            assert 14 + 22 in comparer.chunk_steps  # both hits' rows in one native step
        engine.kv_cache.check_invariants()
        assert engine.kv_cache.usage == 0
    assert outputs[True] == outputs[False]


def test_larger_batches_fall_back_to_python():
    """A step of more rows than native.max_rows runs DecoderLayer.forward, and still serves."""
    engine = tiny_engine(tiny_hf_model(), block_size=4)
    steps = run_and_compare(engine, [3, 4, 5, 6, 7, 8], tokens=4)
    assert steps == []  # six rows > 4: every decode step on the Python path


def test_decode_path_selection_is_explicit():
    from engine.attention import select_attention

    engine = tiny_engine(tiny_hf_model(), attention_backend="torch")
    model = engine.runner.model
    assert model.decode_path == "python"  # auto: the torch attention backend is in use
    with pytest.raises(ValueError, match="native.*'torch' is in use"):
        model.select_decode_path("native")
    with pytest.raises(ValueError, match="decode_path must be"):
        model.select_decode_path("fast")
    model.attn = select_attention("native", torch.device("cpu"), torch.float32, 4)
    assert model.select_decode_path("auto") == ("native", None)
    assert model.select_decode_path("python") == ("python", None)


def test_bad_arguments_are_clear_errors():
    from engine.config import ModelConfig

    with pytest.raises(ValueError, match="decode_path must be auto, native or python"):
        ModelConfig(decode_path="fast")
    engine = tiny_engine(tiny_hf_model(), block_size=4)
    model = engine.runner.model
    args = list(model.native.layers[0])
    k_cache, v_cache = engine.runner.kv_caches[0]
    x, rope = torch.zeros(1, 64), torch.zeros(1, 16)
    table, lens = torch.zeros(1, 2, dtype=torch.long), torch.ones(1, dtype=torch.long)

    def call(slot: int = 0, heads: int = 4, layer_args=args):
        torch.ops.kvserve.decode_layer(x, *layer_args, rope, rope, k_cache, v_cache, torch.tensor([slot]), table,
                                       lens, heads, 0.25)

    call()  # valid
    with pytest.raises(RuntimeError, match="outside the pool"):
        call(slot=10**6)
    with pytest.raises(RuntimeError, match=r"o_proj: a dense part must be a contiguous float32 \[64, 32\]"):
        call(heads=2)  # 2 heads of 16 would make o_proj 64 x 32
    bad = args.copy()
    bad[3] = [args[3][0][:8]]  # qkv: a dense part of the wrong shape
    with pytest.raises(RuntimeError, match="qkv: a dense part must be"):
        call(layer_args=bad)


def _step_inputs(model, rows: int, context: int, block_size: int, seed: int, kv_dtype=torch.float32):
    """Random decode-step inputs over fresh pools (of ``kv_dtype``): every row ``context`` tokens
    long, its new token in the last slot of its own blocks."""
    g = torch.Generator().manual_seed(seed)
    arch = model.arch
    width = (context + block_size - 1) // block_size
    shape = (rows * width + 1, block_size, arch.num_kv_heads, arch.head_dim)
    k_caches = [torch.randn(shape, generator=g).to(kv_dtype) for _ in model.layers]
    v_caches = [torch.randn(shape, generator=g).to(kv_dtype) for _ in model.layers]
    table = torch.arange(rows * width).view(rows, width)
    slots = table[:, (context - 1) // block_size] * block_size + (context - 1) % block_size
    positions = torch.full((rows,), context - 1)
    cos, sin = model.rope_cos[positions].contiguous(), model.rope_sin_signed[positions].contiguous()
    x = torch.randn(rows, arch.hidden_size, generator=g)
    return x, cos, sin, k_caches, v_caches, slots.contiguous(), table.contiguous(), torch.full((rows,), context)


@pytest.mark.parametrize("case", ["llama-Q4_1-gqa", "llama-Q4_K_M-mix", "qwen2-Q4_K-bias"])
def test_decode_stack_equals_one_call_per_layer_on_two_threads(case, cache_dir, tmp_path):  # noqa: F811
    """The native path runs every layer in one DecodeStack call; it must compute exactly what one
    decode_layer call per layer does (same kernels, same per-chunk order: bit for bit), K/V
    writes included, with two threads sharing the work (the engine tests run one thread, so this
    is where threads share the step's buffers), with int8 activations on and off, over fp32 and
    fp16 pools. With final_norm it also applies the model's final RMSNorm (F.rms_norm's up to
    the summation order)."""
    shape, formats = GGUF_CASES[case]
    model = gguf_engine(write_gguf(tmp_path / f"{case}.gguf", shape, formats, seed=3), "blocks").runner.model
    assert model.decode_path == "native" and model.native.stack.num_layers() == len(model.layers)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        for rows, context, int8, kv_dtype in [(1, 9, False, torch.float32), (5, 30, True, torch.float32),
                                              (16, 7, True, torch.float32), (3, 13, True, torch.float16)]:
            x, cos, sin, ks, vs, slots, table, lens = _step_inputs(model, rows, context, 4, seed=rows, kv_dtype=kv_dtype)
            want_x, want_k, want_v = x.clone(), [k.clone() for k in ks], [v.clone() for v in vs]
            scale = model.arch.head_dim ** -0.5
            for args, k, v in zip(model.native.layers, want_k, want_v):
                torch.ops.kvserve.decode_layer(want_x, *args, cos, sin, k, v, slots, table, lens,
                                               model.arch.num_heads, scale, int8)
            model.native.stack.run(x, cos, sin, ks, vs, slots, table, lens, scale, int8, False, False, None)
            assert torch.equal(x, want_x), (rows, int8)
            assert all(torch.equal(a, b) for a, b in zip(ks + vs, want_k + want_v)), (rows, int8)
            assert not torch.equal(x, _step_inputs(model, rows, context, 4, seed=rows)[0])  # the layers ran
            fresh_k = _step_inputs(model, rows, context, 4, seed=rows, kv_dtype=kv_dtype)[3]
            assert not all(torch.equal(a, b) for a, b in zip(ks, fresh_k))  # and wrote their new keys
            normed, _, _, ks2, vs2, _, _, _ = _step_inputs(model, rows, context, 4, seed=rows, kv_dtype=kv_dtype)
            model.native.stack.run(normed, cos, sin, ks2, vs2, slots, table, lens, scale, int8, True, False, None)
            want_normed = F.rms_norm(want_x, (want_x.shape[-1],), model.norm, model.arch.rms_norm_eps)
            torch.testing.assert_close(normed, want_normed, rtol=1e-5, atol=1e-6)
            assert all(torch.equal(a, b) for a, b in zip(ks2 + vs2, want_k + want_v))
            # H2O's block mass: the outputs stay as they were; each row's probabilities, one per
            # head and layer, land in its table's columns (one past them stays 0); one thread or
            # two (the (row, kv head) jobs dealt out differently), the same sums. The mass keeps
            # one attention item per (row, kv head); without it, 5 and 16 rows on two threads are
            # one item a row (every head), so the equality below also holds those two plans to
            # the same bits.
            masses = []
            for n in (2, 1):
                torch.set_num_threads(n)
                x3, _, _, ks3, vs3, _, _, _ = _step_inputs(model, rows, context, 4, seed=rows, kv_dtype=kv_dtype)
                masses.append(torch.zeros(rows, table.shape[1] + 1))
                model.native.stack.run(x3, cos, sin, ks3, vs3, slots, table, lens, scale, int8, False, False,
                                       masses[-1])
                assert torch.equal(x3, want_x)
            torch.set_num_threads(2)
            assert torch.equal(masses[0], masses[1]) and not masses[0][:, -1].any()
            per_row = torch.full((rows,), float(model.arch.num_heads * len(model.layers)))
            torch.testing.assert_close(masses[0].sum(-1), per_row, rtol=1e-5, atol=0)
    finally:
        torch.set_num_threads(threads)


def test_decode_stack_rejects_mismatched_caches():
    engine = tiny_engine(tiny_hf_model(), block_size=4)
    model = engine.runner.model
    x, cos, sin, ks, vs, slots, table, lens = _step_inputs(model, 2, 5, 4, seed=0)
    with pytest.raises(RuntimeError, match="one K and one V cache per layer"):
        model.native.stack.run(x, cos, sin, ks[:1], vs[:1], slots, table, lens, 0.25, False, False, False, None)
    bad = ks[:1] + [torch.zeros(3, 4, model.arch.num_kv_heads, model.arch.head_dim)] + ks[2:]
    with pytest.raises(RuntimeError, match="of one shape and one dtype"):
        model.native.stack.run(x, cos, sin, bad, vs, slots, table, lens, 0.25, False, False, False, None)
    mixed = ks[:1] + [ks[1].half()] + ks[2:]  # one layer's pool fp16, the others fp32
    with pytest.raises(RuntimeError, match="of one shape and one dtype"):
        model.native.stack.run(x, cos, sin, mixed, vs, slots, table, lens, 0.25, False, False, False, None)
    with pytest.raises(RuntimeError, match="contiguous float32 or float16"):
        model.native.stack.run(x, cos, sin, [k.double() for k in ks], vs, slots, table, lens, 0.25, False, False, False,
                               None)
    with pytest.raises(RuntimeError, match="outside the pool"):
        model.native.stack.run(x, cos, sin, ks, vs, slots + 10**6, table, lens, 0.25, False, False, False, None)
    a = model.arch
    bare = torch.classes.kvserve.DecodeStack(a.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim)
    for args in model.native.layers:
        bare.add_layer(*args)
    with pytest.raises(RuntimeError, match="needs set_final_norm"):
        bare.run(x, cos, sin, ks, vs, slots, table, lens, 0.25, False, True, False, None)


def _int4_schedule(engine, prompts: list[list[int]], late: list[list[int]], tokens: int) -> list[list[int]]:
    """``prompts`` at once, ``late`` after three steps (mixed steps), greedy: each request's tokens."""
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    out: dict[str, list[int]] = {engine.add_request(p, params): [] for p in prompts}
    steps = 0
    while engine.has_unfinished():
        if steps == 3:
            out.update({engine.add_request(p, params): [] for p in late})
        for o in engine.step():
            out[o.request_id] += o.new_token_ids
        steps += 1
    engine.kv_cache.check_invariants()
    assert engine.kv_cache.usage == 0
    return list(out.values())


def test_int4_preempted_requests_resume_natively():
    """A pool too small for three sequences preempts one (its half-filled block goes back with its
    residual slot, reclaimed later): on the native path the tokens equal the Python path's, and
    every compared step's logits and pools agree (Int4PoolCheck)."""
    hf = tiny_hf_model()
    prompts = [[(7 * i + 3 * j) % 120 + 3 for j in range(10)] for i in range(3)]
    runs = {}
    for path in ("python", "native"):
        engine = tiny_engine(hf, num_blocks=12, block_size=4, kv_cache_dtype="int4", max_num_seqs=3)
        if path == "python":
            engine.runner.model.select_decode_path("python", "int4")
        else:
            comparer = PathComparer(engine.runner.model)
            comparer.int4 = Int4PoolCheck()
        runs[path] = _int4_schedule(engine, prompts, [], tokens=14)
        assert engine.scheduler.stats.num_preemptions > 0
    assert not comparer.failures, comparer.failures[0]
    assert comparer.native_steps and comparer.int4.blocks_checked
    assert runs["native"] == runs["python"]


def test_int4_native_decode_on_the_default_model():
    """SmolLM2-135M (exact flags: fp32 activations) with an int4 pool of 16-token blocks: decode
    rows crossing block edges, a late request whose first two blocks are prefix hits on quantized
    blocks (its 5 new tokens continue them: native chunk rows), one prefilled from scratch (a mixed
    step: decode rows native, the chunk in Python). Every compared step's layer-0 pool agrees with
    the Python path's, every block it completes holds the torch quantizer's codes (all layers),
    and the logits of the steps that quantize no block agree (Int4PoolCheck(layers=1)).

    Not compared: a whole run's greedy tokens against a python-path engine's. A step that
    quantizes blocks can flip a code on one path and not the other (the K/V rows differ in fp32
    summation order), and 30 layers amplify that to logit changes of O(1): with random-token
    prompts (near ties) one such run agreed token for token and another diverged at a request's
    second token. The tiny model's runs (test_int4_native_decode_equals_python,
    test_int4_preempted_requests_resume_natively) do compare tokens."""
    from cache import CacheConfig
    from engine.config import EngineConfig, ModelConfig
    from engine.llm_engine import LLMEngine
    from engine.loader import load_model
    from scheduler.config import SchedulerConfig
    from tests.helpers import EXACT_MODEL_FLAGS

    rng = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 10000, (n,), generator=rng).tolist() for n in (40, 21, 17)]
    late = [prompts[0][:32] + [11, 12, 13, 14, 15], torch.randint(100, 10000, (40,), generator=rng).tolist()]
    engine = LLMEngine(EngineConfig(
        model=ModelConfig(num_threads=1, decode_path="native", **EXACT_MODEL_FLAGS),
        cache=CacheConfig(num_blocks=48, kv_cache_dtype="int4"),
        scheduler=SchedulerConfig(max_num_batched_tokens=64, max_num_seqs=8)), load_model(None, torch.float32))
    assert engine.runner.model.decode_path == "native"
    comparer = PathComparer(engine.runner.model)
    comparer.int4 = Int4PoolCheck(layers=1)
    assert [len(t) for t in _int4_schedule(engine, prompts, late, tokens=20)] == [20] * 5
    assert not comparer.failures, comparer.failures[0]
    assert comparer.native_steps and comparer.mixed_steps and comparer.chunk_steps
    assert comparer.int4.blocks_checked and comparer.int4.logit_steps >= 10
