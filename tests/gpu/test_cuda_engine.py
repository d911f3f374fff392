"""kvserve on a CUDA device against transformers on the same device, per attention backend,
with CUDA graphs on and off: batched decode, a prefix hit, chunked prefill and preemption
(logits compared row by row, not only greedy text), and the KV pool sized by profiling."""
from __future__ import annotations

import copy
import importlib.util
import random

import pytest
import torch

from cache import CacheConfig
from engine.model.arch import ModelArch
from engine.config import ModelConfig
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import LoadedModel
from kvtypes.sampling_params import SamplingParams
from scheduler.config import SchedulerConfig
from tests.helpers import tiny_engine, tiny_hf_model, tiny_llama_config

CUDA = torch.device("cuda")
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# float32 on both sides (TF32 off for matmuls, IEEE dots in the Triton kernels): only the
# summation order differs. bf16: a few ulps at |logit| ~ 2 (see tests/engine/model/test_bf16_vs_transformers.py).
TOLERANCE = {"float32": (2e-3, 1e-3), "bfloat16": (0.06, 0.02)}

BACKENDS = ["torch", "triton", "flash_attn"]
# 1024 positions: room for a two-block prefix hit at flash-attn's 256-token blocks
CONFIGS = {"gqa": tiny_llama_config(max_position_embeddings=1024),
           "mqa": tiny_llama_config(num_key_value_heads=1, max_position_embeddings=1024),
           "mha-tied": tiny_llama_config(num_key_value_heads=4, tie_word_embeddings=True, max_position_embeddings=1024)}


class LogitRecorder:
    def __init__(self, engine) -> None:
        self.inner = engine.runner.sampler
        self.records: dict[tuple[int, ...], torch.Tensor] = {}
        engine.runner.sampler = self

    def __call__(self, logits, rows):
        assert logits.device.type == "cuda"  # sampling runs on the GPU
        for i, row in enumerate(rows):
            self.records[tuple(row.prompt_token_ids) + tuple(row.output_token_ids)] = logits[i].float().cpu()
        return self.inner(logits, rows)


def backend_case(backend: str, dtype: str) -> tuple[str, int]:
    """(dtype, block_size) for a backend, skipping what cannot run here."""
    if backend == "triton" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if backend == "flash_attn":
        if importlib.util.find_spec("flash_attn") is None:
            pytest.skip("flash-attn is not installed")
        return "bfloat16", 256
    return dtype, 4


def check(hf_model, recorder: LogitRecorder, dtype: str) -> int:
    atol, rtol = TOLERANCE[dtype]
    ref = copy.deepcopy(hf_model).to(CUDA, getattr(torch, dtype))  # the fixture is shared: never cast it
    agree = 0
    for seq, logits in recorder.records.items():
        with torch.no_grad():
            expected = ref(torch.tensor([list(seq)], device=CUDA)).logits[0, -1].float().cpu()
        torch.testing.assert_close(logits, expected, atol=atol, rtol=rtol)
        agree += int(logits.argmax() == expected.argmax())
    assert agree >= len(recorder.records) - (len(recorder.records) // 10 if dtype == "bfloat16" else 0)
    return len(recorder.records)


def prompts(n: int, seed: int, lo: int = 3, hi: int = 40) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 128) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@pytest.fixture(params=list(CONFIGS), scope="module")
def hf_model(request):
    return tiny_hf_model(CONFIGS[request.param])


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_batched_decode_and_prefix_hit(hf_model, backend, dtype, graphs):
    dtype, block = backend_case(backend, dtype)
    engine = tiny_engine(hf_model, block_size=block, num_blocks=64 if block == 256 else 256, attention_backend=backend,
                         dtype=dtype, device="cuda", cuda_graphs=graphs)
    assert engine.runner.kv_caches[0][0].device.type == "cuda"
    used_graphs = engine.runner.graphs is not None
    assert used_graphs == (graphs and backend in ("triton", "flash_attn"))
    recorder = LogitRecorder(engine)
    shared = list(range(3, 3 + 2 * block))
    batch = prompts(6, seed=1) + [shared + [50, 51]]
    engine.generate(batch, GREEDY)
    hit = engine.generate([shared + [60]], GREEDY)[0]
    assert hit.num_cached_tokens == 2 * block
    assert check(hf_model, recorder, dtype) >= 7 * 6
    assert engine.kv_cache.usage == 0
    if used_graphs:
        assert engine.runner.graphs.replays >= 5  # the decode steps of both batches replayed graphs


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunked_prefill(hf_model, backend):
    dtype, block = backend_case(backend, "float32")
    engine = tiny_engine(hf_model, block_size=block, num_blocks=64 if block == 256 else 256,
                         max_num_batched_tokens=16, attention_backend=backend, dtype=dtype, device="cuda")
    recorder = LogitRecorder(engine)
    engine.generate(prompts(3, seed=2, lo=30, hi=60), GREEDY)  # every prompt is split over several steps
    assert check(hf_model, recorder, dtype) == 3 * 6


