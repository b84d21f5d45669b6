"""The step's one small all-reduce: presence, squared norm, overflow, problems, counts.

Fusing them into one message keeps the step at a single latency: the global norm
(clipping), fp16 overflow agreement (every rank skips the same step), the check that a
gradient which exists on some ranks exists on all of them (named if not), which
parameters no rank holds a gradient for (torch does not step those), the check that
every rank ran as many micro-batches under no_sync(), and a flag for
problems a rank found alone (at the end of backward, in a backward that raised, in
gradients it discarded), so that every rank raises instead of the others waiting in
this very all-reduce for the one that stopped. Its plan record is `plan.step_check`.
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
from evenzero.runtime.collectives import TraceRecorder, all_reduce_sum


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
            sq = sum((torch.linalg.vector_norm(g.double()) ** 2).to(cfg.device) for g in shards)
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
            self.trace.record(self.record, "all_reduce")
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
