"""A rank that stops arriving is named, not waited for in silence.

When one rank stops issuing collectives (it sleeps, loops in user code, waits on a lock,
sits in a debugger), every other rank waits in the next collective it issues. On gloo
that wait raises after the process group's timeout with a message about a socket
("Timed out waiting 600000ms for recv operation to complete"), and the process group is
then unusable (measured on torch 2.13: `dist.monitored_barrier` after it fails at once
with "Application timeout caused pair closure", so it cannot be asked who is missing).
This module turns that timeout into a `StalledRankError` that says which ranks did not
come, where each waiting rank was waiting (step, bucket) and what the missing ranks last
did.

How it knows, without a store round trip per bucket:

* every rank publishes a progress record to the default store (the store its process
  group was formed on): the steps it has completed and when (`ProgressBoard.step_done`,
  called at the end of `step()`, writes at most once per `RECORD_EVERY_SECONDS`, so a
  job of many fast steps on many ranks does not load the store), and one at
  construction, which also replaces any record an earlier attempt of the job left. A
  `FileStore` (`file://` init) appends every write to its file, so there only the
  construction and waiting records are written;
* the runtime's waits go through `wait` (a plain `work.wait()` unless it raises);
* when a wait times out, the rank adds what it was waiting for to its record, gives the
  other ranks a short grace to time out and do the same (`grace_seconds`), reads every
  rank's record (one round trip), and raises. The ranks without a waiting record are the
  ones that did not come. A rank whose wait is cut off instead (the first rank to give up
  closed its connections) finds that rank's waiting record and names the same ranks; a
  wait that fails with no waiting record anywhere (a peer crashed) keeps torch's error.

NCCL: `work.wait()` does not block the host there unless `TORCH_NCCL_BLOCKING_WAIT=1`;
without it NCCL's watchdog ends the process at the timeout with its own report, and the
records still tell who was behind.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import re
import time
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger("evenzero.runtime.stall")

GRACE = (0.1, 2.0, 30.0)
"""A timed-out rank waits this share of the process group's timeout, at least and at most
these many seconds, for the other ranks' waiting records: every rank that reached the
collective times out within about the skew with which they reached it."""
POLL_SECONDS = 0.2
RECORD_EVERY_SECONDS = 1.0
"""Least time between two progress records of one rank."""
DEFAULT_TIMEOUT_SECONDS = 1800.0
"""torch's default process-group timeout for gloo, used when the group's cannot be read."""

_boards = itertools.count()
_watching: dict[int, ProgressBoard] = {}
"""Process group (by id) -> the board of the optimizer that reduces over it."""


class StalledRankError(RuntimeError):
    """A collective timed out because ranks did not arrive; the message names them."""

    def __init__(self, message: str, missing: list[int], step: int) -> None:
        super().__init__(message)
        self.missing = missing
        """Global ranks that were not waiting in any evenzero collective."""
        self.step = step
        """Optimizer steps this rank had completed (`opt.step_count`) when it waited."""


class ProgressBoard:
    """This rank's progress record in the default store, and the reading of everyone's."""

    def __init__(self, group: Any, watched: Iterable[Any]) -> None:
        self.group = group
        self.ranks = dist.get_process_group_ranks(group)
        self.rank = dist.get_rank()
        self.steps = 0
        self.prefix = f"evenzero/progress/{next(_boards)}"
        self.store = _default_store()
        self.per_step = self.store is not None and not _appends(self.store)
        self.published = -math.inf
        self.watched = {id(g): g for g in (group, *watched) if g is not None}
        self._publish({"steps": 0, "at": time.time(), "waiting": None})
        for key in self.watched:
            _watching[key] = self

    def close(self) -> None:
        for key in self.watched:
            if _watching.get(key) is self:
                del _watching[key]

    def key(self, rank: int) -> str:
        return f"{self.prefix}/rank-{rank}"

    def step_done(self, steps: int) -> None:
        """This rank completed `steps` optimizer steps (called once per step; writes a
        record at most once per `RECORD_EVERY_SECONDS`)."""
        self.steps = steps
        now = time.monotonic()
        if self.per_step and now - self.published >= RECORD_EVERY_SECONDS:
            self.published = now
            self._publish({"steps": steps, "at": time.time(), "waiting": None})

    def _publish(self, record: dict[str, Any]) -> None:
        if self.store is None:
            return
        try:
            self.store.set(self.key(self.rank), json.dumps(record))
        except Exception as e:  # noqa: BLE001 - a lost store must not stop training
            logger.warning("evenzero: progress records are off (the store failed: %s)", e)
            self.store = None

    def read(self) -> dict[int, dict[str, Any]]:
        """Every rank's record (ranks without one are left out)."""
        if self.store is None:
            return {}
        keys = [self.key(r) for r in self.ranks]
        present = [r for r, k in zip(self.ranks, keys, strict=True) if self.store.check([k])]
        values = self.store.multi_get([self.key(r) for r in present]) if present else []
        return {r: json.loads(bytes(v).decode()) for r, v in zip(present, values, strict=True)}

    def diagnose(self, error: BaseException, group: Any, what: Any,
                 timeout: float) -> StalledRankError | None:
        """After this rank's wait for `what` over `group` timed out: publish it, give the
        others `grace_seconds(timeout)` to do the same, and name who did not come (None
        without a store)."""
        if self.store is None:
            return None
        waiting = {"step": self.steps, "what": describe(what), "since": time.time()}
        self._publish({"steps": self.steps, "at": time.time(), "waiting": waiting})
        members = dist.get_process_group_ranks(group) if group is not None else self.ranks
        deadline = time.monotonic() + grace_seconds(timeout)
        records = self.read()
        while time.monotonic() < deadline and any(
                (records.get(r) or {}).get("waiting") is None for r in members):
            time.sleep(POLL_SECONDS)
            records = self.read()
        how = f"timed out after {timeout:g} s (the process group's timeout)"
        return stalled_error(self.rank, waiting, members, records, how,
                             waiting["since"] - timeout, error)

    def explain(self, error: BaseException, group: Any, what: Any) -> StalledRankError | None:
        """After this rank's wait failed otherwise (a peer closed its connections): if a
        rank of the group published a waiting record, the peer gave up on a stalled rank
        and this is the same stall; None if none did (a crash, not a stall)."""
        members = dist.get_process_group_ranks(group) if group is not None else self.ranks
        if self.store is None:
            return None
        records = self.read()
        if not any((records.get(r) or {}).get("waiting") for r in members if r != self.rank):
            return None
        waiting = {"step": self.steps, "what": describe(what), "since": time.time()}
        records[self.rank] = {"steps": self.steps, "at": time.time(), "waiting": waiting}
        how = "was cut off by a rank that timed out first"
        return stalled_error(self.rank, waiting, members, records, how, waiting["since"],
                             error)


