"""Mixed precision: dtype names and the dynamic loss scaler for fp16 training.

Model parameters may be bf16 or fp16; the optimizer always steps fp32 master shards
(`master_dtype`), and gradients are accumulated into fp32 shards. Gradients travel in
`reduce_dtype` (the parameter dtype unless told otherwise).

fp16 gradients overflow easily, so fp16 training scales the loss up before backward and
the gradients down before the step. Overflow is agreed across ranks (it rides on the
step's single all-reduce), and a step with an overflow anywhere is skipped everywhere.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from evenzero.runtime.checks import ZeroConfigError

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "fp32": torch.float32, "fp16": torch.float16,
          "bf16": torch.bfloat16, "half": torch.float16}


def as_dtype(value: torch.dtype | str, what: str) -> torch.dtype:
    """A torch dtype from a dtype or a name; the error names the accepted spellings."""
    if isinstance(value, torch.dtype):
        if value not in DTYPES.values():
            raise ValueError(f"{what}: {value} is not a floating dtype the runtime supports; "
                             f"use one of {sorted(set(DTYPES) - {'half', 'fp16', 'fp32', 'bf16'})}")
        return value
    if value not in DTYPES:
        raise ValueError(f"{what}: unknown dtype {value!r}; use one of {sorted(DTYPES)}")
    return DTYPES[value]


@dataclass(frozen=True)
class LossScaleConfig:
    """Dynamic loss scaling, as in apex/DeepSpeed/torch.amp.GradScaler."""

    init_scale: float = 2.0**16
    """Scale of the first step."""
    growth_factor: float = 2.0
    """The scale is multiplied by this after `growth_interval` steps without overflow."""
    backoff_factor: float = 0.5
    """The scale is multiplied by this on every overflow (the step is skipped)."""
    growth_interval: int = 1000
    """Good steps in a row before the scale grows."""
    min_scale: float = 1.0
    """The scale never goes below this."""

    def __post_init__(self) -> None:
        for name in ("init_scale", "growth_factor", "backoff_factor", "min_scale"):
            value = getattr(self, name)
            if (isinstance(value, bool) or not isinstance(value, (int, float))
                    or not math.isfinite(value) or value <= 0):
                raise ZeroConfigError(f"LossScaleConfig.{name} must be a finite positive number, "
                                      f"got {value!r}")
        if self.growth_factor < 1:
            raise ZeroConfigError(f"LossScaleConfig.growth_factor must be >= 1, got "
                                  f"{self.growth_factor!r}; e.g. growth_factor=2.0")
        if not self.backoff_factor < 1:
            raise ZeroConfigError(f"LossScaleConfig.backoff_factor must be in (0, 1), got "
                                  f"{self.backoff_factor!r}; e.g. backoff_factor=0.5")
        if isinstance(self.growth_interval, bool) or not isinstance(self.growth_interval, int) \
                or self.growth_interval < 1:
            raise ZeroConfigError(f"LossScaleConfig.growth_interval must be an integer >= 1, got "
                                  f"{self.growth_interval!r}; e.g. growth_interval=1000")


class LossScaler:
    """Current loss scale and its update rule; `enabled=False` is a no-op scale of 1."""

    def __init__(self, enabled: bool, config: LossScaleConfig = LossScaleConfig(),
                 dynamic: bool = True) -> None:
        self.enabled = enabled
        self.dynamic = dynamic and enabled
        self.config = config
        self.scale = config.init_scale if enabled else 1.0
        self.good_steps = 0
        self.overflows = 0

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale if self.enabled else loss

    def update(self, overflow: bool) -> None:
        """Record one step's outcome: back off on overflow, grow after enough good steps."""
        if not self.dynamic:
            return
        if overflow:
            self.overflows += 1
            self.good_steps = 0
            self.scale = max(self.config.min_scale, self.scale * self.config.backoff_factor)
            return
        self.good_steps += 1
        if self.good_steps >= self.config.growth_interval:
            self.good_steps = 0
            self.scale *= self.config.growth_factor

    def state_dict(self) -> dict:
        return {"enabled": self.enabled, "dynamic": self.dynamic, "scale": self.scale,
                "good_steps": self.good_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict) -> None:
        if bool(state.get("enabled")) != self.enabled:
            raise ValueError(f"loss scaler state was saved with enabled={state.get('enabled')} "
                             f"but this optimizer has enabled={self.enabled}; build the optimizer "
                             f"with the same loss_scale setting as the run that saved it")
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.overflows = int(state.get("overflows", 0))


def loss_scaler_for(loss_scale: str | float | None, config: LossScaleConfig,
                    param_dtypes: list[torch.dtype]) -> LossScaler:
    """`ZeroConfig.loss_scale` to a scaler: None means dynamic for fp16 params, else off."""
    if loss_scale is None:
        return LossScaler(any(d == torch.float16 for d in param_dtypes), config)
    if loss_scale == "dynamic":
        return LossScaler(True, config)
    return LossScaler(True, replace(config, init_scale=float(loss_scale)), dynamic=False)


class ScalerSlot:
    """Holds the optimizer's current loss scaler. `ZeroOptimizer.loss_scaler` may be
    replaced after construction (the DeepSpeed drop-in puts its own in); the reducer,
    which divides each gradient by the scale of its backward, and the backward's check
    read it through this slot, so they always see the scaler in use."""

    def __init__(self, scaler: LossScaler) -> None:
        self.scaler = scaler

    def scale(self) -> float:
        """The current loss scale."""
        return self.scaler.scale
