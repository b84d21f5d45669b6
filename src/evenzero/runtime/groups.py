"""From a module and the user's parameter groups to named groups and a `ModelSpec`.

Three ways to say which process group a parameter is reduced over:

* nothing: every trainable parameter is in group "dense", reduced over the world;
* `param_groups=[{"params": [...], "process_group": pg, "name": ..., **optimizer_kwargs}]`;
  a group's `"optimizer"` key (a `torch.optim.Optimizer` class) steps it with that class
  instead of `ZeroOptimizer`'s (Muon for the matrices, AdamW for the rest: docs/muon.md);
* DeepSpeed's MoE marker `param.allreduce = False` with `param.group_name`, plus
  `expert_groups={group_name: edp_process_group}`.

The planner knows groups only by size: a group whose process group has S ranks is
described as expert-parallel with E = world / S.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch
import torch.distributed as dist

from evenzero.spec import (
    DENSE,
    GroupSpec,
    ModelSpec,
    ParamSpec,
    dtype_name,
    expert_group_name,
    is_expert,
)

OPTIMIZER_KEY = "optimizer"
"""The param-group key that names the group's own inner optimizer class."""


class GroupingError(ValueError):
    """A parameter-group problem found on this rank; it is agreed across ranks before raising."""


@dataclass(frozen=True)
class TrainGroup:
    """One parameter group as the runtime trains it."""

    name: str
    """Group name in the plan."""
    names: tuple[str, ...]
    """Parameter names in registration order."""
    params: tuple[torch.nn.Parameter, ...]
    """The parameters, same order as `names`."""
    process_group: Any
    """Process group the gradients are reduced over (the data-parallel world for dense)."""
    options: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    """Optimizer keyword arguments that override the defaults for this group."""
    optimizer: type | None = None
    """The group's own inner optimizer class (its `"optimizer"` key); None: the one
    `ZeroOptimizer` was given."""


