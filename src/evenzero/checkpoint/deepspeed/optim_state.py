"""DeepSpeed's saved optimizer and loss-scaler state, translated for a torch optimizer
and evenzero's `LossScaler`, with every mismatch that would change training refused.

Optimizer: DeepSpeed's inner optimizer stepped one flat fp32 partition per group, so its
state is per element (exp_avg, ...) plus scalars (`step`), and its param group holds the
options (lr, betas, ...). FusedAdam keeps `step` as an int, torch's Adam as a 0-d
tensor; the saved values are converted to what this optimizer keeps. Which state keys
this optimizer keeps is found by stepping a throwaway two-element copy of it, so an
optimizer that keeps different state (SGD for a DeepSpeed Adam run) is refused.

Loss scaler: DeepSpeed's `DynamicLossScaler` (deepspeed/runtime/fp16/loss_scaler.py:
253-288 @ v0.19.8) grows the scale once `cur_iter - last_overflow_iter - 1` is a positive
multiple of `scale_window`; evenzero's grows after `growth_interval` good steps in a
row. The good-step count is set so that the next growth falls on the same step.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from evenzero.checkpoint.deepspeed.reader import FlatGroup, same_value
from evenzero.checkpoint.format import MASTER, CheckpointError
from evenzero.checkpoint.protocol import DeepSpeedScaling, LossScaling

IMPLEMENTATION_OPTIONS = frozenset({"foreach", "fused", "capturable", "differentiable"})
"""Param-group options that choose an implementation, not the math: kept as this run has
them (a GPU run's `fused=True` must not follow the state onto a CPU run)."""


def optimizer_values(groups: Sequence[FlatGroup], optimizer_class: type,
                     current: Mapping[str, Any], ds_config: Any, where: str
                     ) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
    """(per-element state kinds, scalar state, param-group options) for one torch param
    group whose parameters DeepSpeed kept in `groups`; `current` is that group now."""
    now = {k: v for k, v in current.items() if k != "params"}
    first = groups[0]
    hyper = _options(first, now, where)
    for g in groups[1:]:
        if not same_value(_options(g, now, where), hyper):
            raise CheckpointError(f"{where}: DeepSpeed optimizer groups {first.index} and "
                                  f"{g.index} hold parameters of this one group but have "
                                  f"different options; give ZeroOptimizer param_groups that "
                                  f"split the parameters as DeepSpeed's groups did")
        if set(g.parts) != set(first.parts) or not same_value(dict(g.scalars), dict(first.scalars)):
            raise CheckpointError(f"{where}: DeepSpeed optimizer groups {first.index} and "
                                  f"{g.index} hold parameters of this one group but different "
                                  f"optimizer state; give ZeroOptimizer matching param_groups")
    _check_weight_decay(first, hyper, optimizer_class, ds_config, where)
    kinds = [k for k in first.parts if k != MASTER]
    saved = set(kinds) | set(first.scalars)
    probe = _probe(optimizer_class, hyper, where)
    if saved and saved != set(probe):
        raise CheckpointError(f"{where}: DeepSpeed's optimizer kept state {sorted(saved)} but "
                              f"{optimizer_class.__name__} keeps {sorted(probe)}; build "
                              f"ZeroOptimizer with the optimizer DeepSpeed ran (e.g. "
                              f"torch.optim.AdamW for DeepSpeed's Adam/AdamW)")
    scalars = {k: _like(v, probe.get(k)) for k, v in first.scalars.items()}
    return kinds, scalars, hyper


def _options(group: FlatGroup, now: Mapping[str, Any], where: str) -> dict[str, Any]:
    """This run's options with the saved values of the ones both optimizers have."""
    out = dict(now)
    saved = group.hyperparameters
    if saved is None:  # elastic checkpoints keep no param groups; DeepSpeed keeps the live ones
        return out
    if saved.get("bias_correction") is False:
        raise CheckpointError(f"{where}: DeepSpeed's FusedAdam ran with bias_correction=False, "
                              f"which torch's Adam/AdamW cannot do")
    for key, value in saved.items():
        if key in out and key not in IMPLEMENTATION_OPTIONS:
            out[key] = value
    return out


def _check_weight_decay(group: FlatGroup, hyper: Mapping[str, Any], optimizer_class: type,
                        ds_config: Any, where: str) -> None:
    """Adam with L2 decay and AdamW's decoupled decay differ whenever weight_decay != 0."""
    if not issubclass(optimizer_class, torch.optim.Adam) or not hyper.get("weight_decay"):
        return
    saved = saved_decoupled(group, ds_config)
    here = bool(hyper.get("decoupled_weight_decay", issubclass(optimizer_class, torch.optim.AdamW)))
    if saved is not None and saved != here:
        want = "torch.optim.AdamW" if saved else "torch.optim.Adam"
        raise CheckpointError(f"{where}: DeepSpeed ran Adam with "
                              f"{'decoupled (AdamW)' if saved else 'L2 (adam_w_mode=false)'} "
                              f"weight decay, this optimizer uses the other kind; build "
                              f"ZeroOptimizer with {want}")


def saved_decoupled(group: FlatGroup, ds_config: Any) -> bool | None:
    """Whether DeepSpeed's Adam decayed weights decoupled (AdamW); None: not recorded."""
    saved = group.hyperparameters or {}
    if "decoupled_weight_decay" in saved:
        return bool(saved["decoupled_weight_decay"])
    section = ds_config.get("optimizer") if isinstance(ds_config, Mapping) else None
    kind = str(section.get("type", "")).lower() if isinstance(section, Mapping) else ""
    if kind not in ("adam", "adamw"):
        return None
    # deepspeed/runtime/engine.py:2490 @ v0.19.8: AdamW, or Adam unless adam_w_mode=false.
    params = section.get("params") or {}
    return kind == "adamw" or bool(params.get("adam_w_mode", True))


def _probe(optimizer_class: type, hyper: Mapping[str, Any], where: str) -> dict[str, Any]:
    """The state this optimizer keeps after one step, on a throwaway parameter."""
    p = torch.zeros(2, requires_grad=True)
    options = {k: v for k, v in hyper.items() if k not in IMPLEMENTATION_OPTIONS}
    try:
        probe = optimizer_class([{"params": [p], **options}])
        p.grad = torch.zeros(2)
        probe.step()
    except Exception as e:  # noqa: BLE001 - any failure means the options do not fit
        raise CheckpointError(f"{where}: {optimizer_class.__name__} does not accept DeepSpeed's "
                              f"saved options {sorted(options)} ({type(e).__name__}: {e})"
                              ) from None
    return dict(probe.state[p])


def _like(value: Any, example: Any) -> Any:
    """`value` in the type this optimizer keeps (FusedAdam's int step -> torch's tensor)."""
    if isinstance(example, torch.Tensor):
        return torch.as_tensor(value, dtype=example.dtype).detach().clone().reshape(example.shape)
    if isinstance(value, torch.Tensor) and value.numel() == 1 and isinstance(example, (int, float)):
        return type(example)(value.item())
    return copy.deepcopy(value)


# --------------------------------------------------------------------------- loss scale


def loss_scaler_state(saved: Mapping[str, Any] | None,
                      scaler: LossScaling | DeepSpeedScaling | None, skipped_steps: int,
                      where: str) -> dict[str, Any] | None:
    """evenzero `LossScaler` state equivalent to DeepSpeed's; None to leave it alone."""
    if saved is None or scaler is None or not scaler.enabled:
        return None  # this run does not scale the loss (bf16/fp32): nothing to carry over
    if isinstance(scaler, DeepSpeedScaling):
        # A scaler with DeepSpeed's own update rule (evenzero.deepspeed's engine) takes
        # the saved fields as they are, hysteresis included.
        state = scaler.state_from_deepspeed(saved)
        try:
            copy.deepcopy(scaler).load_state_dict(state)
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"{where}: loss scaler: {e}") from None
        return state
    scale = float(saved.get("cur_scale", 1.0))
    dynamic = bool(saved.get("dynamic"))
    if not dynamic and scale == 1.0:
        return None  # DeepSpeed did not scale (bf16/fp32); this run starts its own scaling
    state = dict(scaler.state_dict())
    if dynamic:
        window = int(saved["scale_window"])
        factor = float(saved["scale_factor"])
        cfg = scaler.config
        want = (window, factor, 1.0 / factor, float(saved["min_scale"]))
        have = (cfg.growth_interval, cfg.growth_factor, cfg.backoff_factor, cfg.min_scale)
        if not scaler.dynamic or want != have:
            raise CheckpointError(
                f"{where}: DeepSpeed scaled the loss dynamically (scale_window={window}, "
                f"scale_factor={factor}, min_scale={want[3]}); build ZeroOptimizer with "
                f"loss_scale='dynamic', loss_scale_config=LossScaleConfig(growth_interval="
                f"{window}, growth_factor={factor}, backoff_factor={1.0 / factor}, "
                f"min_scale={want[3]}) to continue it")
        state.update(scale=scale, good_steps=_good_steps(saved, window))
    else:
        if scaler.dynamic or float(scaler.scale) != scale:
            raise CheckpointError(f"{where}: DeepSpeed used a static loss scale of {scale}; "
                                  f"build ZeroOptimizer with loss_scale={scale}")
        state.update(scale=scale)
    if "overflows" in state:
        state["overflows"] = skipped_steps
    try:
        copy.deepcopy(scaler).load_state_dict(state)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: loss scaler: {e}") from None
    return state


def _good_steps(saved: Mapping[str, Any], window: int) -> int:
    """Good steps so far such that evenzero's next growth is DeepSpeed's next growth."""
    stable = int(saved["cur_iter"]) - int(saved["last_overflow_iter"]) - 1
    # DeepSpeed grows on the next step whose `stable` count is a positive multiple of the
    # window: m steps from now, counting that step.
    m = window + 1 if stable <= 0 else 1 + (-stable) % window
    return window - m
