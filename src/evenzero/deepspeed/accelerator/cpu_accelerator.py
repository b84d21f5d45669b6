"""The CPU accelerator (deepspeed/accelerator/cpu_accelerator.py@0.19.8): one device per
NUMA node, RSS as the memory figures, gloo for communication."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from evenzero.deepspeed.accelerator.abstract_accelerator import DeepSpeedAccelerator


class CPU_Accelerator(DeepSpeedAccelerator):  # noqa: N801 - DeepSpeed's class name
    def __init__(self) -> None:
        super().__init__()
        self._name = "cpu"
        # DeepSpeed uses 'ccl' when oneccl_bindings_for_pytorch is importable; evenzero's
        # runtime communicates through gloo on the CPU.
        self._communication_backend_name = "gloo"
        self.max_mem = _rss()

    def is_synchronized_device(self) -> bool:
        return True

    def use_host_timers(self) -> bool:
        return True

    def resolves_data_dependency(self) -> bool:
        return True

    def handles_memory_backpressure(self) -> bool:
        return True

    # ------------------------------------------------------------------ devices

    def device_name(self, device_index: Any = None) -> str:
        return "cpu"

    def device(self, device_index: Any = None) -> None:
        return None

    def set_device(self, device_index: Any) -> None:
        return None

    def current_device(self) -> Any:
        return os.environ.get("LOCAL_RANK", 0)

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """`LOCAL_SIZE` when a launcher set it, else the NUMA nodes with cores."""
        local = int(os.environ.get("LOCAL_SIZE", 0))
        if local > 0:
            return local
        nodes = numa_core_lists()
        if not nodes:
            return 1
        count, previous = 0, None
        for cores in nodes:
            if cores and cores != previous:
                count += 1
                previous = cores
        return count

    def synchronize(self, device_index: Any = None) -> None:
        return None

    def is_available(self) -> bool:
        return True

    # ------------------------------------------------------------------ RNG

    def set_rng_state(self, new_state: torch.Tensor, device_index: Any = None) -> None:
        torch.set_rng_state(new_state)

    def get_rng_state(self, device_index: Any = None) -> torch.Tensor:
        return torch.get_rng_state()

    def manual_seed(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def initial_seed(self) -> int:
        return torch.initial_seed()

    def default_generator(self, device_index: Any) -> torch.Generator:
        return torch.default_generator

    # ------------------------------------------------------------------ streams

    @property
    def Stream(self) -> None:  # noqa: N802 - DeepSpeed's name
        return None

    def stream(self, stream: Any) -> Any:
        import contextlib

        return contextlib.nullcontext()

    def current_stream(self, device_index: Any = None) -> None:
        return None

    def default_stream(self, device_index: Any = None) -> None:
        return None

    @property
    def Event(self) -> None:  # noqa: N802
        return None

    # ------------------------------------------------------------------ memory (RSS)

    def empty_cache(self) -> None:
        return None

    def _rss(self) -> int:
        mem = _rss()
        self.max_mem = max(self.max_mem, mem)
        return mem

    def memory_allocated(self, device_index: Any = None) -> int:
        return self._rss()

    def max_memory_allocated(self, device_index: Any = None) -> int:
        self._rss()
        return self.max_mem

    def reset_max_memory_allocated(self, device_index: Any = None) -> None:
        self.max_mem = _rss()

    memory_cached = memory_allocated
    max_memory_cached = max_memory_allocated
    reset_max_memory_cached = reset_max_memory_allocated
    memory_reserved = memory_allocated
    max_memory_reserved = max_memory_allocated
    reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index: Any = None) -> dict[str, int]:
        mem = self._rss()
        return {"allocated_bytes.all.current": mem, "allocated_bytes.all.peak": self.max_mem}

    def total_memory(self, device_index: Any = None) -> int:
        return _meminfo("MemTotal")

    def available_memory(self, device_index: Any = None) -> int:
        return _meminfo("MemAvailable")

    # ------------------------------------------------------------------ dtypes

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        # The same probe as DeepSpeed's CPU accelerator.
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except Exception:  # noqa: BLE001 - an absent op means no fp16 kernels
            return False


def numa_core_lists() -> list[list[int]]:
    """Cores of each NUMA node, from sysfs (DeepSpeed asks `numactl --hardware`; both
    read the same kernel table). Empty when the kernel does not expose it."""
    root = Path("/sys/devices/system/node")
    nodes = sorted((int(m.group(1)), p) for p in root.glob("node*")
                   if (m := re.fullmatch(r"node(\d+)", p.name)))
    out = []
    for _, path in nodes:
        try:
            text = (path / "cpulist").read_text().strip()
        except OSError:
            return []
        out.append(parse_cpu_list(text) if text else [])
    return out


def parse_cpu_list(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11] (the kernel's and numactl's notation)."""
    cores: list[int] = []
    for part in text.split(","):
        if "-" in part:
            lo, hi = part.split("-")
            cores.extend(range(int(lo), int(hi) + 1))
        elif part:
            cores.append(int(part))
    return cores


def _rss() -> int:
    try:
        import psutil

        return int(psutil.Process().memory_info().rss)
    except ImportError:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
        return pages * os.sysconf("SC_PAGE_SIZE")


def _meminfo(key: str) -> int:
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total if key == "MemTotal" else vm.available)
    except ImportError:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
        raise
