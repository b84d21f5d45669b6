"""`import evenzero.deepspeed as deepspeed`: run a DeepSpeed ZeRO-1/2 training script on
evenzero, changing only that import.

    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), config=ds_config)
    for x, y in loader:
        loss = criterion(engine(x), y)
        engine.backward(loss)
        engine.step()

The names here mirror the DeepSpeed 0.19.8 API that such scripts and the frameworks
built on DeepSpeed (Hugging Face Trainer, Accelerate, TRL) use: `initialize`,
`init_distributed`, `add_config_arguments`, `DeepSpeedEngine`, the LR schedules, and the
submodules `accelerator`, `checkpoint.utils`, `checkpointing` (activation checkpointing),
`comm`, `launcher.runner`, `moe` (DeepSpeed's MoE layer
and its helpers, implemented here), `ops.adam`, `runtime.lr_schedules` / `.engine` /
`.dataloader`, `utils.logging` / `.zero_to_fp32` and `zero` (ZeRO-3's API: refused, except
the no-op `GatheredParameters`), each importable as a real module. What DeepSpeed has and
evenzero does not is refused by name (`evenzero.deepspeed.refusals`). What each config key
maps to, what is accepted as a no-op and what is refused: docs/why.md, "Switching from
DeepSpeed in one line". DeepSpeed itself is never imported here.

`evenzero run COMMAND...` runs any launch command (python, torchrun, accelerate launch,
`deepspeed --num_gpus N ...`) with `import deepspeed` resolving to this package
(`evenzero.deepspeed.standin`).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from evenzero.deepspeed import comm
from evenzero.deepspeed.config import DeepSpeedConfigError
from evenzero.deepspeed.dataloader import DeepSpeedDataLoader, RepeatingLoader
from evenzero.deepspeed.engine import DeepSpeedEngine
from evenzero.deepspeed.launch import add_config_arguments, init_distributed
from evenzero.deepspeed.loss_scaler import DeepSpeedLossScaler
from evenzero.deepspeed.refusals import unsupported
from evenzero.deepspeed.schedulers import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
)
from evenzero.deepspeed.setup import initialize

__version__ = "0.19.8"
"""The DeepSpeed API version mirrored (scripts sometimes compare it)."""
__version_major__, __version_minor__, __version_patch__ = 0, 19, 8
version = __version__


SUBMODULES = ("accelerator", "checkpoint", "checkpointing", "git_version_info", "launcher", "moe",
              "ops", "pipe", "runtime", "utils", "zero")
"""DeepSpeed's submodules provided here, each a real module (`import deepspeed.ops.adam`)."""

_LAZY_NAMES = {"get_accelerator": "evenzero.deepspeed.accelerator",
               "log_dist": "evenzero.deepspeed.utils.logging",
               "logger": "evenzero.deepspeed.log"}


def __getattr__(name: str) -> Any:
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    if name in _LAZY_NAMES:
        return getattr(importlib.import_module(_LAZY_NAMES[name]), name)
    if name in _MISSING:
        raise AttributeError(f"deepspeed.{name} is not provided by evenzero.deepspeed: "
                             f"{_MISSING[name]}")
    raise AttributeError(f"module 'evenzero.deepspeed' has no attribute {name!r}")


_MISSING = {
    "inference": "DeepSpeed inference is not supported",
    "InferenceEngine": "DeepSpeed inference is not supported",
    "DeepSpeedHybridEngine": "the hybrid (RLHF) engine is not supported",
    "module_inject": "kernel injection and AutoTP are not supported",
}


def init_inference(model: Any = None, config: Any = None, **kwargs: Any) -> Any:
    """Refused: DeepSpeed inference is not part of evenzero."""
    raise unsupported("deepspeed.init_inference", "DeepSpeed inference is not supported")


def tp_model_init(model: Any = None, tp_size: Any = None, dtype: Any = None,
                  config: Any = None, **kwargs: Any) -> Any:
    """Refused: tensor parallelism is not part of evenzero."""
    raise unsupported("deepspeed.tp_model_init", "tensor parallelism (AutoTP) is not supported")


class PipelineModule(torch.nn.Module):
    """Refused on construction: pipeline parallelism is not part of evenzero."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise unsupported("deepspeed.PipelineModule", "pipeline parallelism is not supported")


__all__ = ["DeepSpeedConfigError", "DeepSpeedDataLoader", "DeepSpeedEngine",
           "DeepSpeedLossScaler", "LRRangeTest", "OneCycle", "PipelineModule", "RepeatingLoader",
           "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "__version__", "add_config_arguments",
           "comm", "init_distributed", "init_inference", "initialize", "tp_model_init"]
