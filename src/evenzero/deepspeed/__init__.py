"""`import evenzero.deepspeed as deepspeed`: run a DeepSpeed ZeRO-1/2 training script on
evenzero, changing only that import.

    engine, optimizer, loader, scheduler = deepspeed.initialize(
        args=args, model=model, model_parameters=model.parameters(), config=ds_config)
    for x, y in loader:
        loss = criterion(engine(x), y)
        engine.backward(loss)
        engine.step()

The names here mirror the DeepSpeed 0.19.8 API such a script uses: `initialize`,
`init_distributed`, `add_config_arguments`, `DeepSpeedEngine`, `comm`, `moe` (DeepSpeed's
own MoE layer, imported lazily when DeepSpeed is installed) and the LR schedules. What
each config key maps to, what is accepted as a no-op and what is refused: docs/why.md,
"Switching from DeepSpeed in one line". DeepSpeed itself is never imported here.
"""

from __future__ import annotations

import importlib
from typing import Any

from evenzero.deepspeed import comm
from evenzero.deepspeed.config import DeepSpeedConfigError
from evenzero.deepspeed.dataloader import DeepSpeedDataLoader, RepeatingLoader
from evenzero.deepspeed.engine import DeepSpeedEngine
from evenzero.deepspeed.launch import add_config_arguments, init_distributed
from evenzero.deepspeed.loss_scaler import DeepSpeedLossScaler
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


def __getattr__(name: str) -> Any:
    if name == "moe":
        return importlib.import_module("evenzero.deepspeed.moe")
    if name in ("zero", "checkpointing", "pipe", "ops", "runtime"):
        raise AttributeError(f"deepspeed.{name} is not provided by evenzero.deepspeed: "
                             f"{_MISSING[name]}")
    raise AttributeError(f"module 'evenzero.deepspeed' has no attribute {name!r}")


_MISSING = {
    "zero": "ZeRO stage 3 (deepspeed.zero.Init, GatheredParameters) is not supported",
    "checkpointing": "use torch.utils.checkpoint(use_reentrant=False) for activation "
                     "checkpointing",
    "pipe": "pipeline parallelism is not supported",
    "ops": "DeepSpeed's kernels are not provided; configure the optimizer in the config or "
           "pass a torch.optim optimizer",
    "runtime": "use evenzero.deepspeed's names directly (e.g. deepspeed.WarmupLR)",
}

__all__ = ["DeepSpeedConfigError", "DeepSpeedDataLoader", "DeepSpeedEngine",
           "DeepSpeedLossScaler", "LRRangeTest", "OneCycle", "RepeatingLoader", "WarmupCosineLR",
           "WarmupDecayLR", "WarmupLR", "__version__", "add_config_arguments", "comm",
           "init_distributed", "initialize"]
