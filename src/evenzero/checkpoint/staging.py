"""One path for this rank's shard state, in every direction: sources, `stage()`, `apply()`.

Every checkpoint operation moves the same thing: per plan group, this rank's flat fp32
shards (the master and each elementwise optimizer-state kind), each parameter's scalar
state, which parameters were stepped, and the group's options; plus the model's buffers
and frozen parameters, the loss scaler and the step counter. Where it comes from is a
`ShardSource`:

    the running optimizer      `OptimizerSource`          (a save; copies for a background one)
    a published checkpoint     `reader.FileSource`        (load)
    whole-model state dicts    `consolidate.ConsolidatedSource` (import_consolidated)
    a DeepSpeed checkpoint     `deepspeed.load.DeepSpeedSource`  (load_deepspeed, convert)

`stage(opt, place, source)` asks the source for each of this rank's `ShardTarget`s and
checks what it gets (fp32 shards of the shard's size, state for every parameter of the
shard, a loss-scaler state the optimizer accepts) into a `StagedState`. A save writes
that; a load `apply()`s it, and since everything was read and checked first, a load
either changes the whole state or nothing.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from evenzero.checkpoint.format import MASTER, CheckpointError
from evenzero.checkpoint.protocol import ShardedOptimizer
from evenzero.checkpoint.state import (
    RankPlace,
    ShardTarget,
    extra_tensors,
    group_state,
    shard_target,
    stepped_params,
)


@dataclass(frozen=True)
class StagedGroup:
    """One plan group's state for this rank's shard."""

    flats: Mapping[str, torch.Tensor]
    """"master" and each elementwise optimizer-state kind: flat fp32, the shard's size
    (zeros in its padding)."""
    param_scalars: Mapping[str, Mapping[str, Any]]
    """Parameter of the shard -> its scalar optimizer state (its own `step`, ...; {} if
    never stepped)."""
    stepped: frozenset[str]
    """Parameters of the shard stepped at least once."""
    hyperparameters: Mapping[str, Any]
    """The torch param group's options (lr, betas, ...), without "params"."""


@dataclass(frozen=True)
class StagedState:
    """Everything a load writes or a save stores, read and checked in full first."""

    groups: Mapping[str, StagedGroup]
    """Plan group -> its state on this rank."""
    targets: Mapping[str, ShardTarget]
    """Plan group -> the shard it is the state of."""
    extras: Mapping[str, torch.Tensor]
    """Buffers and frozen parameters by state-dict name ({}: none to store or load)."""
    loss_scaler: Mapping[str, Any] | None
    """Loss-scaler state dict, or None to leave the scaler as it is."""
    step_count: int | None
    """The optimizer's step counter, or None to leave it."""


class ShardSource(Protocol):
    """Where a stage takes this rank's state from; see the module docstring."""

    where: str
    """Names the source in errors (a checkpoint directory, "the optimizer", ...)."""

    def group(self, target: ShardTarget) -> StagedGroup:
        """The state of the shard `target` describes (only its parameters matter)."""
        ...

    def model_extras(self) -> Mapping[str, torch.Tensor]:
        """Buffers and frozen parameters by name ({}: leave them)."""
        ...

    def loss_scaler(self) -> Mapping[str, Any] | None:
        """The loss scaler's state dict (None: leave the scaler)."""
        ...

    def step_count(self) -> int | None:
        """The step counter (None: leave it)."""
        ...


def stage(opt: ShardedOptimizer, place: RankPlace, source: ShardSource) -> StagedState:
    """This rank's state from `source`, for the optimizer's current plan, checked; no
    collective, and nothing of `opt` changes."""
    groups, targets = {}, {}
    for g in opt.plan.groups:
        target = shard_target(opt, place, g.name)
        groups[g.name] = _checked(source.group(target), target, source.where)
        targets[g.name] = target
    scaler = source.loss_scaler()
    if scaler is not None and opt.loss_scaler_state() is not None:
        try:
            opt.check_loss_scaler_state(scaler)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{source.where}: loss scaler: {e}") from None
    else:
        scaler = None  # an optimizer without loss scaling has none to set
    return StagedState(groups=groups, targets=targets, extras=source.model_extras(),
                       loss_scaler=scaler, step_count=source.step_count())


