"""What DeepSpeed's CPU and CUDA accelerators share (deepspeed/accelerator/
abstract_accelerator.py@0.19.8 is the interface; the bodies follow cpu_accelerator.py and
cuda_accelerator.py there)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch


class DeepSpeedAccelerator:
    """Base of `CPU_Accelerator` and `CUDA_Accelerator`."""

    _name = ""
    _communication_backend_name = ""

    def __init__(self) -> None:
        self._compile_backend = "inductor"

    # ------------------------------------------------------------------ misc

    def random(self) -> Any:
        return torch.random

    def lazy_call(self, callback: Any) -> Any:
        return callback()

    def range_push(self, msg: str, domain: Any = None, category: Any = None) -> None:
        return None

    def range_pop(self, domain: Any = None) -> None:
        return None

    def communication_backend_name(self) -> str:
        return self._communication_backend_name

    def supported_dtypes(self) -> list[torch.dtype]:
        out = [torch.float]
        if self.is_fp16_supported():
            out.append(torch.half)
        if self.is_bf16_supported():
            out.append(torch.bfloat16)
        return out

    def is_fp64_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        raise NotImplementedError

    def is_bf16_supported(self) -> bool:
        raise NotImplementedError

    def is_triton_supported(self) -> bool:
        return False

    def prefer_triton_grouped_mm(self) -> bool:
        return False

    def get_compile_backend(self) -> str:
        return self._compile_backend

    def set_compile_backend(self, backend: str) -> None:
        supported = torch._dynamo.list_backends(exclude_tags=())
        if backend not in supported:
            raise ValueError(f"{backend} not supported by {self._name}. Supported Backends are "
                             f"{supported}")
        self._compile_backend = backend

    def on_accelerator(self, tensor: torch.Tensor) -> bool:
        return str(tensor.device).startswith(self._name)

    def export_envs(self) -> list[str]:
        return []

    def visible_devices_envs(self) -> list[str]:
        # DeepSpeed's CPU accelerator also names CUDA_VISIBLE_DEVICES (cpu_accelerator.py).
        return ["CUDA_VISIBLE_DEVICES"]

    def set_visible_devices_envs(self, current_env: dict, local_accelerator_ids: list) -> None:
        for env in self.visible_devices_envs():
            current_env[env] = ",".join(map(str, local_accelerator_ids))

    def pin_memory(self, tensor: torch.Tensor, align_bytes: int = 1, **kwargs: Any
                   ) -> torch.Tensor:
        return tensor

    def is_pinned(self, tensor: torch.Tensor) -> bool:
        return tensor.is_pinned() if tensor.device.type == "cpu" else False

    def create_graph(self) -> Any:
        return None

    def capture_to_graph(self, graph: Any, pool: Any = None, stream: Any = None) -> Any:
        return contextlib.nullcontext()

    def replay_graph(self, graph: Any) -> None:
        return None

    # ------------------------------------------------------------------ tensor types

    @property
    def BFloat16Tensor(self) -> Any:  # noqa: N802 - DeepSpeed's names
        return torch.BFloat16Tensor

    @property
    def ByteTensor(self) -> Any:  # noqa: N802
        return torch.ByteTensor

    @property
    def DoubleTensor(self) -> Any:  # noqa: N802
        return torch.DoubleTensor

    @property
    def FloatTensor(self) -> Any:  # noqa: N802
        return torch.FloatTensor

    @property
    def HalfTensor(self) -> Any:  # noqa: N802
        return torch.HalfTensor

    @property
    def IntTensor(self) -> Any:  # noqa: N802
        return torch.IntTensor

    @property
    def LongTensor(self) -> Any:  # noqa: N802
        return torch.LongTensor

    # ------------------------------------------------------------------ compiled ops

    def op_builder_dir(self) -> str:
        raise NotImplementedError(_NO_OPS)

    def create_op_builder(self, op_name: str) -> Any:
        raise NotImplementedError(f"{op_name}: {_NO_OPS}")

    def get_op_builder(self, class_name: str) -> Any:
        raise NotImplementedError(f"{class_name}: {_NO_OPS}")

    def build_extension(self) -> Any:
        raise NotImplementedError(_NO_OPS)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self._name!r})"


_NO_OPS = ("DeepSpeed's compiled ops (op builders) are not provided by evenzero.deepspeed; "
           "its optimizers are deepspeed.ops.adam.FusedAdam / DeepSpeedCPUAdam in PyTorch")
