"""The step's one small all-reduce: presence, squared norm, overflow, problems, counts.

Fusing them into one message keeps the step at a single latency: the global norm
(clipping), fp16 overflow agreement (every rank skips the same step), the check that a
gradient which exists on some ranks exists on all of them (named if not), which
parameters no rank holds a gradient for (torch does not step those), the check that
every rank ran as many micro-batches under no_sync(), and a flag for
problems a rank found alone (at the end of backward, in a backward that raised, in
gradients it discarded), so that every rank raises instead of the others waiting in
this very all-reduce for the one that stopped. Its plan record is `plan.step_check`.

The squared norm (`squared_norm`) is computed in the shard's own precision, in rows of
`NORM_ROW` elements, and only the row norms are combined in fp64: one pass over the
shard, no shard-sized temporary (`vector_norm(g.double())` allocated an 8-byte copy of
every element, about a quarter of a world-size-1 step). Megatron-core does the same
with an fp32 multi-tensor L2 norm (megatron/core/optimizer/clip_grads.py@d98e8a64).
Rows whose fp32 norm is not finite (a NaN, an inf, or an fp32 overflow) are recomputed
in fp64, and so is a shard so small that fp32 underflow could matter, so the result
agrees with the fp64 norm of the whole shard (the one DeepSpeed computes,
stage_1_and_2.py@edaa7221 `get_grad_norm_direct`): a non-finite gradient still gives a
non-finite sum, and a finite one never overflows.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import record_function

from evenzero.plan import STEP_CHECK_EXTRA, step_check
from evenzero.runtime.checks import ZeroRuntimeError, check_presence
from evenzero.runtime.collectives import LOCAL, TraceRecorder, all_reduce_sum

NORM_ROW = 256
"""Elements per partial norm. A row's sum of squares is accumulated in fp32, in a few
vector lanes of a handful of terms each, so its rounding error is a few fp32 ulps; the
row norms meet in fp64. Measured against the fp64 norm of 12.6M elements: relative
error 1e-10 (normal values) to 2e-8 (bf16 values widened), with 256-element rows; at
16384 elements per row the same was 4e-8 to 4e-6, at the same speed."""
UNDERFLOW_PER_ROW = NORM_ROW * 2.0**-149
"""The most a row's fp32 sum of squares can lose to underflow: each square below the
smallest fp32 subnormal (2**-149) is flushed, the others are kept to within it. Exact
zeros (dead ReLU units, padding, parameters without a gradient) lose nothing."""
UNDERFLOW_SHARE = 1e-8
"""A shard whose fp32 sum of squares is below `UNDERFLOW_PER_ROW` per row divided by
this (a norm under about 1e-15 for 10M elements) is recomputed in fp64 whole, so
underflow never costs more than this share of the result."""
STAGE_NUMEL = 1 << 20
"""Low-precision shards (bf16/fp16 masters) are widened to fp32 this many elements at a
time (a 4 MiB staging buffer), not as a whole; fp64 recomputation goes as many
elements at a time."""


def squared_norm(shards: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The sum of squares of every element of `shards`, as an fp64 scalar on `device`,
    without a shard-sized temporary. Agrees with the fp64 sum of squares to a few fp32
    ulps of the largest row's (relative); inf where it has an inf, NaN where a NaN."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for g in shards:
        if g.numel():
            total += _squared_norm(g.reshape(-1)).to(device)
    return total


def _squared_norm(flat: torch.Tensor) -> torch.Tensor:
    if flat.dtype == torch.float64:
        return torch.linalg.vector_norm(flat).square()
    if flat.dtype == torch.float32:
        return _rows_squared(flat)
    total = torch.zeros((), dtype=torch.float64, device=flat.device)
    stage = torch.empty(min(STAGE_NUMEL, flat.numel()), dtype=torch.float32, device=flat.device)
    for start in range(0, flat.numel(), STAGE_NUMEL):
        part = flat[start:start + STAGE_NUMEL]
        widened = stage[:part.numel()]
        widened.copy_(part)
        total += _rows_squared(widened)
    return total


def _rows_squared(flat: torch.Tensor) -> torch.Tensor:
    """Sum of squares of an fp32 vector: fp32 row norms met in fp64; rows whose fp32 norm
    is not finite (an inf or NaN element, or an fp32 overflow) again in fp64, and the
    whole vector in fp64 if underflow could matter."""
    whole = flat.numel() // NORM_ROW * NORM_ROW
    # The tail is under one row: fp64 directly.
    total = torch.linalg.vector_norm(flat[whole:], dtype=torch.float64).square()
    if not whole:
        return total
    rows = flat[:whole].view(-1, NORM_ROW)
    norm = torch.linalg.vector_norm(rows, dim=1)
    finite = torch.isfinite(norm)
    total += norm.double().square().masked_fill_(~finite, 0).sum()
    redo = (~finite).nonzero().flatten()
    per = STAGE_NUMEL // NORM_ROW
    for start in range(0, redo.numel(), per):
        total += torch.linalg.vector_norm(rows.index_select(0, redo[start:start + per]),
                                          dtype=torch.float64).square()
    if total.item() < rows.shape[0] * UNDERFLOW_PER_ROW / UNDERFLOW_SHARE:
        low, high = torch.aminmax(flat)
        if low.item() == 0 and high.item() == 0:
            return total  # zeros: exact (a shard of padding, or of no gradient)
        # Tiny gradients everywhere: as fp64 sees them.
        total = torch.linalg.vector_norm(flat[whole:], dtype=torch.float64).square()
        for start in range(0, whole, STAGE_NUMEL):
            total += torch.linalg.vector_norm(flat[start:min(start + STAGE_NUMEL, whole)],
                                              dtype=torch.float64).square()
    return total


@dataclass(frozen=True)
class GradStats:
    """What the step's all-reduce established."""

    norm: float
    """Global 2-norm of the gradients over every rank and group."""
    overflow: bool
    """A non-finite gradient exists on some rank."""
    problem_ranks: int = 0
    """Ranks that found a problem (decided locally, raised everywhere)."""
    present: tuple[bool, ...] = ()
    """Per parameter: some rank holds a gradient for it (torch's `p.grad is not None`),
    so the step touches it."""


