"""Resume a DeepSpeed ZeRO-1/2 checkpoint in a `ZeroOptimizer`, at any world size.

    ckpt = evenzero.checkpoint.load_deepspeed(opt, "ds_ckpt/", lr_scheduler=scheduler)
    # fp32 masters, Adam moments and step, param-group options (lr, ...), loss scale,
    # buffers and frozen parameters are in place; ckpt.client_state, ckpt.global_steps, ...

DeepSpeed itself refuses to load ZeRO optimizer state at another data-parallel size
(deepspeed/runtime/engine.py:4749 @ v0.19.8). Here every rank cuts its evenzero shard
out of DeepSpeed's flat partitions by parameter name (`reader.FlatGroup`), so the saved
size does not matter: `DeepSpeedSource` is the `evenzero.checkpoint.staging.ShardSource`
over a read checkpoint, which `load_deepspeed` and the offline converter
(`evenzero.checkpoint.deepspeed.offline`) stage through the one `stage()`. What comes over, and from where:

* fp32 masters and per-element optimizer state: the optimizer files, padding removed;
* scalar optimizer state (`step`) and the inner param-group options (lr, betas, eps,
  weight_decay, ...): the optimizer files, as DeepSpeed's own load restores them
  (the LR in effect is the saved group's, not the scheduler's initial one);
* buffers and frozen parameters: `module` in the model-states file;
* loss scale: DeepSpeed's scaler state mapped onto the `ZeroOptimizer`'s scaler;
* the LR scheduler state (into `lr_scheduler=`), counters, `client_state`: returned.

Every rank reads and checks everything, the ranks agree, and only then is anything
written, so a damaged or mismatched checkpoint is the same `CheckpointError` on every
rank and leaves the optimizer untouched.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from evenzero.checkpoint.agree import agree, attempt
from evenzero.checkpoint.deepspeed.optim_state import loss_scaler_state, optimizer_values
from evenzero.checkpoint.deepspeed.reader import (
    MOE_FIX,
    DeepSpeedFiles,
    FlatGroup,
    read_deepspeed,
)
from evenzero.checkpoint.format import MASTER, CheckpointError
from evenzero.checkpoint.protocol import ShardedOptimizer
from evenzero.checkpoint.reshard import fill_shard
from evenzero.checkpoint.staging import StagedGroup, StagedState, apply, stage
from evenzero.checkpoint.state import (
    RankPlace,
    ShardTarget,
    extra_tensors,
    group_params,
    group_state,
    stepped_params,
    trainable_names,
)
from evenzero.plan import ShardRange

_ENGINE_KEYS = ("module", "skipped_steps", "global_steps", "dp_world_size", "mp_world_size",
                "data_sampler", "random_ltd")
"""Model-states keys DeepSpeed's load keeps to itself; every other key is client state
(deepspeed/runtime/engine.py:4722-4736 @ v0.19.8)."""


@dataclass(frozen=True)
class DeepSpeedCheckpoint:
    """What a DeepSpeed checkpoint held besides the tensors `load_deepspeed` put in place."""

    path: Path
    """The tag directory that was loaded."""
    tag: str
    global_steps: int
    """DeepSpeed's step counter (overflow-skipped steps included)."""
    global_samples: int | None
    skipped_steps: int
    lr_scheduler: Mapping[str, Any] | None
    """The scheduler's saved `state_dict()` (loaded into `lr_scheduler=` when given)."""
    client_state: Mapping[str, Any]
    """As `engine.load_checkpoint` returns it: every model-states key DeepSpeed does not
    keep (your `client_state` keys, `ds_config`, `param_shapes`, `buffer_names`, ...)."""
    loss_scaler: Mapping[str, Any] | None
    """DeepSpeed's loss-scaler attributes (cur_scale, cur_iter, ...); None if not read."""
    clip_grad: float | None
    """Gradient clipping saved by the ZeRO optimizer (DeepSpeed's load restores it)."""
    ds_config: Mapping[str, Any]
    ds_version: str | None
    zero_stage: int
    dp_world_size: int
    """Data-parallel ranks that wrote it."""


