"""Compressed gradients on the wire: the modes, the bytes they send, the work they cost.

`grad_compression` (`ZeroConfig`, `PlanOptions`) changes what a bucket's one
reduce-scatter sends, never what it computes:

* `None` (the default): the gradients in their own dtype (fp32, or the parameters' dtype,
  or `reduce_dtype`): exact values.
* "bf16": each rank casts its bucket to bf16 and sends it with one all-to-all; the
  receiver sums the N pieces of its chunk in fp32 (the master dtype), not in bf16. Half
  the bytes of fp32. (A native bf16 reduce-scatter, which `reduce_dtype=torch.bfloat16`
  runs on NCCL, sums in bf16 inside the collective; this mode never does.)
* "int8": each rank's bucket is cut into blocks of `block` elements that never straddle
  two ranks' chunks; every block is sent as int8 values `round(x * 127 / absmax)` and one
  fp32 scale `absmax / 127`. The receiver dequantizes each piece and sums in fp32. Bytes
  per element: 1 + 4 / block (3.94x fewer than fp32 at the default block of 256).

Optional error feedback (`error_feedback=True`) keeps, per rank, what quantization lost
(`x - dequantize(quantize(x))` of the rank's whole bucket) and adds it to the next
synchronising backward's gradient before quantizing (1-bit Adam's and PowerSGD's error
compensation: arXiv 2102.02888, 1905.13727). Its memory is one fp32 value per gradient
element on every rank.

Pure Python: the planner prices these from here, and the runtime's codecs
(`runtime/compression.py`) send exactly the bytes `wire_bytes` counts.
"""

from __future__ import annotations

MODES = ("bf16", "int8")
"""The compressed wire formats (`None` is the uncompressed default)."""

DEFAULT_BLOCK = 256
"""Elements per int8 scale. Chosen by measurement (`benchmarks/compression_block.py`,
BENCHMARKS.md, 4 ranks' real gradients): the relative error of the reduced gradient
grows slowly with the block (seed model 0.0034 at 128, 0.0037 at 256, 0.0046 at 1024,
0.0062 at 4096; Llama-style 0.0070, 0.0080, 0.0112, 0.0153), while the scales' share
of the bytes falls (3.88x fewer bytes than fp32 at 128, 3.94x at 256, 3.98x at 1024).
256 is where the scales cost 1.6% and the error is within 15% of 128's; smaller blocks
buy little accuracy for up to 11% more bytes and a slower codec (32 was the slowest)."""
MIN_BLOCK = 32
"""Smallest block: 32 elements already spend 11% of the bytes on scales."""
MAX_BLOCK = 1 << 16
"""Largest block: one outlier then flattens 65,536 values to zero."""
SCALE_BYTES = 4
"""One fp32 scale per int8 block."""

WIRE_ITEMSIZE = {"bf16": 2, "int8": 1}
"""Bytes per gradient element on the wire, scales aside."""


class WireError(ValueError):
    """A compression setting that cannot be used; the message names the setting."""


def check_mode(mode: object) -> None:
    if mode is not None and mode not in MODES:
        raise WireError(f"grad_compression must be None, \"bf16\" or \"int8\", got {mode!r}")


def check_block(block: object) -> None:
    """A block must be a power of two in [MIN_BLOCK, MAX_BLOCK]: it then divides every
    rank's chunk of a bucket aligned to it, and every alignment in bytes."""
    if (isinstance(block, bool) or not isinstance(block, int) or block < MIN_BLOCK
            or block > MAX_BLOCK or block & (block - 1)):
        raise WireError(f"grad_compression_block must be a power of two from {MIN_BLOCK} to "
                        f"{MAX_BLOCK} elements (each block shares one fp32 scale and must divide "
                        f"every rank's chunk of a bucket), got {block!r}; the default is "
                        f"{DEFAULT_BLOCK}")


def chunk_alignment(mode: str | None, block: int) -> int:
    """Elements every rank's chunk of a bucket must be a multiple of, so that no int8
    block straddles two ranks' chunks."""
    return block if mode == "int8" else 1


def wire_bytes(mode: str | None, numel: int, itemsize: int, block: int = DEFAULT_BLOCK) -> int:
    """Bytes one rank sends and receives for a message of `numel` elements (all ranks'
    chunks; `numel` is a multiple of the group size times `chunk_alignment`), whose
    uncompressed elements are `itemsize` bytes."""
    if mode is None:
        return numel * itemsize
    if mode == "bf16":
        return numel * WIRE_ITEMSIZE["bf16"]
    return numel * WIRE_ITEMSIZE["int8"] + SCALE_BYTES * -(-numel // block)


def codec_traffic(mode: str | None, numel: int, itemsize: int, group_size: int,
                  error_feedback: bool = False) -> tuple[int, int]:
    """Memory traffic (bytes read plus written) of the runtime's codec for one message
    of `numel` elements of `itemsize` bytes: (encoding before the send, decoding and the
    fp32 sum after the receive). Counted pass by pass from `runtime/compression.py`; the
    uncompressed all_to_all+sum's own sum is not counted here (nor for None)."""
    if mode is None:
        return 0, 0
    if mode == "bf16":
        encode = numel * (itemsize + 2)  # one cast
        decode = numel * 2 + numel // max(1, group_size) * 4  # the fp32 sum of N pieces
        if error_feedback:
            encode += numel * (4 + itemsize + 4) + numel * (4 + 2 + 4)
        return encode, decode
    # int8: absmax of every block (read), scale and round into fp32 (read, write), the
    # cast to int8 (read, write); decode: int8 to fp32 times the scale (read, write), the
    # sum of the N pieces (read, write one chunk).
    encode = numel * itemsize + numel * (itemsize + 4) + numel * (4 + 1)
    decode = numel * (1 + 4) + numel * 4 + numel // max(1, group_size) * 4
    if error_feedback:
        # residual += gradient (read two, write one); residual -= dequantized (read the
        # int8 values, the residual; write it).
        encode += numel * (4 + itemsize + 4) + numel * (1 + 4 + 4)
    return encode, decode


def scratch_bytes(mode: str | None, numel: int, itemsize: int, block: int = DEFAULT_BLOCK) -> int:
    """Bytes of pool memory one in-flight compressed message takes besides its bucket:
    the encoded message sent and the one received, and for int8 an fp32 buffer of the
    whole message (the scaled values before the cast, then the dequantized pieces)."""
    if mode is None:
        return 0
    wire = wire_bytes(mode, numel, itemsize, block)
    return 2 * wire + (4 * numel if mode == "int8" else 0)


RESIDUAL_ITEMSIZE = 4
"""Error feedback keeps its residual in fp32, whatever the gradients' dtype."""
