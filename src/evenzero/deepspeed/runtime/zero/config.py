"""`deepspeed.runtime.zero.config.DeepSpeedZeroConfig`: the `zero_optimization` section as an
object, with DeepSpeed's defaults for the ZeRO-1/2 settings (deepspeed/runtime/zero/
config.py@0.19.8). Building one for stage 3, or with an offload device, refuses by name."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from evenzero.deepspeed.refusals import ZERO3, unsupported

_OFFLOAD = "ZeRO-Offload (offload_optimizer / offload_param) is not supported"


@dataclass(frozen=True)
class DeepSpeedZeroConfig:
    """DeepSpeed's ZeRO settings that apply at stages 0-2, with its defaults."""

    stage: int = 0
    contiguous_gradients: bool = True
    reduce_scatter: bool = True
    reduce_bucket_size: int = 500_000_000
    use_multi_rank_bucket_allreduce: bool = True
    allgather_partitions: bool = True
    allgather_bucket_size: int = 500_000_000
    overlap_comm: bool | None = None
    load_from_fp32_weights: bool = True
    elastic_checkpoint: bool = False
    round_robin_gradients: bool = False
    ignore_unused_parameters: bool = True
    legacy_stage1: bool = False
    offload_optimizer: Any = None
    offload_param: Any = None
    sub_group_size: int = 1_000_000_000
    log_trace_cache_warnings: bool = False

    def __post_init__(self) -> None:
        if self.stage == 3:
            raise unsupported("DeepSpeedZeroConfig(stage=3)", ZERO3)
        for key in ("offload_optimizer", "offload_param"):
            device = _device(getattr(self, key))
            if device not in (None, "none"):
                raise unsupported(f"DeepSpeedZeroConfig({key}=...)", _OFFLOAD)

    @classmethod
    def from_dict(cls, section: dict[str, Any]) -> DeepSpeedZeroConfig:
        """The section of a DeepSpeed config; keys that only ZeRO-3 reads are ignored."""
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in section.items() if k in names})


def _device(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, dict):
        value = value.get("device", "none")
    return str(getattr(value, "value", value))


__all__ = ["DeepSpeedZeroConfig"]
