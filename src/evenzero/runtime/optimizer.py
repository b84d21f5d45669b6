"""`ZeroOptimizer`: ZeRO-1/2 data parallelism with one equal reduce-scatter per bucket.

    opt = evenzero.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, stage=2)
    loss.backward(); opt.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()

Lifecycle of one step:

1. construction: every rank checks and agrees on the model, plans it (arrival order
   assumed to be reverse registration), re-points the parameters into flat per-layout
   buffers and copies its 1/N slice into fp32 master shards;
2. the first backward only records the real gradient-arrival order; at its end rank 0's
   order is adopted everywhere and, if it differs, the model is re-planned and
   re-laid-out once; then all buckets are reduced in plan order;
3. later backwards reduce each bucket as soon as it (and every bucket before it) is
   complete, overlapped with the rest of backward;
4. `clip_grad_norm_` / `step`: one small all-reduce over the world carries the squared
   norm, the overflow flag, a presence bit per parameter and a flag for problems a rank
   found alone in backward (raised there on every rank); then the inner optimizer
   steps the master shards and each layout's all-gather is launched, in forward order;
5. with `overlap_param_gather=True` the step returns without waiting and each module
   waits for the gathers of its own parameters in a forward pre-hook, so they overlap
   the next forward (`runtime/prefetch.py`); read parameters outside their modules'
   forward only after `opt.wait_for_params()` (`opt.module`, `state_dict()` and the
   optimizer's own methods wait by themselves).

Where the optimizer is in that cycle is one `TrainingState` (`runtime/lifecycle.py`);
the backward side, including recovery from a backward that raised on some ranks only,
is `runtime/backward.py`; what happens at exit and when the optimizer is dropped is
`runtime/teardown.py`. Profiler labels "evenzero::..." mark the backward hook, bucket
copy, launch, wait, accumulate, step check, step and gather.

Usage beyond the basic loop (gradient accumulation with `no_sync()`, mixed precision
and fp16 loss scaling with `opt.backward(loss)`, MoE `expert_groups`, checkpoints with
`evenzero.checkpoint.save(opt, dir)` / `load`, DeepSpeed's schedule with `strategy="deepspeed-0.6"`) is in the
README and in `ZeroConfig`'s field docstrings.

What it keeps from torch (README, "Coming from PyTorch / DDP"): it is a
`torch.optim.Optimizer` whose `param_groups` are the user's groups, so LR schedulers and
hyperparameter changes work; gradients accumulate until the user clears them, however
they clear them (`runtime/gradclear.py`), and after a synchronised backward `p.grad` is a
`ShardedGrad` placeholder (`runtime/shardedgrad.py`); a parameter no rank holds a
gradient for is not stepped, and every parameter keeps its own step count
(`runtime/maskedstep.py`); writes to the parameters between steps are picked up
(`runtime/paramwrites.py`); `state_dict()` holds this rank's shard
(`runtime/optstate.py`, `runtime/statedict.py`). Construction broadcasts the first
rank's parameters and buffers, as DDP does, and refuses a model another live
ZeroOptimizer manages (`close()` releases it).

Semantics worth knowing: a gradient produced on some ranks only is an error unless
`allow_partial_grads=True`. A rank whose backward reaches no managed parameter (but
does go through the module's output) reduces zeros, so the others do not wait for it;
the step then names the parameters, as above. Reentrant activation checkpointing is not
supported. A backward that raises on some ranks only voids the step on every rank: the
rank that raised settles its share of the collectives at its next zero_grad(), forward
or step, the others' step raises, and zero_grad() on every rank goes on. zero_grad()
after a backward but before step() takes part in the step's one small all-reduce, so a
rank that discards its gradients while the others step is an error, not a divergence.
step() without a backward since the last step or zero_grad() is refused, and so is
add_param_group() (the shard layout is planned once).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from time import perf_counter
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from evenzero.plan import Plan, Schedule
from evenzero.runtime.backward import BackwardSide
from evenzero.runtime.backwardclock import RefinementSchedule
from evenzero.runtime.buckets import FlatParams
from evenzero.runtime.checks import ZeroConfigError, ZeroRuntimeError
from evenzero.runtime.collectives import (
    REDUCE_SCATTERS,
    TraceRecorder,
    default_reduce_scatter_algorithm,
)
from evenzero.runtime.config import ZeroConfig
from evenzero.runtime.gradclear import ClearTracker
from evenzero.runtime.gradstats import StepCheck, StepCheckConfig
from evenzero.runtime.hooks import BackwardHooks
from evenzero.runtime.lifecycle import Lifecycle, TrainingState
from evenzero.runtime.maskedstep import MaskedStep
from evenzero.runtime.memory import MemoryReport, measure
from evenzero.runtime.paramwrites import adopt_replaced, refresh_masters
from evenzero.runtime.precision import as_dtype, loss_scaler_for
from evenzero.runtime.prefetch import ParamPrefetch
from evenzero.runtime.reducer import GradientReducer, ReducerConfig, keeps_pool
from evenzero.runtime.routes import plan_routes
from evenzero.runtime.setup import broadcast_initial_state, establish, make_plan
from evenzero.runtime.shardedgrad import drop_placeholders, placeholders
from evenzero.runtime.shardruns import ShardRuns
from evenzero.runtime.shards import GroupState, gather_order, load_masters, reshard_group
from evenzero.runtime.stall import ProgressBoard
from evenzero.runtime.statedict import ShardStateSide
from evenzero.runtime.teardown import Resources, claim, release_with


class ZeroOptimizer(BackwardSide, ShardStateSide, torch.optim.Optimizer):
    """Shards gradients (stage 2) and optimizer state (stages 1, 2) over data-parallel ranks.

    A `torch.optim.Optimizer`: `param_groups` are the user's groups of model parameters
    with their hyperparameters (an LR scheduler drives them; a change applies at the next
    step); the inner `optimizer_class` instance that steps the flat master shards is an
    implementation detail.

    Args:
        module: the model, with the same architecture on every rank (checked); its
            parameters and buffers start from the first rank's values (broadcast).
        optimizer_class: an elementwise `torch.optim` optimizer class (e.g. AdamW).
        param_groups: optional `[{"params": [...], "process_group": pg, "name": str,
            **optimizer_kwargs}]`; a group with a process group of S ranks is reduced over
            it (an expert-data-parallel group). Default: one group "dense" over the world,
            plus one group per `param.group_name` of params marked `allreduce=False`.
        config: a `ZeroConfig`; any of its fields may instead be passed as a keyword.
        expert_groups: `{group_name: edp_process_group}` for DeepSpeed-marked expert params.
        process_group: the data-parallel world (default: the default process group).
        **kwargs: `ZeroConfig` fields (stage, bucket_numel, ...) and optimizer defaults
            (lr, weight_decay, ...).
    """

    def __init__(self, module: torch.nn.Module, optimizer_class: type[torch.optim.Optimizer],
                 param_groups: Iterable[Mapping[str, Any]] | None = None, *,
                 config: ZeroConfig | None = None,
                 expert_groups: Mapping[str, Any] | None = None,
                 process_group: Any = None, **kwargs: Any) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ZeroConfigError("torch.distributed is not initialised; call "
                                  "dist.init_process_group(...) before building ZeroOptimizer")
        engine = {k: kwargs.pop(k) for k in list(kwargs) if k in ZeroConfig.field_names()}
        try:
            self.config = replace(config, **engine) if config is not None else ZeroConfig(**engine)
            config_error = None
        except ZeroConfigError as e:
            # Raised after the ranks agree, so a rank with a bad setting cannot leave the
            # others waiting in the construction collectives.
            self.config, config_error = config or ZeroConfig(), str(e)
        self._module = module
        self.world_group = dist.group.WORLD if process_group is None else process_group
        self.world_size = dist.get_world_size(self.world_group)
        self.rank = dist.get_rank(self.world_group)
        setup = establish(module, optimizer_class, param_groups, self.config, expert_groups,
                          self.world_group, kwargs, config_error)
        self._setup = setup
        self.spec = setup.spec
        self.params = dict(setup.named)
        self._names = tuple(n for n, _ in setup.named)
        self._index = {n: i for i, n in enumerate(self._names)}
        self._managed = {id(p) for p in self.params.values()}

        cfg = self.config
        master_dtype = as_dtype(cfg.master_dtype, "master_dtype")
        reduce_dtype = as_dtype(cfg.reduce_dtype, "reduce_dtype") if cfg.reduce_dtype else None
        backend = str(dist.get_backend(self.world_group))
        self.reduce_scatter_algorithm = (cfg.reduce_scatter_algorithm or
                                         default_reduce_scatter_algorithm(backend, setup.device.type))
        param_dtypes = {g.name: g.params[0].dtype for g in setup.groups}
        self.loss_scaler = loss_scaler_for(cfg.loss_scale, cfg.loss_scale_config,
                                            list(param_dtypes.values()))

        broadcast_initial_state(module, setup.groups, self.world_group)
        # Parameters frozen now are not managed; unfreezing one later is named at the step.
        self._frozen = {id(p) for p in module.parameters() if not p.requires_grad}
        plan = make_plan(self.spec, self.world_size, cfg, setup.group_sizes, setup.device)
        self.groups: dict[str, GroupState] = {}
        for g in setup.groups:
            n = plan.shard_numel(g.name)
            self.groups[g.name] = GroupState(
                g.name, g.process_group, setup.group_sizes[g.name], setup.group_ranks[g.name],
                param_dtypes[g.name], reduce_dtype or param_dtypes[g.name],
                torch.zeros(n, dtype=master_dtype, device=setup.device),
                torch.zeros(n, dtype=master_dtype, device=setup.device), g.options)
        self._placeholders = placeholders(setup.named)
        self._clearing = ClearTracker(self.params, self._placeholders)
        self._loss_scaled = False
        self._recorder = TraceRecorder()
        self._step_check = StepCheck(StepCheckConfig(self._names, self.world_group,
                                                     self.world_size, setup.control_device,
                                                     cfg.allow_partial_grads), self._recorder)
        self._life = Lifecycle(len(self._names))
        self._prefetch = ParamPrefetch(module, self.params)
        self._stepper: MaskedStep | None = None
        self._install(plan, previous=None)
        self._inner = optimizer_class(
            [{"params": [self.groups[g.name].master], **self.groups[g.name].options}
             for g in plan.groups], **kwargs)
        self._inner_groups = {g.name: pg for g, pg in zip(plan.groups, self._inner.param_groups,
                                                          strict=True)}
        self._stepper = MaskedStep(self._inner, self._masters(), self._runs)
        # The torch face: the user's groups, every option filled in from the inner
        # optimizer's defaults, as torch fills them.
        self._constructing = True
        torch.optim.Optimizer.__init__(
            self, [{"params": list(g.params), **g.options} for g in setup.groups],
            dict(self._inner.defaults))
        self._constructing = False
        self.step_count = 0
        self.last_step_skipped = False
        self._hooks = BackwardHooks(module, setup.named, self)
        self._hooks.record_arrival()
        # bucket_numel "auto": refined once, after the first backwards (backwardclock.py).
        self._refine = RefinementSchedule(cfg.auto_bucket and cfg.strategy == "evenzero" and
                                          any(st.size > 1 for st in self.groups.values()))
        self._hooks.clock = self._refine.clock
        # Finished work and hooks are released when this object goes away, at the latest
        # at interpreter exit (runtime/teardown.py), or by close(); nothing the model holds
        # refers to it.
        self._resources = Resources()
        self._resources.on_close(self._prefetch.remove)
        self._resources.on_close(self._hooks.remove)
        self._resources.on_close(claim(list(self.params.values()), self))
        self._resources.on_close(partial(drop_placeholders, self.params))
        # A rank that stops arriving is named in the others' timeout (runtime/stall.py).
        self._progress = ProgressBoard(self.world_group,
                                       [st.process_group for st in self.groups.values()])
        self._resources.on_close(self._progress.close)
        release_with(self, self._resources)

    # ------------------------------------------------------------------ the plan

    def _masters(self) -> dict[str, torch.Tensor]:
        return {name: st.master for name, st in self.groups.items()}

    def _install(self, plan: Plan, previous: Plan | None) -> None:
        """Make `plan` the executed one: routes, flat buffers, masters, reducer."""
        self._prefetch.wait_all()
        routes = plan_routes(plan, dict(self._setup.group_ranks))
        self._runs = {g: ShardRuns.of(plan, g, st.rank) for g, st in self.groups.items()}
        if previous is None or plan.layouts != previous.layouts:
            self._flat = FlatParams(plan, self.params, dict(self._setup.group_ranks))
            for st in self.groups.values():
                if previous is None:
                    load_masters(plan, self._flat, st)
                    continue
                reshard_group(self._inner, previous, plan, st)
            if self._stepper is not None:
                self._stepper = self._restepper()
        self.plan = plan
        self._reducer = GradientReducer(
            routes, self.params, self.groups,
            ReducerConfig(self.config.stage, self.world_size, self.config.max_buckets_in_flight,
                          self._setup.device, REDUCE_SCATTERS[self.reduce_scatter_algorithm],
                          partial(getattr, self.loss_scaler, "scale"),
                          keeps_pool(self._setup.device)),
            self._recorder, self._clearing, self._runs)
        self._prefetch.bind(plan, self._flat, self.groups, gather_order(plan, self.groups))

    def _restepper(self) -> MaskedStep:
        """The per-parameter stepper for new shard runs. A rank may now own runs of
        parameters whose scalar state (step counts) only other ranks kept: every rank
        shares what it has (a collective, only once something was stepped)."""
        stepper = MaskedStep(self._inner, self._masters(), self._runs)
        if self.step_count == 0 and not getattr(self, "_stepped_outside_step", False):
            return stepper
        stepper.take_state_of(self._stepper, self.world_group)
        return stepper

    # ------------------------------------------------------------------ backward

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communication."""
        previous, self._life.sync = self._life.sync, False
        try:
            yield
        finally:
            self._life.sync = previous

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current loss scale (unchanged unless loss scaling is on).
        With fp16 loss scaling the next backward must run on this (checked)."""
        self._loss_scaled = True
        return self.loss_scaler.scale_loss(loss)

    def backward(self, loss: torch.Tensor) -> None:
        """`scale_loss(loss).backward()`."""
        self.scale_loss(loss).backward()

    # ------------------------------------------------------------------ step

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """Update the master shards and all-gather the parameters; skipped on fp16
        overflow. As in torch, `closure` (which runs forward and backward) is called
        first, with gradients enabled, and its loss is returned."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        stats = self._grad_stats("step")
        with record_function("evenzero::step"):
            self.last_step_skipped = stats.overflow and self.loss_scaler.enabled
            if self.last_step_skipped:
                self.loss_scaler.update(overflow=True)
                for st in self.groups.values():
                    st.grad.zero_()
            else:
                self._step_shards(stats.present)
                self.loss_scaler.update(overflow=False)
                self._prefetch.launch(self._recorder, self.config.overlap_param_gather)
                self.step_count += 1
        self._recorder.close_step()
        self._life.reset()
        self._progress.step_done(self.step_count)
        return loss

    def _step_shards(self, present: tuple[bool, ...]) -> None:
        """Pick up writes to the parameters, take the groups' current hyperparameters,
        and step every parameter some rank holds a gradient for."""
        adopt_replaced(self._flat)
        for name, st in self.groups.items():
            refresh_masters(self.plan, self._flat, name, st.master)
        for g, user in zip(self._setup.groups, self.param_groups, strict=True):
            inner = self._inner_groups[g.name]
            for key, value in user.items():
                if key != "params":
                    inner[key] = value
        stepped = {n for n, here in zip(self._names, present, strict=True) if here}
        active = {self.plan.locate(n)[0] for n in stepped}
        t0 = perf_counter()
        self._stepper.step({name: st.grad for name, st in self.groups.items()}, stepped, active)
        if self._refine.pending:  # the optimizer's cost, for the bucket size's timeline
            self._refine.optimizer_seconds = (perf_counter() - t0, sum(
                st.master.numel() for st in self.groups.values()))
        self._clearing.drop_absent([n for n in self._names if n not in stepped])

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients as torch does: `p.grad = None`, or zeros with
        `set_to_none=False` (a parameter holding zeros is still stepped, as in torch).

        After a backward that raised on this rank, this first finishes that backward's
        collectives with the other ranks (the error's advice). Gradients reduced but
        never stepped are discarded with the other ranks' agreement: a rank that steps
        them while another discards them raises instead of training differently."""
        life = self._life
        if life.is_dead_backward():
            self._recover()
            return
        if life.state is TrainingState.BACKWARD:
            raise ZeroRuntimeError("zero_grad() called during backward; call it before the "
                                   "forward or after step()")
        if life.state is TrainingState.REDUCED and not self._resources.closed:
            life.note_problem("this rank discarded the step's gradients with zero_grad() "
                              "before step()")
            self._run_step_check(raise_problems=False)
        self._clearing.clear_all(set_to_none)
        torch.optim.Optimizer.zero_grad(self, set_to_none)
        self._reducer.zero_()
        if self._recorder.pending:
            self._recorder.close_step()
        life.reset()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused after construction: the shard layout is planned once for all groups."""
        if getattr(self, "_constructing", False):
            torch.optim.Optimizer.add_param_group(self, param_group)
            return
        raise ZeroConfigError("add_param_group() is not supported by ZeroOptimizer: every "
                              "parameter's place in the flat shards is planned at construction; "
                              "pass all groups to ZeroOptimizer(model, cls, param_groups=[...]) "
                              "(a group may start with lr=0), or close() and build a new one")

    def close(self) -> None:
        """Detach from the model: finish outstanding collectives, remove every hook,
        drop the `ShardedGrad` placeholders from `p.grad` (set to None) and release the
        model, so that another ZeroOptimizer may be built on it. The parameters keep
        their current values. Dropping every reference to the optimizer (`del opt`) does
        the same. A closed optimizer refuses to step. Not a collective."""
        self._prefetch.wait_all()
        self._resources.close()

    # ------------------------------------------------------------------ interface

    @property
    def trace(self) -> Schedule:
        """Collectives issued in the last step (backward ones in issue order, then the
        step's), as plan records; prints as a table and equals the plan's tuples."""
        return self._recorder.last

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped model, with every parameter gathered (waits for the step's gathers)."""
        self._prefetch.wait_all()
        return self._module

    def wait_for_params(self) -> None:
        """Wait until the last step's parameter all-gathers are done, so every parameter
        holds its new value. Needed only before reading parameters outside the forward of
        the modules that hold them (forward pre-hooks, `state_dict()`, `opt.module` and
        this optimizer's own methods wait by themselves); a no-op when nothing is pending."""
        self._prefetch.wait_all()

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds now for gradients, master weights and optimizer state."""
        return measure(self.groups.values(), self._reducer, self.params.values(), self._inner,
                       self._flat)
