"""How one bucket's reduced gradients reach this rank's shard: two route executors.

A plan installs one executor per bucket, chosen once from its `BucketRoute` and the
size of the bucket's group:

* `DirectShardSync`, evenzero's route (and Megatron's): one equal reduce-scatter of the
  whole bucket, whose output is exactly this rank's slice of its gradient shard, so it
  is accumulated with one add and no piecewise copies;
* `ReplaySync`, the replay of a peer's schedule (DeepSpeed's reduces and all-reduces of
  pieces of a bucket): every planned collective runs as planned, then the pieces this
  rank owns are accumulated one by one;
* `CompressedShardSync`, evenzero's route with `grad_compression`: the same one
  collective per bucket, carried as an all-to-all of encoded pieces that this rank
  decodes and sums in fp32 into its shard slice (`runtime/compression.py`);
* `LocalSync`, any route on a group of one rank: there is nothing to reduce, so nothing
  is issued and the bucket's gradients are its reduced gradients. On evenzero's route
  a bucket of the group's own dtype needs no bucket at all: the parameters' gradients
  are added straight into the shard (`accumulate_grads`), without the concatenation.

The verbs are Megatron-core's (megatron/core/distributed/param_and_grad_buffer.py@d98e8a64,
`_ParamAndGradBucketGroup.start_grad_sync` / `finish_grad_sync`): `start_grad_sync`
issues the bucket's collectives and returns what `finish_grad_sync` needs to wait for
them and accumulate. The gradient is divided by the world size on accumulation, for
expert groups too, which makes it the gradient of the mean loss over the global batch
(DeepSpeed divided experts by the expert-DP size: deepspeedai/DeepSpeed#6546).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from torch.profiler import record_function

from evenzero.runtime.buckets import PoolSlot
from evenzero.runtime.collectives import LOCAL, PieceCollective, ReduceScatter, TraceRecorder
from evenzero.runtime.compression import CompressedReduceScatter
from evenzero.runtime.gradclear import add_reduced
from evenzero.runtime.routes import BucketRoute
from evenzero.runtime.shards import GroupShard
from evenzero.runtime.stall import wait


class RouteExecutor(Protocol):
    """Issues and completes the reduction of one bucket."""

    route: BucketRoute
    bucketless: bool
    """Whether the gradients go straight into the shard (`LocalSync.accumulate_grads`)
    instead of through a bucket."""

    def pool_numel(self) -> int:
        """Pool elements (reduce dtype) the bucket's collectives allocate."""

    def start_grad_sync(self, bucket: torch.Tensor, slot: PoolSlot, trace: TraceRecorder) -> Any:
        """Issue the bucket's collectives on `bucket` (its gradients, reduce dtype)."""

    def finish_grad_sync(self, handle: Any, bucket: torch.Tensor, shard: torch.Tensor,
                         scale: float, cleared: Sequence[tuple[int, int]] = ()) -> None:
        """Wait for them and add this rank's reduced elements, times `scale`, to `shard`;
        the shard runs in `cleared` ((offset, numel): gradients the user cleared since
        they were last reduced, `runtime/gradclear.py`) are overwritten instead."""


class DirectShardSync:
    """One equal reduce-scatter whose output is this rank's shard slice."""

    bucketless = False

    def __init__(self, route: BucketRoute, group: GroupShard, reduce_scatter: ReduceScatter) -> None:
        if route.direct_shard_offset is None or len(route.collectives) != 1:
            raise ValueError("DirectShardSync needs a route with a direct shard offset")
        self.route, self.group, self.rs = route, group, reduce_scatter

    def pool_numel(self) -> int:
        return self.rs.scratch_numel(self.route.bucket.numel, self.group.size)

    def start_grad_sync(self, bucket: torch.Tensor, slot: PoolSlot, trace: TraceRecorder) -> Any:
        output = self.rs.allocate(slot, bucket.numel(), self.group.size, bucket.dtype)
        with record_function("evenzero::launch"):
            work = self.rs(output, bucket, self.group.process_group)
        trace.record(self.route.collectives[0], self.rs.name)
        return work, output

    def finish_grad_sync(self, handle: Any, bucket: torch.Tensor, shard: torch.Tensor,
                         scale: float, cleared: Sequence[tuple[int, int]] = ()) -> None:
        work, output = handle
        with record_function("evenzero::wait"):
            wait(work, self.group.process_group, self.route)
        with record_function("evenzero::accumulate"):
            chunk = self.rs.chunk(output, self.group.size, shard.dtype)
            off = self.route.direct_shard_offset
            self.group.land([chunk], lambda c: add_reduced(shard, off, c[0], scale, cleared))


