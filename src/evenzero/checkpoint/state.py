"""What a checkpoint takes from, and puts back into, a running optimizer.

This is the only checkpoint module that talks to the optimizer, and only through
`evenzero.checkpoint.protocol.ShardedOptimizer` (which `ZeroOptimizer` implements): per
plan group, this rank's flat shards (fp32 masters and elementwise state), each
parameter's scalar state and the group's hyperparameters; the model through `module`.
Everything a load will write is first staged in a `StagedState`, so a load either
changes the whole state or nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from evenzero.checkpoint.compat import LocalModel, LocalParam
from evenzero.checkpoint.format import MASTER, CheckpointError, StoredTensor, storage_name
from evenzero.checkpoint.protocol import ShardedOptimizer
from evenzero.spec import dtype_name


@dataclass(frozen=True)
class RankPlace:
    """This process's place among the ranks that write and agree on one checkpoint."""

    rank: int
    """Rank in the optimizer's data-parallel world."""
    world_size: int
    device: torch.device
    """Where small agreement tensors live (the optimizer's `control_device`)."""
    group: Any
    """The optimizer's data-parallel world process group (None without torch.distributed)."""
    ep_ranks: Mapping[str, int]
    """Plan group -> which copy of the group's parameters this rank holds: the index of
    its (expert-)data-parallel process group among all of them, ordered by lowest rank.
    Under DeepSpeed's layout ({r % E + kE}) that is r % E, the expert-parallel rank;
    it stays the same when the data-parallel size changes."""

    @staticmethod
    def of(opt: Any) -> RankPlace:
        if not (dist.is_available() and dist.is_initialized()):
            return RankPlace._check(opt, RankPlace(0, 1, torch.device("cpu"), None,
                                                   {g.name: 0 for g in opt.plan.groups}))
        world = _world_group(opt)
        # The optimizer's own, so checkpoints agree on the device the optimizer uses.
        device = opt.control_device
        rank, size = dist.get_rank(world), dist.get_world_size(world)
        RankPlace._check(opt, RankPlace(rank, size, device, world, {}))
        return RankPlace(rank, size, device, world, _ep_ranks(opt, world, size, device))

    @staticmethod
    def _check(opt: Any, place: RankPlace) -> RankPlace:
        if place.world_size != opt.plan.world_size:
            raise CheckpointError(f"the optimizer was planned for {opt.plan.world_size} ranks but "
                                  f"its process group has {place.world_size}")
        return place


def _world_group(opt: Any) -> Any:
    """The optimizer's data-parallel world (None: the default group)."""
    return getattr(opt, "world_group", None)


def _ep_ranks(opt: Any, world: Any, size: int, device: torch.device) -> dict[str, int]:
    """One all-gather of each group's lowest member; a collective over the world."""
    groups = opt.plan.groups
    lowest = []
    for g in groups:
        if g.expert_parallel_size == 1:
            lowest.append(0)
            continue
        members = dist.get_process_group_ranks(opt.process_group(g.name))
        # Process groups list global ranks; the world group may be a subgroup.
        world_ranks = dist.get_process_group_ranks(world) if world is not None else range(size)
        lowest.append(min(list(world_ranks).index(m) for m in members))
    mine = torch.tensor(lowest, dtype=torch.int64, device=device)
    every = [torch.empty_like(mine) for _ in range(size)]
    dist.all_gather(every, mine, group=world)
    table = torch.stack(every).cpu()
    out = {}
    for i, g in enumerate(groups):
        distinct = sorted(set(table[:, i].tolist()))
        if len(distinct) != g.expert_parallel_size:
            raise CheckpointError(f"group {g.name!r}: {len(distinct)} distinct process groups "
                                  f"over the ranks, expected {g.expert_parallel_size}")
        out[g.name] = distinct.index(lowest[i])
    return out


@dataclass(frozen=True)
class GroupPlace:
    """This rank's coordinates in one plan group."""

    local_rank: int
    """Rank inside the group's (expert-)data-parallel process group."""
    ep_rank: int
    """Which copy of the group's parameters this rank holds (0 for dense groups)."""
    expert_parallel_size: int

    def storage(self) -> Callable[[str], str]:
        return lambda name: storage_name(name, self.expert_parallel_size, self.ep_rank)


def group_place(opt: Any, place: RankPlace, group: str) -> GroupPlace:
    e = opt.plan.group(group).expert_parallel_size
    return GroupPlace(int(opt.group_rank(group)), place.ep_ranks[group], e)


def optimizer_class(opt: ShardedOptimizer) -> str:
    """The qualified name of the torch optimizer class that steps the shards."""
    cls = opt.inner_optimizer_class
    return f"{cls.__module__}.{cls.__qualname__}"


