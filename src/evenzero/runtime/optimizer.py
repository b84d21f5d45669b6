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
`opt.save` / `opt.load`, DeepSpeed's schedule with `strategy="deepspeed-0.6"`) is in the
README and in `ZeroConfig`'s field docstrings.

Semantics worth knowing: a parameter that produced no gradient on any rank is stepped
with a zero gradient (as in DeepSpeed, Megatron and FSDP), not skipped as torch.optim
skips `grad=None`; one that produced a gradient on some ranks only is an error unless
`allow_partial_grads=True`. A rank whose backward reaches no managed parameter (but
does go through the module's output) reduces zeros, so the others do not wait for it;
the step then names the parameters, as above. Reentrant activation checkpointing is not
supported. A backward that raises on some ranks only voids the step on every rank: the
rank that raised settles its share of the collectives at its next zero_grad(), forward
or step, the others' step raises, and zero_grad() on every rank goes on. zero_grad()
after a backward but before step() takes part in the step's one small all-reduce, so a
rank that discards its gradients while the others step is an error, not a divergence.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from evenzero.plan import Plan, Schedule
from evenzero.runtime.backward import BackwardSide
from evenzero.runtime.buckets import FlatParams
from evenzero.runtime.checks import ZeroConfigError, ZeroRuntimeError
from evenzero.runtime.collectives import (
    REDUCE_SCATTERS,
    TraceRecorder,
    default_reduce_scatter_algorithm,
)
from evenzero.runtime.config import ZeroConfig
from evenzero.runtime.gradstats import GradStats, StepCheck, StepCheckConfig
from evenzero.runtime.hooks import BackwardHooks
from evenzero.runtime.lifecycle import Lifecycle, TrainingState
from evenzero.runtime.memory import MemoryReport, measure
from evenzero.runtime.precision import as_dtype, loss_scaler_for
from evenzero.runtime.prefetch import ParamPrefetch
from evenzero.runtime.reducer import GradientReducer, ReducerConfig
from evenzero.runtime.routes import plan_routes
from evenzero.runtime.setup import establish, make_plan
from evenzero.runtime.shards import GroupState, gather_order, load_masters, reshard_group
from evenzero.runtime.teardown import Resources, release_with


class ZeroOptimizer(BackwardSide):
    """Shards gradients (stage 2) and optimizer state (stages 1, 2) over data-parallel ranks.

    Args:
        module: the model, built identically on every rank (checked).
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

        plan = make_plan(self.spec, self.world_size, cfg, setup.group_sizes)
        self.groups: dict[str, GroupState] = {}
        for g in setup.groups:
            n = plan.shard_numel(g.name)
            self.groups[g.name] = GroupState(
                g.name, g.process_group, setup.group_sizes[g.name], setup.group_ranks[g.name],
                param_dtypes[g.name], reduce_dtype or param_dtypes[g.name],
                torch.zeros(n, dtype=master_dtype, device=setup.device),
                torch.zeros(n, dtype=master_dtype, device=setup.device), g.options)
        self._recorder = TraceRecorder()
        self._step_check = StepCheck(StepCheckConfig(self._names, self.world_group,
                                                     self.world_size, setup.control_device,
                                                     cfg.allow_partial_grads), self._recorder)
        self._life = Lifecycle(len(self._names))
        self._prefetch = ParamPrefetch(module, self.params)
        self._install(plan, previous=None)
        self.optimizer = optimizer_class(
            [{"params": [self.groups[g.name].master], **self.groups[g.name].options}
             for g in plan.groups], **kwargs)
        self.step_count = 0
        self.last_step_skipped = False
        self._hooks = BackwardHooks(module, setup.named, self)
        self._hooks.record_arrival()
        # Finished work and hooks are released when this object goes away, at the latest
        # at interpreter exit (runtime/teardown.py); nothing the model holds refers to it.
        self._resources = Resources()
        self._resources.on_close(self._prefetch.remove)
        self._resources.on_close(self._hooks.remove)
        release_with(self, self._resources)

    # ------------------------------------------------------------------ the plan

    def _install(self, plan: Plan, previous: Plan | None) -> None:
        """Make `plan` the executed one: routes, flat buffers, masters, reducer."""
        self._prefetch.wait_all()
        routes = plan_routes(plan, dict(self._setup.group_ranks))
        if previous is None or plan.layouts != previous.layouts:
            self._flat = FlatParams(plan, self.params, dict(self._setup.group_ranks))
            for st in self.groups.values():
                if previous is None:
                    load_masters(plan, self._flat, st)
                    continue
                reshard_group(self.optimizer, previous, plan, st)
        self.plan = plan
        self._reducer = GradientReducer(
            routes, self.params, self.groups,
            ReducerConfig(self.config.stage, self.world_size, self.config.max_buckets_in_flight,
                          self._setup.device, REDUCE_SCATTERS[self.reduce_scatter_algorithm]),
            self._recorder)
        self._prefetch.bind(plan, self._flat, self.groups, gather_order(plan, self.groups))

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
        """The loss times the current loss scale (unchanged unless loss scaling is on)."""
        return self.loss_scaler.scale_loss(loss)

    def backward(self, loss: torch.Tensor) -> None:
        """`scale_loss(loss).backward()`."""
        self.scale_loss(loss).backward()

    # ------------------------------------------------------------------ step

    def _grad_stats(self, what: str) -> GradStats:
        """The step check's result, after making sure `what` may run now."""
        life = self._life
        if life.is_dead_backward():
            problem = self._recover()
            raise ZeroRuntimeError(f"{what}(): {problem}; call zero_grad() and go on")
        life.require(what)
        self._prefetch.wait_all()
        return life.record.stats or self._run_step_check()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
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

    @torch.no_grad()
    def step(self, closure=None) -> None:
        """Update the master shards and all-gather the parameters; skipped on fp16 overflow."""
        if closure is not None:
            raise ZeroConfigError("step(closure) is not supported; compute the loss and call "
                                  "backward() before step()")
        stats = self._grad_stats("step")
        with record_function("evenzero::step"):
            self.last_step_skipped = stats.overflow and self.loss_scaler.enabled
            if self.last_step_skipped:
                self.loss_scaler.update(overflow=True)
                for st in self.groups.values():
                    st.grad.zero_()
            else:
                if self.loss_scaler.enabled and self.loss_scaler.scale != 1.0:
                    for st in self.groups.values():
                        st.grad.mul_(1.0 / self.loss_scaler.scale)
                for st in self.groups.values():
                    st.master.grad = st.grad
                self.optimizer.step()
                for st in self.groups.values():
                    st.master.grad = None
                self.loss_scaler.update(overflow=False)
                self._flat.repoint_moved()
                self._prefetch.launch(self._recorder, self.config.overlap_param_gather)
                self.step_count += 1
        self._recorder.close_step()
        self._life.reset()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient shards (and stage 1's buffers); drop any local `.grad`.

        After a backward that raised on this rank, this first finishes that backward's
        collectives with the other ranks (the error's advice). Gradients reduced but
        never stepped are discarded with the other ranks' agreement: a rank that steps
        them while another discards them raises instead of training differently."""
        del set_to_none  # shards are kept allocated: they are the at-rest gradient memory
        life = self._life
        if life.is_dead_backward():
            self._recover()
            return
        if life.state is TrainingState.BACKWARD:
            raise ZeroRuntimeError("zero_grad() called during backward; call it before the "
                                   "forward or after step()")
        if life.state is TrainingState.REDUCED:
            life.note_problem("this rank discarded the step's gradients with zero_grad() "
                              "before step()")
            self._run_step_check(raise_problems=False)
        self._void_step()

    # ------------------------------------------------------------------ interface

    @property
    def trace(self) -> Schedule:
        """Collectives issued in the last step (backward ones in issue order, then the
        step's), as plan records; prints as a table and equals the plan's tuples."""
        return self._recorder.last

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def master_shard(self, group: str) -> torch.Tensor:
        """This rank's flat master shard of `group` (padding included, zeros)."""
        return self._group(group).master

    def group_rank(self, group: str) -> int:
        return self._group(group).rank

    def process_group(self, group: str):
        return self._group(group).process_group

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

    def sync_params_from_master(self) -> None:
        """Re-gather the model parameters from the master shards (after loading them);
        returns with every parameter gathered."""
        with torch.no_grad():
            self._prefetch.wait_all()
            self._flat.repoint_moved()
            self._prefetch.launch(None, overlap=False)

    def save(self, directory, step: int | None = None):
        """Write a sharded, atomic checkpoint (see `evenzero.checkpoint.save`)."""
        from evenzero.checkpoint import save

        return save(self, directory, step)

    def load(self, directory):
        """Load the newest complete checkpoint, any world size (`evenzero.checkpoint.load`)."""
        from evenzero.checkpoint import load

        return load(self, directory)

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds now for gradients, master weights and optimizer state."""
        return measure(self.groups.values(), self._reducer, self.params.values(), self.optimizer,
                       self._flat)

    def _group(self, name: str) -> GroupState:
        if name not in self.groups:
            raise KeyError(f"no parameter group {name!r}; groups are {list(self.groups)}")
        return self.groups[name]
