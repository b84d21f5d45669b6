"""The strategies' evenzero options, and what Lightning's precision setting implies for them.

`EvenZeroStrategy(stage=1, bucket_numel=2**22, ...)` takes `ZeroConfig` fields as
keywords (or a whole `config=ZeroConfig(...)`; `offload_optimizer=True` means "cpu", as
in Lightning's DeepSpeedStrategy); they are checked when the strategy is
built, so a bad value fails at `Trainer(...)` / `Fabric(...)` on every rank. DDP's own
options mean nothing without a DDP wrapper and are refused by name.

Lightning's `precision=` decides what the `ZeroOptimizer` needs beyond that:

* "32-true", "bf16-mixed": nothing (fp32 parameters, fp32 masters);
* "bf16-true", "16-true": the module is converted to that dtype by Lightning; the
  optimizer keeps fp32 masters (`master_dtype`), as DeepSpeed's ZeRO does, so the update
  is not rounded to 8 or 11 bits of mantissa. DDP steps the half-precision weights
  themselves, so these two differ from `strategy="ddp"` by that rounding;
* "16-true", "16-mixed": dynamic loss scaling inside the optimizer (`opt.scale_loss`),
  with torch.amp.GradScaler's schedule (or the one of the GradScaler given to
  Lightning's MixedPrecision plugin): a 2**16 start, x2 after 2000 good steps, x0.5 and a
  skipped step on overflow;
* "64-true": float64 masters (fp32 ones would round the float64 weights).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from evenzero.runtime import LossScaleConfig, ZeroConfig, ZeroConfigError

STRATEGY_NAMES = {
    "evenzero": ({}, "evenzero ZeRO-2: sharded gradients and optimizer state, one equal "
                     "reduce-scatter per bucket"),
    "evenzero_stage_1": ({"stage": 1}, "evenzero ZeRO-1: sharded optimizer state"),
    "evenzero_stage_2": ({"stage": 2}, "evenzero ZeRO-2 (the same as 'evenzero')"),
}
"""Names registered in the Trainer's and Fabric's strategy registries: (init parameters,
description)."""

SUPPORTED_PRECISIONS = ("32-true", "bf16-true", "16-true", "bf16-mixed", "16-mixed", "64-true")

DDP_ONLY_OPTIONS = {
    "find_unused_parameters": "allow_partial_grads=True",
    "static_graph": None,
    "gradient_as_bucket_view": None,
    "bucket_cap_mb": "bucket_numel=<elements>",
    "broadcast_buffers": None,
    "ddp_comm_state": None,
    # DDP's bf16_compress_hook / fp16_compress_wrapper compress what each rank sends.
    "ddp_comm_hook": "grad_compression=\"bf16\" (or \"int8\")",
    "ddp_comm_wrapper": "grad_compression=\"bf16\"",
    "model_averaging_period": None,
}
"""Options of DDPStrategy / DistributedDataParallel, and the evenzero option that is
closest (None: there is none)."""

GRAD_SCALER_SCHEDULE = LossScaleConfig(init_scale=2.0**16, growth_factor=2.0,
                                       backoff_factor=0.5, growth_interval=2000)
"""torch.amp.GradScaler's defaults (torch/amp/grad_scaler.py@v2.13.0)."""


def zero_options(config: ZeroConfig | None, kwargs: Mapping[str, Any], who: str) -> dict[str, Any]:
    """The `ZeroConfig` fields a strategy was given; refuses anything else by name."""
    fields = ZeroConfig.field_names()
    for key in kwargs:
        if key in DDP_ONLY_OPTIONS:
            closest = DDP_ONLY_OPTIONS[key]
            raise TypeError(f"{who}({key}=...): that is an option of DistributedDataParallel, which "
                            f"evenzero does not use" +
                            (f"; the closest evenzero option is {closest}" if closest else ""))
        if key not in fields:
            raise TypeError(f"{who}() got an unexpected keyword argument {key!r}; evenzero's options "
                            f"are the fields of evenzero.runtime.ZeroConfig: {sorted(fields)}")
    if config is not None and not isinstance(config, ZeroConfig):
        raise TypeError(f"{who}(config=...) must be an evenzero.runtime.ZeroConfig, got "
                        f"{type(config).__name__}")
    given = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)} if config else {}
    given.update(kwargs)
    offload = given.get("offload_optimizer")
    if isinstance(offload, bool):  # Lightning's DeepSpeedStrategy(offload_optimizer=True)
        given["offload_optimizer"] = "cpu" if offload else None
    ZeroConfig(**given)  # every value checked now, on every rank that builds the strategy
    return given


def zero_config(options: Mapping[str, Any], precision: str,
                grad_scaler: Any = None) -> ZeroConfig:
    """The `ZeroConfig` for `options` under Lightning's `precision` setting."""
    if precision not in SUPPORTED_PRECISIONS:
        raise ZeroConfigError(f"precision={precision!r} is not supported by the evenzero strategy; "
                              f"use one of {list(SUPPORTED_PRECISIONS)}")
    settings = dict(options)
    if precision in ("16-true", "16-mixed"):
        if precision == "16-mixed" and settings.get("loss_scale") is None:
            settings["loss_scale"] = "dynamic"  # fp32 parameters: not dynamic by default
        if settings.get("loss_scale_config", LossScaleConfig()) == LossScaleConfig():
            settings["loss_scale_config"] = _schedule_of(grad_scaler)
    if precision == "64-true" and settings.get("master_dtype", torch.float32) == torch.float32:
        settings["master_dtype"] = torch.float64
    return ZeroConfig(**settings)


def _schedule_of(grad_scaler: Any) -> LossScaleConfig:
    """The loss-scale schedule of a torch GradScaler, through its public getters."""
    if grad_scaler is None or not grad_scaler.is_enabled():
        return GRAD_SCALER_SCHEDULE
    return LossScaleConfig(init_scale=float(grad_scaler.get_scale()),
                           growth_factor=float(grad_scaler.get_growth_factor()),
                           backoff_factor=float(grad_scaler.get_backoff_factor()),
                           growth_interval=int(grad_scaler.get_growth_interval()))
