"""`deepspeed.runtime.zero.partition_parameters`: ZeRO-3's parameter partitioning. Its enums
and no-op contexts import (`evenzero.deepspeed.zero`); `Init` refuses when enabled."""

from __future__ import annotations

from evenzero.deepspeed.zero import (
    GatheredParameters,
    Init,
    ZeroParamStatus,
    ZeroParamType,
    register_external_parameter,
    unregister_external_parameter,
)

__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "ZeroParamType",
           "register_external_parameter", "unregister_external_parameter"]
