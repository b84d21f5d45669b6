"""The optimizer a DeepSpeed config or a client hands the engine, as a torch class plus
keyword arguments that `ZeroOptimizer` steps on flat shards.

Config `Adam`/`AdamW` (deepspeed/runtime/engine.py@0.19.8:2377-2550): `adam_w_mode`
defaults to True and `AdamW` forces it, so `Adam` is AdamW unless `adam_w_mode: false`.
With `torch_adam: true` DeepSpeed builds torch.optim.AdamW/Adam with the remaining
params as given (torch's own defaults apply, e.g. AdamW's weight_decay 0.01). Without it
DeepSpeed runs FusedAdam, which on a CPU job (DS_BUILD_OPS=0) is a JIT-built C++ kernel
(deepspeed/ops/csrc/adam/cpu_adam_impl.cpp@0.19.8, `Step_1`): decoupled decay
`p -= lr*wd*p` then `p -= lr/bc1 * m / (sqrt(v)/sqrt(bc2) + eps)` in AdamW mode, L2
`g += wd*p` in Adam mode - the update torch.optim.AdamW/Adam compute, up to float
rounding, except that torch decays with `p *= 1 - lr*wd`, whose float32 factor drifts
systematically over many steps. So FusedAdam maps to `evenzero.deepspeed.fused_adam.
FusedAdam`, which keeps the kernel's arithmetic (and FusedAdam's defaults, notably
weight_decay 0.0); `amsgrad` is refused, as FusedAdam itself refuses it.

Any other type is looked up in torch.optim (`SGD`, `Adagrad`, ...), as DeepSpeed does;
`Muon` is DeepSpeed's Muon with its auxiliary Adam (`evenzero.deepspeed.muon`); LAMB,
Lion, OneBit*, ... are DeepSpeed kernels evenzero does not have.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from evenzero.deepspeed.config import DeepSpeedConfigError, NamedSection
from evenzero.deepspeed.fused_adam import DeepSpeedCPUAdam, FusedAdam
from evenzero.deepspeed.muon import DeepSpeedMuon, halves

# deepspeed/runtime/config.py@0.19.8:52-66: names DeepSpeed lower-cases.
DEEPSPEED_OPTIMIZERS = ("adagrad", "adam", "adamw", "lamb", "muadam", "muadamw", "musgd",
                        "lion", "muon")
# DeepSpeed's own Adam kernels a client may pass as its optimizer object; they are
# elementwise, so ZeroOptimizer may step shards with them.
DEEPSPEED_ELEMENTWISE = ("FusedAdam", "DeepSpeedCPUAdam")


@dataclass(frozen=True)
class OptimizerChoice:
    """A torch optimizer class, its keyword arguments, and DeepSpeed's name for it."""

    cls: type[torch.optim.Optimizer]
    kwargs: Mapping[str, Any]
    name: str
    """`optimizer.type` as DeepSpeed normalises it (used by `get_mom`)."""
    muon_adam: tuple[Mapping[str, Any], bool] | None = None
    """Muon: the Adam half's settings and `adam_w_mode` (`evenzero.deepspeed.muon`)."""


