"""The parts of DeepSpeed 0.19.8 that evenzero.deepspeed does not provide, and why.

`import deepspeed.X` of a module listed here (or below one) fails with
`ModuleNotFoundError` naming the feature; so does any other DeepSpeed module this
package does not have (the `deepspeed` stand-in's import finder asks `missing_module`).
A script that only imports such a module inside `try/except ImportError` keeps its
fallback, as without DeepSpeed.

Refused calls raise `UnsupportedError` (a `NotImplementedError`) and refused modules
`RefusedModuleError` (a `ModuleNotFoundError`), so that code catching what DeepSpeed's
users catch keeps working, while `evenzero run` can tell a refusal from a crash
(`evenzero.deepspeed.uncaught`).
"""

from __future__ import annotations


class UnsupportedError(NotImplementedError):
    """A DeepSpeed call that evenzero.deepspeed refuses; the message names it and why."""


class RefusedModuleError(ModuleNotFoundError):
    """A DeepSpeed module that evenzero.deepspeed does not provide; the message says why."""


ZERO3 = "ZeRO stage 3 (parameter partitioning) is not supported; use stage 1 or 2"

REFUSED_MODULES = {
    # Submodules not provided here. runtime.zero itself, its ZeRO-1/2 modules
    # (stage_1_and_2, config, utils, partition_parameters' enums), ops.op_builder and ops.aio
    # import, and refuse at use.
    "runtime.zero": ZERO3,
    "zero": ZERO3,
    "ops.op_builder": "DeepSpeed's compiled ops (op builders) are not provided",
    "runtime.pipe": "pipeline parallelism (PipelineModule) is not supported",
    "inference": "DeepSpeed inference (init_inference) is not supported",
    "module_inject": "kernel injection and AutoTP are not supported",
    "runtime.tensor_parallel": "tensor parallelism (AutoTP) is not supported",
    "runtime.sequence_parallel": "sequence parallelism (Ulysses/ALST) is not supported",
    "sequence": "sequence parallelism (Ulysses) is not supported",
    "runtime.hybrid_engine": "the hybrid (RLHF) engine is not supported",
    "ops.adagrad": "DeepSpeedCPUAdagrad is not provided; under offload_optimizer use "
                   "torch.optim.Adagrad (stepped on the host with its CPU kernel)",
    "ops.lion": "DeepSpeed's Lion optimizers are not provided (FusedLion, DeepSpeedCPULion)",
    "ops.lamb": "DeepSpeed's FusedLamb is not provided",
    "ops.transformer": "DeepSpeed's fused transformer kernels are not provided",
    "runtime.swap_tensor": "NVMe offload is not supported",
    "runtime.zenflow": "ZenFlow is not supported",
    "checkpoint.ds_to_universal": "universal checkpoints are not needed: evenzero checkpoints "
                                  "load at any world size",
    "checkpoint.universal_checkpoint": "universal checkpoints are not needed: evenzero "
                                       "checkpoints load at any world size",
    "autotuning": "the autotuner is not supported",
    "compression": "DeepSpeed compression is not supported",
    "elasticity": "elastic training was removed from DeepSpeed's config too",
    "monitor": "DeepSpeed's monitors (tensorboard, wandb, csv) are not written",
    "profiling": "DeepSpeed's flops profiler is not run; use torch.profiler",
    "compile": "DeepCompile is not supported",
    "nvme": "NVMe offload is not supported",
    "launcher.multinode_runner": "multi-node launches through pdsh/ssh/MPI are not supported "
                                 "by the deepspeed launcher here; run `evenzero run torchrun "
                                 "--nnodes ...` on each node",
}


def missing_module(fullname: str) -> str:
    """Why `deepspeed.<...>` named by `fullname` cannot be imported here."""
    rest = fullname.partition(".")[2]
    parts = rest.split(".")
    for i in range(len(parts), 0, -1):
        reason = REFUSED_MODULES.get(".".join(parts[:i]))
        if reason is not None:
            return f"No module named {fullname!r}: {reason} (evenzero stands in for DeepSpeed)"
    return (f"No module named {fullname!r}: evenzero's stand-in for DeepSpeed 0.19.8 provides "
            f"the ZeRO-1/2 training API (initialize, the engine, comm, accelerator, "
            f"runtime.lr_schedules, ops.adam, checkpoint.utils, utils, checkpointing, "
            f"launcher.runner), not this module")


def unsupported(what: str, reason: str) -> UnsupportedError:
    """The error a refused DeepSpeed call raises: it names the call and the reason."""
    return UnsupportedError(f"{what}: {reason} (evenzero.deepspeed stands in for "
                               f"DeepSpeed)")


def refused_features() -> dict[str, list[str]]:
    """Everything refused, by where it is asked for: config keys, modules. Built from the
    tables (`config_keys`, `REFUSED_MODULES`), so it lists what the code refuses."""
    from evenzero.deepspeed.config_keys import REFUSED_SECTIONS, ZERO_REFUSED

    zero = {"stage": "3 (ZeRO-3)"}
    zero.update(ZERO_REFUSED)
    modules: dict[str, list[str]] = {}
    for name, reason in REFUSED_MODULES.items():
        modules.setdefault(reason, []).append(f"deepspeed.{name}")
    return {
        "zero_optimization keys": [f"{k}: {v}" for k, v in zero.items()],
        "config sections (unless switched off)": [f"{k}: {v}" for k, v in
                                                  REFUSED_SECTIONS.items()],
        "modules": [f"{', '.join(names)}: {reason}" for reason, names in modules.items()],
    }
