"""`deepspeed.accelerator`: `get_accelerator()` for the two devices evenzero runs on, the
CPU and CUDA, with the methods of DeepSpeed 0.19.8's `CPU_Accelerator` and
`CUDA_Accelerator` (deepspeed/accelerator/cpu_accelerator.py, cuda_accelerator.py)
that training scripts and frameworks call: device names, `set_device`, `current_device`,
`device_count`, `synchronize`, RNG, memory queries, `communication_backend_name`,
`is_bf16_supported` / `is_fp16_supported`. DeepSpeed's compiled-op builders are not
provided (`get_op_builder` raises naming the op).

Which one: `DS_ACCELERATOR` (`cpu` or `cuda`; any other accelerator is refused by name),
else CUDA when torch sees a GPU, else the CPU: the same rule the engine uses to place the
model (`evenzero.deepspeed.launch.use_cpu`).
"""

from __future__ import annotations

from evenzero.deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator
from evenzero.deepspeed.accelerator.real_accelerator import (
    get_accelerator,
    is_current_accelerator_supported,
    set_accelerator,
)

__all__ = ["DeepSpeedAccelerator", "get_accelerator", "is_current_accelerator_supported",
           "set_accelerator"]
