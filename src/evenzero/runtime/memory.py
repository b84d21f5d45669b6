"""Per-rank memory of the engine: what ZeRO is supposed to shrink, measured, not modelled."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields

import torch

from evenzero.runtime.shardedgrad import ShardedGrad
from evenzero.runtime.shards import GroupShard


@dataclass(frozen=True, repr=False)
class MemoryReport:
    """Bytes held by this rank at the moment of the report (the fields are byte counts;
    printed, each has its unit)."""

    gradient_shards: int
    """Accumulated fp32 gradient shards (1/N of the model, padding included)."""
    gradient_buffers: int
    """Bucket buffers currently allocated: stage 1's full buffers, stage 2's in-flight pool."""
    pending_grads: int
    """`param.grad` tensors not backed by the engine's buffers (e.g. under no_sync)."""
    master_weights: int
    """Master shards with memory of their own: bf16/fp16 parameters' fp32 masters. 0 for
    groups whose masters are the parameters' own memory (master dtype = parameter
    dtype, e.g. fp32 training: `runtime/shards.py`)."""
    optimizer_state: int
    """Tensors in the inner optimizer's state (Adam moments, ...)."""
    parameters: int
    """Flat parameter buffers that back the model parameters (full model, param dtype)."""
    bucket_pool: int = 0
    """Stage 2's bucket arenas kept idle between backwards, on CPU only (reused by the
    next backward; `runtime.reducer.keeps_pool` says why). Not gradients."""
    error_feedback: int = 0
    """`grad_compression_error_feedback`'s fp32 residuals: what compression has not yet
    delivered, one value per element of every compressed bucket."""
    host_staging: int = 0
    """`offload_optimizer`: host buffers the copies to and from the device go through."""
    offloaded: int = 0
    """`offload_optimizer`: bytes of the fields above held in host memory away from the
    parameters (masters, gradient shards, optimizer state, staging); 0 without offload."""
    by_device: tuple[tuple[str, int], ...] = ()
    """Every byte counted above, by the device it lives on (e.g. `(("cpu", ...),
    ("cuda:0", ...))`), largest first."""

    @property
    def gradients(self) -> int:
        return self.gradient_shards + self.gradient_buffers + self.pending_grads

    @property
    def total(self) -> int:
        """Every byte counted, on all devices."""
        return (self.gradients + self.master_weights + self.optimizer_state + self.parameters
                + self.bucket_pool + self.error_feedback + self.host_staging)

    def on(self, device: str | torch.device) -> int:
        """Bytes counted on `device` ("cuda:0", "cpu")."""
        return dict(self.by_device).get(str(device), 0)

    def __repr__(self) -> str:
        held = ", ".join(f"{f.name}={_human_bytes(getattr(self, f.name))}" for f in fields(self)
                         if f.name != "by_device")
        where = ", ".join(f"{d}: {_human_bytes(n)}" for d, n in self.by_device)
        return (f"MemoryReport({held}; gradients in all {_human_bytes(self.gradients)}; "
                f"by device {where or '-'})")

    __str__ = __repr__


def _human_bytes(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{n} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def measure(groups: Iterable[GroupShard], reducer, params: Iterable[torch.nn.Parameter],
            flat, residual_bytes: int = 0) -> MemoryReport:
    """Measure the engine's current holdings: each group shard's masters, gradient shard
    and optimizer state, the gradient reducer's buffers, stray `.grad` tensors and the
    flat parameter buffers."""
    groups = list(groups)
    held = reducer.held_grads()
    pending = sum(_nbytes(p.grad) for p in params
                  if p.grad is not None and not isinstance(p.grad, ShardedGrad)
                  and p.grad.data_ptr() not in held)
    where: dict[str, int] = {}
    for g in groups:
        for dev, n in g.nbytes_by_device().items():
            where[dev] = where.get(dev, 0) + n
    # The reducer's buffers, stray gradients and residuals live with the parameters.
    device = next((str(b.device) for b in flat.buffers.values()), "cpu")
    rest = reducer.nbytes() + reducer.kept_pool_nbytes() + pending + flat.nbytes() + residual_bytes
    if rest:
        where[device] = where.get(device, 0) + rest
    offloaded = sum(g.grad_nbytes() + g.master_nbytes() + g.state_nbytes() + g.staging_nbytes()
                    for g in groups if g.placement.offloaded)
    return MemoryReport(
        host_staging=sum(g.staging_nbytes() for g in groups),
        offloaded=offloaded,
        by_device=tuple(sorted(where.items(), key=lambda kv: -kv[1])),
        gradient_shards=sum(g.grad_nbytes() for g in groups),
        gradient_buffers=reducer.nbytes(),
        pending_grads=pending,
        master_weights=sum(g.master_nbytes() for g in groups),
        optimizer_state=sum(g.state_nbytes() for g in groups),
        parameters=flat.nbytes(),
        bucket_pool=reducer.kept_pool_nbytes(),
        error_feedback=residual_bytes)