class CompressedShardSync:
    """One compressed all-to-all whose decoded sum is this rank's shard slice."""

    bucketless = False

    def __init__(self, route: BucketRoute, group: GroupShard,
                 residual: Callable[[BucketRoute], torch.Tensor | None] = lambda r: None) -> None:
        c = route.collectives[0] if len(route.collectives) == 1 else None
        if route.direct_shard_offset is None or c is None or not c.compression:
            raise ValueError("CompressedShardSync needs a direct route of one compressed collective")
        self.route, self.group, self.residual = route, group, residual
        self.rs = CompressedReduceScatter(c.compression, c.block_numel)

    def pool_numel(self) -> int:
        itemsize = torch.empty((), dtype=self.group.reduce_dtype).element_size()
        return self.rs.pool_numel(self.route.bucket.numel, itemsize)

    def start_grad_sync(self, bucket: torch.Tensor, slot: PoolSlot, trace: TraceRecorder) -> Any:
        buffers = self.rs.allocate(slot, bucket)
        with record_function("evenzero::encode"):
            work = self.rs(buffers, bucket, self.group.process_group, self.residual(self.route))
        trace.record(self.route.collectives[0], self.rs.name)
        return work, buffers

    def finish_grad_sync(self, handle: Any, bucket: torch.Tensor, shard: torch.Tensor,
                         scale: float, cleared: Sequence[tuple[int, int]] = ()) -> None:
        work, buffers = handle
        with record_function("evenzero::wait"):
            wait(work, self.group.process_group, self.route)
        with record_function("evenzero::decode"):
            chunk = self.rs.chunk(buffers, self.group.size, shard.dtype)
        with record_function("evenzero::accumulate"):
            off = self.route.direct_shard_offset
            self.group.land([chunk], lambda c: add_reduced(shard, off, c[0], scale, cleared))


class ReplaySync:
    """A peer's collectives on pieces of the bucket, then the owned pieces one by one."""

    bucketless = False

    def __init__(self, route: BucketRoute, group: GroupShard, reduce_scatter: ReduceScatter) -> None:
        self.route, self.group = route, group
        self.calls = [PieceCollective(c, group.rank, reduce_scatter) for c in route.collectives]

    def pool_numel(self) -> int:
        return sum(call.pool_numel() for call in self.calls)

    def start_grad_sync(self, bucket: torch.Tensor, slot: PoolSlot, trace: TraceRecorder) -> Any:
        issued = []
        for call in self.calls:
            message = call.allocate(slot, bucket)
            with record_function("evenzero::launch"):
                work = call(message, self.group.process_group)
            trace.record(call.planned, call.algorithm)
            issued.append((call, message, work))
        return issued

    def finish_grad_sync(self, handle: Any, bucket: torch.Tensor, shard: torch.Tensor,
                         scale: float, cleared: Sequence[tuple[int, int]] = ()) -> None:
        with record_function("evenzero::wait"):
            for call, message, work in handle:
                wait(work, self.group.process_group, self.route)
                call.finish(message, bucket)
        with record_function("evenzero::accumulate"):
            add_owned(self.group, self.route, bucket, shard, scale, cleared)


