"""Gradient reduction during backward: buckets started in plan order, overlapped.

Every rank must issue the same collectives in the same order, or they pair up wrongly
or hang. So a bucket's sync is started only when the bucket is complete *and* every
bucket before it in the plan has been started; a complete bucket behind an incomplete
one waits. At the end of backward (`finish_grad_sync`) every bucket not yet started is
started in order, with zeros for parameters that produced no gradient. Whatever the
data did, every rank has then issued exactly `plan.backward()`; a gradient that exists
on some ranks only is caught by name at the step, not by a hang.

At most `max_in_flight` buckets are outstanding (the oldest is finished first). Each
bucket's collectives and their accumulation into the fp32 gradient shard are done by
the bucket's route executor (`runtime/executors.py`): evenzero's one reduce-scatter,
the replay of a peer's pieces, or nothing at all on a group of one rank (at stage 2 its
gradients are then added into the shard directly, with no bucket).

Why stage 2 concatenates the gradients into a bucket, rather than letting autograd
accumulate them in bucket memory (DDP's `gradient_as_bucket_view`, Megatron's
`main_grad`): autograd never writes a gradient into memory it is given. AccumulateGrad
(torch/csrc/autograd/functions/accumulate_grad.h@v2.13.0) either adopts the tensor the
backward produced as `p.grad` (p.grad None, what `zero_grad()` leaves: no copy) or adds
it into an existing `p.grad` in place. With `.grad` pointed at a zeroed bucket view,
every backward would pay a memset of the bucket and an in-place add (read two tensors,
write one) instead of the one concatenation (read one, write one) it pays now. Measured
by this project (12 gradients of 1M fp32 elements, one thread, loaded 2-core machine,
three runs): concatenation 21-32 ms, zeroing plus in-place add 31-39 ms. DDP copies an
adopted gradient into its bucket view the same way, and with `.grad` kept as views its
`zero_grad(set_to_none=False)` is the memset (`Reducer::mark_variable_ready_dense`,
torch/csrc/distributed/c10d/reducer.cpp@v2.13.0); Megatron
avoids the copy only where its weight-gradient GEMM accumulates into `main_grad` itself
(`gradient_accumulation_fusion`, a custom kernel) and otherwise adds in a hook. Views
would also need every bucket resident from the first gradient of a backward to its
bucket's reduction: stage 2 would hold a full-size gradient buffer, as stage 1 does (48
MiB for 12.6M fp32 parameters, where stage 2 now holds `max_buckets_in_flight` buckets),
and `p.grad` would no longer carry the accumulate-or-clear signal the `ShardedGrad`
placeholder gives (`runtime/shardedgrad.py`). Stage 1 keeps full buffers anyway, and its
gradients land in them (`ShardedGrad.landing`). So the one concatenation per bucket per
synced backward (`evenzero::bucket_copy`) stays: one read and one write of the
gradients; on a 1-rank 12.6M-parameter MLP, before groups of one skipped it, it was 1.3%
of the step's CPU time (torch.profiler, 3 steps). A group of one rank skips it (above).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import record_function

from evenzero.runtime.buckets import BucketPool, GradBuffers, PoolSlot
from evenzero.runtime.collectives import ReduceScatter, TraceRecorder
from evenzero.runtime.errorfeedback import ErrorFeedback
from evenzero.runtime.executors import RouteExecutor, executor_for
from evenzero.runtime.gradclear import ClearTracker
from evenzero.runtime.routes import BucketRoute
from evenzero.runtime.shardedgrad import ShardedGrad
from evenzero.runtime.shardruns import ShardRuns
from evenzero.runtime.shards import GroupShard


@dataclass(frozen=True)
class ReducerConfig:
    """How the reducer runs, fixed for one plan."""

    stage: int
    """1: persistent full-gradient buffers per bucket (gradients land and accumulate in
    them: `ShardedGrad.landing`);
    2: each bucket's gradients are copied into a pool slot when it is complete."""
    world_size: int
    """Reduced gradients are divided by this: the mean over the global batch."""
    max_in_flight: int
    """Buckets whose collectives may be outstanding at once."""
    device: torch.device
    """Device of the gradients (and the pool)."""
    reduce_scatter: ReduceScatter
    """The reduce-scatter algorithm for the backend."""
    loss_scale: Callable[[], float] = lambda: 1.0
    """The loss scale of the running backward; gradients are divided by it as they are
    accumulated, so the shards always hold true (unscaled) gradients."""
    keep_pool: bool = False
    """Keep the pool's arenas between backwards instead of freeing them after each.
    The runtime sets it for CPU gradients (`keeps_pool`)."""