def trainable(module: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Trainable, non-empty parameters in registration order; tied ones once (first name)."""
    return [(n, p) for n, p in module.named_parameters() if p.requires_grad and p.numel() > 0]


def build_groups(module: torch.nn.Module, world_group, param_groups: Iterable[Mapping] | None,
                 expert_groups: Mapping[str, Any] | None) -> tuple[TrainGroup, ...]:
    """Group the module's trainable parameters; raises `GroupingError` naming the fix."""
    named = trainable(module)
    if not named:
        raise GroupingError("the module has no trainable parameters (all frozen or empty)")
    name_of = {id(p): n for n, p in named}
    if param_groups is None:
        return _groups_by_marker(named, world_group, expert_groups or {})
    if expert_groups:
        raise GroupingError("pass either param_groups (with a process_group per group) or "
                            "expert_groups, not both")
    groups: list[TrainGroup] = []
    placed: dict[int, str] = {}
    for i, raw in enumerate(param_groups):
        if not isinstance(raw, Mapping) or "params" not in raw:
            raise GroupingError(f"param_groups[{i}] must be a dict with a 'params' list")
        opts = {k: v for k, v in raw.items()
                if k not in ("params", "process_group", "name", OPTIMIZER_KEY)}
        gname = str(raw.get("name") or (DENSE if i == 0 else f"group{i}"))
        pg = world_group if raw.get("process_group") is None else raw["process_group"]
        members = []
        for p in raw["params"]:
            if not isinstance(p, torch.Tensor):
                raise GroupingError(f"param_groups[{i}] ({gname}) holds a {type(p).__name__}, "
                                    f"not a parameter")
            if id(p) not in name_of:
                if isinstance(p, torch.nn.Parameter) and not p.requires_grad:
                    continue
                # An empty parameter is legal in a torch optimizer and has nothing to shard.
                if p.numel() == 0 and any(p is q for q in module.parameters()):
                    continue
                raise GroupingError(f"param_groups[{i}] ({gname}) holds a tensor of shape "
                                    f"{list(p.shape)} that is not a trainable parameter of the module")
            if id(p) in placed:
                raise GroupingError(f"parameter {name_of[id(p)]!r} is in groups {placed[id(p)]!r} "
                                    f"and {gname!r}; put it in one group only")
            if is_expert(p) and raw.get("process_group") is None:
                raise GroupingError(f"parameter {name_of[id(p)]!r} is marked as an expert "
                                    f"(allreduce=False) but its group {gname!r} has no "
                                    f"process_group; give the group its expert-data-parallel group")
            placed[id(p)] = gname
            members.append(p)
        if any(g.name == gname for g in groups):
            raise GroupingError(f"two parameter groups are named {gname!r}; name them apart")
        own = raw.get(OPTIMIZER_KEY)
        if own is not None and not (isinstance(own, type) and issubclass(own, torch.optim.Optimizer)):
            raise GroupingError(f"param_groups[{i}] ({gname}): \"{OPTIMIZER_KEY}\" must be a "
                                f"torch.optim.Optimizer class such as torch.optim.AdamW, got "
                                f"{own!r}")
        if members:
            groups.append(_group(gname, members, name_of, pg, opts, own))
    missing = [n for n, p in named if id(p) not in placed]
    if missing:
        raise GroupingError(f"trainable parameter {missing[0]!r} (and {len(missing) - 1} more) "
                            f"is in no parameter group; add it to one or set requires_grad=False")
    return tuple(groups)


def _groups_by_marker(named, world_group, expert_groups: Mapping[str, Any]) -> tuple[TrainGroup, ...]:
    buckets: dict[str, list[torch.nn.Parameter]] = {}
    name_of = {id(p): n for n, p in named}
    for n, p in named:
        gname = expert_group_name(p)
        if gname is not None:
            if gname not in expert_groups:
                raise GroupingError(f"parameter {n!r} is an expert (allreduce=False, group_name="
                                    f"{gname!r}) but expert_groups has no process group for "
                                    f"{gname!r}; pass expert_groups={{{gname!r}: edp_group}}")
        else:
            gname = DENSE
        buckets.setdefault(gname, []).append(p)
    order = ([DENSE] if DENSE in buckets else []) + [g for g in buckets if g != DENSE]
    return tuple(_group(g, buckets[g], name_of,
                        world_group if g == DENSE else expert_groups[g], {}) for g in order)


def _group(name: str, params: list, name_of: dict, pg, opts: dict,
           optimizer: type | None = None) -> TrainGroup:
    return TrainGroup(name, tuple(name_of[id(p)] for p in params), tuple(params), pg,
                      MappingProxyType(dict(opts)), optimizer)


def check_process_group(group: TrainGroup, world_group) -> int:
    """This rank's rank in the group's process group, after validating it; returns it."""
    pg = group.process_group
    rank = dist.get_rank(pg) if pg is not dist.GroupMember.NON_GROUP_MEMBER else -1
    if rank < 0:
        raise GroupingError(f"the process group of parameter group {group.name!r} does not "
                            f"contain this rank (global rank {dist.get_rank()}); pass each rank the "
                            f"process group it belongs to")
    world = dist.get_world_size(world_group)
    size = dist.get_world_size(pg)
    if world % size:
        raise GroupingError(f"parameter group {group.name!r}: its process group has {size} ranks, "
                            f"which does not divide the data-parallel world of {world}")
    return rank


def model_spec(module_name: str, named: list[tuple[str, torch.nn.Parameter]],
               groups: tuple[TrainGroup, ...], world_size: int,
               group_sizes: Mapping[str, int]) -> ModelSpec:
    """The planner's view: params in registration order, each group sized by E = world / S."""
    group_of = {n: g.name for g in groups for n in g.names}
    params = tuple(ParamSpec(n, tuple(p.shape), group_of[n], dtype_name(p.dtype)) for n, p in named)
    specs = tuple(GroupSpec(g.name, world_size // group_sizes[g.name]) for g in groups)
    return ModelSpec(params, specs, None, "reverse-registration", module_name)
