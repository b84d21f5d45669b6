"""Which of torch.optim's implementations steps the master shards.

torch.optim has up to three implementations of each elementwise optimizer: a loop over
single tensors, a multi-tensor `foreach` one and a `fused` kernel. When the user names
neither, torch picks `foreach` for CUDA tensors only and `fused` never
(torch/optim/optimizer.py@v2.13.0 `_default_to_fused_or_foreach`), so on the CPU the
single-tensor loop runs, with a shard-sized temporary per operation
(torch/optim/adam.py@v2.13.0 `_single_tensor_adam`). evenzero steps one flat shard per
group, which every implementation handles alike, so when the user did not choose, it
picks the one measured fastest for the shard's device and dtype (`FASTEST_ON_CPU`).

Measured by this project on one CPU process, fp32 shards of 1M, 4M and 10M elements, one
thread, median of 7 interleaved steps, on a shared, heavily loaded 2-core machine (so
only the large ratios count; ms):

| optimizer          |  single-tensor (1M/4M/10M) |  foreach          |  fused          |
|--------------------|----------------------------|-------------------|-----------------|
| AdamW (wd 0.01)    |  23 / 218 / 261            |  19 / 206 / 191   |  11 / 18 / 27   |
| Adam               |  25 / 133 / 240            |  27 / 154 / 258   |  1.1 / 30 / 21  |
| SGD (momentum 0.9) |  0.9 / 28 / 45             |  1.0 / 28 / 42    |  0.9 / 20 / 24  |
| SGD                |  0.6 / 12 / 18             |  0.7 / 18 / 16    |  0.5 / 5.9 / 23 |
| Adagrad            |  11 / 44 / 150             |  35 / 45 / 244    |  3.3 / 8.6 / 22 |
| RMSprop            |  5.7 / 31 / 208            |  2.2 / 33 / 200   |  -              |
| NAdam              |  33 / 83 / 287             |  22 / 75 / 207    |  -              |
| RAdam              |  102 / 213 / 807           |  23 / 45 / 228    |  -              |
| Rprop              |  67 / 178 / 906            |  54 / 159 / 834   |  -              |
| Adamax             |  10 / 25 / 203             |  5.2 / 30 / 140   |  -              |
| Adadelta           |  26 / 55 / 297             |  44 / 50 / 294    |  -              |
| ASGD               |  9.9 / 16 / 51             |  1.9 / 31 / 300   |  -              |

(`python3 benchmarks/optimizer_impls.py --sizes 1000000 4000000 10000000`; an earlier run
of the same loop on a quieter moment of the machine ranked them alike, e.g. AdamW at 10M
129 / 84 / 12 ms. Adamax, Adadelta and ASGD show no consistent winner and keep torch's
default.)

The fused and foreach kernels compute the same update in another order: results differ
from the single-tensor loop by a few ulps (the equivalence tests hold at 1e-5 relative).

Only torch's own classes are chosen for (a subclass may override `step`), only for fp32
and fp64 shards (torch's fused CPU kernels compute bf16/fp16 in fp32, which the
single-tensor loop does not: a different result, not just a faster one), and only on the
CPU (on CUDA torch already picks foreach; fused there is the user's call). The user's
choice always stands: `foreach=` or `fused=` in the optimizer's arguments (or in any
parameter group), `differentiable=True`, or `ZeroConfig.optimizer_impl`.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from evenzero.runtime.checks import ZeroConfigError

SINGLE_TENSOR, FOREACH, FUSED = "single_tensor", "foreach", "fused"
IMPLS = (SINGLE_TENSOR, FOREACH, FUSED)
"""torch.optim's implementations (the planner's `OPTIMIZER_IMPLS`)."""

_IMPL_KWARGS = {SINGLE_TENSOR: {"foreach": False}, FOREACH: {"foreach": True},
                FUSED: {"fused": True}}

FASTEST_ON_CPU: dict[type, str] = {
    torch.optim.SGD: FUSED, torch.optim.Adam: FUSED, torch.optim.AdamW: FUSED,
    torch.optim.Adagrad: FUSED, torch.optim.RAdam: FOREACH, torch.optim.NAdam: FOREACH,
    torch.optim.RMSprop: FOREACH, torch.optim.Rprop: FOREACH,
}
"""The implementation measured fastest on CPU fp32 shards, where it is not torch's
default (the module docstring's table); classes not listed keep torch's default."""

_CHOOSABLE_DTYPES = (torch.float32, torch.float64)


@dataclass(frozen=True)
class InnerStep:
    """How the inner optimizer is built."""

    kwargs: dict[str, Any]
    """The optimizer's keyword arguments, with `foreach`/`fused` set when chosen here."""
    impl: str | None
    """The implementation torch will run: one of `IMPLS`; None when parameter groups
    choose differently."""
    chosen: bool
    """Whether evenzero chose it (False: the user did, or torch's default stands)."""



IMPL_KEYS = ("foreach", "fused")
"""The optimizer arguments that pick an implementation."""


def user_defaults(inner_defaults: Mapping[str, Any], user_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """The defaults `ZeroOptimizer.param_groups` show: the inner optimizer's, except the
    implementation keys, which stay as the user gave them (None: torch's default), as
    `torch.optim` would show them; an implementation evenzero chose is its own detail."""
    out = dict(inner_defaults)
    for key in IMPL_KEYS:
        if key in out:
            out[key] = user_kwargs.get(key)
    return out


def keeps_inner_choice(key: str, value: Any) -> bool:
    """Whether a user group's `key: value` leaves the inner optimizer's own setting alone
    (an implementation key the user left at torch's default)."""
    return key in IMPL_KEYS and value is None


def _accepts(optimizer_class: type, name: str) -> bool:
    try:
        return name in inspect.signature(optimizer_class.__init__).parameters
    except (TypeError, ValueError):
        return False


def torch_default_impl(kwargs: Mapping[str, Any], device: torch.device) -> str:
    """What torch runs for these arguments: fused or foreach if named, else foreach on
    the devices torch defaults to it for, else single-tensor (`_default_to_fused_or_foreach`)."""
    if kwargs.get("fused"):
        return FUSED
    if kwargs.get("foreach") is not None:
        return FOREACH if kwargs["foreach"] else SINGLE_TENSOR
    if kwargs.get("differentiable"):
        return SINGLE_TENSOR
    from torch.utils._foreach_utils import _get_foreach_kernels_supported_devices

    return FOREACH if device.type in _get_foreach_kernels_supported_devices() else SINGLE_TENSOR


def choose_inner_step(optimizer_class: type, kwargs: Mapping[str, Any],
                      group_options: Iterable[Mapping[str, Any]], device: torch.device,
                      dtype: torch.dtype, requested: str | None = None) -> InnerStep:
    """The inner optimizer's arguments for master shards of `dtype` on `device`.

    `kwargs` are the user's optimizer arguments, `group_options` the per-group overrides,
    `requested` `ZeroConfig.optimizer_impl` (None: evenzero's choice). Raises
    `ZeroConfigError` for a request the class or the arguments contradict."""
    kwargs = dict(kwargs)
    groups = [dict(o) for o in group_options]
    named = {k for o in (kwargs, *groups) for k in ("foreach", "fused") if o.get(k) is not None}
    if requested is not None:
        if requested not in IMPLS:
            raise ZeroConfigError(f"optimizer_impl must be one of {IMPLS} or None, got "
                                  f"{requested!r}")
        wanted = _IMPL_KWARGS[requested]
        clashing = [o for o in (kwargs, *groups)
                    if named and torch_default_impl({**kwargs, **o}, device) != requested]
        if clashing:
            given = {k: o[k] for o in (kwargs, *groups) for k in ("foreach", "fused")
                     if o.get(k) is not None}
            raise ZeroConfigError(f"optimizer_impl={requested!r} contradicts the optimizer "
                                  f"arguments {given}; pass only one of them")
        for key in wanted:
            if not _accepts(optimizer_class, key):
                raise ZeroConfigError(f"optimizer_impl={requested!r}: "
                                      f"{optimizer_class.__name__} has no {key!r} argument; "
                                      f"use one of "
                                      f"{[i for i in IMPLS if _accepts_all(optimizer_class, i)]}")
        return InnerStep({**kwargs, **wanted}, requested, chosen=False)
    if named or any(o.get("differentiable") for o in (kwargs, *groups)):
        impls = {torch_default_impl({**kwargs, **g}, device) for g in groups or [{}]}
        return InnerStep(kwargs, impls.pop() if len(impls) == 1 else None, chosen=False)
    fastest = FASTEST_ON_CPU.get(optimizer_class) if device.type == "cpu" else None
    if fastest is None or dtype not in _CHOOSABLE_DTYPES:
        return InnerStep(kwargs, torch_default_impl(kwargs, device), chosen=False)
    return InnerStep({**kwargs, **_IMPL_KWARGS[fastest]}, fastest, chosen=True)


def _accepts_all(optimizer_class: type, impl: str) -> bool:
    return all(_accepts(optimizer_class, k) for k in _IMPL_KWARGS[impl])


def plan_note(impl: str | None) -> str | None:
    """The line `plan.notes` carries for `ZeroConfig.optimizer_impl` as resolved."""
    if impl is None:
        return None
    return (f"optimizer step: torch.optim's {impl} implementation steps the master shards "
            f"(opt.config.optimizer_impl; unless the optimizer's foreach=/fused= or "
            f"optimizer_impl say otherwise, evenzero picks the fastest measured for the "
            f"device and dtype; optimizer_impl='single_tensor' is torch's CPU default)")