def _default_store() -> Any:
    # The store the default process group was formed on: torch keeps it in its group map
    # (torch/distributed/distributed_c10d.py@v2.13.0 `_get_default_store`); there is no
    # public accessor. Without it the timeout is still raised, naming no ranks.
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - any failure means: no records
        return None


def _appends(store: Any) -> bool:
    """Whether `store` (through its prefixes) keeps every write in a growing file."""
    while isinstance(store, dist.PrefixStore) and hasattr(store, "underlying_store"):
        store = store.underlying_store
    return isinstance(store, dist.FileStore)


def grace_seconds(timeout: float) -> float:
    share, lo, hi = GRACE
    return min(hi, max(lo, share * timeout))


def process_group_timeout(group: Any, error: BaseException) -> float:
    """The group's timeout in seconds: from its backend's options, else from gloo's
    message ("Timed out waiting 600000ms"), else torch's gloo default."""
    try:
        backend = group._get_backend(torch.device("cpu"))
        return backend.options._timeout.total_seconds()
    except Exception:  # noqa: BLE001 - private API; fall back to the message
        pass
    found = re.search(r"waiting (\d+)ms", str(error))
    return int(found.group(1)) / 1000 if found else DEFAULT_TIMEOUT_SECONDS


def is_timeout(error: BaseException) -> bool:
    text = str(error).lower()
    return "timed out" in text or "timeout" in text