def load_deepspeed(opt: ShardedOptimizer, directory: str | os.PathLike, tag: str | None = None, *,
                   load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                   load_module_only: bool = False, load_module_strict: bool = True,
                   lr_scheduler: Any = None, allow: Sequence[Any] = ()) -> DeepSpeedCheckpoint:
    """Load a DeepSpeed ZeRO-1/2 checkpoint into `opt`; a collective over its ranks.

    Args:
        directory: DeepSpeed's `save_dir` (with `latest`), or a tag directory.
        tag: the tag to load; default: the one `latest` names.
        load_optimizer_states: False keeps the optimizer state as it is and rebuilds the
            fp32 masters from the saved model weights, as DeepSpeed does.
        load_lr_scheduler_states: False leaves `lr_scheduler` alone.
        load_module_only: weights, buffers and frozen parameters only (no counters).
        load_module_strict: False keeps buffers and frozen parameters the checkpoint lacks
            (e.g. saved with exclude_frozen_parameters) and ignores entries this model
            lacks, like DeepSpeed's; trained parameters must match either way.
        lr_scheduler: a scheduler to load the saved scheduler state into.
        allow: extra classes you trust for unpickling (e.g. your own in client_state).
    """
    place = RankPlace.of(opt)
    read_optimizer = load_optimizer_states and not load_module_only
    load_scheduler = (lr_scheduler is not None and load_lr_scheduler_states
                      and not load_module_only)

    def read() -> tuple[DeepSpeedFiles, StagedState, Any]:
        files = read_deepspeed(directory, tag, optimizer_states=read_optimizer, allow=allow)
        source = DeepSpeedSource(opt, files, optimizer_states=read_optimizer,
                                 strict=load_module_strict, counters=not load_module_only)
        staged = stage(opt, place, source)
        scheduler = _scheduler_state(files, lr_scheduler) if load_scheduler else None
        return files, staged, scheduler

    result, err = attempt(read)
    agree(place, err, f"loading DeepSpeed checkpoint {directory}",
          same=int(result[0].states.get("global_steps") or 0) if result else -1)
    files, staged, scheduler = result
    apply(opt, staged)
    if scheduler is not None:
        lr_scheduler.load_state_dict(scheduler)
    return _summary(files, load_optimizer_states, load_lr_scheduler_states, load_module_only)


def _summary(files: DeepSpeedFiles, optimizer: bool, scheduler: bool,
             module_only: bool) -> DeepSpeedCheckpoint:
    s = files.states
    kept = ["module"] if module_only else list(_ENGINE_KEYS)
    kept += ["lr_scheduler"] if scheduler else []
    kept += ["optimizer"] if optimizer else []
    config = s.get("ds_config") or {}
    steps = int(s.get("global_steps") or 0)
    samples = s.get("global_samples")
    if samples is None and isinstance(config.get("train_batch_size"), int):
        samples = steps * config["train_batch_size"]
    return DeepSpeedCheckpoint(
        files.path, files.tag, steps, None if samples is None else int(samples),
        int(s.get("skipped_steps") or 0), s.get("lr_scheduler"),
        {k: v for k, v in s.items() if k not in kept}, files.loss_scaler, files.clip_grad,
        config, s.get("ds_version"), files.zero_stage, files.dp_world_size)


# --------------------------------------------------------------------------- staging


class DeepSpeedSource:
    """A read DeepSpeed checkpoint as a `staging.ShardSource` for `opt`'s shards.

    Checks on construction that the checkpoint is of this model (`check_model`) and has
    no expert groups. Without `optimizer_states` the masters come from the saved
    weights and the optimizer keeps its state and options (DeepSpeed's
    `_restore_from_bit16_weights`). `counters`: take the step counter (False for
    `load_module_only`).
    """

    def __init__(self, opt: ShardedOptimizer, files: DeepSpeedFiles, *, optimizer_states: bool,
                 strict: bool = True, counters: bool = True) -> None:
        named = trainable_names(opt)
        check_model(files, {n: tuple(p.shape) for n, p in named.items()},
                    {n: tuple(t.shape) for n, t in extra_tensors(opt).items()},
                    set(opt.module.state_dict()), strict)
        experts = [g.name for g in opt.plan.groups if g.expert_parallel_size > 1]
        if experts:
            raise CheckpointError(f"{files.path}: this optimizer has expert groups {experts} but "
                                  f"the DeepSpeed checkpoint has none; {MOE_FIX}")
        self.where = str(files.path)
        self._opt = opt
        self._files = files
        self._optimizer_states = optimizer_states
        self._counters = counters
        self._holder = {name: g for g in files.groups for name, _ in g.params}

    def group(self, target: ShardTarget) -> StagedGroup:
        files, opt = self._files, self._opt
        flats, param_scalars, hyper = group_state(opt, target.group)
        if not self._optimizer_states:
            masters = fill_shard(target.ranges, target.shard_numel,
                                 lambda param: files.module[param].float())
            return StagedGroup(
                flats={MASTER: masters, **{k: v.clone() for k, v in flats.items() if k != MASTER}},
                param_scalars=copy.deepcopy(param_scalars),
                stepped=frozenset(stepped_params(opt, target.group)), hyperparameters=hyper)
        names = group_params(opt, target.group)
        sources = sorted({self._holder[n].index for n in names})
        kinds, scalars, hyper = optimizer_values(
            [files.groups[i] for i in sources], opt.inner_optimizer_class, hyper,
            files.states.get("ds_config"), f"{files.path} (group {target.group!r})")
        flats = {k: _shard(target.ranges, target.shard_numel, self._holder, k)
                 for k in (MASTER, *kinds)}
        # DeepSpeed steps each flat group whole, so every parameter in it has the group's
        # scalar state (its `step`); torch keeps one copy per parameter.
        return StagedGroup(flats=flats,
                           param_scalars={p: copy.deepcopy(scalars) for p in target.params},
                           stepped=frozenset(target.params) if kinds or scalars else frozenset(),
                           hyperparameters=hyper)

    def model_extras(self) -> Mapping[str, torch.Tensor]:
        extras = {n: self._files.saved_tensor(n) for n in extra_tensors(self._opt)}
        return {n: t for n, t in extras.items() if t is not None}

    def loss_scaler(self) -> Mapping[str, Any] | None:
        if not self._optimizer_states:
            return None
        states = self._files.states
        return loss_scaler_state(self._files.loss_scaler, self._opt.loss_scaler,
                                 int(states.get("skipped_steps") or 0), self.where)

    def step_count(self) -> int | None:
        if not self._counters:
            return None
        states = self._files.states
        return int(states.get("global_steps") or 0) - int(states.get("skipped_steps") or 0)


