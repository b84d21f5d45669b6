"""Flat buffers: parameters as views into per-layout buffers, gradient buckets, the pool.

* `FlatParams`: one buffer per ownership layout, in the parameter dtype. Every model
  parameter's `.data` is a view into it, so the step's all-gather writes the model
  parameters directly (as Megatron and DeepSpeed do). Padding is zero.
* `GradBuffers` (stage 1): one persistent buffer per bucket; a backward's first gradient
  lands in its parameter's view of it (`ShardedGrad.landing`), which becomes
  `param.grad`, so later micro-batches accumulate in place and there is no copy.
* `BucketPool`: at most `slots` arenas per dtype in flight, one per bucket being
  reduced; stage 2 copies the bucket's gradients in with one batched `_foreach_copy_`
  when its last one arrives, and every collective takes its scratch from the same slot.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from evenzero.plan import Bucket, Plan
from evenzero.runtime.checks import ZeroRuntimeError


def slot_views(buf: torch.Tensor, bucket: Bucket, shapes: dict[str, torch.Size]) -> list[torch.Tensor]:
    return [buf[s.offset:s.offset + s.numel].view(shapes[s.name]) for s in bucket.params]


class FlatParams:
    """Per-layout flat parameter buffers whose slices back the model parameters."""

    def __init__(self, plan: Plan, params: dict[str, torch.nn.Parameter],
                 group_ranks: dict[str, int]) -> None:
        self.plan = plan
        self.params = params
        self.group_ranks = group_ranks
        self.buffers: dict[tuple[str, int], torch.Tensor] = {}
        for layout in plan.layouts:
            first = params[layout.params[0].name]
            buf = torch.zeros(layout.numel, dtype=first.dtype, device=first.device)
            for s in layout.params:
                p = params[s.name]
                view = buf[s.offset:s.offset + s.numel].view(p.shape)
                view.copy_(p.detach())
                # Re-point the parameter at the buffer; autograd and the module keep the
                # same Parameter object, hooks included.
                p.data = view
            self.buffers[(layout.group, layout.index)] = buf
        self._ptrs = {s.name: self.buffers[(lay.group, lay.index)][s.offset:].data_ptr()
                      for lay in plan.layouts for s in lay.params}
        # The same in flat lists, for the check every step makes (`in_place`).
        self._watched = [params[s.name] for lay in plan.layouts for s in lay.params]
        self._watched_ptrs = [self._ptrs[s.name] for lay in plan.layouts for s in lay.params]
        self._watched_dtypes = [self.buffers[(lay.group, lay.index)].dtype
                                for lay in plan.layouts for s in lay.params]

    def owned_slice(self, group: str, index: int) -> torch.Tensor:
        """This rank's equal slice of a layout buffer."""
        buf = self.buffers[(group, index)]
        n = self.plan.group(group).size
        per = buf.numel() // n
        r = self.group_ranks[group]
        return buf[r * per:(r + 1) * per]

    def in_place(self) -> bool:
        """Whether every parameter still is its contiguous view of its buffer. Checked
        every step, for every parameter: list comprehensions over C getters cost a
        fraction of a per-parameter Python loop, which runs only when one moved."""
        return ([p.data_ptr() for p in self._watched] == self._watched_ptrs
                and [p.dtype for p in self._watched] == self._watched_dtypes
                and all([p.is_contiguous() for p in self._watched]))

    def repoint_moved(self) -> list[str]:
        """Re-point parameters whose `.data` was replaced (e.g. a dtype re-cast in forward)
        back to their buffer view; returns their names."""
        if self.in_place():
            return []
        moved = []
        for lay in self.plan.layouts:
            buf = self.buffers[(lay.group, lay.index)]
            for s in lay.params:
                p = self.params[s.name]
                if p.data_ptr() != self._ptrs[s.name] or p.dtype != buf.dtype:
                    if p.device != buf.device or p.numel() != s.numel:
                        raise ZeroRuntimeError(
                            f"parameter {s.name!r} was moved to {p.device} or resized after "
                            f"ZeroOptimizer was built; move the model before building it")
                    p.data = buf[s.offset:s.offset + s.numel].view(p.shape)
                    moved.append(s.name)
        return moved

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers.values())


class GradBuffers:
    """Stage 1: persistent full-gradient buffers, one per bucket, in the parameter dtype."""

    def __init__(self, buckets: Sequence[Bucket], params: Mapping[str, torch.nn.Parameter]) -> None:
        self.buffers: list[torch.Tensor] = []
        self.views: list[list[torch.Tensor]] = []
        for b in buckets:
            first = params[b.params[0].name]
            buf = torch.zeros(b.numel, dtype=first.dtype, device=first.device)
            self.buffers.append(buf)
            self.views.append(slot_views(buf, b, {s.name: params[s.name].shape for s in b.params}))

    def zero_(self) -> None:
        for b in self.buffers:
            b.zero_()

    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers)


class PoolSlot:
    """One in-flight bucket's share of the pool: a flat arena in the reduce dtype, handed
    out front to back (the bucket's contents, then its collectives' scratch)."""

    def __init__(self, arena: torch.Tensor) -> None:
        self.arena = arena
        self.used = 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        if dtype != self.arena.dtype or self.used + numel > self.arena.numel():
            raise ZeroRuntimeError(f"bucket pool slot overflow: {numel} {dtype} elements asked, "
                                   f"{self.arena.numel() - self.used} {self.arena.dtype} left; "
                                   f"this is an evenzero bug")
        out = self.arena[self.used:self.used + numel]
        self.used += numel
        return out


class BucketPool:
    """At most `slots` arenas per dtype, allocated on first use and freed by `release_all`.

    A slot holds one in-flight bucket: its contents (stage 2, or stage 1's cast to the
    reduce dtype) and every buffer its collectives allocate. Freeing the arenas after
    backward is what makes stage 2's gradient memory at rest just the 1/N shards.
    """

    def __init__(self, device: torch.device, arena_numel: dict[torch.dtype, int],
                 slots: int) -> None:
        self.device = device
        self.arena_numel = arena_numel
        self.slots = slots
        self._free: dict[torch.dtype, list[PoolSlot]] = {}
        self._all: list[PoolSlot] = []

    def acquire(self, dtype: torch.dtype) -> PoolSlot:
        free = self._free.setdefault(dtype, [])
        if free:
            slot = free.pop()
            slot.used = 0
            return slot
        if sum(1 for s in self._all if s.arena.dtype == dtype) >= self.slots:
            raise ZeroRuntimeError("bucket pool exhausted: release a slot before acquiring "
                                   "another; this is an evenzero bug")
        slot = PoolSlot(torch.empty(self.arena_numel.get(dtype, 0), dtype=dtype,
                                    device=self.device))
        self._all.append(slot)
        return slot

    def release(self, slot: PoolSlot) -> None:
        self._free.setdefault(slot.arena.dtype, []).append(slot)

    def release_all(self) -> None:
        self._free.clear()
        self._all.clear()

    def nbytes(self) -> int:
        return sum(s.arena.numel() * s.arena.element_size() for s in self._all)

    def idle(self) -> bool:
        """No slot is acquired: what it holds is kept for the next backward."""
        return sum(len(f) for f in self._free.values()) == len(self._all)
