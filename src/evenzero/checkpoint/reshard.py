"""Mapping flat shards to per-parameter runs and back, across world and bucket sizes.

Saving splits a rank's flat shard along its `ShardRange`s: each run of a parameter
becomes one stored tensor per kind (master, exp_avg, ...), padding excluded. Loading on
a different plan asks, for each of the new rank's `ShardRange`s, which stored runs
overlap it, and copies the overlaps into place. Both directions are exact copies, so a
checkpoint written on N ranks and loaded on M reproduces the consolidated state bit for
bit. Nothing here talks to other ranks or to the file system.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from evenzero.checkpoint.format import CheckpointError, StoredParam, StoredRange, tensor_key
from evenzero.plan import ShardRange


def split_shard(ranges: Sequence[ShardRange], storage: Callable[[str], str],
                flats: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One tensor per (run, kind), keyed by `tensor_key`: views into `flats`, so write
    them before the shard changes."""
    out: dict[str, torch.Tensor] = {}
    for r in ranges:
        name = storage(r.param)
        for kind, flat in flats.items():
            out[tensor_key(name, kind, r.start)] = \
                flat.detach()[r.shard_offset:r.shard_offset + r.numel]
    return out


def runs_index(ranges: Sequence[ShardRange], file: str, storage: Callable[[str], str],
               meta: Callable[[str], StoredParam]) -> tuple[StoredParam, ...]:
    """The manifest entries for the runs `split_shard` put in `file`.

    `meta(name)` gives a parameter's stored description; its ranges are replaced.
    """
    runs: dict[str, list[StoredRange]] = {}
    for r in ranges:
        runs.setdefault(r.param, []).append(StoredRange(file, r.start, r.numel))
    out = []
    for name, rs in runs.items():
        out.append(dataclasses.replace(meta(name), key=storage(name), ranges=tuple(rs)))
    return tuple(out)


@dataclass(frozen=True)
class Read:
    """Copy stored[lo:hi] of one run into the target shard at `dst`."""

    file: str
    storage: str
    """Storage name of the parameter."""
    run_start: int
    """Start of the stored run inside the parameter (part of its tensor key)."""
    lo: int
    """Slice start inside the stored run."""
    hi: int
    dst: int
    """Offset inside the target flat shard."""

    def key(self, kind: str) -> str:
        return tensor_key(self.storage, kind, self.run_start)


def plan_reads(target: Sequence[ShardRange], storage: Callable[[str], str],
               stored: Mapping[str, StoredParam]) -> list[Read]:
    """The copies that fill `target` from the stored runs (which tile each parameter)."""
    reads: list[Read] = []
    for r in target:
        name = storage(r.param)
        sp = stored.get(name)
        if sp is None:
            raise CheckpointError(f"parameter {name!r} is not in the checkpoint")
        a, b = r.start, r.start + r.numel
        if b > sp.numel:
            raise CheckpointError(f"parameter {name!r} has {sp.numel} elements in the checkpoint "
                                  f"but this run needs elements up to {b}")
        starts = [s.start for s in sp.ranges]
        i = max(0, bisect.bisect_right(starts, a) - 1)
        covered = a
        for s in sp.ranges[i:]:
            if s.start >= b:
                break
            lo, hi = max(a, s.start), min(b, s.start + s.numel)
            if lo < hi:
                if lo != covered:
                    raise _gap(name, covered)
                reads.append(_read(s, name, lo, hi, r.shard_offset + lo - a))
                covered = hi
        if covered != b:
            raise _gap(name, covered)
    return reads


def _read(s: StoredRange, name: str, lo: int, hi: int, dst: int) -> Read:
    return Read(s.file, name, s.start, lo - s.start, hi - s.start, dst)


def _gap(name: str, at: int) -> CheckpointError:
    return CheckpointError(f"parameter {name!r}: element {at} is stored in no file; "
                           f"the checkpoint is incomplete")


def assemble_shard(reads: Sequence[Read], kinds: Sequence[str], shard_numel: int,
                   read: Callable[[str, str, int, int], torch.Tensor]) -> dict[str, torch.Tensor]:
    """New fp32 flat shards (zeros in padding) filled by `reads` for every kind."""
    out = {kind: torch.zeros(shard_numel, dtype=torch.float32) for kind in kinds}
    for rd in sorted(reads, key=lambda x: (x.file, x.storage, x.run_start)):
        n = rd.hi - rd.lo
        for kind in kinds:
            piece = read(rd.file, rd.key(kind), rd.lo, rd.hi)
            if piece.dtype != torch.float32 or piece.numel() != n:
                raise CheckpointError(f"{rd.file}: tensor {rd.key(kind)!r} is "
                                      f"{piece.dtype}/{piece.numel()} elements, expected "
                                      f"float32/{n}; the file does not match the manifest")
            out[kind][rd.dst:rd.dst + n] = piece
    return out


def fill_shard(ranges: Sequence[ShardRange], shard_numel: int,
               full: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """A flat fp32 shard cut out of whole parameters (`full(name)`, any shape)."""
    out = torch.zeros(shard_numel, dtype=torch.float32)
    for r in ranges:
        flat = full(r.param).detach().reshape(-1)
        out[r.shard_offset:r.shard_offset + r.numel] = flat[r.start:r.start + r.numel]
    return out


def scatter_shard(ranges: Sequence[ShardRange], shard: torch.Tensor,
                  full: Callable[[str], torch.Tensor]) -> None:
    """Write the runs of `shard` into whole flat parameters (`full(name)`, 1-D)."""
    for r in ranges:
        full(r.param)[r.start:r.start + r.numel] = shard[r.shard_offset:r.shard_offset + r.numel]
