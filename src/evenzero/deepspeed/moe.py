"""Mixture-of-experts layers in a DeepSpeed script, and `deepspeed.moe` itself.

A model built with DeepSpeed's own `deepspeed.moe.layer.MoE` has already imported
DeepSpeed. The engine then does what DeepSpeed's engine does for it
(deepspeed/runtime/engine.py@0.19.8:2096-2180): it lets DeepSpeed's communication layer
adopt the running process group, calls every layer's `set_deepspeed_parallelism`, which
builds DeepSpeed's expert-parallel and expert-data-parallel groups, and reads those
groups back from `deepspeed.utils.groups`; `ZeroOptimizer` reduces each expert group's
gradients over them (`expert_groups`). evenzero's own `evenzero.moe.MoE` layers carry
their groups with them. Nothing here imports DeepSpeed unless the model already did.

`evenzero.deepspeed.moe.layer` / `.utils` are DeepSpeed's modules, imported on first
use, so `deepspeed.moe.layer.MoE(...)` works after `import evenzero.deepspeed as deepspeed`
wherever DeepSpeed is installed.
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch
import torch.distributed as dist

from evenzero.deepspeed.optimizers import is_expert


def __getattr__(name: str) -> Any:
    if name in ("layer", "utils", "experts", "sharded_moe", "mappings"):
        try:
            return importlib.import_module(f"deepspeed.moe.{name}")
        except ImportError as e:
            raise AttributeError(f"deepspeed.moe.{name} needs DeepSpeed installed "
                                 f"(pip install deepspeed): {e}") from None
    raise AttributeError(name)


def deepspeed_moe_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    """DeepSpeed MoE layers in `module` (only possible if the model imported DeepSpeed)."""
    if "deepspeed.moe.layer" not in sys.modules:
        return []
    moe_cls = sys.modules["deepspeed.moe.layer"].MoE
    return [m for m in module.modules() if isinstance(m, moe_cls)]


def evenzero_moe_layers(module: torch.nn.Module) -> list[torch.nn.Module]:
    from evenzero.moe import MoE

    return [m for m in module.modules() if isinstance(m, MoE) and m.groups is not None]


def expert_groups(module: torch.nn.Module, backend: str,
                  use_data_before_expert_parallel: bool) -> dict[str, Any]:
    """`{group_name: expert-data-parallel process group}` for every MoE layer."""
    out: dict[str, Any] = {}
    ds_layers = deepspeed_moe_layers(module)
    if ds_layers:
        ds_comm = sys.modules["deepspeed"].comm
        # Adopts the running torch process group (deepspeed/comm/comm.py@0.19.8:878-881).
        ds_comm.init_distributed(dist_backend=backend, verbose=False)
        for m in module.modules():
            if hasattr(m, "set_deepspeed_parallelism"):
                m.set_deepspeed_parallelism(use_data_before_expert_parallel)
        groups = importlib.import_module("deepspeed.utils.groups")
        out.update(groups._get_expert_data_parallel_group_dict())
    for m in evenzero_moe_layers(module):
        out[m.groups.group_name] = m.groups.edp_group
    names = {p.group_name for p in module.parameters() if is_expert(p)}
    missing = sorted(names - set(out))
    if missing:
        raise ValueError(f"parameters are marked as experts of group(s) {missing} "
                         f"(param.allreduce=False), but no DeepSpeed or evenzero MoE layer in "
                         f"the model provides that group's process group")
    return out


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
