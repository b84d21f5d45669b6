"""`deepspeed.zero`: the ZeRO-3 API, where evenzero has no ZeRO-3.

* `GatheredParameters(params, modifier_rank=None, fwd_module=None, enabled=True)` is a
  context that does nothing, exactly as DeepSpeed's does for parameters that were not
  partitioned by `zero.Init` (deepspeed/runtime/zero/partition_parameters.py@0.19.8:2438:
  "enable if at least one is zero-param, otherwise a noop"); under evenzero no parameter
  is partitioned, every rank holds the whole model. Frameworks call it around weight
  edits (resizing embeddings, loading pretrained weights).
* `Init(...)` with `enabled=False` is DeepSpeed's no-op too; enabled, it raises naming
  the call, as do `register_external_parameter` and the other ZeRO-3-only names.
* `ZeroParamStatus` / `ZeroParamType` are DeepSpeed's enums (compared against, never set).
"""

from __future__ import annotations

from enum import Enum
from typing import Any

from evenzero.deepspeed.refusals import ZERO3, unsupported


class ZeroParamType(Enum):
    NORMAL = 1
    PARTITIONED = 2
    REMOTE = 3


class ZeroParamStatus(Enum):
    AVAILABLE = 1
    NOT_AVAILABLE = 2
    INFLIGHT = 3


class GatheredParameters:
    """A no-op: no parameter is partitioned here (see the module docstring)."""

    def __init__(self, params: Any, modifier_rank: int | None = None, fwd_module: Any = None,
                 enabled: bool = True) -> None:
        self.enabled = False

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


class Init:
    """`deepspeed.zero.Init`: builds a model with partitioned parameters (ZeRO-3).
    Refused unless `enabled=False`, which DeepSpeed also treats as a no-op."""

    def __init__(self, *args: Any, enabled: bool = True, **kwargs: Any) -> None:
        if enabled:
            raise unsupported("deepspeed.zero.Init", ZERO3)

    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def register_external_parameter(module: Any, parameter: Any) -> None:
    raise unsupported("deepspeed.zero.register_external_parameter", ZERO3)


def unregister_external_parameter(module: Any, parameter: Any) -> None:
    raise unsupported("deepspeed.zero.unregister_external_parameter", ZERO3)


def __getattr__(name: str) -> Any:
    raise AttributeError(f"deepspeed.zero.{name}: {ZERO3} (evenzero.deepspeed provides only "
                         f"GatheredParameters, a no-op here, and refuses Init)")


__all__ = ["GatheredParameters", "Init", "ZeroParamStatus", "ZeroParamType",
           "register_external_parameter", "unregister_external_parameter"]
