"""What the engine does for the MoE layers of a model at `initialize`, as DeepSpeed's engine
does it (deepspeed/runtime/engine.py@0.19.8:2096-2180, 2038-2062): it calls every module's
`set_deepspeed_parallelism`, which creates the expert-parallel and expert-data-parallel
groups, collects `{group_name: expert-data-parallel group}` for `ZeroOptimizer`
(`expert_groups`), and broadcasts every parameter from its source rank.

Three kinds of layers are recognised:
- `evenzero.deepspeed.moe.layer.MoE`, DeepSpeed's layer implemented here (what
  `deepspeed.moe.layer.MoE` is after `import evenzero.deepspeed as deepspeed`); its groups
  are kept in `evenzero.deepspeed.moe.groups`.
- DeepSpeed's own `deepspeed.moe.layer.MoE`, when the model imported real DeepSpeed: its
  communication layer adopts the running process group, its layers create their groups in
  `deepspeed.utils.groups`, and they are read back from there. Nothing here imports
  DeepSpeed unless the model already did.
- evenzero's `evenzero.moe.MoE`, which carries its groups with it.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch
import torch.distributed as dist

from evenzero.deepspeed.config import DeepSpeedConfigError
from evenzero.deepspeed.moe.groups import expert_groups_named
from evenzero.deepspeed.moe.layer import MoE
from evenzero.deepspeed.optimizers import is_expert


def _real_deepspeed_moe_class() -> type | None:
    """Real DeepSpeed's MoE class if the process imported it (and it is not this one, which
    `deepspeed.moe.layer` is when `deepspeed` resolves to evenzero.deepspeed)."""
    module = sys.modules.get("deepspeed.moe.layer")
    cls = getattr(module, "MoE", None)
    return None if cls is None or cls is MoE else cls


def real_deepspeed_moe_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    cls = _real_deepspeed_moe_class()
    return [] if cls is None else [m for m in module.modules() if isinstance(m, cls)]


def deepspeed_moe_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """DeepSpeed-style MoE layers in `module` (this package's, and real DeepSpeed's if the
    model was built with it), in module order: what DeepSpeed's engine counts as
    `moe_layers` and reads `num_experts` from."""
    cls = _real_deepspeed_moe_class()
    kinds = (MoE,) if cls is None else (MoE, cls)
    return [m for m in module.modules() if isinstance(m, kinds)]


def evenzero_moe_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    from evenzero.moe import MoE as EvenzeroMoE

    return [m for m in module.modules() if isinstance(m, EvenzeroMoE) and m.groups is not None]


def expert_groups(module: torch.nn.Module, backend: str,
                  use_data_before_expert_parallel: bool) -> dict[str, Any]:
    """`{group_name: expert-data-parallel process group}` for every MoE layer."""
    out: dict[str, Any] = {}
    _check_layout(module, use_data_before_expert_parallel)
    real = real_deepspeed_moe_layers(module)
    if real:
        ds_comm = sys.modules["deepspeed"].comm
        # Adopts the running torch process group (deepspeed/comm/comm.py@0.19.8:878-881).
        ds_comm.init_distributed(dist_backend=backend, verbose=False)
    # Every module that has it, in module order on every rank, as DeepSpeed's engine does
    # (its group creation is a collective).
    for m in module.modules():
        if hasattr(m, "set_deepspeed_parallelism"):
            m.set_deepspeed_parallelism(use_data_before_expert_parallel)
    if real:
        groups = importlib.import_module("deepspeed.utils.groups")
        out.update(groups._get_expert_data_parallel_group_dict())
    for m in module.modules():
        if isinstance(m, MoE):
            made = expert_groups_named(m.expert_group_name)
            if made is None:
                raise RuntimeError(f"the MoE layer's process groups {m.expert_group_name!r} were "
                                   f"not created by its set_deepspeed_parallelism (overridden?)")
            out[m.expert_group_name] = made.edp_group
    for m in evenzero_moe_layers(module):
        out[m.groups.group_name] = m.groups.edp_group
    names = {p.group_name for p in module.parameters() if is_expert(p)}
    missing = sorted(names - set(out), key=str)
    if missing:
        raise ValueError(f"parameters are marked as experts of group(s) {missing} "
                         f"(param.allreduce=False), but no DeepSpeed or evenzero MoE layer in "
                         f"the model provides that group's process group")
    return out


def _check_layout(module: torch.nn.Module, use_data_before_expert_parallel: bool) -> None:
    """DeepSpeed's "D + E" layout puts the expert-data-parallel groups on consecutive ranks;
    `ZeroOptimizer` plans expert groups in the "E + D" layout ({i, i+E, ...}). The two have
    the same rank sets when ep_size is 1 or the world size; otherwise refused by name, on
    every rank, before any group is made."""
    if not use_data_before_expert_parallel or not dist.is_initialized():
        return
    world = dist.get_world_size()
    sizes = sorted({m.ep_size for m in deepspeed_moe_layers(module) if 1 < m.ep_size < world})
    if sizes:
        raise DeepSpeedConfigError(
            f"config key 'use_data_before_expert_parallelism': true is not supported by "
            f"evenzero.deepspeed with ep_size {sizes[0]} on {world} ranks: evenzero lays out "
            f"expert groups in DeepSpeed's default E + D rank order only; remove the key (or set "
            f"it to false)")


@torch.no_grad()
def broadcast_parameters(module: torch.nn.Module, groups: dict[str, Any]) -> None:
    """Every parameter from its source rank, as DeepSpeed's `_broadcast_model`
    (deepspeed/runtime/engine.py@0.19.8:2038-2062): dense ones from global rank 0, expert
    ones from the first rank of their expert-data-parallel group."""
    if dist.get_world_size() == 1:
        return
    for p in module.parameters():
        if is_expert(p):
            pg = groups[p.group_name]
            src = dist.get_process_group_ranks(pg)[0]
            dist.broadcast(p.data, src, group=pg)
        else:
            dist.broadcast(p.data, 0)
