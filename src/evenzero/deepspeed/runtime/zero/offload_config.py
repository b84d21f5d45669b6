"""`deepspeed.runtime.zero.offload_config`: the offload devices DeepSpeed names. Only `none`
runs here (offload is refused as a config key); the enum imports for comparisons."""

from __future__ import annotations

from enum import Enum


class OffloadDeviceEnum(str, Enum):
    """DeepSpeed's offload targets (deepspeed/runtime/zero/offload_config.py@0.19.8)."""

    none = "none"
    cpu = "cpu"
    nvme = "nvme"


__all__ = ["OffloadDeviceEnum"]
