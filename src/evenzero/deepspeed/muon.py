"""DeepSpeed 0.19.8's Muon (`"optimizer": {"type": "Muon"}`), as `ZeroOptimizer` runs it.

DeepSpeed tags every parameter `use_muon` from the model it is given
(deepspeed/__init__.py@v0.19.8 `set_optimizer_flags`): True for a parameter of two or
more dimensions whose name holds neither "embed" nor "lm_head", else False. The engine
then splits each param group into a Muon half and an Adam half
(deepspeed/runtime/engine.py@v0.19.8 `_muon_param_groups`): the config's shared `lr`,
`weight_decay` and, per half, `momentum`/`ns_method` (Muon) or `betas`/`eps` (Adam), with
`muon_lr`/`adam_lr` overriding `lr`, then the group's own settings; what is still
missing takes `MuonWithAuxAdam`'s defaults (runtime/zero/muon/original_muon.py@v0.19.8):
Muon lr 0.02, momentum 0.95, weight_decay 0, ns_method "gram"; Adam lr 3e-4, betas
(0.9, 0.95), eps 1e-10, weight_decay 0, stepped by FusedAdam in AdamW mode unless
`adam_w_mode: false`.

Here the Muon half is a group stepped by `DeepSpeedMuon` (DeepSpeed's `muon_update`:
Nesterov momentum, Newton-Schulz by the "gram" or "standard" method, the
sqrt(max(1, rows/cols)) scale), declared whole-tensor, so each rank steps the matrices
it owns whole, after one reduce-scatter per bucket. DeepSpeed instead all-reduces the
matrices that straddle two ranks' partitions and orthogonalises each on every rank that
holds a piece (runtime/zero/stage_1_and_2.py@v0.19.8, `use_muon` in
`get_flat_partition`). The Adam half is a group of its own with `"optimizer":
FusedAdam` (`evenzero.deepspeed.fused_adam`, the kernel's arithmetic).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from evenzero.deepspeed.config import DeepSpeedConfigError
from evenzero.deepspeed.fused_adam import FusedAdam

MUON_DEFAULTS = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.0, "ns_method": "gram"}
"""MuonWithAuxAdam's Muon-half defaults (original_muon.py@v0.19.8)."""
ADAM_DEFAULTS = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-10, "weight_decay": 0.0}
"""MuonWithAuxAdam's Adam-half defaults (original_muon.py@v0.19.8)."""
MUON_KEYS = ("lr", "momentum", "weight_decay", "ns_method")
ADAM_KEYS = ("lr", "betas", "eps", "weight_decay")
"""`DeepSpeedEngine._MUON_HALF_KEYS` / `_ADAM_HALF_KEYS` (engine.py@v0.19.8)."""
CONFIG_KEYS = frozenset(MUON_KEYS + ADAM_KEYS + ("muon_lr", "adam_lr", "adam_w_mode"))
NS_METHODS = ("standard", "gram")
NS_STEPS = 5
A, B, C = 3.4445, -4.7750, 2.0315


def uses_muon(name: str, p: torch.Tensor) -> bool:
    """DeepSpeed's `use_muon` tag (deepspeed/__init__.py@v0.19.8 `set_optimizer_flags`)."""
    return p.dim() >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))


def halves(params: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], bool]:
    """(Muon-half defaults, Adam-half defaults, adam_w_mode) from the config's params."""
    extra = sorted(set(params) - CONFIG_KEYS)
    if extra:
        raise DeepSpeedConfigError(f"config key 'optimizer.params.{extra[0]}' is not a Muon "
                                   f"setting evenzero runs (it takes {sorted(CONFIG_KEYS)})")
    muon = {**MUON_DEFAULTS, **{k: params[k] for k in MUON_KEYS if k in params}}
    adam = {**ADAM_DEFAULTS, **{k: params[k] for k in ADAM_KEYS if k in params}}
    if "muon_lr" in params:
        muon["lr"] = params["muon_lr"]
    if "adam_lr" in params:
        adam["lr"] = params["adam_lr"]
    if isinstance(adam.get("betas"), list):
        adam["betas"] = tuple(adam["betas"])
    if muon["ns_method"] not in NS_METHODS:
        raise DeepSpeedConfigError(f"config key 'optimizer.params.ns_method' = "
                                   f"{muon['ns_method']!r}: must be one of {list(NS_METHODS)}")
    return muon, adam, bool(params.get("adam_w_mode", True))


