"""`deepspeed.moe.mappings`: token gathering and dropping across tensor-parallel ranks
(deepspeed/moe/mappings.py@0.19.8:104-118). DeepSpeed applies them only when a model-parallel
unit with tensor-parallel size > 1 is set; evenzero runs data and expert parallelism only
(`deepspeed.initialize` refuses an `mpu`), where both return their input unchanged, as
DeepSpeed's do without one."""

from __future__ import annotations

import torch


def gather_tokens(input_: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return input_


def drop_tokens(input_: torch.Tensor, dim: int = 0) -> torch.Tensor:
    return input_
