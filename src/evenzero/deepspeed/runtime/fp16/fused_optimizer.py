"""`deepspeed.runtime.fp16.fused_optimizer`: DeepSpeed's `FP16_Optimizer` (fp16 without ZeRO). No engine
optimizer here is one; building it refuses (evenzero runs fp16 at ZeRO stage 1 or 2)."""

from __future__ import annotations

from typing import Any

from evenzero.deepspeed.refusals import unsupported


class FP16_Optimizer:  # noqa: N801 (DeepSpeed's name)
    """Refused on construction."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise unsupported("FP16_Optimizer", "fp16 without ZeRO is not run by evenzero; use ZeRO "
                                "stage 1 or 2")


__all__ = ["FP16_Optimizer"]
