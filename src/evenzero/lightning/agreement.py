"""Setup problems raised on every rank.

A strategy's checks at setup (an optimizer evenzero cannot shard, a checkpoint path it
cannot write) run on every rank; when one rank finds a problem the others must raise
too, not walk on into the optimizer's collectives and wait there for it. One
`all_gather_object` at setup (never per step) carries each rank's finding.
"""

from __future__ import annotations

import torch.distributed as dist

from evenzero.runtime import ZeroConfigError


def raise_on_every_rank(problem: str | None, error: type[Exception] = ZeroConfigError) -> None:
    """Raise `error` on every rank if any rank passes a problem; a collective when
    torch.distributed is initialised."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        if problem:
            raise error(problem)
        return
    found: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(found, problem)
    if problem:
        raise error(problem)
    rank, message = next((r, m) for r, m in enumerate(found) if m) if any(found) else (0, None)
    if message:
        raise error(f"rank {rank}: {message}")
