"""The compressed reduce-scatter: encode, one all-to-all, decode and sum in fp32.

The wire formats and their byte counts are `evenzero.wire`'s; this module is the code
that sends exactly those bytes. A bucket of `n` elements on a group of `N` ranks is `N`
chunks of `C = n / N`; chunk `k` goes to rank `k`, which owns it. Each rank

1. encodes its whole bucket (every chunk): "bf16" casts it; "int8" cuts it into blocks of
   `block` elements (a block never straddles two chunks: the planner aligns every chunk
   to the block) and writes per chunk its `C` int8 values followed by its `C / block`
   fp32 scales, so one chunk is one contiguous run of bytes;
2. sends chunk `k` to rank `k` with one `all_to_all_single` of equal pieces (the
   planned collective: one per bucket, equal pieces);
3. decodes the `N` pieces it received and sums them in the shard's dtype (fp32 masters:
   fp32), never in bf16 or int8.

A native reduce-scatter cannot do 3 (it sums in the wire dtype inside the collective:
NCCL's bf16 reduce-scatter adds in bf16, and no backend adds blockwise-scaled int8), so
a compressed bucket always takes the all-to-all, on NCCL too; Megatron-core makes the
same swap for fp32 accumulation of bf16 gradients
(megatron/core/distributed/reduce_scatter_with_fp32_accumulation.py@d98e8a64).
`reduce_dtype=torch.bfloat16` remains the way to a native bf16 reduce-scatter.

int8: value `q = round(x * 127 / absmax)` and scale `absmax / 127` per block, so the
dequantized value is `q * scale`; a block of zeros sends zeros. A block holding an inf
or a NaN gets a non-finite scale and decodes to NaN, so the overflow check of the step
(fp16 loss scaling) sees the overflow on every rank, as it would uncompressed.

Error feedback (`residual` given): the residual of the last synchronising backward is
added to this one's bucket before encoding, and what the encoding loses is kept for the
next: `residual <- (x + residual) - decode(encode(x + residual))`. The residual is in the
units of the bucket (the loss-scaled gradient); `runtime/errorfeedback.py` keeps it.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from evenzero.runtime.collectives import ALL_TO_ALL_SUM, Arena
from evenzero.runtime.teardown import keep
from evenzero.wire import MODES, SCALE_BYTES, wire_bytes

QMAX = 127.0
"""int8 values run from -127 to 127 (symmetric: -128 is never sent)."""
_ALIGN = 16
"""Bytes every buffer taken from a pool slot starts on, so its dtype views line up."""


class Buffers(NamedTuple):
    """A compressed bucket's buffers, all from its pool slot."""

    send: torch.Tensor
    """Encoded message, uint8, `N` equal pieces."""
    recv: torch.Tensor
    """Received pieces, uint8, the same size."""
    scratch: torch.Tensor | None
    """int8: fp32 values of the whole message (scaled before the cast, then the
    dequantized pieces). None for bf16."""


