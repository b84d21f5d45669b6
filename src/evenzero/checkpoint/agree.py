"""Ranks agree on success before they go on: never a hang, never a partial state.

Every collective checkpoint step ends in `agree`: each rank says whether it failed, one
small all-reduce tells every rank, and if any failed they all raise the same
`CheckpointError` (the failing rank's message, shared as bytes over the same process
group). A rank that meets a bad file therefore never leaves the others blocked in the
next collective.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch
import torch.distributed as dist

from evenzero.checkpoint.format import CheckpointError
from evenzero.checkpoint.state import RankPlace

MESSAGE_BYTES = 2048
"""Longest error text shared between ranks; longer ones are cut."""

T = TypeVar("T")


def attempt(fn: Callable[[], T]) -> tuple[T | None, BaseException | None]:
    """Run `fn`, keeping its failure for `agree` instead of leaving the collective."""
    try:
        return fn(), None
    except Exception as e:  # noqa: BLE001 - any failure must reach the other ranks
        return None, e


def agree(place: RankPlace, err: BaseException | None, doing: str, same: int | None = None,
          differ: str | None = None) -> None:
    """Raise the same error on every rank if any rank failed (also a barrier).

    With `same`, every rank must also hold the same value (e.g. the step it loads); if
    they do not, every rank raises `differ` (default: they found different checkpoints).
    """
    if place.world_size == 1:
        if err is not None:
            raise _as_checkpoint_error(err, doing) from err
        return
    v = 0 if same is None else same
    flags = torch.tensor([int(err is not None), v, -v], dtype=torch.int64, device=place.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=place.group)
    failed, hi, lo = (int(x) for x in flags.tolist())
    if failed:
        text = (str(_as_checkpoint_error(err, doing)) or f"{doing}: {type(err).__name__}"
                if err is not None else "")
        mine = torch.zeros(MESSAGE_BYTES, dtype=torch.uint8, device=place.device)
        raw = text.encode()[:MESSAGE_BYTES]
        mine[:len(raw)] = torch.tensor(list(raw), dtype=torch.uint8)
        every = [torch.zeros_like(mine) for _ in range(place.world_size)]
        dist.all_gather(every, mine, group=place.group)
        reports = [(r, bytes(t.cpu().tolist()).rstrip(b"\0").decode(errors="replace"))
                   for r, t in enumerate(every)]
        reports = [(r, m) for r, m in reports if m]
        first_rank, first = reports[0]
        more = f"; {len(reports) - 1} other rank(s) failed too" if len(reports) > 1 else ""
        raise CheckpointError(f"rank {first_rank}: {first}{more}") from err
    if hi != -lo:
        raise CheckpointError(f"{doing}: " + (differ or f"ranks found different checkpoints "
                                                        f"(steps {-lo} to {hi}); another job may "
                                                        f"be saving into the same directory"))


def _as_checkpoint_error(err: BaseException, doing: str) -> CheckpointError:
    if isinstance(err, CheckpointError):
        return err
    if isinstance(err, OSError):
        where = f" ({err.filename})" if err.filename else ""
        return CheckpointError(f"{doing}: {err.strerror or err}{where}")
    return CheckpointError(f"{doing}: {type(err).__name__}: {err}")


