"""The model the user holds is the truth: writes to parameters between steps are kept.

Users write to weights between steps: `model.load_state_dict(pretrained)`, `p.copy_(...)`,
in-place ops, `p.data.clamp_(-c, c)` (WGAN), `p.data = tensor`. Each rank's master shard
would otherwise overwrite them at the next step, silently. Version counters cannot see
them all (`p.data.clamp_()` bypasses them, and a parameter re-pointed with
`p.data = view` does not share the flat buffer's counter), so values are compared
instead, once per step, before the inner step:

1. `adopt_replaced`: a parameter whose `.data` was replaced (it no longer points into
   its flat buffer) has its new values copied into the buffer, then is re-pointed;
2. fp32 parameters (master dtype = parameter dtype) need nothing more: the master *is*
   this rank's slice of the flat buffer (`runtime/shards.py`), so a write to a parameter
   is a write to the master. For bf16/fp16 parameters each rank reads its owned slice of
   every flat buffer back into its master shard (`pick_up`, through
   `GroupShard.pick_up_writes`): the master keeps its extra precision wherever the
   parameter still equals the master rounded to the parameter dtype, and takes the
   parameter's value where it differs. A cheap bitwise check comes first, so a step
   without writes pays one comparison pass.

Every rank refreshes only its own slice, so a write must be made on every rank (as the
same code on every rank does); a write on one rank only changes that rank's slice.
"""

from __future__ import annotations

import torch

from evenzero.runtime.buckets import FlatParams
from evenzero.runtime.checks import ZeroRuntimeError


def adopt_replaced(flat: FlatParams) -> list[str]:
    """Copy the values of parameters whose `.data` was replaced into their flat buffer
    and point them back at it; returns their names."""
    if flat.in_place():
        return []
    moved = []
    with torch.no_grad():
        for lay in flat.plan.layouts:
            buf = flat.buffers[(lay.group, lay.index)]
            for s in lay.params:
                p = flat.params[s.name]
                view = buf[s.offset:s.offset + s.numel]
                if p.data_ptr() == view.data_ptr() and p.dtype == buf.dtype and p.is_contiguous():
                    continue
                if p.device != buf.device or p.numel() != s.numel:
                    raise ZeroRuntimeError(
                        f"parameter {s.name!r} was moved to {p.device} or resized to "
                        f"{list(p.shape)} after ZeroOptimizer was built; move or resize the "
                        f"model before building it")
                view.copy_(p.detach().reshape(-1))
                p.data = view.view(p.shape)
                moved.append(s.name)
    return moved


CHECK_NUMEL = 1 << 20
"""Elements compared per chunk on the CPU (a 2 MiB bf16 scratch buffer)."""
ACCELERATOR_CHECK_NUMEL = 1 << 23
"""Elements merged per chunk on an accelerator: each chunk costs a few kernel launches
and no host sync, so chunks are large; temporaries are about 11 bytes per element."""


def check_numel(device: torch.device) -> int:
    """Chunk size of `pick_up` for masters on `device`."""
    return CHECK_NUMEL if device.type == "cpu" else ACCELERATOR_CHECK_NUMEL


_INT_OF_SIZE = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

def _bits(t: torch.Tensor) -> torch.Tensor:
    """`t`'s bits as integers of its element size: compared bit for bit, a NaN equals
    itself and -0.0 differs from 0.0, which is exactly "was it written?"."""
    return t.view(_INT_OF_SIZE[t.element_size()])


def pick_up(master: torch.Tensor, owned: torch.Tensor, scratch: torch.Tensor | None = None,
            sync_free: bool | None = None) -> bool | None:
    """Master slice := the parameter values in `owned`, keeping the master's precision
    where the parameter was not written (it still holds the rounded master, bit for bit,
    as the last gather left it). Returns whether anything was written (None on the
    sync-free path, which cannot know without waiting for the device).

    Chunk by chunk, the master is rounded into `scratch` (the parameter dtype; any size,
    allocated here if None) and compared with the parameter bit for bit. On the CPU
    (`sync_free` False, the default there) a chunk that compares equal is skipped: one
    pass and no shard-sized temporary when nothing was written, which is every step of a
    loop that does not write to its weights. On an accelerator (`sync_free` True, the
    default there) asking "did anything differ?" is a host sync per chunk, which stalls
    the device queue: the H200 run of `benchmarks/gpu_single.py` (370M GPT, 370 chunks
    of 1M) went from 0.95x to 1.32x plain PyTorch's step. There every chunk is merged
    unconditionally (`where(differs, parameter, master)`, the same values), which the
    device streams through without the host waiting."""
    if owned.dtype == master.dtype:
        master.copy_(owned)
        return True
    if sync_free is None:
        sync_free = master.device.type != "cpu"
    n = master.numel()
    if scratch is None:
        scratch = torch.empty(min(n, check_numel(master.device)), dtype=owned.dtype,
                              device=owned.device)
    chunk = max(1, scratch.numel())
    written_any = False
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        m, o, rounded = master[lo:hi], owned[lo:hi], scratch[:hi - lo]
        rounded.copy_(m)
        if sync_free:
            torch.where(_bits(rounded) != _bits(o), o.to(m.dtype), m, out=m)
            continue
        if torch.equal(_bits(rounded), _bits(o)):
            continue
        written = _bits(rounded) != _bits(o)
        m.copy_(torch.where(written, o.to(m.dtype), m))
        written_any = True
    return None if sync_free else written_any
