"""`deepspeed.checkpointing`: DeepSpeed's activation-checkpointing API
(deepspeed/runtime/activation_checkpointing/checkpointing.py@0.19.8) on
`torch.utils.checkpoint`.

`checkpoint(function, *args, **kwargs)` runs `function` without keeping its activations
and recomputes them in backward, with the CPU and accelerator RNG states of the forward
restored, as DeepSpeed's `CheckpointFunction` does. It is torch's non-reentrant
checkpoint (`use_reentrant=False`): evenzero reduces each gradient once as it is
accumulated, which a reentrant inner backward would break, and the gradients are the same.
Where DeepSpeed's reentrant function differs from torch's non-reentrant one, DeepSpeed's
result is kept: when no tensor argument requires a gradient, the outputs do not either
and the function's parameters get no gradient (DeepSpeed's autograd.Function only
records a graph through inputs that require one); the outputs come back as DeepSpeed
returns them (one tensor alone, several as a tuple). `non_reentrant_checkpoint` is
DeepSpeed's non-reentrant variant: torch's, unchanged.

`configure(...)` takes DeepSpeed's signature. What only changes timing or logging is
accepted (`synchronize`, `profile`, `num_checkpoints`); what evenzero cannot do is
refused by name: `partition_activations` (splits checkpoints across model-parallel
ranks; there are none here), `contiguous_checkpointing` (needs it) and
`checkpoint_in_cpu` (moves checkpoints to host memory), and an `mpu` with model
parallelism. Lightning's DeepSpeed strategy calls `configure` with all of them off.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from evenzero.deepspeed.log import info_rank0
from evenzero.deepspeed.refusals import unsupported

# DeepSpeed's config keys (deepspeed/runtime/activation_checkpointing/config.py@0.19.8).
SECTION = "activation_checkpointing"
REFUSED = {
    "partition_activations": "partitioning activation checkpoints across model-parallel "
                             "ranks needs model parallelism, which evenzero does not have",
    "contiguous_memory_optimization": "contiguous checkpoint buffers work only with "
                                      "partition_activations",
    "cpu_checkpointing": "moving activation checkpoints to CPU memory is not supported",
}
ARGUMENT_KEYS = {"partition_activations": "partition_activations",
                 "contiguous_checkpointing": "contiguous_memory_optimization",
                 "checkpoint_in_cpu": "cpu_checkpointing"}

_configured = False
num_layers: int | None = None
SYNCHRONIZE = False
PROFILE_TIME = False


def configure(mpu_: Any, deepspeed_config: Any = None, partition_activations: bool | None = None,
              contiguous_checkpointing: bool | None = None, num_checkpoints: int | None = None,
              checkpoint_in_cpu: bool | None = None, synchronize: bool | None = None,
              profile: bool | None = None) -> None:
    """DeepSpeed's `configure`: the config file's `activation_checkpointing` section, then
    the arguments over it; refuses what cannot be honoured (module docstring)."""
    global _configured, num_layers, SYNCHRONIZE, PROFILE_TIME
    settings: dict[str, Any] = {}
    if deepspeed_config is not None:
        from evenzero.deepspeed.config import load_config

        section = load_config(deepspeed_config).get(SECTION) or {}
        settings.update(section)
    given = {"partition_activations": partition_activations,
             "contiguous_checkpointing": contiguous_checkpointing,
             "checkpoint_in_cpu": checkpoint_in_cpu}
    for arg, value in given.items():
        if value is not None:
            settings[ARGUMENT_KEYS[arg]] = value
    for key, why in REFUSED.items():
        if settings.get(key):
            arg = next((a for a, k in ARGUMENT_KEYS.items() if k == key), key)
            raise unsupported(f"deepspeed.checkpointing.configure({arg}=True) / config key "
                              f"'{SECTION}.{key}'", why)
    if mpu_ is not None:
        size = (mpu_.get_tensor_model_parallel_world_size()
                if hasattr(mpu_, "get_tensor_model_parallel_world_size")
                else mpu_.get_model_parallel_world_size())
        if size != 1:
            raise unsupported("deepspeed.checkpointing.configure(mpu_=...)",
                              f"model parallelism (size {size}) is not supported")
    num_layers = num_checkpoints if num_checkpoints is not None else \
        settings.get("number_checkpoints")
    SYNCHRONIZE = bool(synchronize if synchronize is not None
                       else settings.get("synchronize_checkpoint_boundary", False))
    PROFILE_TIME = bool(profile if profile is not None else settings.get("profile", False))
    _configured = True
    if PROFILE_TIME:
        info_rank0("activation checkpointing: profile is accepted but times are not logged "
                   "(use torch.profiler)")


def is_configured() -> bool:
    """True once `configure` was called, as in DeepSpeed."""
    return _configured


def reset() -> None:
    """Nothing to free: no contiguous checkpoint buffers are kept."""


def set_num_layers(nlayers: int) -> None:
    global num_layers
    num_layers = nlayers


def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's `checkpoint` (see the module docstring for how it maps)."""
    if not torch.is_grad_enabled() or not any(
            isinstance(a, torch.Tensor) and a.requires_grad for a in (*args, *kwargs.values())):
        with torch.no_grad():
            outputs = _run(function, args, kwargs)
    else:
        outputs = _run(function, args, kwargs, recompute=True)
    return _as_deepspeed_returns(outputs)


def non_reentrant_checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's non-reentrant variant: torch's non-reentrant checkpoint."""
    return _as_deepspeed_returns(_run(function, args, kwargs, recompute=True))


def _run(function: Any, args: tuple, kwargs: dict, recompute: bool = False) -> Any:
    if SYNCHRONIZE:
        _synchronize()
    if recompute:
        out = torch_checkpoint.checkpoint(function, *args, use_reentrant=False,
                                          preserve_rng_state=True, **kwargs)
    else:
        out = function(*args, **kwargs)
    if SYNCHRONIZE:
        _synchronize()
    return out


def _synchronize() -> None:
    from evenzero.deepspeed.accelerator import get_accelerator

    get_accelerator().synchronize()


def _as_deepspeed_returns(outputs: Any) -> Any:
    """DeepSpeed collects the outputs in a list and returns its one element alone, else a
    tuple (checkpointing.py@0.19.8:1070-1076)."""
    if torch.is_tensor(outputs):
        return outputs
    outputs = tuple(outputs)
    return outputs[0] if len(outputs) == 1 else outputs


def __getattr__(name: str) -> Any:
    if name in ("get_cuda_rng_tracker", "model_parallel_cuda_manual_seed",
                "model_parallel_reconfigure_tp_seed", "CudaRNGStatesTracker"):
        raise AttributeError(f"deepspeed.checkpointing.{name}: the model-parallel RNG tracker "
                             f"is not provided (evenzero has no model parallelism)")
    raise AttributeError(f"deepspeed.checkpointing.{name} is not provided by evenzero.deepspeed "
                         f"(configure, checkpoint, non_reentrant_checkpoint, is_configured, "
                         f"reset and set_num_layers are)")


__all__ = ["checkpoint", "configure", "is_configured", "non_reentrant_checkpoint", "reset",
           "set_num_layers"]
