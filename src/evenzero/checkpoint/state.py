"""What a checkpoint reads from a running optimizer: this rank's place, its shards, its model.

The checkpoint package reaches the optimizer only through
`evenzero.checkpoint.protocol.ShardedOptimizer` (which `ZeroOptimizer` implements), and
these are the readers its parts share: where this rank sits among the ranks
(`RankPlace`) and in each plan group (`ShardTarget`), per plan group this rank's flat
shards (fp32 masters and elementwise state), each parameter's scalar state and the
group's hyperparameters, and the model through `module` (its trained parameters by
name, and the buffers and frozen parameters a checkpoint stores whole).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from evenzero.checkpoint.compat import LocalModel, LocalParam
from evenzero.checkpoint.format import MASTER, CheckpointError, StoredTensor, storage_name
from evenzero.checkpoint.protocol import ShardedOptimizer
from evenzero.plan import ShardRange
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
    """The process group the ranks agree over: the optimizer's data-parallel world (a
    background save's own group, `evenzero.checkpoint.background`); None without
    torch.distributed."""
    ep_ranks: Mapping[str, int]
    """Plan group -> which copy of the group's parameters this rank holds: the index of
    its (expert-)data-parallel process group among all of them, ordered by lowest rank.
    Under DeepSpeed's layout ({r % E + kE}) that is r % E, the expert-parallel rank;
    it stays the same when the data-parallel size changes."""

    @staticmethod
    def of(opt: ShardedOptimizer) -> RankPlace:
        """This rank's place; a collective over the optimizer's world."""
        if not (dist.is_available() and dist.is_initialized()):
            return RankPlace._check(opt, RankPlace(0, 1, torch.device("cpu"), None,
                                                   {g.name: 0 for g in opt.plan.groups}))
        world = opt.world_group
        # The optimizer's own, so checkpoints agree on the device the optimizer uses.
        device = opt.control_device
        rank, size = dist.get_rank(world), dist.get_world_size(world)
        RankPlace._check(opt, RankPlace(rank, size, device, world, {}))
        return RankPlace(rank, size, device, world, _ep_ranks(opt, world, size, device))

    @staticmethod
    def _check(opt: ShardedOptimizer, place: RankPlace) -> RankPlace:
        if place.world_size != opt.plan.world_size:
            raise CheckpointError(f"the optimizer was planned for {opt.plan.world_size} ranks but "
                                  f"its process group has {place.world_size}")
        return place


def _ep_ranks(opt: ShardedOptimizer, world: Any, size: int,
              device: torch.device) -> dict[str, int]:
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
class ShardTarget:
    """This rank's shard of one plan group: the runs a stage fills or a save writes."""

    group: str
    ranges: tuple[ShardRange, ...]
    """The runs of parameters in this rank's flat shard (`plan.shard_ranges`)."""
    shard_numel: int
    """Elements of the flat shard, padding included."""
    local_rank: int
    """Rank inside the group's (expert-)data-parallel process group."""
    ep_rank: int
    """Which copy of the group's parameters this rank holds (0 for dense groups)."""
    expert_parallel_size: int

    @property
    def params(self) -> tuple[str, ...]:
        """Parameters with elements in this shard, in shard order."""
        return tuple(dict.fromkeys(r.param for r in self.ranges))

    def storage(self, param: str) -> str:
        """The name `param`'s runs are stored under (`format.storage_name`)."""
        return storage_name(param, self.expert_parallel_size, self.ep_rank)


def shard_target(opt: ShardedOptimizer, place: RankPlace, group: str) -> ShardTarget:
    local = int(opt.group_rank(group))
    return ShardTarget(group=group, ranges=tuple(opt.plan.shard_ranges(group, local)),
                       shard_numel=opt.plan.shard_numel(group), local_rank=local,
                       ep_rank=place.ep_ranks[group],
                       expert_parallel_size=opt.plan.group(group).expert_parallel_size)


def optimizer_class(opt: ShardedOptimizer) -> str:
    """The qualified name of the torch optimizer class that steps the shards."""
    cls = opt.inner_optimizer_class
    return f"{cls.__module__}.{cls.__qualname__}"


def group_state(opt: ShardedOptimizer, group: str) -> tuple[dict[str, torch.Tensor],
                                                           dict[str, Any], dict[str, Any]]:
    """(shard-shaped tensors incl. the master, per-parameter scalar state,
    hyperparameters) of a plan group on this rank; the tensors are the live ones."""
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


def trainable_names(opt: ShardedOptimizer) -> dict[str, torch.nn.Parameter]:
    """Plan parameters by name, as the module holds them."""
    named = dict(opt.module.named_parameters())
    return {s.name: named[s.name] for b in opt.plan.layouts for s in b.params}


def group_params(opt: ShardedOptimizer, group: str) -> list[str]:
    """Every parameter of plan group `group` (on all ranks), in layout order."""
    return [s.name for b in opt.plan.group_layouts(group) for s in b.params]


def extra_tensors(opt: ShardedOptimizer) -> dict[str, torch.Tensor]:
    """Model state that evenzero does not train: buffers, frozen and empty parameters.

    Aliases of trained parameters (tied weights) are left out; they are restored with
    the parameter they alias.
    """
    trained = {id(p) for p in trainable_names(opt).values()}
    aliases = {n for n, p in opt.module.named_parameters(remove_duplicate=False) if id(p) in trained}
    return {n: t for n, t in opt.module.state_dict(keep_vars=True).items()
            if isinstance(t, torch.Tensor) and n not in aliases}


def local_params(opt: ShardedOptimizer) -> dict[str, LocalParam]:
    """Every trained parameter as this rank's model holds it (name, group, shape, dtype)."""
    named = trainable_names(opt)
    return {s.name: LocalParam(s.name, b.group, tuple(named[s.name].shape),
                               dtype_name(named[s.name].dtype))
            for b in opt.plan.layouts for s in b.params}


def local_model(opt: ShardedOptimizer, place: RankPlace) -> LocalModel:
    ep_size, hyper = {}, {}
    for g in opt.plan.groups:
        ep_size[g.name] = g.expert_parallel_size
        hyper[g.name] = dict(opt.shard_state(g.name)["hyperparameters"])
    extras = tuple(StoredTensor(n, tuple(t.shape), dtype_name(t.dtype))
                   for n, t in extra_tensors(opt).items())
    return LocalModel(tuple(local_params(opt).values()), ep_size, place.ep_ranks,
                      optimizer_class(opt), frozenset(opt.defaults), hyper, extras)
