"""`deepspeed.runtime`, as far as training scripts and frameworks reach into it: the LR
schedules (`runtime.lr_schedules`, with `VALID_LR_SCHEDULES`), the engine class
(`runtime.engine.DeepSpeedEngine`) and the data loaders (`runtime.dataloader`). Each is
a real submodule, so `import deepspeed.runtime.lr_schedules` works too."""

from __future__ import annotations

import importlib
from typing import Any

SUBMODULES = ("lr_schedules", "engine", "dataloader", "zero", "fp16", "bf16_optimizer")


def __getattr__(name: str) -> Any:
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"deepspeed.runtime.{name} is not provided by evenzero.deepspeed "
                         f"(runtime has {', '.join(SUBMODULES)})")


__all__ = list(SUBMODULES)
