"""The step's one small all-reduce: presence bits, squared norm, overflow, problems.

Fusing them into one message keeps the step at a single latency: the global norm
(clipping), fp16 overflow agreement (every rank skips the same step), the check that a
gradient which exists on some ranks exists on all of them (named if not), and a flag for
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
from evenzero.runtime.checks import check_presence
from evenzero.runtime.collectives import TraceRecorder, all_reduce_sum


@dataclass(frozen=True)
class GradStats:
    """What the step's all-reduce established."""

    norm: float
    """Global 2-norm of the (unscaled) gradients over every rank and group."""
    overflow: bool
    """A non-finite gradient exists on some rank."""
    problem_ranks: int = 0
    """Ranks that found a problem (decided locally, raised everywhere)."""


@dataclass(frozen=True)
class StepCheckConfig:
    """What the step check needs to know, fixed at construction."""

    names: tuple[str, ...]
    """Managed parameter names in registration order (one presence bit each)."""
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

    def __call__(self, shards: Iterable[torch.Tensor], presence: Sequence[float],
                 loss_scale: float, local_problem: bool) -> GradStats:
        """All-reduce [presence per param, sum of squared shard norms, overflow, problem];
        the caller raises if `problem_ranks` is non-zero.

        Shards partition every gradient element exactly once over the world (padding is
        zero), so the sum of local squared norms is the global squared norm."""
        cfg = self.config
        n = len(cfg.names)
        with record_function("evenzero::step_check"):
            sq = sum((torch.linalg.vector_norm(g.float()) ** 2).to(cfg.device) for g in shards)
            vec = torch.zeros(n + STEP_CHECK_EXTRA, dtype=torch.float32, device=cfg.device)
            vec[:n] = torch.tensor(list(presence), dtype=torch.float32)
            vec[n] = sq
            vec[n + 1] = (~torch.isfinite(sq)).float()  # on device: no host sync before the call
            vec[n + 2] = float(local_problem)
            all_reduce_sum(vec, cfg.group)
            self.trace.record(self.record, "all_reduce")
            values = vec.tolist()
        problem_ranks = round(values[n + 2])
        if not problem_ranks:
            check_presence(values[:n], cfg.names, cfg.world_size, cfg.allow_partial_grads)
        total = values[n]
        overflow = values[n + 1] > 0 or not math.isfinite(total)
        return GradStats(math.sqrt(total) / loss_scale if not overflow else math.inf, overflow,
                         problem_ranks)
