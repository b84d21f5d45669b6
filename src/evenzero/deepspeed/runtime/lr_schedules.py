"""`deepspeed.runtime.lr_schedules`: DeepSpeed's LR schedule classes (implemented in
`evenzero.deepspeed.schedulers`) and the names Accelerate checks a scheduler against
(`VALID_LR_SCHEDULES`, deepspeed/runtime/lr_schedules.py@0.19.8:19-24)."""

from __future__ import annotations

from evenzero.deepspeed.schedulers import (
    LRRangeTest,
    OneCycle,
    WarmupCosineLR,
    WarmupDecayLR,
    WarmupLR,
    torch_optimizer,
)

get_torch_optimizer = torch_optimizer
"""DeepSpeed's name for it (deepspeed/runtime/lr_schedules.py@0.19.8:293)."""

LR_SCHEDULE = "lr_schedule"
LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]

__all__ = ["LRRangeTest", "LR_RANGE_TEST", "LR_SCHEDULE", "ONE_CYCLE", "OneCycle",
           "VALID_LR_SCHEDULES", "WARMUP_COSINE_LR", "WARMUP_DECAY_LR", "WARMUP_LR",
           "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "get_torch_optimizer"]
