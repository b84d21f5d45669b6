"""`deepspeed.utils`, as far as training scripts and frameworks use it: `logger`,
`log_dist`, `RepeatingLoader`, and the submodules `utils.logging` and
`utils.zero_to_fp32` (importable, and reachable as attributes)."""

from __future__ import annotations

import importlib
from typing import Any

from evenzero.deepspeed.dataloader import RepeatingLoader
from evenzero.deepspeed.log import logger
from evenzero.deepspeed.utils.logging import (
    log_dist,
    log_dist_once,
    set_log_level_from_string,
)

SUBMODULES = ("logging", "zero_to_fp32")


def __getattr__(name: str) -> Any:
    if name in SUBMODULES:
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"deepspeed.utils.{name} is not provided by evenzero.deepspeed "
                         f"(only logger, log_dist, log_dist_once, set_log_level_from_string, "
                         f"RepeatingLoader and the submodules {', '.join(SUBMODULES)} are)")


__all__ = ["RepeatingLoader", "log_dist", "log_dist_once", "logger",
           "set_log_level_from_string"]