def _checked(got: StagedGroup, target: ShardTarget, where: str) -> StagedGroup:
    """`got` limited to the shard's parameters, with every part present and shaped."""
    at = f"{where}: group {target.group!r}"
    if MASTER not in got.flats:
        raise CheckpointError(f"{at}: no master weights")
    for kind, flat in got.flats.items():
        if flat.dtype != torch.float32:
            what = "master weights" if kind == MASTER else f"optimizer state {kind!r}"
            raise CheckpointError(f"{what} of group {target.group!r} are {flat.dtype}; evenzero "
                                  f"checkpoints store fp32 (use master_dtype=torch.float32)")
        if flat.dim() != 1 or flat.numel() != target.shard_numel:
            raise CheckpointError(f"{at}: {kind} has shape {list(flat.shape)}, this rank's "
                                  f"shard {target.shard_numel} elements")
    params = target.params
    missing = [n for n in params if n not in got.param_scalars]
    if missing:
        raise CheckpointError(f"{at}: no optimizer state for parameter(s) {missing[:5]}")
    return StagedGroup(flats=dict(got.flats),
                       param_scalars={n: got.param_scalars[n] for n in params},
                       stepped=frozenset(got.stepped) & frozenset(params),
                       hyperparameters=got.hyperparameters)


def apply(opt: ShardedOptimizer, staged: StagedState) -> None:
    """Write a staged state into the optimizer and model; cannot fail half-way on input.
    Saved hyperparameters win, keys only the running groups hold (a scheduler's
    `initial_lr`) are kept; saved optimizer state replaces the running state whole."""
    with torch.no_grad():
        if staged.extras:
            current = extra_tensors(opt)
            for name, value in staged.extras.items():
                current[name].copy_(value)
    shards = {name: {"flats": dict(g.flats), "param_scalars": dict(g.param_scalars),
                     "hyperparameters": dict(g.hyperparameters), "stepped": sorted(g.stepped)}
              for name, g in staged.groups.items()}
    opt.load_shard_state(shards, staged.step_count, staged.loss_scaler)


# --------------------------------------------------------------------------- the optimizer


Copier = Callable[[tuple[str, ...], torch.Tensor], torch.Tensor]
"""Copies a live tensor off the optimizer under a key (a background save's buffers)."""


class OptimizerSource:
    """The running optimizer's own state, for a save.

    Without `copier`, the shards are the live tensors (write them before the next step).
    With it, every tensor is copied off through `copier(key, tensor)` and the scalar
    state and options are deep copies, so the result stays the state of this instant
    while training goes on. `extras`: include the buffers and frozen parameters (rank 0
    stores them).
    """

    where = "the optimizer"

    def __init__(self, opt: ShardedOptimizer, extras: bool, copier: Copier | None = None) -> None:
        self._opt = opt
        self._extras = extras
        self._copy = copier

    def group(self, target: ShardTarget) -> StagedGroup:
        flats, scalars, hyper = group_state(self._opt, target.group)
        stepped = stepped_params(self._opt, target.group)
        if self._copy is not None:
            flats = {k: self._copy(("shard", target.group, k), v) for k, v in flats.items()}
            scalars, hyper = _detached(scalars), _detached(hyper)
        return StagedGroup(flats=flats, param_scalars=scalars, stepped=frozenset(stepped),
                           hyperparameters=hyper)

    def model_extras(self) -> Mapping[str, torch.Tensor]:
        if not self._extras:
            return {}
        live = extra_tensors(self._opt)
        if self._copy is None:
            return live
        return {n: self._copy(("extra", n), t) for n, t in live.items()}

    def loss_scaler(self) -> Mapping[str, Any] | None:
        state = self._opt.loss_scaler_state()
        return None if state is None else _detached(state)

    def step_count(self) -> int | None:
        return int(self._opt.step_count)


def _detached(value: Any) -> Any:
    """A deep copy whose tensors are detached copies (scalar state, options)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, Mapping):
        return {k: _detached(v) for k, v in value.items()}
    if isinstance(value, tuple):
        return tuple(_detached(v) for v in value)
    if isinstance(value, list):
        return [_detached(v) for v in value]
    return copy.deepcopy(value)


__all__ = ["OptimizerSource", "ShardSource", "StagedGroup", "StagedState", "apply", "stage"]

