"""`deepspeed.utils.logging` (deepspeed/utils/logging.py@0.19.8): the package logger and
the rank-filtered helpers built on it. Which ranks log follows DeepSpeed's
`get_dist_msg`: every rank before torch.distributed is initialised; afterwards only the
ranks listed (`[-1]` meaning all), so `log_dist(msg)` with no ranks logs nothing in a
distributed job, as in DeepSpeed."""

from __future__ import annotations

import functools
import json
import logging
import os
from typing import Any

import torch.distributed as dist

from evenzero.deepspeed.log import logger

log_levels = {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
              "error": logging.ERROR, "critical": logging.CRITICAL}


def _rank() -> int | None:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def get_dist_msg(message: str, ranks: list[int] | None = None) -> str | None:
    rank = _rank()
    ranks = ranks or []
    should_log = rank is None or (bool(ranks) and (ranks[0] == -1 or rank in set(ranks)))
    return f"[Rank {-1 if rank is None else rank}] {message}" if should_log else None


def log_dist(message: str, ranks: list[int] | None = None, level: int = logging.INFO) -> None:
    final = get_dist_msg(message, ranks)
    if final is not None:
        logger.log(level, final)


def print_dist(message: str, ranks: list[int] | None = None) -> None:
    final = get_dist_msg(message, ranks)
    if final is not None:
        print(final)


@functools.lru_cache(None)
def _log_dist_once(message: str, ranks: tuple[int, ...] | None, level: int) -> None:
    log_dist(message, ranks=list(ranks) if ranks is not None else None, level=level)


def log_dist_once(message: str, ranks: list[int] | None = None,
                  level: int = logging.INFO) -> None:
    _log_dist_once(message, tuple(ranks) if ranks is not None else None, level)


@functools.lru_cache(None)
def warning_once(*args: Any, **kwargs: Any) -> None:
    logger.warning(*args, **kwargs)


def print_json_dist(message: dict, ranks: list[int] | None = None,
                    path: str | None = None) -> None:
    rank = _rank()
    ranks = ranks or []
    if rank is None or (ranks and (ranks[0] == -1 or rank in set(ranks))):
        message["rank"] = -1 if rank is None else rank
        with open(path, "w") as f:
            json.dump(message, f)
            f.flush()
            os.fsync(f.fileno())


def get_log_level_from_string(log_level_str: str) -> int:
    level = log_levels.get(log_level_str.lower())
    if level is None:
        raise ValueError(f"{log_level_str} is not one of the valid logging levels. Valid log "
                         f"levels are {log_levels.keys()}.")
    return level


def set_log_level_from_string(log_level_str: str, custom_logger: Any = None) -> None:
    level = get_log_level_from_string(log_level_str)
    target = logger if custom_logger is None else custom_logger
    target.setLevel(level)
    for handler in target.handlers:
        handler.setLevel(level)


def get_current_level() -> int:
    return logger.getEffectiveLevel()


def should_log_le(max_log_level_str: str) -> bool:
    if not isinstance(max_log_level_str, str):
        raise ValueError(f"{max_log_level_str} is not a string")
    return get_current_level() <= get_log_level_from_string(max_log_level_str)


__all__ = ["get_current_level", "get_dist_msg", "log_dist", "log_dist_once", "logger",
           "print_dist", "print_json_dist", "set_log_level_from_string", "should_log_le",
           "warning_once"]
