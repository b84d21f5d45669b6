"""The process groups of DeepSpeed-style MoE layers, kept by name as DeepSpeed keeps them in
`deepspeed.utils.groups` (deepspeed/utils/groups.py@0.19.8:370-471, 685-722).

A layer with expert-parallel size E uses the groups named "ep_size_E": its expert-parallel
group (the all_to_all) and its expert-data-parallel group (where its experts' gradients
are reduced, and from whose first rank they are broadcast). They are created once per name
and shared by every layer of that size, with DeepSpeed's rank sets for both of its layouts
(`evenzero.moe.expert_parallel_groups`); creating them is a collective, so every rank
creates them at the same point: when the engine calls each layer's
`set_deepspeed_parallelism`, as DeepSpeed's engine does, or at a layer's first forward.
Groups made for an earlier default process group (destroyed since) are made again. Asking
for a name's groups in the other layout is refused: DeepSpeed would silently reuse the
first (it checks only the name, groups.py@0.19.8:432, 449).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from evenzero.deepspeed.log import info_rank0
from evenzero.moe import ExpertGroups, expert_parallel_groups


@dataclass(frozen=True)
class _Created:
    world: Any
    """The default process group they were created in."""
    data_before_expert: bool
    groups: ExpertGroups


_CREATED: dict[str, _Created] = {}


def group_name(ep_size: int) -> str:
    return f"ep_size_{ep_size}"


def create_expert_groups(ep_size: int, use_data_before_expert_parallel: bool = False
                         ) -> ExpertGroups:
    """This rank's groups named `ep_size_{ep_size}`, created on first use (a collective)."""
    name = group_name(ep_size)
    made = _current(name)
    if made is not None:
        if made.data_before_expert != use_data_before_expert_parallel:
            layout = {False: "E + D", True: "D + E"}
            raise ValueError(
                f"the MoE process groups {name!r} exist already in this process in the "
                f"{layout[made.data_before_expert]} layout (use_data_before_expert_parallel_="
                f"{made.data_before_expert}), made by an earlier deepspeed.initialize or by a "
                f"forward before initialize (which uses E + D), but this model asks for "
                f"{layout[use_data_before_expert_parallel]}. DeepSpeed keeps one set of groups "
                f"per name and would reuse the first layout whatever the config says; use one "
                f"layout per process")
        return made.groups
    info_rank0("creating MoE process groups %s (expert-parallel size %d, %s layout)", name,
               ep_size, "D + E" if use_data_before_expert_parallel else "E + D")
    groups = expert_parallel_groups(ep_size, data_before_expert=use_data_before_expert_parallel)
    _CREATED[name] = _Created(dist.group.WORLD, use_data_before_expert_parallel, groups)
    return groups


def expert_groups_named(name: str) -> ExpertGroups | None:
    """This rank's groups called `name`, or None when they have not been created."""
    made = _current(name)
    return None if made is None else made.groups


def expert_data_parallel_groups() -> dict[str, Any]:
    """`{name: expert-data-parallel group}` of every group created in this process group."""
    return {name: made.groups.edp_group for name in list(_CREATED)
            if (made := _current(name)) is not None}


def _current(name: str) -> _Created | None:
    made = _CREATED.get(name)
    if made is None or not dist.is_initialized() or made.world is not dist.group.WORLD:
        return None
    return made
