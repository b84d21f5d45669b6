"""`ZeroOptimizer`: ZeRO-1/2 data parallelism with one equal reduce-scatter per bucket.

    opt = evenzero.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, stage=2)
    loss.backward(); opt.clip_grad_norm_(1.0); opt.step(); opt.zero_grad()

Lifecycle of one step:

1. construction: every rank checks and agrees on the model, plans it (arrival order
   assumed to be reverse registration) and re-points the parameters into flat
   per-layout buffers; its 1/N slice of each buffer is its master shard (fp32
   parameters), or is copied into fp32 master shards (bf16/fp16 parameters);
2. the first backward only records the real gradient-arrival order; at its end rank 0's
   order is adopted everywhere and, if it differs, the model is re-planned and
   re-laid-out once; then all buckets are reduced in plan order;
3. later backwards reduce each bucket as soon as it (and every bucket before it) is
   complete, overlapped with the rest of backward;
4. `clip_grad_norm_` / `step`: one small all-reduce over the world carries the squared
   norm, the overflow flag, a presence bit per parameter and a flag for problems a rank
   found alone in backward (raised there on every rank); then the inner optimizer
   steps the master shards layout by layout, in forward order, and each layout's
   all-gather is launched as soon as its shard is stepped (`runtime/engine.py`), so the
   gathers overlap the rest of the step, which then waits for them;
5. with `overlap_param_gather=True` the step returns without waiting and each module
   waits for the gathers of its own parameters in a forward pre-hook, so they overlap
   the next forward (`runtime/prefetch.py`); read parameters outside their modules'
   forward only after `opt.wait_for_params()` (`opt.module`, `state_dict()` and the
   optimizer's own methods wait by themselves).

`ZeroOptimizer` is the torch face; it delegates to parts, each in its own module: the
plan and its one `replan` (`runtime/planholder.py`); what executes the plan, with the
step (`runtime/engine.py`), each group's sharded state in one `GroupShard`
(`runtime/shards.py`); the backward side, including the step check and recovery from a
backward that raised on some ranks only (`runtime/backward.py`, which the hooks hold
weakly); the state dicts and the checkpoint protocol (`runtime/statedict.py`); the
parameter gathers (`runtime/prefetch.py`). Where the optimizer is in its cycle is one
`TrainingState`, and whether parameters may be read is one `ParamState`
(`runtime/lifecycle.py`); what happens at exit and when the optimizer is dropped is
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

import copy
import math
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch.profiler import record_function

from evenzero.plan import Plan, Schedule
from evenzero.runtime.backward import BackwardDriver
from evenzero.runtime.backwardclock import RefinementSchedule
from evenzero.runtime.checks import ZeroConfigError
from evenzero.runtime.collectives import (
    REDUCE_SCATTERS,
    TraceRecorder,
    default_reduce_scatter_algorithm,
)
from evenzero.runtime.config import ZeroConfig
from evenzero.runtime.engine import ShardEngine
from evenzero.runtime.gradclear import ClearTracker
from evenzero.runtime.gradstats import StepCheck, StepCheckConfig
from evenzero.runtime.innerstep import choose_inner_step, user_defaults
from evenzero.runtime.memory import MemoryReport
from evenzero.runtime.planholder import PlanHolder
from evenzero.runtime.precision import LossScaler, ScalerSlot, as_dtype, loss_scaler_for
from evenzero.runtime.prefetch import ParamGathers
from evenzero.runtime.reducer import ReducerConfig, keeps_pool
from evenzero.runtime.setup import (
    broadcast_initial_state,
    establish,
    tunes_bucket_size,
    whole_tensor_names,
)
from evenzero.runtime.shardedgrad import drop_placeholders, placeholders
from evenzero.runtime.shards import GroupShard, Placement
from evenzero.runtime.stall import ProgressBoard
from evenzero.runtime.statedict import StateDictIO
from evenzero.runtime.teardown import Resources, claim, release_with
from evenzero.spec import ModelSpec


class ZeroOptimizer(torch.optim.Optimizer):
    """Shards gradients (stage 2) and optimizer state (stages 1, 2) over data-parallel ranks.

    A `torch.optim.Optimizer`: `param_groups` are the user's groups of model parameters
    with their hyperparameters (an LR scheduler drives them; a change applies at the next
    step); the inner `optimizer_class` instance that steps the master shards is an
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
                                  "evenzero.init_process_group(...) (or torch.distributed's) "
                                  "before building ZeroOptimizer")
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
        self.params = dict(setup.named)
        self._control_device = setup.control_device

        cfg = self.config
        master_dtype = as_dtype(cfg.master_dtype, "master_dtype")
        reduce_dtype = as_dtype(cfg.reduce_dtype, "reduce_dtype") if cfg.reduce_dtype else None
        backend = str(dist.get_backend(self.world_group))
        self.reduce_scatter_algorithm = (cfg.reduce_scatter_algorithm or
                                         default_reduce_scatter_algorithm(backend, setup.device.type))
        param_dtypes = {g.name: g.params[0].dtype for g in setup.groups}
        self._scaler = ScalerSlot(loss_scaler_for(cfg.loss_scale, cfg.loss_scale_config,
                                                  list(param_dtypes.values())))

        # The inner optimizer's implementation (runtime/innerstep.py), before the plan names it.
        mine = [g for g in setup.groups if g.optimizer is None]
        # Offloaded shards are stepped on the host, with the host's implementation.
        step_device = torch.device("cpu") if cfg.offload_optimizer else setup.device
        inner_step = choose_inner_step(optimizer_class, kwargs, [g.options for g in mine],
                                       step_device, master_dtype, cfg.optimizer_impl)
        # Groups with their own class (their "optimizer" key) or a whole-tensor update each
        # get an inner optimizer of their own (docs/muon.md).
        whole = whole_tensor_names(setup.groups, optimizer_class, cfg)
        own_inner = {}
        for g in setup.groups:
            if g.optimizer is not None:
                step = choose_inner_step(g.optimizer, {}, [g.options], step_device,
                                         master_dtype, None)
                own_inner[g.name] = partial(g.optimizer, **step.kwargs)
            elif any(n in whole for n in g.names):
                own_inner[g.name] = partial(optimizer_class, **inner_step.kwargs)
        self.config = cfg = replace(cfg, optimizer_impl=inner_step.impl if mine else None,
                                    whole_tensor=whole)
        broadcast_initial_state(module, setup.groups, self.world_group)
        # Parameters frozen now are not managed; unfreezing one later is named at the step.
        frozen = {id(p) for p in module.parameters() if not p.requires_grad}
        self._plans = PlanHolder(setup.spec, self.world_size, cfg, setup.group_sizes, setup.device)
        placement = (Placement.offload(setup.device, cfg.pin_memory) if cfg.offload_optimizer
                     else Placement.on(setup.device))
        shards = {g.name: GroupShard(g.name, g.process_group, setup.group_sizes[g.name],
                                     setup.group_ranks[g.name], param_dtypes[g.name],
                                     reduce_dtype or param_dtypes[g.name], master_dtype,
                                     g.options, placement,
                                     {n: tuple(p.shape) for n, p in zip(g.names, g.params, strict=True)}
                                     if whole and g.names[0] in whole else None)
                  for g in setup.groups}
        self._placeholders = placeholders(setup.named)
        clearing = ClearTracker(self.params, self._placeholders)
        self._recorder = TraceRecorder()
        self._gathers = ParamGathers(module, self.params)
        self._engine = ShardEngine(
            self._plans.plan, self.params, setup.group_ranks, shards,
            partial(optimizer_class, **inner_step.kwargs),
            ReducerConfig(cfg.stage, self.world_size, cfg.max_buckets_in_flight, setup.device,
                          REDUCE_SCATTERS[self.reduce_scatter_algorithm], self._scaler.scale,
                          keeps_pool(setup.device)),
            self._recorder, clearing, self._gathers, self.world_group, own_inner)
        self._plans.bind(self._engine)
        # The torch face: the user's groups, every option filled in from the inner
        # optimizer's defaults, as torch fills them.
        self._constructing = True
        own_defaults = {g.name: user_defaults(self._engine.inners[g.name].defaults, {})
                        for g in setup.groups if g.optimizer is not None}
        torch.optim.Optimizer.__init__(
            self, [{"params": list(g.params), **own_defaults.get(g.name, {}), **g.options}
                   for g in setup.groups],
            user_defaults(self._engine.inner.defaults, kwargs))
        self._constructing = False
        self.step_count = 0
        self.last_step_skipped = False
        # Finished work and hooks are released when this object goes away, at the latest
        # at interpreter exit (runtime/teardown.py), or by close(); nothing the model holds
        # refers to it.
        self._resources = Resources()
        # bucket_numel "auto": refined once, after the first backwards (backwardclock.py).
        refine = RefinementSchedule(cfg.auto_bucket and tunes_bucket_size(cfg.strategy) and
                                    any(st.size > 1 for st in shards.values()))
        self._backward = BackwardDriver(
            module, setup, frozen, self.world_group, self.rank, self.reduce_scatter_algorithm,
            self._plans, self._engine, self._gathers, clearing, self._recorder,
            StepCheck(StepCheckConfig(tuple(self.params), self.world_group, self.world_size,
                                      setup.control_device, cfg.allow_partial_grads),
                      self._recorder),
            self._scaler, refine, self._resources)
        self._states = StateDictIO(self._plans, self._engine, self._backward, self._scaler,
                                   self.params, self.world_group, self.world_size, self.rank)
        self._resources.on_close(self._gathers.remove)
        self._resources.on_close(self._backward.hooks.remove)
        self._resources.on_close(claim(list(self.params.values()), self))
        self._resources.on_close(partial(drop_placeholders, self.params))
        # A rank that stops arriving is named in the others' timeout (runtime/stall.py).
        self._progress = ProgressBoard(self.world_group,
                                       [st.process_group for st in self.groups.values()])
        self._resources.on_close(self._progress.close)
        release_with(self, self._resources)

    # ------------------------------------------------------------------ what it runs

    @property
    def plan(self) -> Plan:
        """The executed plan: groups, layouts, buckets and collectives."""
        return self._plans.plan

    @property
    def spec(self) -> ModelSpec:
        """The planner's view of the model, with the agreed arrival order."""
        return self._plans.spec

    @property
    def groups(self) -> Mapping[str, GroupShard]:
        """Plan group name -> this rank's `GroupShard` (its masters, gradient shard and
        optimizer state)."""
        return self._engine.groups

    @property
    def loss_scaler(self) -> LossScaler:
        """The loss scaler in use (replaceable: the DeepSpeed drop-in puts its own in)."""
        return self._scaler.scaler

    @loss_scaler.setter
    def loss_scaler(self, scaler: LossScaler) -> None:
        self._scaler.scaler = scaler

    # ------------------------------------------------------------------ backward

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communication."""
        with self._backward.unsynced():
            yield

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current loss scale (unchanged unless loss scaling is on).
        With fp16 loss scaling the next backward must run on this (checked)."""
        self._backward.loss_scaled()
        return self.loss_scaler.scale_loss(loss)

    def backward(self, loss: torch.Tensor) -> None:
        """`scale_loss(loss).backward()`."""
        self.scale_loss(loss).backward()

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
        stats = self._backward.grad_stats("clip_grad_norm_")
        if not stats.overflow:
            coef = max_norm / (stats.norm + 1e-6)
            if coef < 1.0:
                self._engine.scale_grads(coef)
        return torch.tensor(stats.norm, dtype=torch.float32)

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
        stats = self._backward.grad_stats("step")
        stepped = None
        with record_function("evenzero::step"):
            scaler = self.loss_scaler
            self.last_step_skipped = stats.overflow and scaler.enabled
            if self.last_step_skipped:
                scaler.update(overflow=True)
                self._engine.zero_grads()
                self._engine.error_feedback.drop()  # computed from non-finite gradients
            else:
                stepped = self._backward.present(stats)
                seconds = self._engine.step(self.param_groups, stepped, self._recorder,
                                            self.config.overlap_param_gather)
                self._backward.optimizer_timed(seconds)
                scaler.update(overflow=False)
                self.step_count += 1
        self._backward.end_step(stepped)
        self._progress.step_done(self.step_count)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients as torch does: `p.grad = None`, or zeros with
        `set_to_none=False` (a parameter holding zeros is still stepped, as in torch).

        After a backward that raised on this rank, this first finishes that backward's
        collectives with the other ranks (the error's advice). Gradients reduced but
        never stepped are discarded with the other ranks' agreement: a rank that steps
        them while another discards them raises instead of training differently."""
        self._backward.zero_grad(set_to_none,
                                 partial(torch.optim.Optimizer.zero_grad, self, set_to_none))

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused after construction: the shard layout is planned once for all groups."""
        if self._constructing:
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
        self._gathers.wait()
        self._resources.close()

    # ------------------------------------------------------------------ state dicts

    def state_dict(self) -> dict[str, Any]:
        """This rank's state (`runtime/statedict.py`, `StateDictIO.state_dict`)."""
        return self._states.state_dict(self.param_groups, self.step_count)

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Load what `state_dict()` returned on this rank (a collective: every rank loads
        its own, or every rank raises the same error). As in torch, the saved groups
        replace the current ones whole, so keys a scheduler added do not matter."""
        self.step_count = self._states.load_state_dict(state_dict, self.param_groups)

    # ------------------------------------------------------------------ checkpoint protocol

    @property
    def inner_optimizer_class(self) -> type[torch.optim.Optimizer]:
        """The torch optimizer class stepping the flat shards."""
        return type(self._engine.inner)

    @property
    def control_device(self) -> torch.device:
        """Where small agreement tensors live (the CUDA device under NCCL, else the CPU)."""
        return self._control_device

    def shard_state(self, group: str) -> dict[str, Any]:
        """`evenzero.checkpoint.protocol.GroupShard` of plan group `group` on this rank."""
        return self._states.shard_state(group, self.param_groups)

    def loss_scaler_state(self) -> dict[str, Any]:
        return self.loss_scaler.state_dict()

    def check_loss_scaler_state(self, state: Mapping[str, Any]) -> None:
        """Raise ValueError (or KeyError, TypeError) if `state` would not load."""
        copy.deepcopy(self.loss_scaler).load_state_dict(dict(state))

    def load_shard_state(self, shards: Mapping[str, Mapping[str, Any]],
                         step_count: int | None, loss_scaler: Mapping[str, Any] | None) -> None:
        """Write every group's shard state (already resharded to this rank's runs), the
        step count and the loss scaler; then re-gather the parameters from the masters.
        Saved hyperparameters win; keys only the running groups hold are kept."""
        self._states.load_shard_state(shards, loss_scaler, self.param_groups)
        if step_count is not None:
            self.step_count = int(step_count)

    @property
    def keeps_error_feedback(self) -> bool:
        """Whether error-feedback residuals are kept (`grad_compression_error_feedback`
        on a group of more than one rank)."""
        return self._engine.error_feedback.active

    def error_feedback_state(self) -> dict[str, torch.Tensor]:
        """This rank's error-feedback residual per parameter (CPU fp32 copies, in units
        of the unscaled gradient; empty without error feedback): what its compressed
        sends still owe. `evenzero.checkpoint` saves it (and reshards it: see
        `evenzero.checkpoint.residuals`)."""
        return self._engine.error_feedback.unscaled()

    def load_error_feedback_state(self, residuals: Mapping[str, torch.Tensor]) -> None:
        """Replace this rank's residuals (unscaled, per parameter; missing ones: zero)."""
        self._engine.error_feedback.load_per_param(residuals, unscaled=True)

    def plan_choices(self) -> dict[str, Any]:
        """What this run settled about its plan (`evenzero.checkpoint.protocol.PlanChoices`):
        the bucket size once it is no longer refined, the arrival order once measured."""
        return self._states.plan_choices()

    def adopt_plan_choices(self, choices: Mapping[str, Any]) -> None:
        """Take over a saved run's `PlanChoices` (a collective, every rank alike): its
        arrival order counts as measured; an "auto" bucket size becomes its
        `bucket_numel` and is no longer refined, a fixed one is kept."""
        self._states.adopt_plan_choices(choices)

    def master_shard(self, group: str) -> torch.Tensor:
        """This rank's flat master shard of `group` (padding included, zeros). A copy for
        groups whose masters are the parameters' own memory (fp32 parameters)."""
        return self._states.group(group).master_values()

    @torch.no_grad()
    def step_masters_on_zero_grads(self) -> None:
        """Step every parameter once on zero gradients (DeepSpeed's stage-0 mixed-precision
        wrappers do this when built; `evenzero.deepspeed` follows them), then gather the
        parameters from the masters. DeepSpeed leaves its bf16 weights alone until the
        first real step; here they follow the masters at once, because a parameter that
        differs from its master is a user's write (runtime/paramwrites.py) and would
        undo the step. They differ by at most one bf16 ulp, where the step crossed one.
        step_count stays 0, as in DeepSpeed."""
        self._engine.step_on_zero_grads(self.params)

    def group_rank(self, group: str) -> int:
        return self._states.group(group).rank

    def process_group(self, group: str) -> Any:
        return self._states.group(group).process_group

    def sync_params_from_master(self) -> None:
        """Re-gather the model parameters from the master shards (after loading them);
        returns with every parameter gathered."""
        self._engine.publish_all()

    # ------------------------------------------------------------------ interface

    @property
    def trace(self) -> Schedule:
        """Collectives issued in the last step (backward ones in issue order, then the
        step's), as plan records; prints as a table and equals the plan's tuples."""
        return self._recorder.last

    @property
    def module(self) -> torch.nn.Module:
        """The wrapped model, with every parameter gathered (waits for the step's gathers)."""
        self._gathers.wait()
        return self._module

    def wait_for_params(self) -> None:
        """Wait until the last step's parameter all-gathers are done, so every parameter
        holds its new value. Needed only before reading parameters outside the forward of
        the modules that hold them (forward pre-hooks, `state_dict()`, `opt.module` and
        this optimizer's own methods wait by themselves); a no-op when nothing is pending."""
        self._gathers.wait()

    def memory_report(self) -> MemoryReport:
        """Bytes this rank holds now for gradients, master weights and optimizer state."""
        return self._engine.memory()
