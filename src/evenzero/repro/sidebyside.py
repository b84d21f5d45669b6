"""Train several data-parallel systems side by side, interleaved step by step.

Each system trains its own copy of the same model on the same batches. Steps are
round-robin (system order rotates every step), so machine noise, a busy neighbour or a
thermal dip hits every system alike; only ratios measured this way mean anything on a
shared 2-core machine. Per step and system we record the loss (mean over ranks), the
backward+step time (slowest rank, after a barrier so all ranks start together) and the
collectives the system issued in that backward and step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from evenzero.plan import BACKWARD, STEP, Collective

Batch = tuple[torch.Tensor, torch.Tensor]
LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class System(Protocol):
    """One data-parallel training system wrapped around its own copy of the model."""

    name: str

    def loss(self, batch: Batch) -> torch.Tensor:
        """Forward pass and loss on this rank's batch."""

    def backward_and_step(self, loss: torch.Tensor) -> None:
        """Backward, gradient reduction, optimizer step, gradients cleared."""

    def collectives(self) -> list[Collective]:
        """Collectives issued by the last `backward_and_step`, both phases, in issue order."""


@dataclass
class SystemResult:
    """What one system did: step times exclude warm-up; losses include it."""

    name: str
    losses: list[float] = field(default_factory=list)
    """Loss per step (warm-up included), mean over ranks."""
    step_ms: list[float] = field(default_factory=list)
    """Backward+step wall time of the slowest rank, per measured step."""
    collectives: list[Collective] = field(default_factory=list)
    """Collectives of the last measured step."""

    @property
    def median_step_ms(self) -> float:
        return statistics.median(self.step_ms) if self.step_ms else float("nan")

    def backward_collectives(self) -> list[Collective]:
        return [c for c in self.collectives if c.phase == BACKWARD]

    def step_collectives(self) -> list[Collective]:
        return [c for c in self.collectives if c.phase == STEP]


@dataclass(frozen=True)
class InterleaveOptions:
    """How many steps to run and how to time them."""

    steps: int = 8
    """Measured steps per system."""
    warmup: int = 2
    """Steps per system run first and not timed (allocations, first-call costs)."""
    device: str = "cpu"
    """Where the model lives; CUDA devices are synchronised around the timed region."""
    time_forward: bool = False
    """Time forward+backward+step instead of backward+step. Needed when a system moves
    work into forward (FSDP2 all-gathers parameters there, evenzero in its step)."""


def run_interleaved(systems: Sequence[System], batch: Callable[[int], Batch],
                    options: InterleaveOptions,
                    on_step: Callable[[str, int], None] | None = None) -> list[SystemResult]:
    """Train every system for warmup+steps steps, round-robin; same batch per step."""
    results = {s.name: SystemResult(s.name) for s in systems}
    total = options.warmup + options.steps
    local_losses = torch.zeros(len(systems), total, dtype=torch.float64)
    local_times = torch.zeros(len(systems), options.steps, dtype=torch.float64)
    index = {s.name: i for i, s in enumerate(systems)}
    for step in range(total):
        x, y = batch(step)
        x, y = x.to(options.device), y.to(options.device)
        shift = step % len(systems)
        for system in list(systems[shift:]) + list(systems[:shift]):
            if not options.time_forward:
                loss = system.loss((x, y))
            _sync(options.device)
            dist.barrier()
            start = time.perf_counter()
            if options.time_forward:
                loss = system.loss((x, y))
            system.backward_and_step(loss)
            _sync(options.device)
            elapsed = time.perf_counter() - start
            local_losses[index[system.name], step] = loss.detach().double().item()
            if step >= options.warmup:
                local_times[index[system.name], step - options.warmup] = elapsed * 1e3
            if on_step is not None:
                on_step(system.name, step)
    # One reduction at the end, so result bookkeeping never sits inside a timed step.
    losses = _reduced(local_losses, dist.ReduceOp.SUM, options.device) / dist.get_world_size()
    times = _reduced(local_times, dist.ReduceOp.MAX, options.device)
    for system in systems:
        r = results[system.name]
        i = index[system.name]
        r.losses = losses[i].tolist()
        r.step_ms = times[i].tolist()
        r.collectives = list(system.collectives())
    return [results[s.name] for s in systems]


def _reduced(t: torch.Tensor, op: Any, device: str) -> torch.Tensor:
    # NCCL reduces device tensors only; gloo is happy with either.
    work = t.to(device)
    dist.all_reduce(work, op=op)
    return work.cpu()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


class EvenzeroSystem:
    """evenzero's `ZeroOptimizer` (any of its strategies) around a plain module."""

    def __init__(self, name: str, model: torch.nn.Module, loss_fn: LossFn, *,
                 strategy: str = "evenzero", lr: float = 1e-3, weight_decay: float = 0.01,
                 stage: int = 2, bucket_numel: int | None = None,
                 expert_groups: dict[str, Any] | None = None,
                 extra: dict[str, Any] | None = None) -> None:
        from evenzero.runtime.optimizer import ZeroOptimizer

        self.name = name
        self.model = model
        self.loss_fn = loss_fn
        kwargs: dict[str, Any] = dict(lr=lr, weight_decay=weight_decay, stage=stage,
                                      strategy=strategy)
        if bucket_numel is not None:
            kwargs["bucket_numel"] = bucket_numel
        if expert_groups:
            kwargs["expert_groups"] = expert_groups
        kwargs.update(extra or {})
        self.optimizer = ZeroOptimizer(model, torch.optim.AdamW, **kwargs)

    def loss(self, batch: Batch) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(self.model(x), y)

    def backward_and_step(self, loss: torch.Tensor) -> None:
        loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad()

    def collectives(self) -> list[Collective]:
        return list(self.optimizer.trace)
