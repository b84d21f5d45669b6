"""`deepspeed.runtime.bf16_optimizer`: DeepSpeed's bf16 optimizer without ZeRO. No engine
optimizer here is one; building it refuses (evenzero runs bf16 at ZeRO stage 1 or 2)."""

from __future__ import annotations

from typing import Any

from evenzero.deepspeed.refusals import unsupported


class BF16_Optimizer:  # noqa: N801 (DeepSpeed's name)
    """Refused on construction."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise unsupported("BF16_Optimizer", "bf16 without ZeRO is not run by evenzero; use "
                                            "ZeRO stage 1 or 2")


__all__ = ["BF16_Optimizer"]