@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_preemption_resumes_identically(hf_model, backend, graphs):
    backend_case(backend, "float32")
    params = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
    ps = prompts(3, seed=3, lo=10, hi=10)
    alone = [tiny_engine(hf_model, attention_backend=backend, device="cuda").generate([p], params)[0].token_ids
             for p in ps]
    engine = tiny_engine(hf_model, num_blocks=12, block_size=4, attention_backend=backend, device="cuda",
                         cuda_graphs=graphs)
    recorder = LogitRecorder(engine)
    results = engine.generate(ps, params)
    assert engine.scheduler.stats.num_preemptions > 0
    assert (engine.runner.graphs is not None and engine.runner.graphs.replays > 0) == (graphs and backend == "triton")
    assert [r.token_ids for r in results] == alone
    check(hf_model, recorder, "float32")
    assert engine.kv_cache.usage == 0


def test_kv_pool_sized_by_profiling(caplog):
    """The pool takes what the utilization leaves after the profiling pass: here about 3 GiB
    above what is in use now (a share of the whole GPU would give a tiny model millions of
    blocks), in 256-token blocks to keep the block count modest."""
    hf = tiny_hf_model(CONFIGS["gqa"])
    loaded = LoadedModel(path=None, name="tiny", hf_config=hf.config, arch=ModelArch.from_hf_config(hf.config),
                         state_dict={k: v.detach().clone() for k, v in hf.state_dict().items()}, tokenizer=None)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    utilization = min(1.0, (total - free + 3 * 2**30) / total)
    config = EngineConfig(model=ModelConfig(device="cuda", dtype="bfloat16", gpu_memory_utilization=utilization),
                          cache=CacheConfig(block_size=256),
                          scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=8))
    with caplog.at_level("INFO"):
        engine = LLMEngine(config, loaded)
    assert "GPU memory:" in caplog.text and "KV pool" in caplog.text and "KV cache:" in caplog.text
    assert engine.capacity.total_bytes <= 3 * 2**30
    assert engine.capacity.num_blocks > 1000  # a tiny model leaves most of the 3 GiB to the pool
    out = engine.generate([[5, 6, 7]], GREEDY)[0]
    assert len(out.token_ids) == 6


def test_http_server_and_metrics_on_cuda():
    """`--device cuda` end to end: the OpenAI server streams completions from a CUDA engine
    (graphs on) and /metrics reports them."""
    from bench.gpu_check import synthetic_tokenizer
    from bench.client import completion_request, run_load, scrape_metrics
    from tests.helpers import serve_inprocess

    hf = tiny_hf_model(CONFIGS["gqa"])
    engine = tiny_engine(hf, device="cuda", dtype="bfloat16", tokenizer=synthetic_tokenizer(128))
    server = serve_inprocess(engine)
    try:
        reqs = [completion_request(p, 8) for p in prompts(6, seed=4)]
        records, _ = run_load(server, reqs, concurrency=3)
        metrics = scrape_metrics(server)
    finally:
        server.close()
    assert [r.error for r in records] == [None] * 6
    assert all(r.output_tokens == 8 and len(r.text.split()) == 8 for r in records)
    assert metrics is not None and metrics.get("kvserve_generation_tokens_total", 0) >= 48
    assert engine.runner.graphs is not None and engine.runner.graphs.replays > 0
