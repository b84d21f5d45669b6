"""The step's parameter all-gathers, and the one state that says whether parameters are
ready to read (`lifecycle.ParamState`), with its one wait and its one check.

The step steps each layout's shard and launches that layout's all-gather at once, in the
plan's step order (forward order), so the gathers run while the rest of the step is
computed (`runtime/engine.py`). Then either the step waits for them (the default:
`step()` returns with every parameter READY), or, with `overlap_param_gather=True`, it
returns with them GATHERING and the next forward waits, layout by layout (FSDP2-style
prefetch):

* a forward pre-hook on every module that holds managed parameters (installed the
  first time gathers are left pending) waits for just the layouts those parameters
  live in, so the gather of a late layer overlaps the forward of the early ones (on
  NCCL `work.wait()` only makes the current stream wait; on gloo it blocks the host
  until that layout's gather is done);
* a `state_dict` pre-hook on the same modules, so checkpoints never see stale values;
* everything else goes through the one wait, `ParamGathers.wait()`: the optimizer's
  methods that read or write parameters, flat buffers or masters (step, clipping,
  backward entry, re-planning, loading, `opt.module`, `opt.wait_for_params()`).

The one check: a parameter may be read only inside the forward of a module that holds
it, or after the wait. A backward that begins while gathers were left GATHERING
remembers which layouts no pre-hook waited for; a gradient of a parameter in one of
them means that parameter was read too early (outside its module's forward), and the
step then fails on every rank with an error naming it, instead of training on stale
values.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch.profiler import record_function

from evenzero.plan import Collective, Plan
from evenzero.runtime.buckets import FlatParams
from evenzero.runtime.collectives import LayoutAllGather, TraceRecorder
from evenzero.runtime.lifecycle import ParamState
from evenzero.runtime.stall import wait

LayoutKey = tuple[str, int]

READ_TOO_EARLY = ("parameter {name!r} was used in forward before the step's all-gather of it "
                  "had finished (it was read outside the forward of a module that holds it); "
                  "call opt.wait_for_params() before such a forward, or build ZeroOptimizer "
                  "with overlap_param_gather=False")


class ParamGathers:
    """Launches the per-layout parameter gathers; holds `ParamState` and waits on demand."""

    def __init__(self, module: torch.nn.Module, params: Mapping[str, torch.nn.Parameter]) -> None:
        self.pending: dict[LayoutKey, Any] = {}
        self._gather = LayoutAllGather()
        self._params = params
        self._holders = [m for m in module.modules()
                         if any(p is not None for p in m._parameters.values())]
        self._keys: list[tuple[LayoutKey, ...]] = [() for _ in self._holders]
        self._layout_of_param: dict[str, LayoutKey] = {}
        self._process_groups: Mapping[str, Any] = {}
        self._flat: FlatParams | None = None
        self._unwaited: frozenset[LayoutKey] = frozenset()
        self._read_early: list[str] = []
        self.handles: list = []
        self._removed = False

    @property
    def state(self) -> ParamState:
        return ParamState.GATHERING if self.pending else ParamState.READY

    def bind(self, plan: Plan, flat: FlatParams, process_groups: Mapping[str, Any]) -> None:
        """Adopt a (new) plan: the flat buffers gathered into, and which layouts each
        module's parameters live in."""
        self.wait()
        self._flat, self._process_groups = flat, process_groups
        self._layout_of_param = {s.name: (lay.group, lay.index)
                                 for lay in plan.layouts for s in lay.params}
        key_of = {id(p): self._layout_of_param[n] for n, p in self._params.items()
                  if n in self._layout_of_param}
        self._keys = [tuple(dict.fromkeys(key_of[id(p)] for p in m._parameters.values()
                                          if p is not None and id(p) in key_of))
                      for m in self._holders]

    # ------------------------------------------------------------------ READY -> GATHERING

    def launch(self, c: Collective, trace: TraceRecorder | None) -> None:
        """Start the all-gather of layout (c.group, c.buffer_index): this rank's slice of
        the layout's flat buffer must already hold its new values."""
        key = (c.group, c.buffer_index)
        with record_function("evenzero::gather"):
            self.pending[key] = self._gather(self._flat.buffers[key], self._flat.owned_slice(*key),
                                             self._process_groups[c.group])
        if trace is not None:
            trace.record(c, self._gather.algorithm_for(c.group_size))

    def leave_pending(self) -> None:
        """The step returns GATHERING: from now on each module's forward waits for its own
        layouts (the hooks are installed the first time, see `_install_hooks`)."""
        if self.pending and not self.handles and not self._removed:
            self._install_hooks()

    # ------------------------------------------------------------------ the one wait

    def wait(self) -> None:
        """GATHERING -> READY: wait for every pending gather (a no-op when READY). In issue
        order: on gloo the oldest gather is the first to finish anyway."""
        while self.pending:
            key = next(iter(self.pending))
            with record_function("evenzero::gather_wait"):
                wait(self.pending.pop(key), self._process_groups[key[0]], key)

    def _wait_for(self, keys: Iterable[LayoutKey]) -> None:
        """A module's forward: wait for the layouts its own parameters live in."""
        for key in keys:
            work = self.pending.pop(key, None)
            if work is not None:
                with record_function("evenzero::gather_wait"):
                    wait(work, self._process_groups[key[0]], key)

    # ------------------------------------------------------------------ the one check

    def begin_backward(self) -> None:
        """A backward begins: remember the layouts no forward waited for, then wait."""
        self._unwaited = frozenset(self.pending)
        self.wait()

    def grad_arrived(self, name: str) -> None:
        """Parameter `name` got a gradient: if its layout was never waited for, its value
        was read while the gather could still be running."""
        if self._unwaited and self._layout_of_param.get(name) in self._unwaited:
            self._read_early.append(name)

    def end_backward(self) -> str | None:
        """The backward ended (or was settled): the problem to raise at the step, if a
        parameter was read too early in it."""
        early, self._read_early, self._unwaited = self._read_early, [], frozenset()
        return READ_TOO_EARLY.format(name=early[0]) if early else None

    # ------------------------------------------------------------------ hooks

    def _install_hooks(self) -> None:
        """The per-module hooks, installed the first time a gather is left pending: until
        then they would have nothing to wait for, and a module with a forward pre-hook
        leaves torch's fast call path (a few microseconds per module call, which on a
        model of thousands of small modules is a measurable share of the step)."""
        for i, m in enumerate(self._holders):
            self.handles.append(m.register_forward_pre_hook(functools.partial(self._before, i)))
            self.handles.append(m.register_state_dict_pre_hook(functools.partial(self._before, i)))

    def _before(self, index: int, *_args) -> None:
        if self.pending:
            self._wait_for(self._keys[index])

    def remove(self) -> None:
        self.wait()
        for h in self.handles:
            h.remove()
        self.handles = []
        self._removed = True