def split_groups(groups: list[dict], names: Mapping[int, str], adam_w_mode: bool,
                 adam: Mapping[str, Any]) -> list[dict]:
    """Each group's Muon half, then its Adam half (`_muon_param_groups`'s order and names),
    the Adam half stepped by FusedAdam; empty halves dropped."""
    out = []
    for i, g in enumerate(groups):
        own = {k: v for k, v in g.items() if k != "params"}
        prefix = own.pop("name", None) or (f"group{i}" if len(groups) > 1 else None)
        trainable = [p for p in g["params"] if p.requires_grad]
        for muon, label, keys in ((True, "muon", MUON_KEYS), (False, "adam", ADAM_KEYS)):
            half = [p for p in trainable if uses_muon(names.get(id(p), ""), p) is muon]
            if not half:
                continue
            settings = {k: v for k, v in own.items() if k in keys or k == "moe"}
            name = f"{prefix}-{label}-params" if prefix else f"{label}-params"
            if muon:
                out.append({"params": half, "name": name, **settings})
            else:
                out.append({"params": half, "name": name,
                            "optimizer": FusedAdam if adam_w_mode else FusedAdamL2,
                            **adam, **settings})
    return out


class FusedAdamL2(FusedAdam):
    """FusedAdam with `adam_w_mode=False` (Adam with L2 decay): a group's own optimizer is
    a class, so the mode is its default here."""

    def __init__(self, params, **kwargs: Any) -> None:
        super().__init__(params, **{"adam_w_mode": False, **kwargs})


class DeepSpeedMuon(torch.optim.Optimizer):
    """DeepSpeed's Muon update (original_muon.py@v0.19.8 `muon_update`, the
    MuonWithAuxAdam Muon half), declared whole-tensor for `ZeroOptimizer`."""

    evenzero_update = "whole_tensor"

    def __init__(self, params, lr: float = 0.02, momentum: float = 0.95,
                 weight_decay: float = 0.0, ns_method: str = "gram") -> None:
        if ns_method not in NS_METHODS:
            raise ValueError(f"ns_method must be one of {NS_METHODS}, got {ns_method!r}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay,
                                  "ns_method": ns_method})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                update = muon_update(p.grad.clone(), state["momentum_buffer"],
                                     group["momentum"], group["ns_method"])
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(update.reshape(p.shape), alpha=-group["lr"])
        return loss


def compute_dtype(ns_method: str, device: torch.device) -> torch.dtype:
    """`ns_compute_dtype`: "gram" in fp16, "standard" in bf16, fp32 where the device
    lacks it (DeepSpeed's CPU accelerator has no fp16, so "gram" runs in fp32 there)."""
    if ns_method == "gram":
        return torch.float16 if device.type == "cuda" else torch.float32
    return torch.bfloat16


def muon_update(grad: torch.Tensor, momentum: torch.Tensor, beta: float,
                ns_method: str) -> torch.Tensor:
    orig = grad.dtype
    finite = torch.isfinite(grad).all()
    momentum.copy_(torch.where(finite, momentum.lerp(grad, 1 - beta), momentum))
    update = grad.lerp_(momentum, beta)
    ns = gram_newton_schulz if ns_method == "gram" else newton_schulz
    update = ns(update, NS_STEPS, compute_dtype(ns_method, grad.device))
    rows, cols = grad.size(-2), grad.size(-1)
    update = update * (math.sqrt(rows / cols) if rows > cols else 1.0)
    return torch.where(finite, update.to(orig), grad.to(orig))


def newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """`zeropower_via_newtonschulz5`."""
    x = g.to(dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)
    for _ in range(steps):
        a = x @ x.mT
        b = B * a + C * a @ a
        x = A * x + b @ x
    return x.mT if tall else x


def gram_newton_schulz(g: torch.Tensor, steps: int, dtype: torch.dtype) -> torch.Tensor:
    """`zeropower_via_gram_newtonschulz`: the iteration on the small Gram matrix, with a
    restart at the second iteration."""
    norm_dtype = torch.float32 if g.dtype == torch.float16 else g.dtype
    x = g.to(norm_dtype)
    tall = g.size(-2) > g.size(-1)
    if tall:
        x = x.mT
    n, m = x.size(-2), x.size(-1)
    x = (x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)).to(dtype)
    if m <= n:
        for _ in range(steps):
            a = x @ x.mT
            b = B * a + C * a @ a
            x = A * x + b @ x
        return x.mT if tall else x
    r = x @ x.mT
    q = None
    restart = 2
    for i in range(steps):
        if i == restart:
            x = q @ x
            r = x @ x.mT
            q = None
        z = B * r + C * r @ r
        if q is None:
            q = z.clone()
            q.diagonal().add_(A)
        else:
            q = A * q + z @ q
        if i < steps - 1 and (i + 1) != restart:
            rz = A * r + z @ r
            r = A * rz + z @ rz
    return x.mT @ q.mT if tall else q @ x


__all__ = ["DeepSpeedMuon", "halves", "split_groups", "uses_muon"]
