"""The `evenzero.deepspeed` logger. Like DeepSpeed's own logger (deepspeed/utils/logging.py
@0.19.8) it prints INFO to stdout unless the application configured it, so the one-line
notes about accepted no-op config keys are seen. Notes about the job as a whole are
printed by rank 0 only."""

from __future__ import annotations

import logging
import sys

import torch.distributed as dist

logger = logging.getLogger("evenzero.deepspeed")
if not logger.handlers:
    _handler = logging.StreamHandler(sys.stdout)
    _handler.setFormatter(logging.Formatter("[evenzero.deepspeed] %(levelname)s %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def on_rank0() -> bool:
    return not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0


def info_rank0(msg: str, *args) -> None:
    if on_rank0():
        logger.info(msg, *args)


def warning_rank0(msg: str, *args) -> None:
    if on_rank0():
        logger.warning(msg, *args)
