"""Train several data-parallel systems side by side, interleaved step by step.

Each system trains its own copy of the same model on the same batches. Steps are
round-robin (system order rotates every step), so machine noise, a busy neighbour or a
thermal dip hits every system alike; only ratios measured this way mean anything on a
shared 2-core machine. Every system's step starts after a barrier, so all ranks start
together, and is timed in three phases, each ended by a device sync (no barrier between
them, so nothing is serialised that the system would overlap):

* forward: the model and the loss (FSDP2 gathers parameters here);
* backward: `loss.backward()` and the gradient reduction the system waits for in it;
* step: the optimizer step and clearing the gradients (evenzero and DeepSpeed gather
  parameters here).

Per step and phase the slowest rank counts; the whole step is each rank's sum of the
three, slowest rank. Losses are the mean over ranks. Collectives are not recorded while
timing: `capture_collectives` runs one more, untimed step per system for that (capturing
wraps torch.distributed, which would slow the systems it wraps).
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
PHASES = ("forward", "backward", "step")
"""The timed phases of one training step, in order."""


class System(Protocol):
    """One data-parallel training system wrapped around its own copy of the model."""

    name: str

    def loss(self, batch: Batch) -> torch.Tensor:
        """Forward pass and loss on this rank's batch."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backward with the gradient reduction the system finishes in it."""

    def step(self) -> None:
        """Optimizer step, gradients cleared."""

    def capture_next_step(self) -> None:
        """Record the collectives of the next backward and step (an untimed step)."""

    def collectives(self) -> list[Collective]:
        """Collectives of the last captured step, both phases, in issue order."""


@dataclass
class SystemResult:
    """What one system did: step times exclude warm-up; losses include it."""

    name: str
    losses: list[float] = field(default_factory=list)
    """Loss per step (warm-up included), mean over ranks."""
    step_ms: list[float] = field(default_factory=list)
    """Forward+backward+step wall time of the slowest rank, per measured step."""
    phase_ms: dict[str, list[float]] = field(default_factory=dict)
    """Per phase (`PHASES`), the slowest rank's time per measured step."""
    collectives: list[Collective] = field(default_factory=list)
    """Collectives of the captured step (see `capture_collectives`)."""

    @property
    def median_step_ms(self) -> float:
        return statistics.median(self.step_ms) if self.step_ms else float("nan")

    def median_phase_ms(self, phase: str) -> float:
        times = self.phase_ms.get(phase, [])
        return statistics.median(times) if times else float("nan")

    def backward_collectives(self) -> list[Collective]:
        return [c for c in self.collectives if c.phase == BACKWARD]

    def extend(self, more: SystemResult) -> None:
        """Append the steps of a later `run_interleaved` of the same system (its losses,
        times and phases); the collectives stay those of the first run."""
        self.losses.extend(more.losses)
        self.step_ms.extend(more.step_ms)
        for phase, times in more.phase_ms.items():
            self.phase_ms.setdefault(phase, []).extend(times)

    def step_collectives(self) -> list[Collective]:
        return [c for c in self.collectives if c.phase == STEP]


@dataclass(frozen=True)
class InterleaveOptions:
    """How many steps to run and where."""

    steps: int = 8
    """Measured steps per system."""
    warmup: int = 2
    """Steps per system run first and not timed (allocations, first-call costs)."""
    device: str = "cpu"
    """Where the model lives; CUDA devices are synchronised at every phase's end."""
    first_step: int = 0
    """Index of the first step: its batch and the step number `on_step` gets. A run that
    continues an earlier one (more steps for some systems) starts where that one ended."""


def run_interleaved(systems: Sequence[System], batch: Callable[[int], Batch],
                    options: InterleaveOptions,
                    on_step: Callable[[str, int], None] | None = None) -> list[SystemResult]:
    """Train every system for warmup+steps steps, round-robin; same batch per step."""
    total = options.warmup + options.steps
    local_losses = torch.zeros(len(systems), total, dtype=torch.float64)
    local_phases = torch.zeros(len(systems), options.steps, len(PHASES), dtype=torch.float64)
    local_whole = torch.zeros(len(systems), options.steps, dtype=torch.float64)
    index = {s.name: i for i, s in enumerate(systems)}
    for step in range(total):
        x, y = batch(options.first_step + step)
        x, y = x.to(options.device), y.to(options.device)
        shift = step % len(systems)
        for system in list(systems[shift:]) + list(systems[:shift]):
            _sync(options.device)
            dist.barrier()
            t0 = time.perf_counter()
            loss = system.loss((x, y))
            _sync(options.device)
            t1 = time.perf_counter()
            system.backward(loss)
            _sync(options.device)
            t2 = time.perf_counter()
            system.step()
            _sync(options.device)
            t3 = time.perf_counter()
            i = index[system.name]
            local_losses[i, step] = loss.detach().double().item()
            if step >= options.warmup:
                k = step - options.warmup
                local_phases[i, k] = torch.tensor([t1 - t0, t2 - t1, t3 - t2]) * 1e3
                local_whole[i, k] = (t3 - t0) * 1e3
            if on_step is not None:
                on_step(system.name, options.first_step + step)
    # One reduction at the end, so result bookkeeping never sits inside a timed step.
    losses = _reduced(local_losses, dist.ReduceOp.SUM, options.device) / dist.get_world_size()
    phases = _reduced(local_phases, dist.ReduceOp.MAX, options.device)
    whole = _reduced(local_whole, dist.ReduceOp.MAX, options.device)
    out = []
    for system in systems:
        i = index[system.name]
        out.append(SystemResult(system.name, losses[i].tolist(), whole[i].tolist(),
                                {p: phases[i, :, j].tolist() for j, p in enumerate(PHASES)},
                                list(system.collectives())))
    return out


def capture_collectives(systems: Sequence[System], batch: Batch,
                        device: str = "cpu") -> dict[str, list[Collective]]:
    """One more, untimed step per system with its collectives recorded; by name."""
    x, y = batch[0].to(device), batch[1].to(device)
    out = {}
    for system in systems:
        dist.barrier()
        system.capture_next_step()
        system.backward(system.loss((x, y)))
        system.step()
        out[system.name] = list(system.collectives())
    return out


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

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()

    def capture_next_step(self) -> None:
        """Nothing to install: `optimizer.trace` always holds the last step's calls."""

    def collectives(self) -> list[Collective]:
        return list(self.optimizer.trace)
