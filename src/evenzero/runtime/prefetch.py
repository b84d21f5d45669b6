"""The step's parameter all-gather, overlapped with the next forward (FSDP2-style prefetch).

`step()` writes each master shard into this rank's slice of the flat parameter buffers
and launches one all-gather per layout, in the plan's step order (forward order), then
returns. Nothing waits for the gathers until something reads the parameters:

* a forward pre-hook on every module that holds managed parameters (installed with the
  first gather left pending) waits for just the layouts those parameters live in, so
  the gather of a late layer overlaps the forward of the early ones (on NCCL `work.wait()` only makes the current stream wait; on gloo it
  blocks the host until that layout's gather is done);
* a `state_dict` pre-hook on the same modules, so checkpoints never see stale values;
* `ZeroOptimizer.wait_for_params()` (and everything in the optimizer that touches the
  parameters or the flat buffers: the next step, clipping, backward entry,
  re-planning, `sync_params_from_master`, `opt.module`) waits for all of them.

The contract this buys: a parameter may be read only inside the forward of a module
that holds it, or after `wait_for_params()`. A parameter whose gradient arrives while
its gather was never waited for was read too early (outside its module's forward); the
backward then fails with an error naming it, instead of training on stale values.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping

import torch
from torch.profiler import record_function

from evenzero.plan import Collective, Plan
from evenzero.runtime.buckets import FlatParams
from evenzero.runtime.collectives import LayoutAllGather, TraceRecorder
from evenzero.runtime.shards import GroupState
from evenzero.runtime.stall import wait

LayoutKey = tuple[str, int]


class ParamPrefetch:
    """Launches the per-layout parameter gathers and waits for them on demand."""

    def __init__(self, module: torch.nn.Module, params: Mapping[str, torch.nn.Parameter]) -> None:
        self.pending: dict[LayoutKey, object] = {}
        self._gather = LayoutAllGather()
        self._params = params
        self._holders = [m for m in module.modules()
                         if any(p is not None for p in m._parameters.values())]
        self._keys: list[tuple[LayoutKey, ...]] = [() for _ in self._holders]
        self._layout_of_param: dict[str, LayoutKey] = {}
        self.handles: list = []
        self._removed = False

    def _install_hooks(self) -> None:
        """The per-module hooks, installed the first time a gather is left pending: until
        then they would have nothing to wait for, and a module with a forward pre-hook
        leaves torch's fast call path (a few microseconds per module call, which on a
        model of thousands of small modules is a measurable share of the step)."""
        for i, m in enumerate(self._holders):
            self.handles.append(m.register_forward_pre_hook(functools.partial(self._before, i)))
            self.handles.append(m.register_state_dict_pre_hook(functools.partial(self._before, i)))

    def bind(self, plan: Plan, flat: FlatParams, states: Mapping[str, GroupState],
             order: tuple[Collective, ...]) -> None:
        """Adopt a (new) plan: which layouts each module's parameters live in, and where
        each layout's slice starts in its group's master shard."""
        self.wait_all()
        self.plan, self.flat, self.states, self.order = plan, flat, states, order
        self._base = {(g, s.layout): s.shard_offset for g in states for s in plan.layout_shards(g)}
        self._layout_of_param = {s.name: (lay.group, lay.index)
                                 for lay in plan.layouts for s in lay.params}
        key_of = {id(p): self._layout_of_param[n] for n, p in self._params.items()
                  if n in self._layout_of_param}
        self._keys = [tuple(dict.fromkeys(key_of[id(p)] for p in m._parameters.values()
                                          if p is not None and id(p) in key_of))
                      for m in self._holders]

    def launch(self, trace: TraceRecorder | None, overlap: bool) -> None:
        """Write every master shard into its slices and start every layout's gather, in
        plan order; with `overlap` False, also wait for all of them before returning."""
        self.wait_all()
        if overlap and not self.handles and not self._removed:
            self._install_hooks()
        with record_function("evenzero::gather"):
            for c in self.order:
                key = (c.group, c.buffer_index)
                st = self.states[c.group]
                mine = self.flat.owned_slice(*key)
                base = self._base[key]
                mine.copy_(st.master[base:base + mine.numel()])
                self.pending[key] = self._gather(self.flat.buffers[key], mine, st.process_group)
                if trace is not None:
                    trace.record(c, self._gather.name)
        if not overlap:
            self.wait_all()

    def wait_for(self, keys: Iterable[LayoutKey]) -> None:
        for key in keys:
            work = self.pending.pop(key, None)
            if work is not None:
                with record_function("evenzero::gather_wait"):
                    wait(work, self.states[key[0]].process_group, key)

    def wait_all(self) -> None:
        # In issue order: on gloo the oldest gather is the first to finish anyway.
        while self.pending:
            key = next(iter(self.pending))
            with record_function("evenzero::gather_wait"):
                wait(self.pending.pop(key), self.states[key[0]].process_group, key)

    def layout_of(self, name: str) -> LayoutKey | None:
        """The layout holding parameter `name`."""
        return self._layout_of_param.get(name)

    def _before(self, index: int, *_args) -> None:
        if self.pending:
            self.wait_for(self._keys[index])

    def remove(self) -> None:
        self.wait_all()
        for h in self.handles:
            h.remove()
        self.handles = []
        self._removed = True
