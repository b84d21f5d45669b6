"""Which accelerator a process uses (deepspeed/accelerator/real_accelerator.py@0.19.8)."""

from __future__ import annotations

from evenzero.deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator

SUPPORTED = ("cpu", "cuda")

_accelerator: DeepSpeedAccelerator | None = None


def get_accelerator() -> DeepSpeedAccelerator:
    """The process's accelerator, chosen once: `DS_ACCELERATOR`, else CUDA if available,
    else the CPU (the engine places the model by the same rule)."""
    global _accelerator
    if _accelerator is None:
        from evenzero.deepspeed.launch import use_cpu

        if use_cpu():
            from evenzero.deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

            _accelerator = CPU_Accelerator()
        else:
            from evenzero.deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

            _accelerator = CUDA_Accelerator()
    return _accelerator


def set_accelerator(accel_obj: DeepSpeedAccelerator) -> None:
    """Use `accel_obj` (one of this package's CPU or CUDA accelerators) from now on."""
    global _accelerator
    if not isinstance(accel_obj, DeepSpeedAccelerator) or accel_obj._name not in SUPPORTED:
        raise ValueError(f"set_accelerator({type(accel_obj).__name__}): evenzero runs on "
                         f"{' or '.join(SUPPORTED)} only; pass "
                         f"deepspeed.accelerator.cpu_accelerator.CPU_Accelerator() or "
                         f"cuda_accelerator.CUDA_Accelerator()")
    _accelerator = accel_obj


def is_current_accelerator_supported() -> bool:
    return get_accelerator()._name in SUPPORTED