@dataclass(frozen=True)
class StepCheckConfig:
    """What the step check needs to know, fixed at construction."""

    names: tuple[str, ...]
    """Managed parameter names in registration order (one presence value each)."""
    group: Any
    """The data-parallel world process group."""
    world_size: int
    """Ranks in `group`."""
    device: torch.device
    """Where the control vector lives (`collectives.control_device`)."""
    allow_partial_grads: bool
    """Whether a gradient present on some ranks only counts as zeros elsewhere."""


class StepCheck:
    """The step check as a collective object: call it once per step."""

    def __init__(self, config: StepCheckConfig, trace: TraceRecorder) -> None:
        self.config, self.trace = config, trace
        self.record = step_check(config.world_size, len(config.names))

    def __call__(self, shards: Iterable[torch.Tensor], arrived: Sequence[float],
                 has_grad: Sequence[bool], local_problem: bool, micro_batches: int) -> GradStats:
        """All-reduce [presence per param, squared norm, overflow, problem, no_sync count,
        its square]; the caller raises if `problem_ranks` is non-zero.

        A parameter's presence is `arrived + (W + 1) * has_grad`: the sums of both
        (each at most W) come back apart. Shards partition every gradient element
        exactly once over the world (padding is zero), so the sum of local squared norms
        is the global squared norm."""
        cfg = self.config
        n, w = len(cfg.names), cfg.world_size
        with record_function("evenzero::step_check"):
            sq = squared_norm(shards, cfg.device)
            vec = torch.zeros(n + STEP_CHECK_EXTRA, dtype=torch.float64, device=cfg.device)
            vec[:n] = torch.tensor([a + (w + 1) * float(h) for a, h in zip(arrived, has_grad,
                                                                           strict=True)],
                                   dtype=torch.float64)
            vec[n] = sq
            vec[n + 1] = (~torch.isfinite(sq)).double()  # on device: no host sync before the call
            vec[n + 2] = float(local_problem)
            vec[n + 3] = float(micro_batches)
            vec[n + 4] = float(micro_batches) ** 2
            all_reduce_sum(vec, cfg.group, "the step check's all-reduce")
            self.trace.record(self.record, LOCAL if w == 1 else "all_reduce")
            values = vec.tolist()
        problem_ranks = round(values[n + 2])
        counts = [round(v) for v in values[:n]]
        if not problem_ranks:
            total_c, total_c2 = round(values[n + 3]), round(values[n + 4])
            if w * total_c2 != total_c * total_c:
                raise ZeroRuntimeError(
                    f"ranks ran different numbers of backward passes under no_sync() since the "
                    f"last step ({total_c} micro-batches over {w} ranks); the gradient would "
                    f"not be the mean over the global batch. Run the same number of "
                    f"micro-batches on every rank")
            check_presence([c % (w + 1) for c in counts], cfg.names, w, cfg.allow_partial_grads)
        total = values[n]
        overflow = values[n + 1] > 0 or not math.isfinite(total)
        return GradStats(math.sqrt(total) if not overflow else math.inf, overflow,
                         problem_ranks, tuple(c // (w + 1) > 0 for c in counts))
