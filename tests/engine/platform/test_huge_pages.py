"""Host buffers on huge pages (engine/platform/huge_pages.py): zeros, slots and copies, the CPU KV
pool over them, and a GGUF model's blocks gathered into one buffer before its matmuls bind them."""
import pytest
import torch

from engine.kv.pool import allocate_kv_pool
from engine.platform import huge_pages
from tests.helpers import require_native_kernel

from tests.engine.loader.test_gguf_formats import cache_dir  # noqa: E402,F401 (fixture)

pytestmark = pytest.mark.skipif(not huge_pages.supported(), reason="anonymous huge-page mappings are Linux's")


def test_zeros_are_aligned_zeros_that_hold_writes():
    t = huge_pages.zeros((3, 16, 2, 8), torch.float16)
    assert t.shape == (3, 16, 2, 8) and t.dtype == torch.float16 and t.is_contiguous()
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0 and not t.any()
    t[1, 2] = 1.5
    assert t.sum().item() == 1.5 * 16


def test_slots_are_64_byte_aligned_and_disjoint_and_copies_keep_values():
    tensors = [torch.arange(7, dtype=torch.uint8), torch.randn(5, 3), torch.arange(100, dtype=torch.int32).view(10, 10)]
    slots = huge_pages.slots([t.numel() * t.element_size() for t in tensors])
    assert [s.numel() for s in slots] == [7, 60, 400]
    assert all(s.data_ptr() % huge_pages.ALIGN == 0 for s in slots)
    assert slots[0].data_ptr() % huge_pages.HUGE_PAGE == 0
    ends = [(s.data_ptr(), s.data_ptr() + s.numel()) for s in slots]
    assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))
    copies = [huge_pages.copy_into(s, t) for s, t in zip(slots, tensors)]
    for c, t in zip(copies, tensors):
        assert c.dtype == t.dtype and c.shape == t.shape and torch.equal(c, t)
    copies[0][0] = 99  # a copy, not a view of the original
    assert tensors[0][0] == 0


def test_the_cpu_float_pool_is_zeros_on_huge_pages():
    pool = allocate_kv_pool(10, 16, 2, 3, 64, "float16", torch.float32, torch.device("cpu"))
    assert len(pool) == 2
    for k, v in pool:
        assert k.shape == v.shape == (11, 16, 3, 64) and k.dtype == torch.float16
        assert k.data_ptr() % huge_pages.HUGE_PAGE == 0 and v.data_ptr() % huge_pages.HUGE_PAGE == 0
        assert not k.any() and not v.any()


@pytest.fixture(scope="module")
def kernels_then_cache_dir(request):
    """The kernels loaded before cache_dir moves the cache (else they are built again there)."""
    require_native_kernel()
    return request.getfixturevalue("cache_dir")


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "int4"])
def test_the_cpu_quantized_pools_are_zeros_on_huge_pages(kv_cache_dtype):
    pool = allocate_kv_pool(10, 16, 2, 3, 64, kv_cache_dtype, torch.float32, torch.device("cpu"), residual_slots=4)
    k, v = pool[0]
    fields = ("data", "scale") if kv_cache_dtype == "int8" else ("codes", "scale", "residual")
    tensors = [getattr(side, f) for side in (k, v) for f in fields]
    for t in tensors:
        assert t.data_ptr() % huge_pages.HUGE_PAGE == 0 and not t.any()


def test_a_gguf_models_blocks_share_one_buffer_the_matmuls_read(kernels_then_cache_dir, tmp_path):
    from bench.make_gguf import write_gguf
    from engine.loader.gguf.blocks import BlockFormat
    from engine.model.block_linear import BlockLinear
    from tests.engine.loader.test_gguf_formats import TINY, gguf_engine, uniform

    path = write_gguf(tmp_path / "q4_1.gguf", TINY, uniform(BlockFormat.Q4_1), seed=3)
    model = gguf_engine(path, "blocks").runner.model
    parts = [p for layer in model.layers for m in layer.blocks.values() for p in m.parts]
    parts += model.lm_head_blocks.parts
    base = parts[0].data.untyped_storage().data_ptr()
    assert all(p.data.untyped_storage().data_ptr() == base for p in parts)  # one mapping
    assert all(p.data.data_ptr() % huge_pages.ALIGN == 0 for p in parts)
    # the matmuls bound after the gather read the gathered tensors
    bound = [mm for layer in model.layers for attr, _, _ in layer.MATMULS
             if isinstance(mm := getattr(layer, attr), BlockLinear)]
    assert len(bound) == 4 * len(model.layers)
    assert all(d.untyped_storage().data_ptr() == base for mm in bound for d, _, _ in mm.parts)
