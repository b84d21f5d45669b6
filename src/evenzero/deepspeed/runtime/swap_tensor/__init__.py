"""`deepspeed.runtime.swap_tensor`: NVMe offload, which evenzero refuses (as the config keys
`offload_optimizer` / `offload_param` with device nvme). The package imports for the one
constant scripts and tests read from it; its submodules are refused by name."""

from __future__ import annotations

MIN_SWAPPABLE_BYTES = 1024 ** 2
"""DeepSpeed's smallest tensor it swaps (deepspeed/runtime/swap_tensor/utils.py@0.19.8:
MIN_AIO_BYTES)."""

__all__ = ["MIN_SWAPPABLE_BYTES"]
