"""`deepspeed.runtime.zero`: where DeepSpeed keeps both its ZeRO-1/2 optimizer and ZeRO-3.
The package and its ZeRO-1/2 names import (`stage_1_and_2.DeepSpeedZeroOptimizer`,
`config.DeepSpeedZeroConfig`, `utils.ZeRORuntimeException`, `offload_config`, the
`ZeroParamStatus` enums); ZeRO-3 is refused when used (`Init`, the stage-3 optimizer, a
`DeepSpeedZeroConfig` with stage 3), not when imported, as `deepspeed.zero` does."""

from __future__ import annotations

from evenzero.deepspeed.zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    ZeroParamType,
    register_external_parameter,
)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "ZeroParamType",
           "register_external_parameter"]
