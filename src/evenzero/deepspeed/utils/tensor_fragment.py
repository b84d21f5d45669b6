"""`deepspeed.utils.safe_get_full_fp32_param` and its family: read and write one parameter's
fp32 master, gradient or optimizer state whole, although ZeRO-1/2 keeps each sharded over
the ranks.

As in DeepSpeed (deepspeed/utils/tensor_fragment.py@0.19.8), the `full` forms are
collectives (every rank calls them for the same parameter, in the same order) and return
`None` for a parameter no engine optimizes; a gradient still in `param.grad` (before it is
reduced, or inside `no_sync` / `coalesce_grad_reduction`) is returned or written there. The
`local` forms are ZeRO-3's (a rank's partition of a parameter); DeepSpeed asserts on them
for other parameters, and so do they here.

Which engine owns a parameter is recorded when its engine optimizer is built (`register`).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from evenzero.runtime.shardedgrad import ShardedGrad
from evenzero.runtime.shards import param_values


@dataclass(frozen=True)
class Owner:
    zero: Any
    """The `evenzero.ZeroOptimizer` holding the parameter's shards."""
    group: str
    name: str


# Keyed by id(): tensors compare elementwise, so they cannot be dictionary keys themselves;
# the entry goes when the parameter does, and a reused id is caught by the identity check.
_OWNERS: dict[int, Owner] = {}


def register(zero: Any) -> None:
    """Record `zero` as the owner of each of its parameters."""
    plan = zero.plan
    for group in zero.groups:
        for layout in plan.group_layouts(group):
            for spec in layout.params:
                param = zero.params[spec.name]
                if id(param) not in _OWNERS:
                    weakref.finalize(param, _OWNERS.pop, id(param), None)
                _OWNERS[id(param)] = Owner(zero, group, spec.name)


def _owner(param: torch.nn.Parameter) -> Owner | None:
    owner = _OWNERS.get(id(param))
    if owner is None or owner.zero.params.get(owner.name) is not param:
        return None
    return owner


def _local_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """`param.grad` when it holds a real gradient (not the sharded placeholder)."""
    grad = param.grad
    return None if grad is None or isinstance(grad, ShardedGrad) else grad


def _shard(owner: Owner, what: str, key: str | None) -> torch.Tensor:
    group = owner.zero.groups[owner.group]
    if what == "param":
        return owner.zero.master_shard(owner.group)
    if what == "grad":
        return group.grad
    flats = group.state_flats()
    if key not in flats:
        raise KeyError(f"optimizer state {key!r}: this parameter's optimizer keeps "
                       f"{sorted(flats)}")
    return flats[key]


def _full(param: torch.nn.Parameter, what: str, key: str | None = None) -> torch.Tensor | None:
    owner = _owner(param)
    if owner is None:
        return None
    shard = _shard(owner, what, key)
    group = owner.zero.groups[owner.group]
    value = param_values(owner.zero.plan, shard, group)[owner.name]
    return value.reshape(param.shape).clone()


def _write(param: torch.nn.Parameter, what: str, value: torch.Tensor,
           key: str | None = None) -> None:
    """Write `value` (the whole parameter's) into this rank's slice of the shard."""
    owner = _owner(param)
    if owner is None:
        return
    zero = owner.zero
    group = zero.groups[owner.group]
    flat = value.detach().reshape(-1)
    if what == "grad":
        target = group.grad
    elif what == "param":
        target = zero.master_shard(owner.group)
    else:
        flats = dict(group.state_flats())
        target = flats[key].clone()
    for r in zero.plan.shard_ranges(owner.group, group.rank):
        if r.param == owner.name:
            target[r.shard_offset:r.shard_offset + r.numel].copy_(
                flat[r.start:r.start + r.numel])
    if what == "param":
        group.load(target, group.state_flats())
        zero.sync_params_from_master()
    elif what == "state":
        flats[key] = target
        group.load(zero.master_shard(owner.group), flats)


def safe_get_full_fp32_param(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The parameter's fp32 master, whole (a collective)."""
    return _full(param, "param")


def safe_set_full_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """Set the parameter's fp32 master (and the parameter) to `value` (a collective)."""
    _write(param, "param", value)


def safe_get_full_optimizer_state(param: torch.nn.Parameter,
                                  optim_state_key: str) -> torch.Tensor | None:
    """The optimizer state `optim_state_key` (e.g. `exp_avg`) of the parameter, whole."""
    return _full(param, "state", optim_state_key)


def safe_set_full_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor,
                                  optim_state_key: str) -> None:
    _write(param, "state", value, optim_state_key)


def safe_get_full_grad(param: torch.nn.Parameter) -> torch.Tensor | None:
    """The parameter's gradient: `param.grad` while it is still local, else the reduced
    gradient gathered from the shards, in the gradient-accumulation dtype."""
    local = _local_grad(param)
    if local is not None:
        return local
    return _full(param, "grad")


def safe_set_full_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    local = _local_grad(param)
    if local is not None:
        local.copy_(value)
        return
    _write(param, "grad", value)


def safe_update_full_grad_vectorized(param_list: Iterable[torch.nn.Parameter],
                                     update_func: Callable[[torch.Tensor, Any], torch.Tensor]
                                     ) -> None:
    """`safe_set_full_grad(p, update_func(safe_get_full_grad(p), p))` for each parameter."""
    for p in param_list:
        local = _local_grad(p)
        if local is not None:
            local.copy_(update_func(local, p))
        elif p.requires_grad and _owner(p) is not None:
            _write(p, "grad", update_func(_full(p, "grad"), p))


def _zero3_only(name: str) -> AssertionError:
    # DeepSpeed asserts the same for parameters that ZeRO-3 did not partition.
    return AssertionError(f"{name}: this API is only defined for ZeRO-3 partitioned parameters "
                          f"(evenzero runs ZeRO stage 1 or 2; use the safe_get_full_* forms)")


def safe_get_local_fp32_param(param: torch.nn.Parameter) -> torch.Tensor:
    raise _zero3_only("safe_get_local_fp32_param")


def safe_get_local_grad(param: torch.nn.Parameter) -> torch.Tensor:
    raise _zero3_only("safe_get_local_grad")


def safe_get_local_optimizer_state(param: torch.nn.Parameter,
                                   optim_state_key: str) -> torch.Tensor:
    raise _zero3_only("safe_get_local_optimizer_state")


def safe_set_local_fp32_param(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    raise _zero3_only("safe_set_local_fp32_param")


def safe_set_local_grad(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    raise _zero3_only("safe_set_local_grad")


def safe_set_local_optimizer_state(param: torch.nn.Parameter, value: torch.Tensor,
                                   optim_state_key: str) -> None:
    raise _zero3_only("safe_set_local_optimizer_state")


__all__ = ["register", "safe_get_full_fp32_param", "safe_get_full_grad",
           "safe_get_full_optimizer_state", "safe_get_local_fp32_param", "safe_get_local_grad",
           "safe_get_local_optimizer_state", "safe_set_full_fp32_param", "safe_set_full_grad",
           "safe_set_full_optimizer_state", "safe_set_local_fp32_param", "safe_set_local_grad",
           "safe_set_local_optimizer_state", "safe_update_full_grad_vectorized"]