def _take_bytes(arena: Arena, nbytes: int, like: torch.dtype) -> torch.Tensor:
    """`nbytes` of pool memory as uint8 (the slot hands out elements of its dtype)."""
    item = torch.empty((), dtype=like).element_size()
    numel = -(-nbytes // _ALIGN) * _ALIGN // item
    return arena.take(numel, like).view(torch.uint8)[:nbytes]


def pool_numel(mode: str, message_numel: int, itemsize: int, block: int) -> int:
    """Pool elements (of `itemsize` bytes) a compressed message takes (`Buffers`)."""
    wire = wire_bytes(mode, message_numel, itemsize, block)
    parts = [wire, wire] + ([4 * message_numel] if mode == "int8" else [])
    return sum(-(-p // _ALIGN) * _ALIGN // itemsize for p in parts)


class CompressedReduceScatter:
    """One compressed bucket: encode, all-to-all of equal pieces, decode and sum."""

    name = ALL_TO_ALL_SUM

    def __init__(self, mode: str, block: int) -> None:
        if mode not in MODES:
            raise ValueError(f"unknown compression {mode!r}; one of {MODES}")
        self.mode, self.block = mode, block

    def pool_numel(self, message_numel: int, itemsize: int) -> int:
        return pool_numel(self.mode, message_numel, itemsize, self.block)

    def allocate(self, arena: Arena, message: torch.Tensor) -> Buffers:
        n = message.numel()
        wire = wire_bytes(self.mode, n, message.element_size(), self.block)
        send = _take_bytes(arena, wire, message.dtype)
        recv = _take_bytes(arena, wire, message.dtype)
        scratch = None
        if self.mode == "int8":
            scratch = _take_bytes(arena, 4 * n, message.dtype).view(torch.float32)
        return Buffers(send, recv, scratch)

    def __call__(self, buffers: Buffers, message: torch.Tensor, group: Any,
                 residual: torch.Tensor | None = None) -> Any:
        """Encode `message` (plus `residual`, updated in place) and start the all-to-all."""
        self.encode(buffers, message, dist.get_world_size(group), residual)
        return keep(dist.all_to_all_single(buffers.recv, buffers.send, group=group,
                                           async_op=True))

    @torch.no_grad()
    def encode(self, buffers: Buffers, message: torch.Tensor, group_size: int,
               residual: torch.Tensor | None = None) -> None:
        """Write `message` (plus `residual`, updated in place) encoded into `buffers.send`."""
        if self.mode == "bf16":
            self._encode_bf16(buffers, message, residual)
        else:
            self._encode_int8(buffers, message, residual, group_size)

    def chunk(self, buffers: Buffers, group_size: int, sum_dtype: torch.dtype) -> torch.Tensor:
        """This rank's chunk, summed over the ranks in `sum_dtype`, once the work is done.
        Pieces are added in rank order: the same bits on every run."""
        if self.mode == "bf16":
            return buffers.recv.view(torch.bfloat16).view(group_size, -1).sum(0, dtype=sum_dtype)
        q, scales = self._pieces(buffers.recv, group_size)
        values = buffers.scratch.view(group_size, -1, self.block)
        torch.mul(q.view(group_size, -1, self.block), scales.unsqueeze(-1), out=values)
        return values.view(group_size, -1).sum(0, dtype=sum_dtype)

    # ------------------------------------------------------------------ encodings

    def _encode_bf16(self, buffers: Buffers, message: torch.Tensor,
                     residual: torch.Tensor | None) -> None:
        send = buffers.send.view(torch.bfloat16)
        if residual is None:
            send.copy_(message)
            return
        residual.add_(message)
        send.copy_(residual)
        residual.sub_(send)

    def _pieces(self, raw: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(int8 values (N, C), fp32 scales (N, C / block)) views of an encoded message."""
        rows = raw.view(group_size, -1)
        per = rows.shape[1]
        c = per * self.block // (self.block + SCALE_BYTES)
        return rows[:, :c].view(torch.int8), rows[:, c:].view(torch.float32)

    def _encode_int8(self, buffers: Buffers, message: torch.Tensor,
                     residual: torch.Tensor | None, group_size: int) -> None:
        q, scales = self._pieces(buffers.send, group_size)
        if residual is not None:
            residual.add_(message)
            source = residual
        elif message.dtype == torch.float32:
            source = message
        else:
            source = buffers.scratch.copy_(message)
        blocks = source.view(-1, self.block)
        amax = torch.linalg.vector_norm(blocks, ord=float("inf"), dim=1)
        # A block of zeros has scale 0 and sends zeros; a non-finite absmax gives a
        # non-finite scale (decoded as NaN) and values 0. A block so small that QMAX /
        # absmax overflows fp32 (subnormal values) sends zeros too: else inf x 0 is NaN.
        # Error feedback drives such blocks there: a parameter whose gradient stays 0 (an
        # expert no token reached) re-encodes its residual, which shrinks ~254x per step
        # and reaches the subnormals in about 15 steps.
        inverse = QMAX / amax
        inverse = torch.where(torch.isinf(inverse), 0.0, inverse)
        scales.copy_(amax.div_(QMAX).view(group_size, -1))
        values = buffers.scratch.view(-1, self.block)
        torch.mul(blocks, inverse.unsqueeze(1), out=values)
        values.round_()
        q.copy_(values.view(group_size, -1))
        if residual is not None:
            # What the receiver will decode, exactly: the rounded values times the sent scales.
            values.mul_(scales.reshape(-1, 1))
            residual.sub_(values.view(-1))
