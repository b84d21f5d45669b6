"""The optimizer's backward side: what the hooks report, the step check, and recovery
from a backward that raised.

`BackwardDriver` implements `hooks.BackwardObserver`; the hooks hold it weakly, and
only the optimizer holds it, so `del opt` frees everything at once. It reacts to the
hooks (`on_forward`, `on_backward_start`, `on_grad`, `on_backward_end`), moves the
`Lifecycle` and, at the end of each synced backward, finishes the bucket reductions.
During the first backwards it also measures: the arrival order (then re-plans with it)
and, with `bucket_numel="auto"`, the timings the bucket size is refined from
(`runtime/backwardclock.py`, `runtime/autotune.py`).

A backward that raised on one rank only is the hard case: the other ranks finished
theirs and wait in their bucket collectives, or in the step check that follows. The
rank that raised settles it the next time it is called (`zero_grad()`, `step()`,
`clip_grad_norm_()` or the next forward): it drops its partial gradients and issues
every collective the others' backward and step check issue (zeros for its buckets,
the problem flag for the check), so all ranks meet, every rank learns that this step
is void, and zero_grad() lets everyone go on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from evenzero.runtime.autotune import calibration_target, refine_bucket_numel
from evenzero.runtime.backwardclock import RefinementSchedule
from evenzero.runtime.checks import ZeroRuntimeError, backward_problems
from evenzero.runtime.collectives import TraceRecorder, broadcast
from evenzero.runtime.engine import ShardEngine
from evenzero.runtime.gradclear import ClearTracker
from evenzero.runtime.gradstats import GradStats, StepCheck
from evenzero.runtime.hooks import BackwardHooks
from evenzero.runtime.lifecycle import Lifecycle, TrainingState
from evenzero.runtime.planholder import PlanHolder
from evenzero.runtime.precision import ScalerSlot
from evenzero.runtime.prefetch import ParamGathers
from evenzero.runtime.setup import Setup
from evenzero.runtime.teardown import KEEPER, Resources

REMOTE_PROBLEM = ("{n} other rank(s) found a problem in this step (in their backward, a "
                  "backward that raised there, or gradients they discarded with zero_grad() "
                  "before step()) and raised it; see their error. This step is void on every "
                  "rank: call zero_grad() and go on")


class BackwardDriver:
    """Hook reactions, the step check and backward recovery of one optimizer."""

    def __init__(self, module: torch.nn.Module, setup: Setup, frozen: set[int],
                 world_group: Any, rank: int, reduce_scatter_algorithm: str,
                 plans: PlanHolder, engine: ShardEngine, gathers: ParamGathers,
                 clearing: ClearTracker, recorder: TraceRecorder, step_check: StepCheck,
                 scaler: ScalerSlot, refine: RefinementSchedule, resources: Resources) -> None:
        self.module, self.setup, self.frozen = module, setup, frozen
        self.names = tuple(n for n, _ in setup.named)
        self.index = {n: i for i, n in enumerate(self.names)}
        self.managed = {id(p) for _, p in setup.named}
        self.world_group = world_group
        self.rank, self.reduce_scatter_algorithm = rank, reduce_scatter_algorithm
        self.plans, self.engine, self.gathers = plans, engine, gathers
        self.clearing, self.recorder, self.step_check = clearing, recorder, step_check
        self.scaler, self.refine, self.resources = scaler, refine, resources
        self.life = Lifecycle(len(self.names))
        self._loss_scaled = False
        self.hooks = BackwardHooks(module, setup.named, self)
        self.hooks.record_arrival()
        self.hooks.clock = refine.clock

    # ------------------------------------------------------------------ the optimizer's calls

    @contextmanager
    def unsynced(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communication."""
        previous, self.life.sync = self.life.sync, False
        try:
            yield
        finally:
            self.life.sync = previous

    def loss_scaled(self) -> None:
        """The next backward runs on a scaled loss (`ZeroOptimizer.scale_loss`)."""
        self._loss_scaled = True

    def grad_stats(self, what: str) -> GradStats:
        """The step check's result, after making sure `what` (step, clip_grad_norm_) may
        run now; the parameters are READY when it returns."""
        if self.resources.closed:
            raise ZeroRuntimeError(f"{what}() on a ZeroOptimizer that was closed; build a new "
                                   f"one for the model")
        life = self.life
        if life.is_dead_backward():
            problem = self._recover()
            raise ZeroRuntimeError(f"{what}(): {problem}; call zero_grad() and go on")
        life.require(what)
        self.gathers.wait()
        return life.record.stats or self._run_step_check()

    def present(self, stats: GradStats) -> set[str]:
        """Parameters some rank holds a gradient for: the ones the step touches."""
        return {n for n, here in zip(self.names, stats.present, strict=True) if here}

    def optimizer_timed(self, seconds: float) -> None:
        """The last step's inner optimizer took `seconds` (for the bucket size's timeline,
        while it is still to be refined)."""
        if self.refine.pending:
            self.refine.optimizer_seconds = (seconds, self.engine.step_numel())

    def end_step(self, stepped: set[str] | None) -> None:
        """The step ended (`stepped`: the parameters it touched; None: skipped). As in
        torch, parameters no rank had a gradient for show `p.grad = None`."""
        if stepped is not None:
            self.clearing.drop_absent([n for n in self.names if n not in stepped])
        self.recorder.close_step()
        self.life.reset()

    def zero_grad(self, set_to_none: bool, clear: Callable[[], None]) -> None:
        """The optimizer's zero_grad(): `clear` clears the user's `.grad` as torch does.

        After a backward that raised on this rank, this first finishes that backward's
        collectives with the other ranks (the error's advice). Gradients reduced but
        never stepped are discarded with the other ranks' agreement: a rank that steps
        them while another discards them raises instead of training differently."""
        life = self.life
        if life.is_dead_backward():
            self._recover()
            return
        if life.state is TrainingState.BACKWARD:
            raise ZeroRuntimeError("zero_grad() called during backward; call it before the "
                                   "forward or after step()")
        if life.state is TrainingState.REDUCED and not self.resources.closed:
            life.note_problem("this rank discarded the step's gradients with zero_grad() "
                              "before step()")
            self._run_step_check(raise_problems=False)
        self.clearing.clear_all(set_to_none)
        clear()
        self.engine.reducer.zero_()
        if self.recorder.pending:
            self.recorder.close_step()
        life.reset()

    @property
    def arrival_measured(self) -> bool:
        """Whether the arrival order the plan is made for was measured (or loaded)."""
        return self.hooks.arrival is None

    def adopt_measured_arrival(self) -> None:
        """A loaded state's arrival order was measured: measure none here."""
        if self.hooks.arrival is not None:
            self.hooks.take_arrival()
            self.life.measuring = self.refine.pending

    @property
    def refining(self) -> bool:
        """Whether an "auto" bucket size is still to be refined from this run's timings."""
        return self.refine.pending

    def stop_refining(self) -> None:
        """The bucket size is fixed from now on (a loaded state dict's or checkpoint's)."""
        self.refine.clock = self.hooks.clock = None
        self.life.measuring = self.hooks.arrival is not None

    # ------------------------------------------------------------------ hooks (BackwardObserver)

    def backward_running(self) -> bool:
        return self.life.state is TrainingState.BACKWARD

    def on_forward(self) -> None:
        if self.life.is_dead_backward():
            self._recover()

    def on_backward_start(self) -> None:
        life = self.life
        if life.is_dead_backward():
            # No forward through the module and no zero_grad() since the backward that
            # raised: its partial gradients may already sit in this backward's first
            # `.grad`, so this step cannot be trusted either.
            problem = self._recover()
            life.note_problem(f"{problem}; the backward after it ran without a "
                              f"zero_grad() or a forward in between")
        KEEPER.new_batch()
        life.begin_backward()
        scaler = self.scaler.scaler
        if scaler.enabled and scaler.scale != 1.0 and not self._loss_scaled:
            life.note_problem(
                f"a backward ran on a loss that was not scaled, while fp16 loss scaling is on "
                f"(scale {scaler.scale:g}): its gradients would be divided by the "
                f"scale. Call opt.backward(loss) (or opt.scale_loss(loss).backward()) instead "
                f"of loss.backward()")
        self._loss_scaled = False
        self.gathers.begin_backward()

    def on_grad(self, name: str) -> None:
        life = self.life
        life.record.presence[self.index[name]] = 1.0
        problem = self.clearing.accumulated(name)
        if problem is not None:
            life.note_problem(problem)
        self.gathers.grad_arrived(name)
        if life.backward_synced and not life.measuring:
            self.engine.reducer.grad_ready(name)

    def on_backward_end(self) -> None:
        self._end_backward(aborted=False)

    # ------------------------------------------------------------------ backward end

    def _end_backward(self, aborted: bool) -> None:
        """Every collective a backward's end issues, on every rank alike."""
        life = self.life
        read_early = self.gathers.end_backward()
        if life.measuring:
            if self.hooks.arrival is not None:
                order = self.hooks.take_arrival() or []
                # A backward that raised measured only part of the order: send none, so
                # everyone keeps the assumed order and measures the next backward.
                self._adopt_arrival([] if aborted else order)
            self._refine_bucket_size(aborted)
            life.measuring = self.hooks.arrival is not None or self.refine.pending
        if life.backward_synced:
            problems = self.engine.reducer.finish_grad_sync()
            problems += [read_early] if read_early else []
            problems += backward_problems(self.module, self.managed, self.frozen)
            # Raised at the step check, on every rank: raising here, on this rank only,
            # would leave the others waiting in that all-reduce.
            life.note_problem(problems[0] if problems else None)
        else:
            life.note_problem(read_early)
        life.end_backward()

    def _adopt_arrival(self, order: list[str]) -> None:
        """Agree on rank 0's measured arrival order and re-plan once if it differs."""
        vec = torch.full((len(self.names) + 1,), -1, dtype=torch.int64,
                         device=self.setup.control_device)
        vec[0] = len(order)
        if order:
            vec[1:1 + len(order)] = torch.tensor([self.index[n] for n in order])
        broadcast(vec, 0, self.world_group)
        values = vec.tolist()
        order = [self.names[i] for i in values[1:1 + values[0]]]
        if not order:
            # Rank 0's backward reached no managed parameter: nothing was measured, so
            # keep the assumed order and measure the next backward instead.
            self.hooks.record_arrival()
            return
        self.plans.replan(arrival=order)

    def _refine_bucket_size(self, aborted: bool) -> None:
        """Once enough backwards were timed (`runtime/backwardclock.py`): calibrate, let
        rank 0 choose the bucket size, and re-plan with it on every rank
        (`runtime/autotune.py`). Before this backward's buckets are reduced, so they
        are reduced in the new plan; collective, reached at the same backward by every
        rank (a rank whose backward raised gets here from `_recover`)."""
        timings = self.refine.backward_ended(aborted, self.life.backward_synced,
                                             self.hooks.arrival is None)
        if timings is None:
            return
        self.hooks.clock = None
        groups = self.engine.groups.values()
        sizes = [(self.plans.world_size, self.world_group)]
        sizes += sorted(((st.size, st.process_group) for st in groups), key=lambda g: -g[0])
        widest = max(groups, key=lambda st: st.size)
        target = calibration_target(sizes, self.setup.device, widest.reduce_dtype,
                                    self.reduce_scatter_algorithm)
        out = refine_bucket_numel(self.plans.spec, self.plans.world_size, timings, target,
                                  self.world_group, self.setup.control_device,
                                  self.plans.options(), self.refine.optimizer_seconds)
        # Not refined: the plan stands, its notes say why.
        self.plans.replan(bucket_numel=out.numel, note=out.note)

    # ------------------------------------------------------------------ recovery

    def _recover(self) -> str:
        """Finish a backward that raised on this rank as the other ranks finish theirs,
        then void the step; returns what happened. Its buckets are reduced as zeros and,
        if it was synced, the step check runs with this rank's problem flag, so every rank
        raises at the same collective."""
        life = self.life
        problem = (f"the last backward raised on this rank (rank {self.rank}) before it "
                   f"finished; its gradients were dropped and this step is void on every rank")
        for _, p in self.setup.named:
            p.grad = None
        self.engine.reducer.zero_()
        life.note_problem(problem)
        self._end_backward(aborted=True)
        synced = life.backward_synced
        if synced:
            self._run_step_check(raise_problems=False)
        self._void_step()
        if not synced:
            # Nothing was agreed: the other ranks still hold this micro-batch's gradients,
            # so the next step check must fail on every rank.
            life.note_problem(problem)
        return problem

    def _void_step(self) -> None:
        """Drop everything this step gathered and start the next one; collectives it
        issued (a discarded or settled step's) become `trace`."""
        self.engine.zero_grads()
        for _, p in self.setup.named:
            p.grad = None
        self.clearing.forget()
        if self.recorder.pending:
            self.recorder.close_step()
        self.life.reset()

    def _run_step_check(self, raise_problems: bool = True) -> GradStats:
        """The step's one all-reduce; raises what any rank found, on every rank."""
        life = self.life
        KEEPER.new_batch()
        # Clears since the last reduction (a zeroed placeholder, p.grad = None) apply now:
        # the norm, the step and has_grad see the gradients torch would hold.
        self.engine.clear_grad_runs(self.clearing.settle())
        has_grad = [self.clearing.has_grad[n] for n in self.names]
        try:
            stats = self.step_check(self.engine.grad_shards(), life.record.presence, has_grad,
                                    life.record.problem is not None, life.record.micro_batches)
        except ZeroRuntimeError:
            life.failed()  # a presence mismatch, raised alike on every rank
            raise
        if stats.problem_ranks:
            problem, life.record.problem = life.record.problem, None
            life.failed()
            if raise_problems:
                raise ZeroRuntimeError(problem or REMOTE_PROBLEM.format(n=stats.problem_ranks))
            return stats
        life.checked(stats)
        return stats
