"""The systems `evenzero repro` and `evenzero bench` train side by side: one table.

Each entry says what the system is and how it is built; a command chooses which run by
default, and `--systems` picks from the entries that can run its model (the seed model's
expert-parallel MoE rules FSDP2 out). `build_systems` builds the chosen ones around a
`Workload`: the model, its loss and what the systems need of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from evenzero.repro.capture import CaptureOptions
from evenzero.repro.sidebyside import LossFn


@dataclass(frozen=True)
class SystemEntry:
    """One system of the side-by-side runs."""

    name: str
    kind: str
    """How it is built: "evenzero", "ddp", "fsdp2", "deepspeed" or "floor"."""
    describe: str
    """What it is, in a few words, for tables and help."""
    strategy: str = "evenzero"
    """kind "evenzero": the schedule evenzero's runtime executes."""
    multi_rank_allreduce: bool = True
    """kind "deepspeed": DeepSpeed's `use_multi_rank_bucket_allreduce` (its default)."""
    exact: bool = False
    """The same math as evenzero's (the same module, torch's AdamW, a mean of the
    gradients): its losses must agree with evenzero's to `LOSS_RTOL`."""
    experts: bool = True
    """Runs a model with expert-parallel MoE layers (the seed model)."""
    trains: bool = True
    """Updates the model's weights (the floor does not: its losses are not compared)."""
    settings: tuple[tuple[str, Any], ...] = ()
    """kind "evenzero": further `ZeroConfig` fields (`grad_compression`, ...)."""
    comm_hook: str | None = None
    """kind "ddp": a DDP comm hook ("bf16": torch's `bf16_compress_hook`)."""


SYSTEMS: tuple[SystemEntry, ...] = (
    SystemEntry("evenzero", "evenzero", "evenzero ZeRO-2: one equal reduce-scatter per bucket, "
                                        "buckets in gradient-arrival order", exact=True),
    SystemEntry("deepspeed-0.6-schedule", "evenzero",
                "DeepSpeed 0.6's reduce schedule (the report's uneven reduces), executed by "
                "evenzero's runtime", strategy="deepspeed-0.6", exact=True),
    SystemEntry("ddp", "ddp", "torch DDP, its C++ reducer; expert gradients all-reduced over "
                              "their expert-data-parallel group", exact=True),
    SystemEntry("fsdp2", "fsdp2", "PyTorch FSDP2, fully_shard(block, reshard_after_forward="
                                  "False): ZeRO-2", exact=True, experts=False),
    SystemEntry("evenzero-bf16", "evenzero", "evenzero ZeRO-2, grad_compression=\"bf16\" "
                                             "(bf16 on the wire, fp32 sums)",
                settings=(("grad_compression", "bf16"),)),
    SystemEntry("evenzero-int8", "evenzero", "evenzero ZeRO-2, grad_compression=\"int8\"",
                settings=(("grad_compression", "int8"),)),
    SystemEntry("evenzero-int8-ef", "evenzero", "evenzero ZeRO-2, grad_compression=\"int8\" "
                                                "with error feedback",
                settings=(("grad_compression", "int8"), ("grad_compression_error_feedback", True))),
    SystemEntry("ddp-bf16-hook", "ddp", "torch DDP with its bf16_compress_hook",
                comm_hook="bf16", experts=False),
    SystemEntry("deepspeed", "deepspeed", "real DeepSpeed ZeRO-2, default config: one "
                                          "all-reduce per process group per bucket (DeepSpeed "
                                          ">= 0.12.4)"),
    SystemEntry("deepspeed-reduce-mode", "deepspeed",
                "real DeepSpeed ZeRO-2 with use_multi_rank_bucket_allreduce: false: its other "
                "path, one synchronous reduce per destination rank per bucket",
                multi_rank_allreduce=False),
    SystemEntry("floor", "floor", "comm-free floor: no reduction, AdamW on this rank's "
                                  "shard only", trains=False),
)
BY_NAME: Mapping[str, SystemEntry] = {e.name: e for e in SYSTEMS}
LOSS_RTOL = 1e-5
"""Largest relative loss difference allowed between evenzero and an exact system."""
LOSS_CHECK_STEPS = 20
"""Steps over which `LOSS_RTOL` is checked. The systems sum gradients in different orders,
and training compounds fp32 rounding: on the seed model evenzero and DDP stay within
2e-7 for 30 steps, then part faster (2.6e-6 at step 34, 1.2e-5 at step 40)."""


def system_names(*, experts: bool = False) -> tuple[str, ...]:
    """Every system's name; with `experts`, those that run an expert-parallel model."""
    return tuple(e.name for e in SYSTEMS if e.experts or not experts)


def is_exact(name: str) -> bool:
    entry = BY_NAME.get(name)
    return entry is not None and entry.exact


