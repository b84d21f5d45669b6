"""The collectives the runtime issues, as objects, and the trace that records them.

Each kind of collective is an object in the style of FSDP2's
(torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py@v2.13.0 `AllGather`,
`ReduceScatter`): `allocate()` takes its buffers from the caller's pool slot and
`__call__` issues it asynchronously. Constructing one issues nothing. Every issued
`Work` goes through `teardown.keep` (why: `evenzero.runtime.teardown`).

Reduce-scatter has two implementations, chosen once per backend; `REDUCE_SCATTERS` is
the only place that maps an algorithm name to code:

* NCCL (and any non-gloo backend): native `reduce_scatter_tensor`.
* gloo: `all_to_all_single` of the N equal chunks, then a local sum over the N received
  chunks. Measured by this project on 8 local gloo ranks, 1M fp32 elements:
  `reduce_scatter_tensor` 8.8 ms, `all_reduce` 6.5 ms, all_to_all + sum 3.1 ms. The
  result is the same sum, still one collective per bucket; the trace records which ran
  in `Collective.algorithm`. (Megatron-core has the same swap for fp32 accumulation:
  megatron/core/distributed/reduce_scatter_with_fp32_accumulation.py@d98e8a64.)

A group of one rank communicates nothing: its reduce-scatter, all-reduce, all-gather and
broadcast are the identity, so none of them is issued (not even to a backend that would
return at once: gloo copies the whole message on a group of one, and a 1-rank run's
all-gather and all_to_all of the whole model cost a fifth of its step). The trace still
lists the planned call, with `LOCAL` as its algorithm.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, ClassVar, NamedTuple, Protocol

import torch
import torch.distributed as dist

from evenzero.plan import Collective, Schedule
from evenzero.runtime.stall import wait
from evenzero.runtime.teardown import keep

NATIVE = "reduce_scatter_tensor"
ALL_TO_ALL_SUM = "all_to_all+sum"
ALL_GATHER = "all_gather_into_tensor"
LOCAL = "local"
"""The algorithm of a collective on a group of one rank: nothing is issued."""

# torch 2.13 renamed the flat collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def control_device(group: Any, param_device: torch.device | None) -> torch.device:
    """Where small control tensors (flags, norms, digests) for collectives on `group` live.

    An NCCL-only group needs CUDA tensors. A mixed backend ("cpu:gloo,cuda:nccl") sends
    CPU tensors over gloo, so they stay on the CPU unless the model itself is on CUDA
    (then NCCL carries them, as it does the gradients). Everything else: the CPU."""
    backend = str(dist.get_backend(group))
    on_cuda = param_device is not None and param_device.type == "cuda"
    if "nccl" in backend and (backend == "nccl" or on_cuda):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def alone(group: Any) -> bool:
    """Whether `group` has a single rank (its collectives are the identity)."""
    return dist.get_world_size(group) == 1


class Done:
    """The finished work of a collective that was not issued (a group of one)."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


DONE = Done()


class Arena(Protocol):
    """Where a collective's buffers come from: a slot of the bucket pool."""

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...


# ---------------------------------------------------------------------- reduce-scatter


class ReduceScatter:
    """An equal reduce-scatter of a flat message over a group (one subclass per algorithm)."""

    name: ClassVar[str]

    def scratch_numel(self, message_numel: int, group_size: int) -> int:
        """Elements of output scratch a message of `message_numel` needs."""
        raise NotImplementedError

    def allocate(self, arena: Arena, message_numel: int, group_size: int,
                 dtype: torch.dtype) -> torch.Tensor:
        return arena.take(self.scratch_numel(message_numel, group_size), dtype)

    def __call__(self, output: torch.Tensor, message: torch.Tensor, group: Any) -> Any:
        """Start the reduce-scatter; returns the (kept) work."""
        raise NotImplementedError

    def chunk(self, output: torch.Tensor, group_size: int, sum_dtype: torch.dtype) -> torch.Tensor:
        """This rank's reduced chunk, once the work is done."""
        raise NotImplementedError


class NativeReduceScatter(ReduceScatter):
    name = NATIVE

    def scratch_numel(self, message_numel: int, group_size: int) -> int:
        return message_numel // group_size

    def __call__(self, output: torch.Tensor, message: torch.Tensor, group: Any) -> Any:
        return keep(_reduce_scatter_flat(output, message, group=group, async_op=True))

    def chunk(self, output: torch.Tensor, group_size: int, sum_dtype: torch.dtype) -> torch.Tensor:
        return output


class AllToAllSum(ReduceScatter):
    name = ALL_TO_ALL_SUM

    def scratch_numel(self, message_numel: int, group_size: int) -> int:
        return message_numel

    def __call__(self, output: torch.Tensor, message: torch.Tensor, group: Any) -> Any:
        return keep(dist.all_to_all_single(output, message, group=group, async_op=True))

    def chunk(self, output: torch.Tensor, group_size: int, sum_dtype: torch.dtype) -> torch.Tensor:
        # Rank s's chunk for us is row s; summing the rows in rank order gives the same
        # bits on every rank, in `sum_dtype` (the fp32 shard dtype on the direct path; the
        # bucket dtype for the pieces of non-evenzero plans).
        return output.view(group_size, -1).sum(0, dtype=sum_dtype)


REDUCE_SCATTERS: dict[str, ReduceScatter] = {NATIVE: NativeReduceScatter(),
                                             ALL_TO_ALL_SUM: AllToAllSum()}
REDUCE_SCATTER_ALGORITHMS = tuple(REDUCE_SCATTERS)


