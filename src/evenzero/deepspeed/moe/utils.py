"""`deepspeed.moe.utils`: telling expert parameters apart and putting them in optimizer param
groups of their own (deepspeed/moe/utils.py@0.19.8:15-183).

`split_params_into_different_moe_groups_for_optimizer` is what DeepSpeed's ZeRO needs
before it is handed the parameters of an MoE model: it moves each group's expert
parameters into appended groups `{**group, "name": "ep_size_E", "moe": True}` (split into
chunks of at most `max_group_size` elements), which the engine reduces over their
expert-data-parallel group.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from evenzero.deepspeed.moe.layer import MoE


def has_moe_layers(m: nn.Module) -> tuple[bool, int]:
    """(whether `m` holds an MoE layer, the number of experts of the first one)."""
    for module in m.modules():
        if isinstance(module, MoE):
            return True, module.num_experts
    return False, 0


def is_moe_param(param: torch.Tensor) -> bool:
    return hasattr(param, "allreduce") and not param.allreduce


def split_params_into_shared_and_expert_params(
        params: Iterable[nn.Parameter]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    shared, experts = [], []
    for p in params:
        (experts if is_moe_param(p) else shared).append(p)
    return shared, experts


def split_params_grads_into_shared_and_expert_params(
        group: Iterable[nn.Parameter]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The gradients of the dense and of the expert parameters, each in its parameter's
    dtype (for norms and overflow checks)."""
    shared, experts = [], []
    for p in group:
        if p.grad is not None:
            (experts if is_moe_param(p) else shared).append(p.grad.to(p.dtype))
    return shared, experts


def split_params_into_different_moe_groups_for_optimizer(
        param_groups: dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]],
        max_group_size: int | float | None = 178956971) -> list[dict[str, Any]]:
    """DeepSpeed's split (utils.py@0.19.8:72-149), with its effects: the groups given lose
    their expert parameters in place, a list given is extended and returned, and every
    group needs a "name" (groups with the same name share their expert groups, which take
    the options of the last of them).

    The expert groups are appended in the order their names first appear. DeepSpeed
    iterates a set of names, whose order follows the string hashes of each process; with
    one expert group name (one `ep_size`) the two agree."""
    if isinstance(param_groups, tuple):
        param_groups = list(param_groups)
    elif isinstance(param_groups, dict):
        param_groups = [param_groups]
    elif not isinstance(param_groups, list):
        raise ValueError(f"Unknown param group type of {type(param_groups)}")

    names: dict[str, None] = {}
    for group in param_groups:
        for param in group["params"]:
            if is_moe_param(param):
                names.setdefault(param.group_name)

    moe_groups: dict[str, dict[str, dict[str, Any]]] = {}
    for i, group in enumerate(param_groups):
        if names and "name" not in group:
            raise KeyError(f"param group {i} has no 'name': "
                           f"split_params_into_different_moe_groups_for_optimizer names every "
                           f"group's expert groups after it (e.g. {{'params': ..., "
                           f"'name': 'parameters'}})")
        for name in names:
            moe_groups.setdefault(group.get("name"), {})[name] = {
                **group, "name": name, "moe": True, "params": []}

    for group in param_groups:
        dense = []
        for param in group["params"]:
            if is_moe_param(param):
                moe_groups[group["name"]][param.group_name]["params"].append(param)
            else:
                dense.append(param)
        group["params"] = dense

    for by_name in moe_groups.values():
        for moe_group in by_name.values():
            if max_group_size is None:
                param_groups.append(moe_group)
                continue
            for chunk in _chunks(moe_group["params"], max_group_size):
                param_groups.append({**moe_group, "params": chunk})
    return param_groups


def _chunks(params: list[nn.Parameter], max_numel: int | float) -> list[list[nn.Parameter]]:
    """Consecutive runs of at most `max_numel` elements (utils.py@0.19.8:122-143). A
    parameter larger than that starts a run of its own, leaving the run before it as it
    is, empty if it came first (DeepSpeed then appends an empty group too)."""
    runs: list[list[nn.Parameter]] = []
    run: list[nn.Parameter] = []
    numel = 0
    for param in params:
        n = param.ds_numel if hasattr(param, "ds_numel") else param.numel()
        if numel + n <= max_numel:
            run.append(param)
            numel += n
        else:
            runs.append(run)
            run, numel = [param], n
    if run:
        runs.append(run)
    return runs


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    return param_group.get("moe", False)


def configure_moe_param_groups(model_parameters: list) -> list:
    """What DeepSpeed's engine does with `model_parameters` of a model with MoE layers and
    no client optimizer (utils.py@0.19.8:156-183): a list of parameters becomes one
    "dense-params" group plus the expert groups; a list of groups is split unless some
    group already carries a "moe" key."""
    if not isinstance(model_parameters, list):
        raise AssertionError("model_parameters must be a list")
    for p in model_parameters:
        if not isinstance(p, (torch.Tensor, dict)):
            raise TypeError("param argument that would be given to the optimizer should be an "
                            f"iterable of Tensors or dicts, but got {type(p)}")
    first = model_parameters[0]
    if isinstance(first, torch.nn.Parameter):
        return split_params_into_different_moe_groups_for_optimizer(
            {"params": model_parameters, "name": "dense-params"})
    if isinstance(first, dict):
        if not any("moe" in group for group in model_parameters):
            return split_params_into_different_moe_groups_for_optimizer(model_parameters)
        return model_parameters
    return None
