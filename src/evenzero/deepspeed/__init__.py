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
MoE layer and its helpers, implemented here: `moe.layer`, `moe.utils`, ...), the LR
schedules (also as `runtime.lr_schedules`), `ops.adam.FusedAdam` / `DeepSpeedCPUAdam` (their
CPU kernel's arithmetic in PyTorch) and `utils.logger` / `utils.log_dist`. What
each config key maps to, what is accepted as a no-op and what is refused: docs/why.md,
"Switching from DeepSpeed in one line". DeepSpeed itself is never imported here.
"""

from __future__ import annotations

import importlib
from types import SimpleNamespace
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
    if name in ("runtime", "utils"):
        return importlib.import_module(f"evenzero.deepspeed.{name}")
    if name == "ops":
        from evenzero.deepspeed.fused_adam import DeepSpeedCPUAdam, FusedAdam

        return SimpleNamespace(adam=SimpleNamespace(FusedAdam=FusedAdam,
                                                    DeepSpeedCPUAdam=DeepSpeedCPUAdam))
    if name in ("zero", "checkpointing", "pipe"):
        raise AttributeError(f"deepspeed.{name} is not provided by evenzero.deepspeed: "
                             f"{_MISSING[name]}")
    raise AttributeError(f"module 'evenzero.deepspeed' has no attribute {name!r}")


_MISSING = {
    "zero": "ZeRO stage 3 (deepspeed.zero.Init, GatheredParameters) is not supported",
    "checkpointing": "use torch.utils.checkpoint(use_reentrant=False) for activation "
                     "checkpointing",
    "pipe": "pipeline parallelism is not supported",
}

__all__ = ["DeepSpeedConfigError", "DeepSpeedDataLoader", "DeepSpeedEngine",
           "DeepSpeedLossScaler", "LRRangeTest", "OneCycle", "RepeatingLoader", "WarmupCosineLR",
           "WarmupDecayLR", "WarmupLR", "__version__", "add_config_arguments", "comm",
           "init_distributed", "initialize"]