def default_reduce_scatter_algorithm(backend: str, device_type: str = "cpu") -> str:
    """The fastest correct reduce-scatter for a backend name ("gloo", "nccl",
    "cpu:gloo,cuda:nccl", ...) and the device the gradients live on."""
    if device_type == "cuda" and "nccl" in backend:
        return NATIVE
    return ALL_TO_ALL_SUM if "gloo" in backend else NATIVE


# ---------------------------------------------------------------------- peer pieces


class Message(NamedTuple):
    """The buffers of one issued piece collective."""

    packed: torch.Tensor
    """The message: a view of the bucket, or the pieces packed into pool memory."""
    scratch: torch.Tensor | None
    """Reduce-scatter output scratch; None for reduce and all-reduce."""


class PieceCollective:
    """One planned reduce, all-reduce or reduce-scatter on pieces of a bucket (the replay
    of a peer's schedule). Non-contiguous pieces (`Collective.segments`) are packed into
    one pool buffer and unpacked after the wait, so the bucket then holds the reduced
    values wherever this rank receives them."""

    def __init__(self, planned: Collective, group_rank: int, reduce_scatter: ReduceScatter) -> None:
        self.planned, self.group_rank, self.rs = planned, group_rank, reduce_scatter
        self.pieces = planned.pieces()
        self.message_numel = sum(n for _, n in self.pieces)
        self.algorithm = reduce_scatter.name if planned.op == "reduce_scatter" else planned.op

    def pool_numel(self) -> int:
        """Pool elements (bucket dtype) the call needs: packing and scratch."""
        packing = self.message_numel if len(self.pieces) > 1 else 0
        scratch = (self.rs.scratch_numel(self.message_numel, self.planned.group_size)
                   if self.planned.op == "reduce_scatter" else 0)
        return packing + scratch

    def allocate(self, arena: Arena, bucket: torch.Tensor) -> Message:
        if len(self.pieces) == 1:
            (o, n), = self.pieces
            packed = bucket[o:o + n]
        else:
            packed = arena.take(self.message_numel, bucket.dtype)
            torch.cat([bucket[o:o + n] for o, n in self.pieces], out=packed)
        scratch = None
        if self.planned.op == "reduce_scatter":
            scratch = self.rs.allocate(arena, self.message_numel, self.planned.group_size,
                                       bucket.dtype)
        return Message(packed, scratch)

    def __call__(self, message: Message, group: Any) -> Any:
        c = self.planned
        if c.op == "reduce":
            return keep(dist.reduce(message.packed, dst=dist.get_global_rank(group, c.root),
                                    group=group, async_op=True))
        if c.op == "all_reduce":
            return keep(dist.all_reduce(message.packed, group=group, async_op=True))
        return self.rs(message.scratch, message.packed, group)

    def finish(self, message: Message, bucket: torch.Tensor) -> None:
        """After the wait: put the reduced values where this rank receives them."""
        c = self.planned
        if c.op == "reduce_scatter":
            chunk = self.rs.chunk(message.scratch, c.group_size, bucket.dtype)
            lo = self.group_rank * chunk.numel()
            message.packed[lo:lo + chunk.numel()].copy_(chunk)
        if len(self.pieces) > 1 and (c.op != "reduce" or c.root == self.group_rank):
            pos = 0
            for o, n in self.pieces:
                bucket[o:o + n].copy_(message.packed[pos:pos + n])
                pos += n


# ---------------------------------------------------------------------- gather, reduce


class LayoutAllGather:
    """The step's all-gather of one flat layout buffer, in place: every rank contributes
    its equal slice (`owned`, a view of `layout`)."""

    name = ALL_GATHER

    def algorithm_for(self, group_size: int) -> str:
        """What the trace records for a gather on a group of `group_size` ranks."""
        return LOCAL if group_size == 1 else self.name

    def __call__(self, layout: torch.Tensor, owned: torch.Tensor, group: Any) -> Any:
        if owned.numel() == layout.numel():  # a group of one: the slice is the layout
            return DONE
        return keep(_all_gather_flat(layout, owned, group=group, async_op=True))


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    """Blocking all-gather of equal flat pieces into `out` (setup checks, re-sharding)."""
    if out.numel() == inp.numel():  # a group of one
        if out.data_ptr() != inp.data_ptr():
            out.copy_(inp)
        return
    keep(_all_gather_flat(out, inp, group=group, async_op=True)).wait()


def all_reduce_sum(vec: torch.Tensor, group: Any, what: str = "a control all-reduce") -> None:
    """Blocking sum all-reduce of a small control vector (`what` names it in a timeout)."""
    if alone(group):
        return
    wait(keep(dist.all_reduce(vec, group=group, async_op=True)), group, what)


def broadcast(t: torch.Tensor, src_group_rank: int, group: Any) -> None:
    """Blocking broadcast from the group's rank `src_group_rank`."""
    if alone(group):
        return
    keep(dist.broadcast(t, src=dist.get_global_rank(group, src_group_rank), group=group,
                        async_op=True)).wait()


# ---------------------------------------------------------------------- trace


class TraceRecorder:
    """Collectives issued since the last optimizer step, as plan records."""

    def __init__(self) -> None:
        self.pending: list[Collective] = []
        self.last: Schedule = Schedule()

    def record(self, c: Collective, algorithm: str = "") -> None:
        self.pending.append(dataclasses.replace(c, algorithm=algorithm or c.op))

    def record_all(self, calls: Sequence[Collective], algorithm: str) -> None:
        for c in calls:
            self.record(c, algorithm)

    def close_step(self) -> None:
        self.last, self.pending = Schedule(self.pending), []