def optimizer_from_config(section: NamedSection, offload: bool = False) -> OptimizerChoice:
    """`offload`: ZeRO-Offload is on, so Adam/AdamW without `torch_adam` is DeepSpeed's
    CPU Adam (deepspeed/runtime/engine.py@0.19.8 `get_optimizer_configuration`), the
    same `Step_1` kernel as FusedAdam on the CPU, stepped on the host."""
    name = section.type
    if name.lower() in DEEPSPEED_OPTIMIZERS:
        name = name.lower()
    params = dict(section.params)
    if "max_grad_norm" in params:
        raise DeepSpeedConfigError("'max_grad_norm' is not supported as an optimizer parameter, "
                                   "please switch to using the deepspeed parameter "
                                   "'gradient_clipping'")
    if name in ("adam", "adamw"):
        cls, kwargs = _adam(name, params)
        if offload and cls is FusedAdam:
            kwargs = {k: v for k, v in kwargs.items() if k not in ("adam_w_mode", "set_grad_none")}
            cls, kwargs = DeepSpeedCPUAdam, {**kwargs, "adamw_mode": _adam_w(name, section)}
        return OptimizerChoice(cls, kwargs, name)
    if name == "muon":
        muon, adam, adam_w_mode = halves(params)
        return OptimizerChoice(DeepSpeedMuon, muon, name, (adam, adam_w_mode))
    if name in DEEPSPEED_OPTIMIZERS and name != "adagrad":
        raise DeepSpeedConfigError(f"config key 'optimizer.type' = {section.type!r}: DeepSpeed's "
                                   f"{name} optimizer is not supported by evenzero.deepspeed; use "
                                   f"Adam, AdamW, SGD or another elementwise torch.optim class")
    cls = torch.optim.Adagrad if name == "adagrad" else getattr(torch.optim, name, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
        raise DeepSpeedConfigError(f"config key 'optimizer.type' = {section.type!r} is not a "
                                   f"supported DeepSpeed Optimizer (not Adam/AdamW and not a "
                                   f"torch.optim class)")
    _check_kwargs(cls, params, section.type)
    return OptimizerChoice(cls, params, name)


def _adam(name: str, params: dict) -> tuple[type[torch.optim.Optimizer], dict]:
    adam_w_mode = params.pop("adam_w_mode", True)
    effective = name == "adamw" or bool(adam_w_mode)
    torch_adam = params.pop("torch_adam", False)
    params.pop("fp32_optimizer_states", None)  # only read by DeepSpeed's CPU Adam (offload)
    if torch_adam:
        cls = torch.optim.AdamW if effective else torch.optim.Adam
        params.setdefault("foreach", None)
        _check_kwargs(cls, params, "torch_adam " + cls.__name__)
        return cls, params
    # FusedAdam(params, lr, bias_correction, betas, eps, adam_w_mode, weight_decay, amsgrad,
    # set_grad_none) (deepspeed/ops/adam/fused_adam.py@0.19.8).
    _check_kwargs(FusedAdam, params, "FusedAdam")
    if params.get("amsgrad"):
        raise DeepSpeedConfigError("FusedAdam does not support the AMSGrad variant "
                                   "('optimizer.params.amsgrad'); remove it, or set "
                                   "'torch_adam': true to use torch's AMSGrad")
    if isinstance(params.get("betas"), list):
        params["betas"] = tuple(params["betas"])
    return FusedAdam, {**params, "adam_w_mode": effective}


def _adam_w(name: str, section: NamedSection) -> bool:
    return name == "adamw" or bool(section.params.get("adam_w_mode", True))


def _check_kwargs(cls: type, params: Mapping[str, Any], what: str) -> None:
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    extra = sorted(set(params) - accepted)
    if extra:
        raise DeepSpeedConfigError(f"config key 'optimizer.params.{extra[0]}' is not an "
                                   f"argument of {what}")


def optimizer_from_client(optimizer: torch.optim.Optimizer) -> OptimizerChoice:
    """The class and defaults of a client optimizer object, as constructor arguments."""
    cls = type(optimizer)
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    kwargs = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    if isinstance(optimizer, FusedAdam):  # its mode is an attribute, not a default
        kwargs["adamw_mode" if "adamw_mode" in accepted else "adam_w_mode"] = optimizer.adam_w_mode
    return OptimizerChoice(cls, kwargs, cls.__name__)


def declared_elementwise(cls: type) -> bool | None:
    """True for Adam kernels known to be elementwise that torch's list does not name."""
    if issubclass(cls, FusedAdam) or (cls.__module__.startswith("deepspeed.ops.adam")
                            and cls.__name__ in DEEPSPEED_ELEMENTWISE):
        return True
    return None


# --------------------------------------------------------------------------- param groups

def is_expert(p: torch.Tensor) -> bool:
    """DeepSpeed's `is_moe_param` (deepspeed/moe/utils.py@0.19.8:27)."""
    return hasattr(p, "allreduce") and not p.allreduce


def as_groups(model_parameters: Iterable[Any]) -> list[dict]:
    """Tensors or group dicts, as torch.optim accepts them, to a list of group dicts."""
    items = list(model_parameters)
    if not items:
        raise DeepSpeedConfigError("model_parameters is empty: there is nothing to optimize")
    if all(isinstance(i, Mapping) for i in items):
        out = []
        for g in items:
            params = g["params"]
            params = [params] if isinstance(params, torch.Tensor) else list(params)
            out.append({**g, "params": params})
        return out
    if any(isinstance(i, Mapping) for i in items):
        raise DeepSpeedConfigError("model_parameters mixes tensors and param-group dicts")
    return [{"params": items}]


def split_moe_groups(groups: list[dict]) -> list[dict]:
    """DeepSpeed's `configure_moe_param_groups` (deepspeed/moe/utils.py@0.19.8:72-183):
    groups already marked `moe` are kept; otherwise the expert params of each group move
    into appended groups `{**group, 'name': group_name, 'moe': True}`. The first group is
    named 'dense-params' when the input was a flat parameter list."""
    if any("moe" in g for g in groups):
        return groups
    names: list[str] = []
    for g in groups:
        for p in g["params"]:
            if is_expert(p) and p.group_name not in names:
                names.append(p.group_name)
    if not names:
        return groups
    if len(groups) == 1 and "name" not in groups[0]:
        groups = [{**groups[0], "name": "dense-params"}]
    out, appended = [], []
    for g in groups:
        dense = [p for p in g["params"] if not is_expert(p)]
        out.append({**g, "params": dense})
        for name in names:
            experts = [p for p in g["params"] if is_expert(p) and p.group_name == name]
            if experts:
                appended.append({**g, "name": name, "moe": True, "params": experts})
    return out + appended


def zero_param_groups(groups: list[dict], expert_groups: Mapping[str, Any]) -> list[dict]:
    """Group dicts for `ZeroOptimizer(param_groups=...)`: each gets its process group (the
    expert-data-parallel group for DeepSpeed's `moe` groups) and a unique name."""
    has_experts = any(is_expert(p) for g in groups for p in g["params"])
    if has_experts and not any(g.get("moe") for g in groups):
        raise DeepSpeedConfigError(
            "The model has moe layers, but None of the param groups are marked as MoE. Create a "
            "param group with 'moe' key set to True before creating optimizer (e.g. with "
            "deepspeed.moe.utils.split_params_into_different_moe_groups_for_optimizer)")
    out, used = [], set()
    for i, g in enumerate(groups):
        name = str(g.get("name") or ("dense" if i == 0 else f"group{i}"))
        base, k = name, 1
        while name in used:
            name, k = f"{base}.{k}", k + 1
        used.add(name)
        pg = None
        if g.get("moe"):
            key = g.get("name")
            if key not in expert_groups:
                raise DeepSpeedConfigError(
                    f"param group {i} is marked moe with name {key!r}, but the model has no "
                    f"DeepSpeed MoE layer whose expert group is called that (expert groups: "
                    f"{sorted(expert_groups)})")
            pg = expert_groups[key]
        opts = {k: v for k, v in g.items() if k not in ("params", "name", "moe")}
        out.append({"params": g["params"], "process_group": pg, "name": name, **opts})
    return out
