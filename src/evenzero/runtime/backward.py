"""The optimizer's backward side: what the hooks report, and recovery from a backward
that raised.

`BackwardSide` is a mixin of `ZeroOptimizer` (one object, so the hooks can hold it
weakly and `del opt` frees it at once). It reacts to the hooks (`_on_forward`,
`_on_backward_start`, `_on_grad`, `_on_backward_end`), moves the `Lifecycle` and, at the
end of each synced backward, finishes the bucket reductions.

A backward that raised on one rank only is the hard case: the other ranks finished
theirs and wait in their bucket collectives, or in the step check that follows. The
rank that raised settles it the next time it is called (`zero_grad()`, `step()`,
`clip_grad_norm_()` or the next forward): it drops its partial gradients and issues
every collective the others' backward and step check issue (zeros for its buckets,
the problem flag for the check), so all ranks meet, every rank learns that this step
is void, and zero_grad() lets everyone go on.
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import TYPE_CHECKING

import torch

from evenzero.plan import Plan
from evenzero.runtime.autotune import calibration_target, refine_bucket_numel
from evenzero.runtime.checks import ZeroConfigError, ZeroRuntimeError, backward_problems
from evenzero.runtime.collectives import broadcast
from evenzero.runtime.gradstats import GradStats
from evenzero.runtime.lifecycle import TrainingState
from evenzero.runtime.setup import make_plan, plan_options
from evenzero.runtime.teardown import KEEPER

if TYPE_CHECKING:
    from evenzero.runtime.optimizer import ZeroOptimizer

REMOTE_PROBLEM = ("{n} other rank(s) found a problem in this step (in their backward, a "
                  "backward that raised there, or gradients they discarded with zero_grad() "
                  "before step()) and raised it; see their error. This step is void on every "
                  "rank: call zero_grad() and go on")


class BackwardSide:
    """Hook reactions and backward recovery; mixed into `ZeroOptimizer`."""

    # ------------------------------------------------------------------ the result

    def _grad_stats(self: ZeroOptimizer, what: str) -> GradStats:
        """The step check's result, after making sure `what` may run now."""
        if self._resources.closed:
            raise ZeroRuntimeError(f"{what}() on a ZeroOptimizer that was closed; build a new "
                                   f"one for the model")
        life = self._life
        if life.is_dead_backward():
            problem = self._recover()
            raise ZeroRuntimeError(f"{what}(): {problem}; call zero_grad() and go on")
        life.require(what)
        self._prefetch.wait_all()
        return life.record.stats or self._run_step_check()

    def clip_grad_norm_(self: ZeroOptimizer, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so their global 2-norm is at most `max_norm`; returns the norm
        before clipping, over all ranks and groups (like torch.nn.utils.clip_grad_norm_,
        which also leaves the gradients alone for max_norm=inf)."""
        if float(norm_type) != 2.0:
            raise ZeroConfigError(f"clip_grad_norm_: only norm_type=2 is supported, got {norm_type}")
        if (isinstance(max_norm, bool) or not isinstance(max_norm, (int, float))
                or math.isnan(max_norm) or max_norm < 0):
            raise ZeroConfigError(f"clip_grad_norm_: max_norm must be a number >= 0 (inf to "
                                  f"measure without clipping), got {max_norm!r}")
        stats = self._grad_stats("clip_grad_norm_")
        if not stats.overflow:
            coef = max_norm / (stats.norm + 1e-6)
            if coef < 1.0:
                for st in self.groups.values():
                    st.grad.mul_(coef)
        return torch.tensor(stats.norm, dtype=torch.float32)

    # ------------------------------------------------------------------ hooks

    def _backward_running(self: ZeroOptimizer) -> bool:
        return self._life.state is TrainingState.BACKWARD

    def _on_forward(self: ZeroOptimizer) -> None:
        if self._life.is_dead_backward():
            self._recover()

    def _on_backward_start(self: ZeroOptimizer) -> None:
        if self._life.is_dead_backward():
            # No forward through the module and no zero_grad() since the backward that
            # raised: its partial gradients may already sit in this backward's first
            # `.grad`, so this step cannot be trusted either.
            problem = self._recover()
            self._life.note_problem(f"{problem}; the backward after it ran without a "
                                    f"zero_grad() or a forward in between")
        KEEPER.new_batch()
        self._life.begin_backward()
        if self.loss_scaler.enabled and self.loss_scaler.scale != 1.0 and not self._loss_scaled:
            self._life.note_problem(
                f"a backward ran on a loss that was not scaled, while fp16 loss scaling is on "
                f"(scale {self.loss_scaler.scale:g}): its gradients would be divided by the "
                f"scale. Call opt.backward(loss) (or opt.scale_loss(loss).backward()) instead "
                f"of loss.backward()")
        self._loss_scaled = False
        # Layouts no forward pre-hook waited for; a gradient for one of their parameters
        # means the parameter was read while its gather could still be running.
        self._life.record.stale_layouts = set(self._prefetch.pending)
        self._prefetch.wait_all()

    def _on_grad(self: ZeroOptimizer, name: str) -> None:
        life = self._life
        rec = life.record
        rec.presence[self._index[name]] = 1.0
        problem = self._clearing.accumulated(name)
        if problem is not None:
            life.note_problem(problem)
        if rec.stale_layouts and self._prefetch.layout_of(name) in rec.stale_layouts:
            rec.read_early.append(name)
        if life.backward_synced and not life.measuring:
            self._reducer.grad_ready(name)

    def _on_backward_end(self: ZeroOptimizer) -> None:
        self._end_backward(aborted=False)

    # ------------------------------------------------------------------ backward end

    def _end_backward(self: ZeroOptimizer, aborted: bool) -> None:
        """Every collective a backward's end issues, on every rank alike."""
        life = self._life
        life.record.stale_layouts = set()
        if life.measuring:
            if self._hooks.arrival is not None:
                order = self._hooks.take_arrival() or []
                # A backward that raised measured only part of the order: send none, so
                # everyone keeps the assumed order and measures the next backward.
                self._adopt_arrival([] if aborted else order)
            self._refine_bucket_size(aborted)
            life.measuring = self._hooks.arrival is not None or self._refine.pending
        if life.backward_synced:
            problems = self._reducer.finish_grad_sync()
            problems += backward_problems(life.record.read_early, self._module, self._managed,
                                          self._frozen)
            life.record.read_early = []
            # Raised at the step check, on every rank: raising here, on this rank only,
            # would leave the others waiting in that all-reduce.
            life.note_problem(problems[0] if problems else None)
        life.end_backward()

    def _adopt_arrival(self: ZeroOptimizer, order: list[str]) -> None:
        """Agree on rank 0's measured arrival order and re-plan once if it differs."""
        vec = torch.full((len(self._names) + 1,), -1, dtype=torch.int64,
                         device=self._setup.control_device)
        vec[0] = len(order)
        if order:
            vec[1:1 + len(order)] = torch.tensor([self._index[n] for n in order])
        broadcast(vec, 0, self.world_group)
        values = vec.tolist()
        order = [self._names[i] for i in values[1:1 + values[0]]]
        if not order:
            # Rank 0's backward reached no managed parameter: nothing was measured, so
            # keep the assumed order and measure the next backward instead.
            self._hooks.record_arrival()
            return
        unchanged = tuple(order) == self.plan.arrival
        self.spec = self.spec.with_arrival(order, "measured")
        if unchanged:
            return
        plan: Plan = make_plan(self.spec, self.world_size, self.config, self._setup.group_sizes,
                               self._setup.device)
        if plan != self.plan:
            self._install(plan, previous=self.plan)

    def _stop_refining(self: ZeroOptimizer) -> None:
        """The bucket size is fixed from now on (a loaded state dict's)."""
        self._refine.clock = self._hooks.clock = None
        self._life.measuring = self._hooks.arrival is not None

    def _refine_bucket_size(self: ZeroOptimizer, aborted: bool) -> None:
        """Once enough backwards were timed (`runtime/backwardclock.py`): calibrate, let
        rank 0 choose the bucket size, and re-plan with it on every rank
        (`runtime/autotune.py`). Before this backward's buckets are reduced, so they
        are reduced in the new plan; collective, reached at the same backward by every
        rank (a rank whose backward raised gets here from `_recover`)."""
        life = self._life
        timings = self._refine.backward_ended(aborted, life.backward_synced,
                                              self._hooks.arrival is None)
        if timings is None:
            return
        self._hooks.clock = None
        sizes = [(self.world_size, self.world_group)]
        sizes += sorted(((st.size, st.process_group) for st in self.groups.values()),
                        key=lambda g: -g[0])
        widest = max(self.groups.values(), key=lambda st: st.size)
        target = calibration_target(sizes, self._setup.device, widest.reduce_dtype,
                                    self.reduce_scatter_algorithm)
        options = plan_options(self.config, self._setup.device)
        out = refine_bucket_numel(self.spec, self.world_size, timings, target, self.world_group,
                                  self._setup.control_device, options,
                                  self._refine.optimizer_seconds)
        if out.numel is None:  # not refined: the plan stands, its notes say why
            self.plan = replace(self.plan, notes=(*self.plan.notes, out.note))
            return
        plan = make_plan(self.spec, self.world_size, self.config, self._setup.group_sizes,
                         self._setup.device, bucket_numel=out.numel, note=out.note)
        if plan.buckets == self.plan.buckets and plan.layouts == self.plan.layouts:
            self.plan = plan  # the same buckets: nothing to re-lay out
        else:
            self._install(plan, previous=self.plan)

    # ------------------------------------------------------------------ recovery

    def _recover(self: ZeroOptimizer) -> str:
        """Finish a backward that raised on this rank as the other ranks finish theirs,
        then void the step; returns what happened. Its buckets are reduced as zeros and,
        if it was synced, the step check runs with this rank's problem flag, so every rank
        raises at the same collective."""
        life = self._life
        problem = (f"the last backward raised on this rank (rank {self.rank}) before it "
                   f"finished; its gradients were dropped and this step is void on every rank")
        for p in self.params.values():
            p.grad = None
        self._reducer.zero_()
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

    def _void_step(self: ZeroOptimizer) -> None:
        """Drop everything this step gathered and start the next one; collectives it
        issued (a discarded or settled step's) become `trace`."""
        self._clear_grads()
        if self._recorder.pending:
            self._recorder.close_step()
        self._life.reset()

    def _run_step_check(self: ZeroOptimizer, raise_problems: bool = True) -> GradStats:
        """The step's one all-reduce; raises what any rank found, on every rank."""
        life = self._life
        KEEPER.new_batch()
        # Clears since the last reduction (a zeroed placeholder, p.grad = None) apply now:
        # the norm, the step and has_grad see the gradients torch would hold.
        for name in self._clearing.settle():
            group = self.plan.locate(name)[0]
            for off, n in self._runs[group].runs.get(name, ()):
                self.groups[group].grad[off:off + n].zero_()
        has_grad = [self._clearing.has_grad[n] for n in self._names]
        try:
            stats = self._step_check((st.grad for st in self.groups.values()),
                                     life.record.presence, has_grad,
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

    def _clear_grads(self: ZeroOptimizer) -> None:
        """Zero the gradient shards (and stage 1's buffers); drop every `.grad`."""
        for st in self.groups.values():
            st.grad.zero_()
        self._reducer.zero_()
        for p in self.params.values():
            p.grad = None
        self._clearing.forget()
