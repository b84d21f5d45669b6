"""`init_process_group`: torch's, made safe for launcher restarts and elastic re-rendezvous.

    evenzero.init_process_group("gloo")     # same parameters and defaults as torch's

Why torch's own is not: under torchrun (torch 2.13) every worker's store is, by default,
the one TCPStore that the rendezvous leader's agent keeps for the whole job
(`TORCHELASTIC_USE_AGENT_STORE`; torch/distributed/elastic/rendezvous/dynamic_rendezvous.py
@v2.13.0 `use_agent_store`), and the env:// handler hands it to the process group without
a per-attempt prefix (torch/distributed/rendezvous.py@v2.13.0 `_create_c10d_store`). After
a restart the process group's keys still hold the dead attempt's values, so gloo's
`connectFullMesh` dials the old peers ("Connection refused") and NCCL would read the old
unique id (pytorch/pytorch#135712; `TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1` avoids the
shared store). The same holds for any store that outlives an attempt (a `file://` path, a
store the user passes).

The fix: the workers of each attempt agree on a namespace of the store that no earlier
attempt used (`agree_round`), and the process group lives under it (a `PrefixStore`, as
torch's own "default_pg" prefix). `TORCHELASTIC_RESTART_COUNT` cannot name that namespace:
it counts the restarts of one agent, and agents disagree (an agent joining an elastic job
starts at 0; a membership change restarts the workers without counting). Everything else
is torch's: the same arguments, defaults and errors; `dist.init_process_group` then runs
with the prefixed store, rank and world size.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.constants import default_pg_nccl_timeout, default_pg_timeout

logger = logging.getLogger("evenzero.rendezvous")

NAMESPACE = "evenzero/rendezvous"
"""Root of the agreement's keys in the launcher's store."""
POLL_SECONDS = (0.002, 0.05)
"""First and longest pause between two looks at the store while waiting for the others."""

_inits = itertools.count()
"""How many times this process initialised a process group through us: a second
initialisation after `destroy_process_group` agrees in its own namespace."""


class RendezvousError(RuntimeError):
    """The ranks of this attempt did not all arrive within the timeout."""


def init_process_group(backend: str | None = None, init_method: str | None = None,
                       timeout: timedelta | None = None, world_size: int = -1, rank: int = -1,
                       store: Any = None, group_name: str = "", pg_options: Any = None,
                       device_id: Any = None, _ranks: list[int] | None = None) -> None:
    """`torch.distributed.init_process_group` (torch 2.13's parameters and defaults), in a
    namespace of the store that this attempt of the job owns.

    The store is the one torch would use: `store` if given, else the one
    `torch.distributed.rendezvous(init_method or "env://")` returns (under torchrun the
    agent's). Raises torch's errors for torch's misuses (initialising twice, `store` with
    `init_method`, a bad `timeout`), and `RendezvousError` naming the absent ranks when
    not every rank arrives within `timeout`.
    """
    if dist.is_initialized():
        raise ValueError("trying to initialize the default process group twice!")
    if store is not None and init_method is not None:
        raise AssertionError("Cannot specify both init_method and store.")
    if backend is not None and str(backend).lower() == "mpi":
        # MPI ranks meet through MPI itself; there is no store to go stale.
        dist.init_process_group(backend, init_method, timeout, world_size, rank, store,
                                group_name, pg_options, device_id, _ranks)
        return
    if timeout is None:
        timeout = default_pg_nccl_timeout if _is_nccl(backend) else default_pg_timeout
    if not isinstance(timeout, timedelta):
        raise TypeError(f"Expected timeout argument to be of type datetime.timedelta, got "
                        f"{timeout}")
    if store is None:
        store, rank, world_size = next(dist.rendezvous(init_method or "env://", rank, world_size,
                                                       timeout=timeout))
        store.set_timeout(timeout)
    else:
        if not world_size > 0:
            raise AssertionError("world_size must be positive if using store")
        if not rank >= 0:
            raise AssertionError("rank must be non-negative if using store")
    namespace = f"{NAMESPACE}/{next(_inits)}"
    round_id = agree_round(dist.PrefixStore(namespace, store), rank, world_size, timeout)
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    logger.info("rank %d of %d: process group in store namespace %s/round-%d%s", rank,
                world_size, namespace, round_id,
                f" (torchrun restart count {restart})" if restart is not None else "")
    pg_store = dist.PrefixStore(f"{namespace}/round-{round_id}/default_pg", store)
    dist.init_process_group(backend, timeout=timeout, world_size=world_size, rank=rank,
                            store=pg_store, group_name=group_name, pg_options=pg_options,
                            device_id=device_id, _ranks=_ranks)


def _is_nccl(backend: Any) -> bool:
    return backend is not None and str(backend).lower() == "nccl"


def agree_round(store: Any, rank: int, world_size: int, timeout: timedelta) -> int:
    """A number that every rank of this attempt returns and no earlier attempt on `store`
    returned (a collective over the store).

    Each rank takes a ticket from one counter. Earlier attempts' workers are gone before
    the launcher starts new ones, so this attempt's W tickets are consecutive: a block
    [s, s + W - 1], whose first ticket s is the answer. A rank does not know s, so it
    votes for the newest block that could hold its ticket (the last W tickets taken)
    whenever the counter moves, and the answer is the block all W ticket holders voted
    for. A block that also holds an earlier attempt's ticket never gets that ticket's
    vote (its holder voted only for blocks that existed in its time), and one holding
    tickets not yet taken never gets theirs, so only this attempt's block is complete.
    """
    deadline = time.monotonic() + timeout.total_seconds()
    ticket = store.add("tickets", 1)
    store.set(f"rank/{rank}", str(ticket))
    voted: list[int] = []
    pause = POLL_SECONDS[0]
    while True:
        for block in voted:
            if store.add(f"block/{world_size}/{block}", 0) >= world_size:
                return block
        newest = store.add("tickets", 0) - world_size + 1
        if newest <= ticket and newest not in voted:
            store.add(f"block/{world_size}/{newest}", 1)
            voted.append(newest)
            continue
        if time.monotonic() > deadline:
            raise RendezvousError(_absent_message(store, rank, world_size, ticket, timeout))
        time.sleep(pause)
        pause = min(2 * pause, POLL_SECONDS[1])


def _absent_message(store: Any, rank: int, world_size: int, ticket: int,
                    timeout: timedelta) -> str:
    # A rank of this attempt holds a ticket no older than W - 1 before ours; one with an
    # older ticket (or none) has certainly not arrived. An earlier attempt's ticket may
    # look recent, so the list can miss ranks but never names one that arrived.
    absent = [r for r in range(world_size)
              if not store.check([f"rank/{r}"])
              or int(store.get(f"rank/{r}")) < ticket - world_size + 1]
    named = f"ranks {absent}" if absent else "some ranks"
    return (f"init_process_group: rank {rank} waited {timeout} for all {world_size} ranks of "
            f"this attempt; {named} did not arrive (not started, or failed before "
            f"init_process_group). Check the launcher's log of those ranks")


__all__ = ["RendezvousError", "agree_round", "init_process_group"]