def wait(work: Any, group: Any, what: Any) -> None:
    """`work.wait()`; a timeout becomes a `StalledRankError` naming the ranks that did
    not arrive. `what` says what is awaited (a `BucketRoute`, a layout key, or a text) and
    is formatted only then, so the hot path pays nothing."""
    try:
        work.wait()
    except RuntimeError as e:
        board = _watching.get(id(group))
        if board is None or isinstance(e, StalledRankError):
            raise
        try:
            if is_timeout(e):
                named = board.diagnose(e, group, what, process_group_timeout(group, e))
            else:
                named = board.explain(e, group, what)
        except Exception:  # noqa: BLE001 - the store failed too: torch's error is all there is
            named = None
        if named is None:
            raise
        raise named from e


def describe(what: Any) -> str:
    """What a rank waits on, in words."""
    bucket = getattr(what, "bucket", None)
    if bucket is not None:
        ops = "+".join(dict.fromkeys(c.op for c in what.collectives)) or "reduction"
        return (f"bucket {what.position} (group {bucket.group!r}, {bucket.numel:,} elements, "
                f"{ops})")
    if isinstance(what, tuple) and len(what) == 2:
        return f"the parameter all-gather of layout {what[1]} (group {what[0]!r})"
    return str(what)


def stalled_error(rank: int, waiting: dict[str, Any], members: list[int],
                  records: dict[int, dict[str, Any]], how: str, started: float,
                  error: BaseException) -> StalledRankError:
    """The error for this rank, which `how` waited for `waiting` since about `started`
    (wall time), from every rank's record."""
    now = time.time()
    missing = [r for r in members if (records.get(r) or {}).get("waiting") is None]
    others = {r: rec["waiting"] for r, rec in sorted(records.items())
              if r != rank and r in members and rec.get("waiting") is not None}
    also = "; ".join(f"rank {r}: {w['what']} in step {w['step']}" for r, w in others.items())
    head = (f"rank {rank} {how} waiting for {waiting['what']} in step {waiting['step']} "
            f"(opt.step_count {waiting['step']}).")
    if not missing and others and all(w["since"] < started for w in others.values()):
        # Everyone else gave up before this rank even began to wait: it is the one late.
        missing = [rank]
        head += (f" This rank is the one that stopped arriving: rank(s) {list(others)} had "
                 f"already timed out waiting for it ({also}).")
    elif missing:
        behind = []
        for r in missing:
            rec = records.get(r)
            if rec is None:
                behind.append(f"rank {r} (no progress record: it never finished building its "
                              f"ZeroOptimizer)")
                continue
            behind.append(f"rank {r} (its last progress record, {now - rec['at']:.1f} s old, "
                          f"says {rec['steps']} steps done; it is in no evenzero collective: "
                          f"in user code, sleeping, stuck or gone)")
        head += f" Rank(s) {missing} did not arrive: " + "; ".join(behind) + "."
        if others:
            head += f" Also waiting: {also}."
    else:
        head += (" Every rank timed out waiting, so they wait for different collectives (the "
                 f"ranks ran different code) or the network dropped them: {also}.")
    head += (" A rank that is only slow (a long save, evaluation or data stall) needs a longer "
             "timeout: init_process_group(..., timeout=timedelta(minutes=N)); see the README's "
             f"'Fault tolerance'. Transport error: {error}")
    return StalledRankError(head, missing, waiting["step"])


__all__ = ["ProgressBoard", "StalledRankError", "describe", "grace_seconds", "wait"]
