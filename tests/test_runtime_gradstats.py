"""The step check's squared gradient norm: fp32 rows met in fp64, agreeing with the fp64
norm of the whole shard, with torch's inf/NaN behaviour and no false overflow."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from evenzero.runtime.gradstats import NORM_ROW, STAGE_NUMEL, squared_norm

CPU = torch.device("cpu")
BOUND = 1e-6
"""Relative agreement with the fp64 sum of squares asserted here. A row of `NORM_ROW`
fp32 squares is accumulated in a few vector lanes, so its rounding error is a few fp32
ulps (2**-24 = 6e-8 each); measured on 12.6M elements: 1e-10 to 2e-8."""


def fp64_squared(shards) -> float:
    return sum(torch.linalg.vector_norm(t.double()).item() ** 2 for t in shards)


def close(got: torch.Tensor, want: float) -> bool:
    return abs(got.item() - want) <= BOUND * abs(want)


@pytest.mark.parametrize("numel", [1, NORM_ROW - 1, NORM_ROW, NORM_ROW + 1, 100_003,
                                   STAGE_NUMEL + 7])
@pytest.mark.parametrize("scale", [1e-30, 1e-12, 1.0, 1e15, 1e30])
def test_agrees_with_the_fp64_norm_across_sizes_and_magnitudes(numel, scale):
    gen = torch.Generator().manual_seed(numel)
    g = torch.randn(numel, generator=gen) * scale
    got = squared_norm([g], CPU)
    assert got.dtype == torch.float64
    assert math.isfinite(got.item()), "a finite fp32 gradient never overflows (fp32 rows of 1e30 do)"
    assert close(got, fp64_squared([g])), (got.item(), fp64_squared([g]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_other_shard_dtypes_agree_with_their_fp64_norm(dtype):
    gen = torch.Generator().manual_seed(1)
    shards = [(torch.randn(STAGE_NUMEL + 300, generator=gen) * 3).to(dtype),
              torch.randn(5, generator=gen).to(dtype)]
    assert close(squared_norm(shards, CPU), fp64_squared(shards))


def test_several_shards_sum_and_empty_ones_count_nothing():
    gen = torch.Generator().manual_seed(2)
    shards = [torch.randn(3000, generator=gen), torch.empty(0), torch.zeros(NORM_ROW * 3),
              torch.randn(7, generator=gen) * 1e-3]
    assert close(squared_norm(shards, CPU), fp64_squared(shards))
    assert squared_norm([], CPU).item() == 0.0
    assert squared_norm([torch.empty(0)], CPU).item() == 0.0
    assert squared_norm([torch.zeros(STAGE_NUMEL * 2)], CPU).item() == 0.0


def test_zero_rows_beside_tiny_ones_keep_the_tiny_ones():
    """Dead ReLU units give whole rows of zeros; values whose fp32 squares underflow
    (below 3.7e-23) still count, as in fp64."""
    g = torch.zeros(NORM_ROW * 64)
    g[5] = 1e-24
    g[NORM_ROW * 10 + 3] = -2e-30
    want = fp64_squared([g])
    assert want > 0
    assert close(squared_norm([g], CPU), want)


@pytest.mark.parametrize("bad, expect", [(math.inf, math.inf), (-math.inf, math.inf),
                                         (math.nan, math.nan)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_non_finite_gradients_give_a_non_finite_norm(bad, expect, dtype):
    g = torch.randn(NORM_ROW * 8 + 3, generator=torch.Generator().manual_seed(3)).to(dtype)
    g[NORM_ROW * 2 + 1] = bad
    got = squared_norm([g], CPU).item()
    assert (math.isnan(got) if math.isnan(expect) else got == expect), got
    g = torch.zeros(10).to(dtype)  # in the tail, and in a shard of zeros otherwise
    g[9] = bad
    got = squared_norm([g], CPU).item()
    assert (math.isnan(got) if math.isnan(expect) else got == expect), got


@settings(max_examples=60, deadline=None)
@given(st.lists(st.floats(allow_nan=False, allow_infinity=False, width=32),
                min_size=0, max_size=3 * NORM_ROW + 5),
       st.integers(min_value=0, max_value=4))
def test_any_finite_fp32_values_agree_with_fp64(values, zeros):
    g = torch.tensor(values + [0.0] * zeros * NORM_ROW, dtype=torch.float32)
    want = fp64_squared([g])
    got = squared_norm([g], CPU)
    assert math.isfinite(got.item())
    assert abs(got.item() - want) <= BOUND * want, (got.item(), want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_shard_sized_temporary(dtype):
    """The largest allocation is the bf16 staging buffer (4 MiB), never a copy of the
    shard (the fp64 copy this replaced was 8 bytes per element: 64 MB here)."""
    from torch.profiler import ProfilerActivity, profile

    g = torch.randn(8 * 2**20, generator=torch.Generator().manual_seed(4)).to(dtype)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        squared_norm([g], CPU)
    largest = max(e.self_cpu_memory_usage for e in prof.events())
    assert 0 < largest <= STAGE_NUMEL * 4, largest
    assert largest * 4 <= g.numel() * g.element_size()
