"""Gradient reduction during backward: buckets launched in plan order, overlapped.

Every rank must issue the same collectives in the same order, or they pair up wrongly
or hang. So a bucket is launched only when it is complete *and* every bucket before it
in the plan has been launched; a complete bucket behind an incomplete one waits. At the
end of backward every bucket not yet launched is launched in order, with zeros for
parameters that produced no gradient. Whatever the data did, every rank has then issued
exactly `plan.backward()`; a gradient that exists on some ranks only is caught by name
at the step, not by a hang.

Each launched bucket is reduced asynchronously; at most `max_in_flight` are outstanding
(the oldest is waited for first). When a bucket's reduction completes, this rank's
owned elements are added, divided by the world size, into its fp32 gradient shard.
Dividing by the world size, for expert groups too, makes the result the gradient of the
mean loss over the global batch (DeepSpeed #6546 divided experts by the expert-DP size).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from evenzero.runtime.buckets import BucketPool, GradBuffers
from evenzero.runtime.collectives import PieceHandle, Trace, reduce_scatter, scratch_numel
from evenzero.runtime.routes import BucketRoute
from evenzero.runtime.shards import GroupState


@dataclass
class _InFlight:
    route: BucketRoute
    buf: torch.Tensor
    handles: list
    slot: tuple[torch.Tensor, torch.Tensor] | None


class GradientReducer:
    """Launches, waits for and accumulates the bucket reductions of one plan."""

    def __init__(self, routes: tuple[BucketRoute, ...], params: Mapping[str, torch.nn.Parameter],
                 groups: Mapping[str, GroupState], stage: int, algorithm: str, world_size: int,
                 trace: Trace, max_in_flight: int, device: torch.device) -> None:
        self.routes, self.groups, self.stage = routes, groups, stage
        self.algorithm, self.world_size, self.trace = algorithm, world_size, trace
        self.max_in_flight = max_in_flight
        self.route_params = [[params[s.name] for s in r.bucket.params] for r in routes]
        self.position = {s.name: r.position for r in routes for s in r.bucket.params}
        self.grad_buffers = GradBuffers([r.bucket for r in routes], params) if stage == 1 else None
        inp: dict[torch.dtype, int] = {}
        out: dict[torch.dtype, int] = {}
        for r in routes:
            g = groups[r.bucket.group]
            if stage == 2:
                inp[g.reduce_dtype] = max(inp.get(g.reduce_dtype, 0), r.bucket.numel)
            if r.direct_shard_offset is not None:
                need = scratch_numel(algorithm, r.bucket.numel, g.size)
                out[g.reduce_dtype] = max(out.get(g.reduce_dtype, 0), need)
        self.pool = BucketPool(device, inp, out, max_in_flight)
        self._reset()

    def _reset(self) -> None:
        self.remaining = [len(p) for p in self.route_params]
        self.launched = [False] * len(self.routes)
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
        if self.launched[pos]:
            self.late.append(name)
            return
        if name in self.arrived:
            return
        self.arrived.add(name)
        self.remaining[pos] -= 1
        while self.next < len(self.routes) and self.remaining[self.next] == 0:
            self._launch(self.next)
            self.next += 1

    def finish(self) -> list[str]:
        """End of backward: launch the rest in order and wait for all. Returns what went
        wrong (empty if nothing), after the collectives, so every rank stays in step."""
        while self.next < len(self.routes):
            self._launch(self.next)
            self.next += 1
        while self.inflight:
            self._finalize_oldest()
        self.pool.release_all()
        problems = [f"gradient of {n!r} arrived after its bucket was reduced in the same "
                    f"backward (reentrant activation checkpointing?); use "
                    f"torch.utils.checkpoint with use_reentrant=False" for n in self.late]
        problems += [f"gradient of {n!r} arrived, but the plan has no collective for it (it "
                     f"was planned as producing no gradient); use strategy='evenzero', which "
                     f"reduces every parameter" for n in self.orphans]
        self._reset()
        return problems

    def abandon(self) -> None:
        """Forget a backward that died midway (its end callback never ran): wait for what
        was launched, so buffers are free, and start clean."""
        while self.inflight:
            self._finalize_oldest()
        self.pool.release_all()
        self._reset()

    # ------------------------------------------------------------------ one bucket

    def _launch(self, pos: int) -> None:
        while len(self.inflight) >= self.max_in_flight:
            self._finalize_oldest()
        route = self.routes[pos]
        g = self.groups[route.bucket.group]
        slot = None
        if self.stage == 2 or route.direct_shard_offset is not None:
            slot = self.pool.acquire(g.reduce_dtype)
        buf = self._fill_stage2(route, slot[0]) if self.stage == 2 else self._fill_stage1(route, g)
        if route.direct_shard_offset is not None:
            c = route.collectives[0]
            out = slot[1][:scratch_numel(self.algorithm, route.bucket.numel, g.size)]
            handles = [reduce_scatter(buf, out, g.process_group, self.algorithm, g.grad.dtype)]
            self.trace.record(c, self.algorithm)
        else:
            handles = []
            for c in route.collectives:
                handles.append(PieceHandle(c, buf, g.process_group, self.algorithm, g.rank))
                self.trace.record(c, self.algorithm if c.op == "reduce_scatter" else c.op)
        self.inflight.append(_InFlight(route, buf, handles, slot))
        self.launched[pos] = True

    def _fill_stage2(self, route: BucketRoute, pool_input: torch.Tensor) -> torch.Tensor:
        buf = pool_input[:route.bucket.numel]
        dst, src = [], []
        for s, p in zip(route.bucket.params, self.route_params[route.position], strict=True):
            region = buf[s.offset:s.offset + s.numel]
            if p.grad is None:
                region.zero_()
            else:
                dst.append(region)
                src.append(p.grad.reshape(-1))
        for o, n in route.gaps:
            buf[o:o + n].zero_()
        if dst:
            # One batched copy for the whole bucket, converting to the reduce dtype.
            torch._foreach_copy_(dst, src)
        for p in self.route_params[route.position]:
            p.grad = None
        return buf

    def _fill_stage1(self, route: BucketRoute, g: GroupState) -> torch.Tensor:
        views = self.grad_buffers.views[route.position]
        for p, view in zip(self.route_params[route.position], views, strict=True):
            grad = p.grad
            if grad is not None and grad.data_ptr() == view.data_ptr() and grad.dtype == view.dtype:
                continue  # autograd accumulated in place into the buffer: nothing to do
            if grad is None:
                view.zero_()
            else:
                # Someone replaced .grad (zero_grad(set_to_none) on the module, the first
                # iteration): its contents are the whole gradient, so overwrite.
                view.copy_(grad)
            p.grad = view if view.dtype == p.dtype and view.shape == p.shape else None
        buf = self.grad_buffers.buffers[route.position]
        return buf if buf.dtype == g.reduce_dtype else buf.to(g.reduce_dtype)

    def _finalize_oldest(self) -> None:
        f = self.inflight.popleft()
        route = f.route
        shard = self.groups[route.bucket.group].grad
        scale = 1.0 / self.world_size
        if route.direct_shard_offset is not None:
            chunk = f.handles[0].wait()
            off = route.direct_shard_offset
            shard[off:off + chunk.numel()].add_(chunk, alpha=scale)
        else:
            for h in f.handles:
                h.wait()
            for piece in route.owned:
                shard[piece.shard_offset:piece.shard_offset + piece.numel].add_(
                    f.buf[piece.bucket_offset:piece.bucket_offset + piece.numel], alpha=scale)
        if self.stage == 1:
            self.grad_buffers.buffers[route.position].zero_()
        if f.slot is not None:
            self.pool.release(f.slot)

    # ------------------------------------------------------------------ state

    def zero_(self) -> None:
        if self.grad_buffers is not None:
            self.grad_buffers.zero_()

    def nbytes(self) -> int:
        held = self.grad_buffers.nbytes() if self.grad_buffers is not None else 0
        return held + self.pool.nbytes()