def trains(name: str) -> bool:
    entry = BY_NAME.get(name)
    return entry is None or entry.trains


@dataclass(frozen=True)
class Workload:
    """What every system is built around."""

    model: Callable[[], nn.Module]
    """A fresh copy of the model on this rank's device, the same weights every call."""
    loss_fn: LossFn
    micro_batch: int
    """Rows per rank per step (DeepSpeed's `train_micro_batch_size_per_gpu`)."""
    lr: float = 1e-3
    weight_decay: float = 0.01
    bucket_numel: int | None = None
    """evenzero's bucket size (the "evenzero" entry only); None: the runtime's default."""
    expert_groups: Mapping[str, Any] | None = None
    """{expert group name: this rank's expert-data-parallel process group}."""
    deepspeed_model: Callable[[], nn.Module] | None = None
    """DeepSpeed's twin of the model (its own MoE layer); None: `model`."""
    after_deepspeed: Callable[[], None] | None = None
    """A check once DeepSpeed has built its groups (the same expert layout as ours)."""
    blocks: Callable[[nn.Module], Sequence[nn.Module]] | None = None
    """FSDP2's units of sharding."""
    capture: CaptureOptions | None = None
    """How captured collectives are named."""


def build_systems(ctx: Any, names: Sequence[str], work: Workload) -> tuple[list, list[dict]]:
    """Each named system around its own copy of the model, in `names` order; and those
    skipped, with the reason (DeepSpeed not importable). Shows each phase on `ctx`."""
    from evenzero.repro.progress import Status

    systems: list = []
    skipped: list[dict] = []
    for name in names:
        entry = BY_NAME[name]
        if entry.kind == "deepspeed":
            system, reason = _deepspeed(ctx, entry, work)
            if system is None:
                skipped.append({"name": name, "reason": reason})
            else:
                systems.append(system)
            continue
        ctx.emit(Status(f"building {name}"))
        systems.append(_build(entry, work))
    return systems, skipped


def _build(entry: SystemEntry, work: Workload):
    from evenzero.repro.baselines import DDPSystem, FloorSystem, FSDP2System
    from evenzero.repro.sidebyside import EvenzeroSystem

    groups = dict(work.expert_groups or {})
    if entry.kind == "evenzero":
        return EvenzeroSystem(entry.name, work.model(), work.loss_fn, strategy=entry.strategy,
                              lr=work.lr, weight_decay=work.weight_decay,
                              bucket_numel=(work.bucket_numel if entry.strategy == "evenzero"
                                            else None),
                              expert_groups=groups or None, extra=dict(entry.settings))
    if entry.kind == "ddp":
        return DDPSystem(work.model(), work.loss_fn, lr=work.lr, weight_decay=work.weight_decay,
                         expert_group=next(iter(groups.values()), None), capture=work.capture,
                         name=entry.name, comm_hook=entry.comm_hook)
    if entry.kind == "fsdp2":
        if work.blocks is None:
            raise ValueError(f"{entry.name} needs the model's blocks (its units of sharding)")
        return FSDP2System(work.model(), work.loss_fn, work.blocks, lr=work.lr,
                           weight_decay=work.weight_decay, capture=work.capture, name=entry.name)
    if entry.kind == "floor":
        import torch.distributed as dist

        edp = next(iter(groups.values()), None)
        return FloorSystem(work.model(), work.loss_fn, lr=work.lr, weight_decay=work.weight_decay,
                           expert_group_size=dist.get_world_size(edp) if edp is not None else 1,
                           name=entry.name)
    raise ValueError(f"no builder for system kind {entry.kind!r}")


def _deepspeed(ctx: Any, entry: SystemEntry, work: Workload):
    import sys

    from evenzero.repro.deepspeed_runner import (
        DEEPSPEED_INSTALL,
        DeepSpeedSystem,
        deepspeed_unavailable,
    )
    from evenzero.repro.progress import Status

    if "deepspeed" not in sys.modules:
        ctx.emit(Status("importing DeepSpeed"))
    reason = deepspeed_unavailable()
    if reason is not None:
        return None, f"DeepSpeed is not importable ({reason}); {DEEPSPEED_INSTALL}"
    ctx.emit(Status(f"building {entry.name}: deepspeed.initialize (slow the first time)"))
    model = (work.deepspeed_model or work.model)()
    system = DeepSpeedSystem(entry.name, model, work.loss_fn, micro_batch=work.micro_batch,
                             multi_rank_allreduce=entry.multi_rank_allreduce, lr=work.lr,
                             weight_decay=work.weight_decay, capture=work.capture)
    if work.after_deepspeed is not None:
        work.after_deepspeed()
    return system, ""


__all__ = ["BY_NAME", "LOSS_CHECK_STEPS", "LOSS_RTOL", "SYSTEMS", "SystemEntry", "Workload", "build_systems",
           "is_exact", "system_names", "trains"]
