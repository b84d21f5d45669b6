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
supported.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from evenzero.plan import STEP, Collective, Plan, PlanError
from evenzero.runtime.buckets import FlatParams
from evenzero.runtime.checks import ZeroConfigError, ZeroRuntimeError, backward_problems
from evenzero.runtime.collectives import Trace, default_reduce_scatter_algorithm
from evenzero.runtime.config import ZeroConfig
from evenzero.runtime.gradstats import GradStats, reduce_grad_stats
from evenzero.runtime.hooks import BackwardHooks
from evenzero.runtime.memory import MemoryReport, measure
from evenzero.runtime.precision import as_dtype, loss_scaler_for
from evenzero.runtime.prefetch import ParamPrefetch
from evenzero.runtime.reducer import GradientReducer
from evenzero.runtime.routes import plan_routes
from evenzero.runtime.setup import establish, make_plan
from evenzero.runtime.shards import GroupState, gather_order, load_masters, reshard_group


class ZeroOptimizer:
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
        self.trace_log = Trace()
        self._prefetch = ParamPrefetch(module, self.params)
        self._install(plan, previous=None)
        self.optimizer = optimizer_class(
            [{"params": [self.groups[g.name].master], **self.groups[g.name].options}
             for g in plan.groups], **kwargs)

        self.step_count = 0
        self.last_step_skipped = False
        self._sync = True
        self._measuring = True
        self._unsynced = False
        self._backward_since_step = False
        self._presence = [0.0] * len(self._names)
        self._stats: GradStats | None = None
        self._read_early: list[str] = []
        self._problem: str | None = None
        self._stale_layouts: set = set()
        self._hooks = BackwardHooks(module, setup.named, self._on_grad, self._on_backward_end,
                                    self._on_backward_start)
        self._hooks.record_arrival()

    # ------------------------------------------------------------------ the plan

    def _install(self, plan: Plan, previous: Plan | None) -> None:
        """Make `plan` the executed one: routes, flat buffers, masters, reducer."""
        self._prefetch.wait_all()
        routes = plan_routes(plan, dict(self._setup.group_ranks))
        if plan.strategy == "evenzero" and any(r.direct_shard_offset is None for r in routes):
            raise PlanError("evenzero plan has a bucket whose reduce-scatter output is not this "
                            "rank's contiguous shard slice; this is a planner bug")
        if previous is None or plan.layouts != previous.layouts:
            self._flat = FlatParams(plan, self.params, dict(self._setup.group_ranks))
            for st in self.groups.values():
                if previous is None:
                    load_masters(plan, self._flat, st)
                    continue
                reshard_group(self.optimizer, previous, plan, st)
        self.plan = plan
        self._reducer = GradientReducer(routes, self.params, self.groups, self.config.stage,
                                        self.reduce_scatter_algorithm, self.world_size,
                                        self.trace_log, self.config.max_buckets_in_flight,
                                        self._setup.device)
        self._gather_order = gather_order(plan, self.groups)
        self._prefetch.bind(plan, self._flat, self.groups, self._gather_order)
        self._check_record = Collective(STEP, "all_reduce", "world", self.world_size, None, None,
                                        0, len(self._names) + 3, itemsize=4)

    def _adopt_arrival(self, order: list[str]) -> None:
        """Agree on rank 0's measured arrival order and re-plan once if it differs."""
        box = [order]
        dist.broadcast_object_list(box, src=dist.get_global_rank(self.world_group, 0),
                                   group=self.world_group)
        order = box[0]
        if not order:
            # Rank 0's backward reached no managed parameter: nothing was measured, so
            # keep the assumed order and measure the next backward instead.
            self._measuring = True
            self._hooks.record_arrival()
            return
        unchanged = tuple(order) == self.plan.arrival
        self.spec = self.spec.with_arrival(order, "measured")
        if unchanged:
            return
        plan = make_plan(self.spec, self.world_size, self.config, self._setup.group_sizes)
        if plan != self.plan:
            self._install(plan, previous=self.plan)

    # ------------------------------------------------------------------ backward

    def _on_backward_start(self) -> None:
        # Layouts no forward pre-hook waited for; a gradient for one of their parameters
        # means the parameter was read while its gather could still be running.
        self._stale_layouts = set(self._prefetch.pending)
        self._prefetch.wait_all()

    def _on_grad(self, name: str) -> None:
        self._presence[self._index[name]] = 1.0
        if self._stale_layouts and self._prefetch.layout_of(name) in self._stale_layouts:
            self._read_early.append(name)
        if self._sync and not self._measuring:
            self._reducer.grad_ready(name)

    def _on_backward_end(self) -> None:
        self._stale_layouts = set()
        if self._measuring:
            self._measuring = False
            self._adopt_arrival(self._hooks.take_arrival() or [])
        self._stats = None
        self._backward_since_step = True
        if not self._sync:
            self._unsynced = True
            return
        self._unsynced = False
        problems = self._reducer.finish() + backward_problems(self._read_early, self._module,
                                                             self._managed)
        self._read_early = []
        # Raised at the step's all-reduce, on every rank: raising here, on this rank only,
        # would leave the others waiting in that all-reduce.
        self._problem = self._problem or (problems[0] if problems else None)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally, without communication."""
        previous, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = previous

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss times the current loss scale (unchanged unless loss scaling is on)."""
        return self.loss_scaler.scale_loss(loss)

    def backward(self, loss: torch.Tensor) -> None:
        """`scale_loss(loss).backward()`."""
        self.scale_loss(loss).backward()

    # ------------------------------------------------------------------ step

    def _check_can_step(self, what: str) -> None:
        if self._hooks.in_backward:
            raise ZeroRuntimeError(f"{what}() called during backward (or after a backward that "
                                   f"raised; call zero_grad() to start over)")
        if not self._backward_since_step:
            raise ZeroRuntimeError(f"{what}() called without a backward() since the last step or "
                                   f"zero_grad(); run loss.backward() first")
        if self._unsynced:
            raise ZeroRuntimeError(f"{what}(): the last backward ran under no_sync(), so its "
                                   f"gradients were never reduced; run the last micro-batch's "
                                   f"backward outside no_sync()")

    def _grad_stats(self) -> GradStats:
        """The step's one all-reduce, once per step (clip and step share it)."""
        if self._stats is None:
            stats = reduce_grad_stats(
                (st.grad for st in self.groups.values()), self._presence, self._names,
                self.world_group, self.world_size, self._setup.comm_device,
                self.loss_scaler.scale, self.config.allow_partial_grads, self._problem is not None)
            self.trace_log.record(self._check_record, "all_reduce")
            if stats.problem_ranks:
                problem, self._problem = self._problem, None
                raise ZeroRuntimeError(problem or (
                    f"{stats.problem_ranks} other rank(s) found a problem in the last backward "
                    f"and raised it; see their error (this rank's backward was fine)"))
            self._stats = stats
        return self._stats

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Scale gradients so their global 2-norm is at most `max_norm`; returns the norm
        before clipping, over all ranks and groups (like torch.nn.utils.clip_grad_norm_)."""
        if float(norm_type) != 2.0:
            raise ZeroConfigError(f"clip_grad_norm_: only norm_type=2 is supported, got {norm_type}")
        self._check_can_step("clip_grad_norm_")
        self._prefetch.wait_all()
        stats = self._grad_stats()
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
        self._check_can_step("step")
        self._prefetch.wait_all()
        stats = self._grad_stats()
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
            self._prefetch.launch(self.trace_log, self.config.overlap_param_gather)
            self.step_count += 1
        self.trace_log.close_step()
        self._presence = [0.0] * len(self._names)
        self._backward_since_step = False
        self._stats = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient shards (and stage 1's buffers); drop any local `.grad`."""
        del set_to_none  # shards are kept allocated: they are the at-rest gradient memory
        if self._hooks.in_backward:
            # A backward raised before its end callback ran; start the next one clean.
            self._hooks.in_backward = False
            self._reducer.abandon()
            self._stale_layouts, self._read_early = set(), []
        for st in self.groups.values():
            st.grad.zero_()
        self._reducer.zero_()
        views = self._reducer.grad_buffers
        held = {v.data_ptr() for vs in views.views for v in vs} if views is not None else set()
        for p in self.params.values():
            if p.grad is not None and p.grad.data_ptr() not in held:
                p.grad = None
        self._presence = [0.0] * len(self._names)
        self._unsynced = False
        self._backward_since_step = False
        self._stats = None

    # ------------------------------------------------------------------ interface

    @property
    def trace(self) -> tuple[Collective, ...]:
        """Collectives issued in the last step (backward ones in issue order, then the step's)."""
        return self.trace_log.last

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

