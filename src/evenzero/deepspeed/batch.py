"""DeepSpeed's batch-size triple: train_batch_size = micro batch x accumulation x ranks."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from evenzero.deepspeed.config_keys import DeepSpeedConfigError


@dataclass(frozen=True)
class BatchSizes:
    train_batch_size: int
    micro_batch_per_gpu: int
    gradient_accumulation_steps: int


def batch_sizes(raw: Mapping[str, Any], world_size: int) -> BatchSizes:
    """DeepSpeed's batch triple (deepspeed/runtime/config.py@0.19.8:590-650)."""
    tbs = raw.get("train_batch_size")
    mbs = raw.get("train_micro_batch_size_per_gpu")
    gas = raw.get("gradient_accumulation_steps")
    for name, v in (("train_batch_size", tbs), ("train_micro_batch_size_per_gpu", mbs),
                    ("gradient_accumulation_steps", gas)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int)):
            raise DeepSpeedConfigError(f"{name} must be an integer, got {v!r}")
    if tbs is not None and mbs is not None and gas is not None:
        pass  # all three given: only the consistency check below applies
    elif tbs is not None and mbs is not None:
        gas = tbs // mbs // world_size
    elif tbs is not None and gas is not None:
        mbs = tbs // world_size // gas
    elif mbs is not None and gas is not None:
        tbs = mbs * gas * world_size
    elif tbs is not None:
        gas, mbs = 1, tbs // world_size
    elif mbs is not None:
        tbs, gas = mbs * world_size, 1
    else:
        raise DeepSpeedConfigError("Either train_batch_size or train_micro_batch_size_per_gpu "
                                   "needs to be provided")
    for what, v in (("Train batch size", tbs), ("Micro batch size per gpu", mbs),
                    ("Gradient accumulation steps", gas)):
        if v <= 0:
            raise DeepSpeedConfigError(f"{what}: {v} has to be greater than 0")
    if tbs != mbs * gas * world_size:
        raise DeepSpeedConfigError(
            f"Check batch related parameters. train_batch_size is not equal to "
            f"micro_batch_per_gpu * gradient_acc_step * world_size {tbs} != {mbs} * {gas} * "
            f"{world_size}")
    return BatchSizes(tbs, mbs, gas)
