"""The CUDA accelerator (deepspeed/accelerator/cuda_accelerator.py@0.19.8): torch.cuda's
device, RNG and memory calls, NCCL for communication."""

from __future__ import annotations

import os
import sys
from typing import Any

import torch

from evenzero.deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator


class CUDA_Accelerator(DeepSpeedAccelerator):  # noqa: N801 - DeepSpeed's class name
    def __init__(self) -> None:
        super().__init__()
        self._name = "cuda"
        self._communication_backend_name = "nccl" if sys.platform != "win32" else "gloo"

    def is_synchronized_device(self) -> bool:
        return False

    def use_host_timers(self) -> bool:
        return False

    def resolves_data_dependency(self) -> bool:
        return False

    def handles_memory_backpressure(self) -> bool:
        return False

    # ------------------------------------------------------------------ devices

    def device_name(self, device_index: Any = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: Any = None) -> torch.device:
        return torch.device("cuda", device_index)

    def set_device(self, device_index: Any) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index: Any = None) -> None:
        torch.cuda.synchronize(device_index)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    # ------------------------------------------------------------------ RNG

    def set_rng_state(self, new_state: torch.Tensor, device_index: Any = None) -> None:
        if device_index is None:
            torch.cuda.set_rng_state(new_state)
        else:
            torch.cuda.set_rng_state(new_state, device_index)

    def get_rng_state(self, device_index: Any = None) -> torch.Tensor:
        return torch.cuda.get_rng_state() if device_index is None else \
            torch.cuda.get_rng_state(device_index)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def initial_seed(self) -> int:
        return torch.cuda.initial_seed()

    def default_generator(self, device_index: int) -> torch.Generator:
        return torch.cuda.default_generators[device_index]

    # ------------------------------------------------------------------ streams

    @property
    def Stream(self) -> Any:  # noqa: N802 - DeepSpeed's name
        return torch.cuda.Stream

    def stream(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def current_stream(self, device_index: Any = None) -> Any:
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index: Any = None) -> Any:
        return torch.cuda.default_stream(device_index)

    @property
    def Event(self) -> Any:  # noqa: N802
        return torch.cuda.Event

    # ------------------------------------------------------------------ memory

    def empty_cache(self) -> None:
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index: Any = None) -> int:
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index: Any = None) -> int:
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index: Any = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_cached(self, device_index: Any = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_cached(self, device_index: Any = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def reset_max_memory_cached(self, device_index: Any = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_stats(self, device_index: Any = None) -> dict:
        return torch.cuda.memory_stats(device_index)

    def reset_peak_memory_stats(self, device_index: Any = None) -> None:
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index: Any = None) -> int:
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index: Any = None) -> int:
        return torch.cuda.max_memory_reserved(device_index)

    def total_memory(self, device_index: Any = None) -> int:
        return torch.cuda.get_device_properties(device_index).total_memory

    def available_memory(self, device_index: Any = None) -> int:
        free, _ = torch.cuda.mem_get_info(device_index)
        return free

    # ------------------------------------------------------------------ dtypes

    def is_bf16_supported(self) -> bool:
        if not torch.cuda.is_available():
            return True
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self) -> bool:
        if not torch.cuda.is_available():
            return True
        # Compute capability 6.x fp16 is deprecated in DeepSpeed unless explicitly allowed.
        major, _ = torch.cuda.get_device_capability()
        if major >= 7:
            return True
        return major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1"

    def is_triton_supported(self) -> bool:
        if not self.is_available():
            return False
        return torch.cuda.get_device_capability()[0] >= 8

    def visible_devices_envs(self) -> list[str]:
        return ["CUDA_VISIBLE_DEVICES"]
