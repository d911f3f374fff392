"""The native greedy arg-max (``argmax_rows``, engine/kernels/cpu/argmax.cpp) gives torch's ids exactly:
the first index of each row's maximum, the first NaN where a row has one, at every row width
around its 16-lane (AVX-512) or 8-lane (AVX2) vectors."""
from __future__ import annotations

import pytest
import torch

from engine.platform.cpu_features import cpu_flags
from tests.helpers import require_native_kernel


@pytest.fixture(scope="module", autouse=True)
def kernel():
    require_native_kernel()


def want(logits: torch.Tensor) -> list[int]:
    expected = logits.argmax(dim=-1)
    assert torch.equal(expected, logits.max(dim=-1).indices)  # the two torch contracts agree
    return expected.tolist()


def test_the_scan_is_native_wherever_the_cpu_has_avx2():
    """Without this the tests below would pass on torch's max alone (the fallback gives the same ids)."""
    flags = cpu_flags()
    if not flags:
        pytest.skip("no /proc/cpuinfo flags to read the CPU's instruction sets from")
    assert torch.ops.kvserve.argmax_lanes() == (16 if "avx512f" in flags else 8 if "avx2" in flags else 0)


@pytest.mark.parametrize("width", [1, 7, 8, 9, 15, 16, 17, 31, 48, 1000, 49152])
@pytest.mark.parametrize("rows", [1, 3, 16])
def test_random_and_tied_logits(width, rows):
    gen = torch.Generator().manual_seed(width * 10 + rows)
    logits = torch.randn(rows, width, generator=gen)
    assert torch.ops.kvserve.argmax_rows(logits).tolist() == want(logits)
    # three distinct values: every row ties many times, in many lanes
    tied = torch.randint(0, 3, (rows, width), generator=gen).float()
    assert torch.ops.kvserve.argmax_rows(tied).tolist() == want(tied)


def test_nan_and_infinities():
    width = 100  # six 16-lane vectors and a 4-value tail
    logits = torch.randn(10, width, generator=torch.Generator().manual_seed(0))
    nan, inf = float("nan"), float("inf")
    logits[0, 3] = nan                      # in the first vector
    logits[1, 40] = nan                     # in a later vector, after the running maximum
    logits[1, 41] = 50.0                    # ... a larger value after it does not win
    logits[2, 97] = nan                     # in the tail
    logits[3, [70, 20, 90]] = nan           # several: the first
    logits[4] = -inf                        # all -inf: index 0
    logits[5, 60] = inf
    logits[5, 80] = inf                     # two +inf: the first
    logits[6, 5] = 9.0
    logits[6, 85] = 9.0                     # a tie across the vector and the tail
    logits[7, 96] = 20.0                    # the maximum in the tail
    logits[8, 15] = nan
    logits[8, 16] = nan                     # the last lane of one vector, the first of the next
    got = torch.ops.kvserve.argmax_rows(logits).tolist()
    assert got == want(logits)
    assert got[:9] == [3, 40, 97, 20, 0, 60, 5, 96, 15]


def test_strided_input_and_bad_arguments():
    base = torch.randn(40, 64, generator=torch.Generator().manual_seed(1))
    view = base.t()[:, ::2]  # [64, 20], not contiguous
    assert torch.ops.kvserve.argmax_rows(view).tolist() == want(view)
    for bad in (torch.randn(8), torch.randn(2, 8).half(), torch.randn(2, 0)):
        with pytest.raises(RuntimeError):
            torch.ops.kvserve.argmax_rows(bad)