class LocalSync:
    """A group of one rank: no collective; the bucket is its own reduction."""

    def __init__(self, route: BucketRoute, group: GroupShard) -> None:
        if group.size != 1:
            raise ValueError("LocalSync runs buckets of a group of one rank only")
        self.route, self.group = route, group

    @property
    def bucketless(self) -> bool:
        """Whether gradients go straight into the shard (`accumulate_grads`): evenzero's
        route, gradients in the dtype they would travel in (a `reduce_dtype` other than
        the parameters' rounds them as the bucket would on more ranks)."""
        return (self.route.direct_shard_offset is not None
                and self.group.param_dtype == self.group.reduce_dtype)

    def pool_numel(self) -> int:
        return 0

    def start_grad_sync(self, bucket: torch.Tensor | None, slot: PoolSlot | None,
                        trace: TraceRecorder) -> Any:
        trace.record_all(self.route.collectives, LOCAL)
        return None

    def finish_grad_sync(self, handle: Any, bucket: torch.Tensor, shard: torch.Tensor,
                         scale: float, cleared: Sequence[tuple[int, int]] = ()) -> None:
        with record_function("evenzero::accumulate"):
            off = self.route.direct_shard_offset
            if off is not None:
                self.group.land([bucket],
                                lambda b: add_reduced(shard, off, b[0], scale, cleared))
                return
            add_owned(self.group, self.route, bucket, shard, scale, cleared)

    def accumulate_grads(self, grads: Sequence[torch.Tensor | None], cleared: Sequence[bool],
                         shard: torch.Tensor, scale: float) -> None:
        """The bucketless reduction: `grads[i]` (None: no gradient) is the gradient of
        the bucket's i-th parameter; its shard run is overwritten where `cleared[i]`,
        else added to, times `scale`. Batched: one foreach call per kind."""
        base = self.route.direct_shard_offset
        add_to, add_from, set_to, set_from, zero = [], [], [], [], []
        for s, grad, clear in zip(self.route.bucket.params, grads, cleared, strict=True):
            run = shard[base + s.offset:base + s.offset + s.numel]
            if grad is None:
                if clear:
                    zero.append(run)
            elif clear:
                set_to.append(run)
                set_from.append(grad.reshape(-1))
            else:
                add_to.append(run)
                add_from.append(grad.reshape(-1))
        def apply(sources: list[torch.Tensor]) -> None:
            sets, adds = sources[:len(set_to)], sources[len(set_to):]
            if zero:
                torch._foreach_zero_(zero)
            if set_to:
                torch._foreach_copy_(set_to, sets)
                if scale != 1.0:
                    torch._foreach_mul_(set_to, scale)
            if add_to:
                torch._foreach_add_(add_to, adds, alpha=scale)

        with record_function("evenzero::accumulate"):
            self.group.land(set_from + add_from, apply)


def add_owned(group: GroupShard, route: BucketRoute, bucket: torch.Tensor, shard: torch.Tensor,
              scale: float, cleared: Sequence[tuple[int, int]]) -> None:
    """Zero the `cleared` runs of `shard`, then add this rank's owned pieces of the reduced
    `bucket`, times `scale` (through the shard's landing: `GroupShard.land`)."""
    def apply(pieces: list[torch.Tensor]) -> None:
        for off, n in cleared:
            shard[off:off + n].zero_()
        for piece, values in zip(route.owned, pieces, strict=True):
            shard[piece.shard_offset:piece.shard_offset + piece.numel].add_(values, alpha=scale)

    group.land([bucket[p.bucket_offset:p.bucket_offset + p.numel] for p in route.owned], apply)


def executor_for(route: BucketRoute, group: GroupShard, reduce_scatter: ReduceScatter,
                 residual: Callable[[BucketRoute], torch.Tensor | None] = lambda r: None
                 ) -> RouteExecutor:
    """The executor of a route: local on a group of one, else `collective_executor_for`.
    `residual(route)` is the bucket's error-feedback residual (None: it keeps none)."""
    if group.size == 1:
        return LocalSync(route, group)
    return collective_executor_for(route, group, reduce_scatter, residual)


def collective_executor_for(route: BucketRoute, group: GroupShard,
                            reduce_scatter: ReduceScatter,
                            residual: Callable[[BucketRoute], torch.Tensor | None] = lambda r: None
                            ) -> RouteExecutor:
    """The executor that issues a route's collectives: compressed or direct when the
    route allows it, else the replay."""
    if route.direct_shard_offset is not None:
        if route.collectives[0].compression:
            return CompressedShardSync(route, group, residual)
        return DirectShardSync(route, group, reduce_scatter)
    if any(c.compression for c in route.collectives):
        raise ValueError(f"bucket {route.bucket.index} of group {route.bucket.group!r}: "
                         f"compressed collectives run on evenzero's direct route only")
    return ReplaySync(route, group, reduce_scatter)
