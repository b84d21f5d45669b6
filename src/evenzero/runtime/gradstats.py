"""The step's one small all-reduce: presence bits, squared norm, overflow, problems.

Fusing them into one message keeps the step at a single latency: the global norm
(clipping), fp16 overflow agreement (every rank skips the same step), the check that a
gradient which exists on some ranks exists on all of them (named if not), and a flag for
problems a rank found alone at the end of backward, so that every rank raises instead of
the others waiting in this very all-reduce for the one that stopped.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from evenzero.runtime.checks import check_presence
from evenzero.runtime.collectives import all_reduce_sum


@dataclass(frozen=True)
class GradStats:
    """What the step's all-reduce established."""

    norm: float
    """Global 2-norm of the (unscaled) gradients over every rank and group."""
    overflow: bool
    """A non-finite gradient exists on some rank."""
    problem_ranks: int = 0
    """Ranks whose last backward found a problem (decided locally, raised everywhere)."""


def reduce_grad_stats(shards: Iterable[torch.Tensor], presence: Sequence[float],
                      names: Sequence[str], group, world_size: int, device: torch.device,
                      loss_scale: float, allow_partial_grads: bool,
                      local_problem: bool = False) -> GradStats:
    """All-reduce [presence per param, sum of squared shard norms, overflow, problem]
    over `group`; the caller raises if `problem_ranks` is non-zero.

    Shards partition every gradient element exactly once over the world (padding is
    zero), so the sum of local squared norms is the global squared norm."""
    n = len(names)
    sq = sum((torch.linalg.vector_norm(g.float()) ** 2).to(device) for g in shards)
    vec = torch.zeros(n + 3, dtype=torch.float32, device=device)
    vec[:n] = torch.tensor(list(presence), dtype=torch.float32)
    vec[n] = sq
    vec[n + 1] = (~torch.isfinite(sq)).float()  # on device: no host sync before the call
    vec[n + 2] = float(local_problem)
    all_reduce_sum(vec, group)
    values = vec.tolist()
    problem_ranks = round(values[n + 2])
    if not problem_ranks:
        check_presence(values[:n], names, world_size, allow_partial_grads)
    total = values[n]
    overflow = values[n + 1] > 0 or not math.isfinite(total)
    return GradStats(math.sqrt(total) / loss_scale if not overflow else math.inf, overflow,
                     problem_ranks)