def _shard(ranges: Sequence[ShardRange], numel: int, holder: Mapping[str, FlatGroup],
           kind: str) -> torch.Tensor:
    """This rank's flat fp32 shard of one kind, zeros in its padding."""
    out = torch.zeros(numel, dtype=torch.float32)
    for r in ranges:
        out[r.shard_offset:r.shard_offset + r.numel] = holder[r.param].flat(r.param, kind, r.start,
                                                                            r.numel)
    return out


def check_model(files: DeepSpeedFiles, trainable: Mapping[str, tuple[int, ...]],
                extras: Mapping[str, tuple[int, ...]], state_names: set[str],
                strict: bool = True) -> None:
    """The checkpoint must be of this model: the same trained parameters (names, shapes),
    buffers and frozen parameters; the first difference is raised and named."""
    where = files.path
    for name, shape in trainable.items():
        saved = files.trainable.get(name)
        if saved is None:
            why = ("was frozen (or tied to another name) when DeepSpeed saved"
                   if name in files.module else "is not in the checkpoint")
            raise CheckpointError(f"{where}: parameter {name!r} is trained here but {why}; "
                                  f"the checkpoint is from a different model")
        if saved != shape:
            raise CheckpointError(f"{where}: parameter {name!r} has shape {list(saved)} in the "
                                  f"checkpoint but {list(shape)} here; it is from a different "
                                  f"model")
    extra = sorted(set(files.trainable) - set(trainable))
    if extra:
        raise CheckpointError(f"{where}: the checkpoint trains parameter(s) {extra[:5]} that "
                              f"this model lacks or has frozen; it is from a different model")
    for name, shape in extras.items():
        saved = files.saved_tensor(name)
        if saved is None and not strict:
            continue
        if saved is None:
            raise CheckpointError(f"{where}: model entry {name!r} (buffer or frozen parameter) "
                                  f"is not in the checkpoint's module state (saved with "
                                  f"exclude_frozen_parameters?); pass load_module_strict=False "
                                  f"to keep this model's value")
        if tuple(saved.shape) != shape:
            raise CheckpointError(f"{where}: model entry {name!r} has shape "
                                  f"{list(saved.shape)} in the checkpoint but {list(shape)} here")
    unknown = sorted(set(files.module) - state_names)
    if unknown and strict:
        raise CheckpointError(f"{where}: the checkpoint's module has entr(ies) {unknown[:5]} "
                              f"that this model lacks; it is from a different model")


def _scheduler_state(files: DeepSpeedFiles, scheduler: Any) -> Mapping[str, Any]:
    saved = files.states.get("lr_scheduler")
    where = files.path
    if saved is None:
        raise CheckpointError(f"{where}: no LR scheduler state was saved; pass "
                              f"lr_scheduler=None (or load_lr_scheduler_states=False)")
    mine = set(scheduler.state_dict())
    if not isinstance(saved, Mapping) or set(saved) != mine:
        raise CheckpointError(f"{where}: the saved LR scheduler state has keys "
                              f"{sorted(saved) if isinstance(saved, Mapping) else saved!r} but "
                              f"{type(scheduler).__name__} keeps {sorted(mine)}; build the "
                              f"scheduler DeepSpeed used (e.g. deepspeed.runtime.lr_schedules."
                              f"WarmupDecayLR) or pass load_lr_scheduler_states=False")
    return saved


__all__ = ["DeepSpeedCheckpoint", "DeepSpeedSource", "check_model", "load_deepspeed"]
