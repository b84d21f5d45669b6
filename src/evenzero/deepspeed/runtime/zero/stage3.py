"""`deepspeed.runtime.zero.stage3`: ZeRO-3's optimizer. Code that compares against the class
(`isinstance(opt, DeepSpeedZeroOptimizer_Stage3)`) imports it; building one refuses."""

from __future__ import annotations

from typing import Any

from evenzero.deepspeed.refusals import ZERO3, unsupported


class DeepSpeedZeroOptimizer_Stage3:  # noqa: N801 (DeepSpeed's name)
    """Refused on construction (ZeRO-3); no optimizer here is an instance of it."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise unsupported("DeepSpeedZeroOptimizer_Stage3", ZERO3)


__all__ = ["DeepSpeedZeroOptimizer_Stage3"]
