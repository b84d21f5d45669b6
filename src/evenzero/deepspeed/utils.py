"""`deepspeed.utils`, as far as training scripts use it: `logger` and `log_dist`."""

from __future__ import annotations

import logging

import torch.distributed as dist

from evenzero.deepspeed.dataloader import RepeatingLoader
from evenzero.deepspeed.log import logger


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    """Log on the given ranks (all when `ranks` is None or holds -1), as DeepSpeed's."""
    rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    if ranks is None or -1 in ranks or rank in ranks:
        logger.log(level, "[Rank %s] %s", rank, message)


def __getattr__(name: str):
    raise AttributeError(f"deepspeed.utils.{name} is not provided by evenzero.deepspeed "
                         f"(only logger, log_dist and RepeatingLoader are)")


__all__ = ["RepeatingLoader", "log_dist", "logger"]
