"""A clean exit: who frees a finished collective, and what runs at interpreter exit.

Why a finished job used to abort with `terminate called without an active exception`:
a gloo collective is run by one of the process group's worker threads, which holds its
own reference to the `Work` (and so to the tensors in it) until just after it marks the
work done (`ProcessGroupGloo::runLoop`, torch/csrc/distributed/c10d/ProcessGroupGloo.cpp).
`work.wait()` returns as soon as the work is done, so when Python drops its `Work` right
after, the worker's reference is the last one. Dropping a tensor that has a Python
object needs the GIL (`TensorImpl::decref_pyobject`), so the worker blocks on the GIL
while the main thread runs on. If the main thread reaches interpreter finalisation
first (the step's last all-gather, then the end of the script), the worker's GIL
request ends its thread, which unwinds through a `noexcept` destructor: `std::terminate`,
SIGABRT, and torchrun reports the job as failed (pytorch/pytorch#190489; the attempt to
destroy process groups at exit, pytorch/pytorch#179291, was abandoned).

The fix here is structural: the runtime keeps every `Work` it issues (`keep`) until it
issues the next batch, so a worker thread never drops the last reference and never
needs the GIL; and at interpreter exit (`atexit`, while the interpreter is whole) every
live optimizer finishes its outstanding work and the last batch is never freed at all.
Collectives issued by others (checkpoints, the script) get a short GIL-free pause at
exit instead; code that issues collectives at the end of a job can `keep` their work.
An optimizer that is dropped (`del opt`) finishes its outstanding work and removes its
hooks from the model through a `weakref.finalize`; the hooks hold the optimizer only
weakly, so dropping it really frees it.
"""

from __future__ import annotations

import atexit
import contextlib
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

from torch.utils.weak import WeakIdKeyDictionary


class WorkKeeper:
    """Holds the `Work` of every collective of the current batch, so that no process-group
    worker thread frees one (see the module docstring)."""

    def __init__(self) -> None:
        self._batch: list[Any] = []

    def keep(self, work: Any) -> Any:
        """Hold `work` until the next batch; returns it."""
        if work is not None:
            self._batch.append(work)
        return work

    def new_batch(self) -> None:
        """The runtime is about to issue new collectives: the previous batch finished and
        was waited for while the interpreter keeps running, so it may be freed now."""
        self._batch = []

    def retain_forever(self) -> None:
        """At exit: never free the last batch (the process is ending; the OS reclaims it)."""
        batch, self._batch = self._batch, []
        if batch:
            _LEAKED.append(batch)
            with contextlib.suppress(Exception):
                import ctypes

                # Module globals are cleared during finalisation; one extra reference
                # keeps the list (and the works in it) out of reach of that clean-up.
                ctypes.pythonapi.Py_IncRef(ctypes.py_object(batch))


KEEPER = WorkKeeper()
"""The process-wide keeper every runtime collective goes through."""
_LEAKED: list[list[Any]] = []
_LIVE: weakref.WeakSet = weakref.WeakSet()


def keep(work: Any) -> Any:
    """`KEEPER.keep(work)`: hold an issued collective's `Work` past its completion."""
    return KEEPER.keep(work)


class Resources:
    """What an optimizer must release when it goes away: `close` runs once, at the
    latest when the optimizer is garbage, or at interpreter exit."""

    def __init__(self) -> None:
        self._closers: list[Callable[[], None]] = []
        self.closed = False
        _LIVE.add(self)

    def on_close(self, closer: Callable[[], None]) -> None:
        """Run `closer` at close, after the ones registered before it."""
        self._closers.append(closer)

    def close(self) -> None:
        """Finish outstanding work and remove hooks; a failure of one closer (a process
        group already destroyed) does not stop the others."""
        if self.closed:
            return
        self.closed = True
        for closer in self._closers:
            with contextlib.suppress(Exception):
                closer()
        self._closers = []


def release_with(owner: Any, resources: Resources) -> None:
    """Close `resources` when `owner` is garbage collected (it must not reference owner)."""
    weakref.finalize(owner, resources.close)


# A model's parameters belong to at most one live optimizer: a second one would register
# a second set of hooks and train the same parameters twice. The claim is dropped by
# `close()`, and when the optimizer is garbage collected (its weak reference dies).
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()


def claimed(named: Sequence[tuple[str, Any]]) -> str | None:
    """The first of `named` that a live optimizer manages, or None."""
    for name, p in named:
        ref = _OWNERS.get(p)
        if ref is not None and ref() is not None:
            return name
    return None


def claim(params: Sequence[Any], owner: Any) -> Callable[[], None]:
    """Mark `params` as managed by `owner`; returns the closer that releases them (it
    holds the parameters, not the owner)."""
    ref = weakref.ref(owner)
    for p in params:
        _OWNERS[p] = ref
    held = list(params)

    def release() -> None:
        for p in held:
            if _OWNERS.get(p) is ref:
                del _OWNERS[p]

    return release


EXIT_DRAIN_SECONDS = 0.05
"""How long the exit handler leaves the GIL free for worker threads already waiting on it."""


@atexit.register
def _at_exit() -> None:
    # atexit runs before finalisation starts, while every thread can still take the GIL.
    for resources in list(_LIVE):
        resources.close()
    KEEPER.retain_forever()
    # Collectives issued outside the runtime (a checkpoint's, the script's own) had their
    # `Work` dropped by torch right after the wait, so a worker thread may be waiting for
    # the GIL to free their tensors. Sleeping releases the GIL to it while the
    # interpreter is still whole.
    time.sleep(EXIT_DRAIN_SECONDS)