def keeps_pool(device: torch.device) -> bool:
    """Whether the bucket pool outlives a backward on `device`. On CUDA it is freed after
    every backward: the caching allocator keeps the memory for the next one, and stage
    2's gradient memory at rest is then the 1/N shards alone. On CPU, glibc hands buffers
    of 32 MiB and more back to the OS when freed and faults them in again at the next
    allocation, page by page; measured on gloo at 4 ranks, that made 8M-element buckets
    12-25% slower per step than the same run with the memory kept (20M Llama-style and
    59M GPT models). So on CPU the arenas, at most `max_buckets_in_flight` of them, stay
    (`memory_report` counts them)."""
    return device.type == "cpu"


@dataclass
class _InFlight:
    position: int
    bucket: torch.Tensor
    slot: PoolSlot
    handle: Any
    cleared: list[tuple[int, int]]


class GradientReducer:
    """Starts, finishes and accumulates the bucket reductions of one plan."""

    def __init__(self, routes: tuple[BucketRoute, ...], params: Mapping[str, torch.nn.Parameter],
                 groups: Mapping[str, GroupShard], config: ReducerConfig, trace: TraceRecorder,
                 clearing: ClearTracker, runs: Mapping[str, ShardRuns],
                 make_executor: Callable[..., RouteExecutor] = executor_for,
                 error_feedback: ErrorFeedback | None = None) -> None:
        self.routes, self.groups, self.config, self.trace = routes, groups, config, trace
        self.clearing, self.runs = clearing, runs
        self.error_feedback = error_feedback
        self.executors = [make_executor(r, groups[r.bucket.group], config.reduce_scatter,
                                        self._residual)
                          for r in routes]
        self.route_params = [[params[s.name] for s in r.bucket.params] for r in routes]
        self.packed = [_packed_numel(r) for r in routes]
        self.position = {s.name: r.position for r in routes for s in r.bucket.params}
        self.grad_buffers = (GradBuffers([r.bucket for r in routes], params)
                             if config.stage == 1 else None)
        # A group of one rank at stage 2 adds the gradients into its shard directly.
        self.bucketless = [config.stage == 2 and ex.bucketless for ex in self.executors]
        arena: dict[torch.dtype, int] = {}
        for r, ex, direct in zip(routes, self.executors, self.bucketless, strict=True):
            if direct:
                continue
            g = groups[r.bucket.group]
            need = ex.pool_numel() + (r.bucket.numel if self._copies_in(g) else 0)
            arena[g.reduce_dtype] = max(arena.get(g.reduce_dtype, 0), need)
        self.pool = BucketPool(config.device, arena, config.max_in_flight)
        self._reset()

    def _residual(self, route: BucketRoute) -> torch.Tensor | None:
        """The bucket's error-feedback residual in the running backward's loss scale."""
        if self.error_feedback is None:
            return None
        return self.error_feedback.residual(route.bucket.group, route.bucket.index,
                                            self.config.loss_scale())

    def _copies_in(self, g: GroupShard) -> bool:
        """Whether a bucket's contents go into its pool slot (else they stay in place)."""
        return self.config.stage == 2 or g.param_dtype != g.reduce_dtype

    def _reset(self) -> None:
        self.remaining = [len(p) for p in self.route_params]
        self.started = [False] * len(self.routes)
        self.arrived: set[str] = set()
        self.late: list[str] = []
        self.orphans: list[str] = []
        self.next = 0
        self.inflight: deque[_InFlight] = deque()

    # ------------------------------------------------------------------ backward

    def grad_ready(self, name: str) -> None:
        """A parameter's gradient has been accumulated (from its post-accumulate hook)."""
        pos = self.position.get(name)
        if pos is None:
            self.orphans.append(name)
            return
        if self.started[pos]:
            self.late.append(name)
            return
        if name in self.arrived:
            return
        self.arrived.add(name)
        self.remaining[pos] -= 1
        while self.next < len(self.routes) and self.remaining[self.next] == 0:
            self.start_grad_sync(self.next)
            self.next += 1

    def finish_grad_sync(self) -> list[str]:
        """End of backward: start the rest in order and finish all. Returns what went
        wrong (empty if nothing), after the collectives, so every rank stays in step."""
        while self.next < len(self.routes):
            self.start_grad_sync(self.next)
            self.next += 1
        while self.inflight:
            self._finish_oldest()
        for group in self.groups.values():
            group.drain_grads()
        if not self.config.keep_pool:
            self.pool.release_all()
        problems = [f"gradient of {n!r} arrived after its bucket was reduced in the same "
                    f"backward (reentrant activation checkpointing?); use "
                    f"torch.utils.checkpoint with use_reentrant=False" for n in self.late]
        problems += [f"gradient of {n!r} arrived, but the plan has no collective for it (it "
                     f"was planned as producing no gradient); use strategy='evenzero', which "
                     f"reduces every parameter" for n in self.orphans]
        self._reset()
        return problems

    # ------------------------------------------------------------------ one bucket

    def start_grad_sync(self, pos: int) -> None:
        """Copy bucket `pos` in and issue its collectives (after finishing the oldest
        bucket if `max_in_flight` are outstanding)."""
        while len(self.inflight) >= self.config.max_in_flight:
            self._finish_oldest()
        route = self.routes[pos]
        g = self.groups[route.bucket.group]
        names = [s.name for s in route.bucket.params]
        # Decided before the copy reads (and replaces) each `.grad`: the runs of gradients
        # the user cleared since their last reduction are overwritten, not accumulated.
        flags = [self.clearing.cleared(n) for n in names]
        if self.bucketless[pos]:
            self._accumulate_directly(pos, flags)
            return
        cleared = self.runs[g.name].of_params([n for n, f in zip(names, flags, strict=True) if f])
        slot = self.pool.acquire(g.reduce_dtype)
        with record_function("evenzero::bucket_copy"):
            if self.config.stage == 2:
                bucket = self._fill_stage2(route, slot, g)
            else:
                bucket = self._fill_stage1(route, slot, g)
        for n in names:
            self.clearing.reduced(n)
        if self.config.stage == 1:
            # The next backward's first gradient lands in the buffer (`ShardedGrad.landing`).
            for n, view in zip(names, self.grad_buffers.views[pos], strict=True):
                self.clearing.placeholders[n].landing = view
        handle = self.executors[pos].start_grad_sync(bucket, slot, self.trace)
        self.inflight.append(_InFlight(pos, bucket, slot, handle, cleared))
        self.started[pos] = True

    def _accumulate_directly(self, pos: int, cleared: list[bool]) -> None:
        """A group of one rank: its gradients are the reduced ones, added into the shard
        without a bucket (`LocalSync.accumulate_grads`)."""
        route = self.routes[pos]
        grads = [None if p.grad is None or isinstance(p.grad, ShardedGrad) else p.grad
                 for p in self.route_params[pos]]
        scale = 1.0 / (self.config.world_size * self.config.loss_scale())
        executor = self.executors[pos]
        executor.start_grad_sync(None, None, self.trace)
        executor.accumulate_grads(grads, cleared, self.groups[route.bucket.group].grad, scale)
        for s in route.bucket.params:
            self.clearing.reduced(s.name)
        self.started[pos] = True

    def _fill_stage2(self, route: BucketRoute, slot: PoolSlot, g: GroupShard) -> torch.Tensor:
        buf = slot.take(route.bucket.numel, g.reduce_dtype)
        packed = self.packed[route.position]
        if packed is not None:
            grads = [p.grad for p in self.route_params[route.position]]
            if all(type(t) is torch.Tensor for t in grads):
                # Every gradient present, laid out back to back: one concatenation into
                # the bucket (converting to the reduce dtype), not a view per parameter.
                torch.cat([t.reshape(-1) for t in grads], out=buf[:packed])
                for o, n in route.gaps:
                    buf[o:o + n].zero_()
                return buf
        dst, src = [], []
        for s, p in zip(route.bucket.params, self.route_params[route.position], strict=True):
            region = buf[s.offset:s.offset + s.numel]
            if p.grad is None or isinstance(p.grad, ShardedGrad):
                region.zero_()
            else:
                dst.append(region)
                src.append(p.grad.reshape(-1))
        for o, n in route.gaps:
            buf[o:o + n].zero_()
        if dst:
            # One batched copy for the whole bucket, converting to the reduce dtype.
            torch._foreach_copy_(dst, src)
        return buf

    def _fill_stage1(self, route: BucketRoute, slot: PoolSlot, g: GroupShard) -> torch.Tensor:
        views = self.grad_buffers.views[route.position]
        for p, view in zip(self.route_params[route.position], views, strict=True):
            grad = p.grad
            if grad is None or isinstance(grad, ShardedGrad):
                view.zero_()
            elif grad.data_ptr() != view.data_ptr() or grad.dtype != view.dtype:
                # A gradient autograd did not land in the buffer (p.grad was None, or
                # replaced by the user): its contents are the whole local gradient.
                view.copy_(grad)
        buf = self.grad_buffers.buffers[route.position]
        if not self._copies_in(g):
            return buf
        cast = slot.take(buf.numel(), g.reduce_dtype)
        cast.copy_(buf)
        return cast

    def _finish_oldest(self) -> None:
        f = self.inflight.popleft()
        route = self.routes[f.position]
        shard = self.groups[route.bucket.group].grad
        scale = 1.0 / (self.config.world_size * self.config.loss_scale())
        self.executors[f.position].finish_grad_sync(f.handle, f.bucket, shard, scale, f.cleared)
        if self.config.stage == 1:
            self.grad_buffers.buffers[f.position].zero_()
        self.pool.release(f.slot)

    # ------------------------------------------------------------------ state

    def zero_(self) -> None:
        if self.grad_buffers is not None:
            self.grad_buffers.zero_()

    def held_grads(self) -> set[int]:
        """Data pointers of the `.grad` views that are the reducer's own buffers (stage 1,
        between backwards under no_sync())."""
        if self.grad_buffers is None:
            return set()
        return {v.data_ptr() for vs in self.grad_buffers.views for v in vs}

    def nbytes(self) -> int:
        """Bucket buffers in use: stage 1's, and the pool while a backward uses it."""
        held = self.grad_buffers.nbytes() if self.grad_buffers is not None else 0
        return held + (0 if self.pool.idle() else self.pool.nbytes())

    def kept_pool_nbytes(self) -> int:
        """Pool arenas kept, idle, for the next backward (`keep_pool`)."""
        return self.pool.nbytes() if self.pool.idle() else 0


def _packed_numel(route: BucketRoute) -> int | None:
    """Elements of the bucket's parameters if they lie back to back from offset 0 in
    their listed order (evenzero's buckets), else None."""
    end = 0
    for slot in route.bucket.params:
        if slot.offset != end:
            return None
        end += slot.numel
    return end
