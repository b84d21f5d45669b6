"""`deepspeed.runtime.zero.stage_1_and_2`: DeepSpeed's ZeRO-1/2 optimizer class. Here
`engine.optimizer` at stage 1 or 2 is `EngineOptimizer`, so the name is that class: code
that checks `isinstance(engine.optimizer, DeepSpeedZeroOptimizer)` before reading the
ZeRO optimizer's attributes takes the ZeRO-1/2 branch, as under DeepSpeed."""

from __future__ import annotations

from evenzero.deepspeed.engine_optimizer import EngineOptimizer

DeepSpeedZeroOptimizer = EngineOptimizer

__all__ = ["DeepSpeedZeroOptimizer"]
