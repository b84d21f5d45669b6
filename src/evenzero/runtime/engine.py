"""What executes one plan on this rank, and the optimizer step through it.

`ShardEngine` holds everything derived from the executed plan: the flat parameter
buffers (`buckets.FlatParams`), one `GroupShard` per parameter group (`shards.py`), the
inner optimizer that steps the shards' pieces, the gradient reducer (`reducer.py`) and
the parameter gathers (`prefetch.py`). It is the `PlanHolder`'s installer: `install`
moves all of it to a new plan, keeping every value.

The step (`step`): pick up the user's writes to the parameters, take the groups'
current hyperparameters, then step the shards layout by layout, in the gathers' order
(the plan's step order, which is forward order), and start each layout's all-gather as
soon as its piece holds the new values, so the gathers run while the rest of the step is
computed. Consecutive layouts are stepped together until they hold `STEP_BATCH_NUMEL`
elements: one inner optimizer call per layout would cost more in call overhead than the
overlap gains on small layouts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from time import perf_counter
from typing import Any

import torch

from evenzero.plan import Collective, Plan
from evenzero.runtime.buckets import FlatParams
from evenzero.runtime.collectives import TraceRecorder
from evenzero.runtime.errorfeedback import ErrorFeedback
from evenzero.runtime.gradclear import ClearTracker
from evenzero.runtime.maskedstep import share_param_state
from evenzero.runtime.memory import MemoryReport, measure
from evenzero.runtime.paramwrites import adopt_replaced, check_numel
from evenzero.runtime.prefetch import ParamGathers
from evenzero.runtime.reducer import GradientReducer, ReducerConfig
from evenzero.runtime.routes import BucketRoute, plan_routes
from evenzero.runtime.shards import GroupShard, gather_order

STEP_BATCH_NUMEL = 1 << 20
"""Elements (per rank) stepped by one inner optimizer call before the gathers of the
layouts stepped so far are launched."""

InnerFactory = Callable[[list[dict[str, Any]]], torch.optim.Optimizer]
"""Builds the inner optimizer from its param groups (one per plan group)."""


class ShardEngine:
    """Flat buffers, group shards, inner optimizer, reducer and gathers of one plan."""

    def __init__(self, plan: Plan, params: Mapping[str, torch.nn.Parameter],
                 group_ranks: Mapping[str, int], shards: Mapping[str, GroupShard],
                 make_inner: InnerFactory, reducer_config: ReducerConfig,
                 recorder: TraceRecorder, clearing: ClearTracker, gathers: ParamGathers,
                 world_group: Any, own_inner: Mapping[str, InnerFactory] | None = None) -> None:
        self.plan = plan
        self.params = params
        self.group_ranks = dict(group_ranks)
        self.groups: dict[str, GroupShard] = dict(shards)
        """Plan group name -> its shard on this rank, in the user's group order."""
        self.reducer_config, self.recorder, self.clearing = reducer_config, recorder, clearing
        self.gathers, self.world_group = gathers, world_group
        self.stepped = False
        """Whether anything was ever stepped (or loaded): the masked steps then hold
        per-parameter state that a re-layout must carry over."""
        routes = plan_routes(plan, self.group_ranks)
        self.flat = FlatParams(plan, dict(params), self.group_ranks)
        for shard in self.groups.values():
            shard.lay_out(plan, self.flat)
        # One inner optimizer for the groups of the class ZeroOptimizer was given, and one
        # of its own for each group in `own_inner` (another class, or a whole-tensor
        # optimizer, whose param group may be empty on a rank that owns none of it).
        own = dict(own_inner or {})
        main = [g.name for g in plan.groups if g.name not in own]
        self.inners: dict[str, torch.optim.Optimizer] = {}
        """Group name -> the inner optimizer that steps it."""
        if main:
            shared = make_inner([self._param_group(g) for g in main])
            self.inners.update(dict.fromkeys(main, shared))
        for g in [g.name for g in plan.groups if g.name in own]:
            self.inners[g] = own[g]([self._param_group(g)])
        self.inner = self.inners[main[0] if main else plan.groups[0].name]
        """The inner optimizer of `ZeroOptimizer`'s own class (where a group has it)."""
        for name, shard in self.groups.items():
            shard.attach(self.inners[name])
        self._scratch: dict[torch.dtype, torch.Tensor] = {}
        self.error_feedback = ErrorFeedback(reducer_config.device)
        """The quantization residuals of compressed buckets (`grad_compression_error_feedback`)."""
        self._wire(plan, routes)

    def _param_group(self, name: str) -> dict[str, Any]:
        return {"params": self.groups[name].optimizer_params(), **self.groups[name].options}

    def _wire(self, plan: Plan, routes: tuple[BucketRoute, ...]) -> None:
        self.error_feedback.bind(plan)
        self.reducer = GradientReducer(routes, self.params, self.groups, self.reducer_config,
                                       self.recorder, self.clearing,
                                       {g: s.runs for g, s in self.groups.items()},
                                       error_feedback=self.error_feedback)
        self.order = gather_order(plan, self.groups)
        self._batches = _step_batches(self.order, self.groups)
        self.gathers.bind(plan, self.flat, {g: s.process_group for g, s in self.groups.items()})

    # ------------------------------------------------------------------ re-planning

    def install(self, plan: Plan, previous: Plan) -> None:
        """Make `plan` the executed one: routes and reducer; when the layouts change, new
        flat buffers (from the parameters' current values) and every group shard moved to
        them (collective)."""
        self.gathers.wait()
        routes = plan_routes(plan, self.group_ranks)
        if plan.layouts != previous.layouts:
            flat = FlatParams(plan, dict(self.params), self.group_ranks)
            before = {g: s.stepper for g, s in self.groups.items()}
            for shard in self.groups.values():
                shard.relayout(previous, plan, flat)
            self.flat = flat
            if self.stepped:
                shared = share_param_state(before, self.world_group)
                for g, shard in self.groups.items():
                    known, stepped = shared[g]
                    shard.stepper.load_param_state({n: known.get(n, {}) for n in shard.runs.names},
                                                   stepped)
        self.plan = plan
        self._wire(plan, routes)

    # ------------------------------------------------------------------ the step

    def step(self, hyperparameters: Sequence[Mapping[str, Any]], stepped: set[str],
             trace: TraceRecorder, overlap: bool) -> float:
        """Step every parameter in `stepped` (some rank holds a gradient for it) with the
        user's groups' `hyperparameters` (in group order) and launch every layout's
        gather, each as soon as its shard is stepped; with `overlap` False, return with
        the parameters READY. Returns the seconds spent in the inner optimizer."""
        self.gathers.wait()
        adopt_replaced(self.flat)
        for shard in self.groups.values():
            shard.pick_up_writes(self._scratch_for(shard))
        for shard, user in zip(self.groups.values(), hyperparameters, strict=True):
            shard.set_hyperparameters(user)
        active = {self.plan.locate(n)[0] for n in stepped}
        t0 = perf_counter()
        for shard in self.groups.values():
            shard.begin_step(stepped, shard.name in active)
        seconds = perf_counter() - t0
        for layouts, batch in self._batches:
            t0 = perf_counter()
            for g, indices in layouts.items():
                self.groups[g].step_layouts(indices)
            seconds += perf_counter() - t0
            self._launch(batch, trace)
        t0 = perf_counter()
        for shard in self.groups.values():
            shard.finish_step()
        seconds += perf_counter() - t0
        self.stepped = True
        if overlap:
            self.gathers.leave_pending()
        else:
            self.gathers.wait()
        return seconds

    def step_numel(self) -> int:
        """Master elements a step updates on this rank."""
        return sum(s.numel for s in self.groups.values())

    @torch.no_grad()
    def step_on_zero_grads(self, names: Iterable[str]) -> None:
        """Step every parameter in `names` once on zero gradients, then re-gather."""
        self.gathers.wait()
        names = set(names)
        for shard in self.groups.values():
            shard.begin_step(names, True, [torch.zeros_like(p.master) for p in shard.pieces])
            shard.finish_step()
        self.stepped = True
        self.publish_all()

    def _launch(self, batch: Iterable[Collective], trace: TraceRecorder | None) -> None:
        for c in batch:
            self.groups[c.group].publish(c.buffer_index)
            self.gathers.launch(c, trace)

    @torch.no_grad()
    def publish_all(self) -> None:
        """Re-gather every parameter from the masters; returns with them READY."""
        self.gathers.wait()
        self.flat.repoint_moved()
        self._launch(self.order, None)
        self.gathers.wait()

    def _scratch_for(self, shard: GroupShard) -> torch.Tensor | None:
        """The pick-up check's buffer for the shard's parameter dtype, made once."""
        if shard.aliased or not shard.pieces:
            return None
        dtype = shard.param_dtype
        want = min(check_numel(shard.placement.master), max(p.numel for p in shard.pieces))
        buf = self._scratch.get(dtype)
        if buf is None or buf.numel() < want:
            buf = self._scratch[dtype] = torch.empty(want, dtype=dtype,
                                                     device=shard.placement.master)
        return buf

    # ------------------------------------------------------------------ gradients

    def zero_grads(self) -> None:
        """Zero every gradient shard and stage 1's bucket buffers."""
        for shard in self.groups.values():
            shard.zero_grad_()
        self.reducer.zero_()

    def scale_grads(self, factor: float) -> None:
        for shard in self.groups.values():
            shard.scale_grad_(factor)

    def clear_grad_runs(self, names: Iterable[str]) -> None:
        """Zero the gradient-shard runs of `names` (gradients cleared since reduced)."""
        by_group: dict[str, list[str]] = {}
        for name in names:
            by_group.setdefault(self.plan.locate(name)[0], []).append(name)
        for g, members in by_group.items():
            self.groups[g].clear_grad_runs(members)

    def grad_shards(self) -> list[torch.Tensor]:
        return [s.grad for s in self.groups.values()]

    # ------------------------------------------------------------------ state

    def load_group(self, group: str, master: torch.Tensor, flats: Mapping[str, torch.Tensor],
                   param_scalars: Mapping[str, Mapping[str, Any]], stepped: Iterable[str]) -> None:
        """Replace one group's master values, optimizer state and per-parameter scalar
        state (already laid out for this rank's shard)."""
        self.gathers.wait()
        shard = self.groups[group]
        with torch.no_grad():
            shard.load(master, flats)
        shard.stepper.load_param_state({n: param_scalars.get(n, {}) for n in shard.runs.names},
                                       stepped)
        self.stepped = True

    def memory(self) -> MemoryReport:
        return measure(self.groups.values(), self.reducer, self.params.values(), self.flat,
                       self.error_feedback.nbytes())


StepBatch = tuple[dict[str, list[int]], list[Collective]]
"""(group -> layouts stepped together, the gathers launched after them)."""


def _step_batches(order: Sequence[Collective], groups: Mapping[str, GroupShard]
                  ) -> list[StepBatch]:
    """The gathers in order, cut into runs of layouts that hold at least
    `STEP_BATCH_NUMEL` elements per rank (the last run may hold fewer)."""
    batches: list[StepBatch] = []
    current: list[Collective] = []
    numel = 0
    for c in order:
        current.append(c)
        numel += c.numel // max(1, groups[c.group].size)
        if numel >= STEP_BATCH_NUMEL or c is order[-1]:
            layouts: dict[str, list[int]] = {}
            for done in current:
                layouts.setdefault(done.group, []).append(done.buffer_index)
            batches.append((layouts, current))
            current, numel = [], 0
    return batches
