"""DeepSpeed's fp16 loss scale, and the bridge that lets it drive a `ZeroOptimizer`.

`DeepSpeedLossScaler` follows deepspeed/runtime/fp16/loss_scaler.py@0.19.8
(`DynamicLossScaler`, `LossScaler`, `CreateLossScaler`): on an overflow the scale halves
only once `hysteresis` overflows have been absorbed (each overflow spends one), it never
goes below `min_loss_scale` and raises when asked to; after `loss_scale_window` good
steps since the last overflow it doubles and the hysteresis refills. evenzero's own
`LossScaler` has no hysteresis, so the engine keeps this one and hands `ZeroOptimizer`
a `ZeroScaleBridge` as its `loss_scaler` (the public attribute the optimizer reads).

The bridge's `scale` is the divisor the optimizer's step applies to the gradient shards.
The engine sets it per step to DeepSpeed's combined factor: DeepSpeed's ZeRO step
updates the scale *before* it unscales, so on a step where the scale grows the
gradients are divided by the new, doubled scale (deepspeed/runtime/zero/stage_1_and_2.py
@0.19.8:3046-3047,3193-3216). That is reproduced, not fixed: the same config must train
the same model.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from evenzero.deepspeed.log import info_rank0, warning_rank0


class LossScaleAtMinimum(Exception):
    """DeepSpeed's 'cannot decrease scale anymore' stop, raised on every rank."""


class DeepSpeedLossScaler:
    """`cur_scale` and DeepSpeed's update rule; `dynamic=False` is a fixed scale."""

    def __init__(self, init_scale: float = 1.0, dynamic: bool = False, scale_window: int = 1000,
                 min_scale: float = 1, delayed_shift: int = 2,
                 consecutive_hysteresis: bool = False,
                 raise_error_at_min_scale: bool = True) -> None:
        self.cur_scale = float(init_scale)
        self.dynamic = dynamic
        self.cur_iter = 0
        self.last_overflow_iter = -1
        self.scale_factor = 2.0
        self.scale_window = scale_window
        self.min_scale = min_scale
        self.delayed_shift = delayed_shift
        self.cur_hysteresis = delayed_shift
        self.consecutive_hysteresis = consecutive_hysteresis
        self.raise_error_at_min_scale = raise_error_at_min_scale

    @classmethod
    def from_precision(cls, precision) -> DeepSpeedLossScaler:
        """`CreateLossScaler` (deepspeed/runtime/fp16/loss_scaler.py@0.19.8:293): dynamic for
        fp16 with loss_scale 0, the static fp16 scale otherwise, 1.0 for bf16/fp32."""
        if precision.fp16 and precision.loss_scale == 0:
            return cls(2.0 ** precision.initial_scale_power, True, precision.loss_scale_window,
                       precision.min_loss_scale, precision.hysteresis,
                       precision.consecutive_hysteresis)
        return cls(precision.loss_scale if precision.fp16 else 1.0, dynamic=False)

    @property
    def loss_scale(self) -> float:
        return self.cur_scale

    def update_scale(self, overflow: bool) -> None:
        """One boundary step's outcome (deepspeed/runtime/fp16/loss_scaler.py@0.19.8:253)."""
        if not self.dynamic:
            if overflow:
                warning_rank0("OVERFLOW! Skipping step. Gradients are "
                               "non-finite, weights were not updated.")
            return
        if overflow:
            if self.delayed_shift == 1 or self.cur_hysteresis == 1:
                if self.cur_scale == self.min_scale and self.raise_error_at_min_scale:
                    raise LossScaleAtMinimum("Current loss scale already at minimum - cannot "
                                             "decrease scale anymore. Exiting run.")
                nxt = max(self.cur_scale / self.scale_factor, self.min_scale)
                info_rank0("OVERFLOW! Skipping step. Attempted loss "
                            "scale: %s, reducing to %s", self.cur_scale, nxt)
                self.cur_scale = nxt
            else:
                info_rank0("OVERFLOW! Skipping step. Attempted loss "
                            "scale: %s, but hysteresis is %s. Reducing hysteresis to %s",
                            self.cur_scale, self.cur_hysteresis, self.cur_hysteresis - 1)
                self.cur_hysteresis -= 1
            self.last_overflow_iter = self.cur_iter
        else:
            if self.consecutive_hysteresis:
                self.cur_hysteresis = self.delayed_shift
            stable = (self.cur_iter - self.last_overflow_iter) - 1
            if stable > 0 and stable % self.scale_window == 0:
                if not self.consecutive_hysteresis:
                    self.cur_hysteresis = self.delayed_shift
                self.cur_scale *= self.scale_factor
        self.cur_iter += 1

    _FIELDS = ("cur_scale", "dynamic", "cur_iter", "last_overflow_iter", "scale_factor",
               "scale_window", "min_scale", "delayed_shift", "cur_hysteresis",
               "consecutive_hysteresis", "raise_error_at_min_scale")

    def state_dict(self) -> dict:
        return {"kind": "deepspeed", **{f: getattr(self, f) for f in self._FIELDS}}

    def load_state_dict(self, state: dict) -> None:
        """Take over a saved scaler, as DeepSpeed's ZeRO load replaces its scaler object."""
        if state.get("kind") != "deepspeed":
            raise ValueError("the checkpoint's loss scaler was not saved by evenzero.deepspeed; "
                             "load it with the engine that saved it")
        if bool(state["dynamic"]) != self.dynamic:
            kinds = ["dynamic" if d else "static" for d in (state["dynamic"], self.dynamic)]
            raise ValueError(f"the checkpoint's loss scale is {kinds[0]} but this config's is "
                             f"{kinds[1]}; use the fp16 section the run was saved with")
        for f in self._FIELDS:
            setattr(self, f, type(getattr(self, f))(state[f]))


class ZeroScaleBridge:
    """What `ZeroOptimizer` reads as `loss_scaler`: the loss is scaled by DeepSpeed's
    current scale, the step divides the gradient shards by `scale` (set by the engine
    for each step), and overflowing steps are skipped (`enabled`)."""

    enabled = True
    dynamic = False

    def __init__(self, scaler: DeepSpeedLossScaler) -> None:
        self.deepspeed = scaler
        self.scale = scaler.cur_scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.deepspeed.cur_scale

    def update(self, overflow: bool) -> None:
        """No-op: the engine updates DeepSpeed's scaler before the unscale, as DeepSpeed does."""

    def state_dict(self) -> dict:
        return self.deepspeed.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.deepspeed.load_state_dict(state)
        self.scale = self.deepspeed.cur_scale

    def state_from_deepspeed(self, saved: Mapping[str, Any]) -> dict:
        """This scaler's state for one DeepSpeed saved (its pickled LossScaler's fields):
        the same semantics, so it continues exactly, hysteresis included."""
        current = self.deepspeed.state_dict()
        return {**current, **{f: saved[f] for f in DeepSpeedLossScaler._FIELDS if f in saved}}
