"""The collectives the runtime issues, each recorded in the trace as a plan `Collective`.

Reduce-scatter has two implementations, chosen per backend (the documented rule):

* NCCL (and any non-gloo backend): native `reduce_scatter_tensor`.
* gloo: `all_to_all_single` of the N equal chunks, then a local sum over the N received
  chunks. On gloo `reduce_scatter_tensor` was measured slower than even `all_reduce`
  (8 local ranks, 1M fp32 elements: 8.8 ms vs 6.5 ms), and all_to_all + sum ran in
  3.1 ms (shared/reference/nccl-costs.md section 6). The result is the same sum, and
  it is still one collective per bucket; the trace records which one ran in
  `Collective.algorithm`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.distributed as dist

from evenzero.plan import Collective

NATIVE = "reduce_scatter_tensor"
ALL_TO_ALL_SUM = "all_to_all+sum"
REDUCE_SCATTER_ALGORITHMS = (NATIVE, ALL_TO_ALL_SUM)

# torch 2.13 renamed the flat collectives; older releases only have the old names.
_all_gather_flat = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_flat = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def default_reduce_scatter_algorithm(backend: str, device_type: str = "cpu") -> str:
    """The fastest correct reduce-scatter for a backend name ("gloo", "nccl",
    "cpu:gloo,cuda:nccl", ...) and the device the gradients live on."""
    if device_type == "cuda" and "nccl" in backend:
        return NATIVE
    return ALL_TO_ALL_SUM if "gloo" in backend else NATIVE


class Trace:
    """Collectives issued since the last optimizer step, as plan records."""

    def __init__(self) -> None:
        self.pending: list[Collective] = []
        self.last: tuple[Collective, ...] = ()

    def record(self, c: Collective, algorithm: str = "") -> None:
        self.pending.append(dataclasses.replace(c, algorithm=algorithm or c.op))

    def close_step(self) -> None:
        self.last, self.pending = tuple(self.pending), []


class ReduceScatterHandle:
    """An in-flight reduce-scatter; `wait()` returns this rank's reduced chunk."""

    def __init__(self, work, output: torch.Tensor, algorithm: str, group_size: int,
                 sum_dtype: torch.dtype) -> None:
        self.work, self.output, self.algorithm = work, output, algorithm
        self.group_size, self.sum_dtype = group_size, sum_dtype

    def wait(self) -> torch.Tensor:
        self.work.wait()
        if self.algorithm == ALL_TO_ALL_SUM:
            # Rank s's chunk for us is row s; summing the rows in rank order gives the
            # same bits on every rank, in `sum_dtype` (the fp32 shard dtype on the direct
            # path; the bucket dtype for the pieces of non-evenzero plans).
            return self.output.view(self.group_size, -1).sum(0, dtype=self.sum_dtype)
        return self.output


def reduce_scatter(inp: torch.Tensor, out: torch.Tensor, group, algorithm: str,
                   sum_dtype: torch.dtype) -> ReduceScatterHandle:
    """Start a reduce-scatter of `inp` over `group`; `out` is scratch space: as large as
    `inp` for all_to_all+sum, one chunk for the native op."""
    n = dist.get_world_size(group)
    if algorithm == ALL_TO_ALL_SUM:
        work = dist.all_to_all_single(out, inp, group=group, async_op=True)
    else:
        work = _reduce_scatter_flat(out, inp, group=group, async_op=True)
    return ReduceScatterHandle(work, out, algorithm, n, sum_dtype)


def scratch_numel(algorithm: str, message_numel: int, group_size: int) -> int:
    """Elements of scratch output a reduce-scatter of `message_numel` needs."""
    return message_numel if algorithm == ALL_TO_ALL_SUM else message_numel // group_size


class PieceHandle:
    """An in-flight reduce / all-reduce / reduce-scatter on pieces of a bucket buffer.

    Non-contiguous pieces (`Collective.segments`) are packed into one message first and
    unpacked into the buffer when done, so after `wait()` the buffer holds the reduced
    values wherever this rank receives them.
    """

    def __init__(self, c: Collective, buf: torch.Tensor, group, algorithm: str,
                 group_rank: int) -> None:
        self.c, self.buf, self.group_rank = c, buf, group_rank
        pieces = c.pieces()
        self.message = (buf[pieces[0][0]:pieces[0][0] + pieces[0][1]] if len(pieces) == 1
                        else torch.cat([buf[o:o + n] for o, n in pieces]))
        self.rs: ReduceScatterHandle | None = None
        self.work = None
        if c.op == "reduce":
            self.work = dist.reduce(self.message, dst=dist.get_global_rank(group, c.root),
                                    group=group, async_op=True)
        elif c.op == "all_reduce":
            self.work = dist.all_reduce(self.message, group=group, async_op=True)
        else:
            scratch = torch.empty(scratch_numel(algorithm, self.message.numel(), c.group_size),
                                  dtype=buf.dtype, device=buf.device)
            self.rs = reduce_scatter(self.message, scratch, group, algorithm, buf.dtype)

    def wait(self) -> None:
        pieces = self.c.pieces()
        if self.rs is not None:
            chunk = self.rs.wait()
            lo = self.group_rank * chunk.numel()
            self.message[lo:lo + chunk.numel()].copy_(chunk)
        else:
            self.work.wait()
        if len(pieces) > 1 and (self.c.op != "reduce" or self.c.root == self.group_rank):
            pos = 0
            for o, n in pieces:
                self.buf[o:o + n].copy_(self.message[pos:pos + n])
                pos += n


def all_gather_layout(buf: torch.Tensor, group_rank: int, group):
    """Start filling the flat layout buffer from every rank's equal slice, in place;
    returns the work handle."""
    n = dist.get_world_size(group)
    per = buf.numel() // n
    return _all_gather_flat(buf, buf[group_rank * per:(group_rank + 1) * per], group=group,
                            async_op=True)


def all_gather_flat(out: torch.Tensor, inp: torch.Tensor, group) -> None:
    _all_gather_flat(out, inp, group=group)


def all_reduce_sum(vec: torch.Tensor, group) -> None:
    dist.all_reduce(vec, group=group)