def group_state(opt: ShardedOptimizer, group: str) -> tuple[dict[str, torch.Tensor],
                                                           dict[str, Any], dict[str, Any]]:
    """(shard-shaped tensors incl. the master, per-parameter scalar state,
    hyperparameters) of a plan group on this rank."""
    shard = opt.shard_state(group)
    flats = dict(shard["flats"])
    for key, value in flats.items():
        if value.dtype != torch.float32:
            what = "master weights" if key == MASTER else f"optimizer state {key!r}"
            raise CheckpointError(f"{what} of group {group!r} are {value.dtype}; evenzero "
                                  f"checkpoints store fp32 (use master_dtype=torch.float32)")
    return flats, dict(shard["param_scalars"]), dict(shard["hyperparameters"])


def stepped_params(opt: ShardedOptimizer, group: str) -> set[str]:
    """Parameters of this rank's shard of `group` stepped at least once."""
    shard = opt.shard_state(group)
    if "stepped" in shard:
        return set(shard["stepped"])
    return {n for n, s in shard["param_scalars"].items() if s}


def trainable_names(opt: Any) -> dict[str, torch.nn.Parameter]:
    """Plan parameters by name, as the module holds them."""
    named = dict(opt.module.named_parameters())
    return {s.name: named[s.name] for b in opt.plan.layouts for s in b.params}


def extra_tensors(opt: Any) -> dict[str, torch.Tensor]:
    """Model state that evenzero does not train: buffers, frozen and empty parameters.

    Aliases of trained parameters (tied weights) are left out; they are restored with
    the parameter they alias.
    """
    trained = {id(p) for p in trainable_names(opt).values()}
    aliases = {n for n, p in opt.module.named_parameters(remove_duplicate=False) if id(p) in trained}
    return {n: t for n, t in opt.module.state_dict(keep_vars=True).items()
            if isinstance(t, torch.Tensor) and n not in aliases}


def local_model(opt: Any, place: RankPlace) -> LocalModel:
    named = trainable_names(opt)
    params = []
    ep_size, hyper = {}, {}
    for g in opt.plan.groups:
        ep_size[g.name] = g.expert_parallel_size
        hyper[g.name] = dict(opt.shard_state(g.name)["hyperparameters"])
    for b in opt.plan.layouts:
        for s in b.params:
            p = named[s.name]
            params.append(LocalParam(s.name, b.group, tuple(p.shape), dtype_name(p.dtype)))
    extras = tuple(StoredTensor(n, tuple(t.shape), dtype_name(t.dtype))
                   for n, t in extra_tensors(opt).items())
    return LocalModel(tuple(params), ep_size, place.ep_ranks, optimizer_class(opt),
                      frozenset(opt.defaults), hyper, extras)


@dataclass
class StagedState:
    """Everything a load writes, read and checked in full before anything is written."""

    masters: dict[str, torch.Tensor]
    """Plan group -> new flat fp32 master shard (zeros in padding)."""
    states: dict[str, dict[str, torch.Tensor]]
    """Plan group -> shard-shaped optimizer state by key."""
    param_scalars: dict[str, dict[str, dict[str, Any]]]
    """Plan group -> parameter (with runs on this rank) -> its scalar optimizer state
    (its own `step`, ...; {} if never stepped), decoded."""
    hyperparameters: dict[str, dict[str, Any]]
    """Plan group -> torch param-group options (lr, betas, ...), decoded."""
    extras: Mapping[str, torch.Tensor]
    """Buffers and frozen parameters by state-dict name."""
    loss_scaler: Any
    """Loss-scaler state dict, or None to leave the scaler as it is."""
    step_count: int | None
    """New optimizer step counter, or None to leave it."""
    stepped: dict[str, set[str]] = field(default_factory=dict)
    """Plan group -> parameters stepped at least once (default: those with scalar
    state)."""


def apply(opt: ShardedOptimizer, staged: StagedState) -> None:
    """Write a staged state into the optimizer and model; cannot fail half-way on input.
    Saved hyperparameters win, keys only the running groups hold (a scheduler's
    `initial_lr`) are kept; saved optimizer state replaces the running state whole."""
    with torch.no_grad():
        if staged.extras:
            current = extra_tensors(opt)
            for name, value in staged.extras.items():
                current[name].copy_(value)
    shards = {g.name: {"flats": {MASTER: staged.masters[g.name], **staged.states[g.name]},
                       "param_scalars": staged.param_scalars[g.name],
                       "hyperparameters": staged.hyperparameters[g.name],
                       "stepped": sorted(staged.stepped.get(g.name, {
                           n for n, s in staged.param_scalars[g.name].items() if s}))}
              for g in opt.plan.groups}
    opt.load_shard_state(shards, staged.step_count, staged.loss_scaler)
