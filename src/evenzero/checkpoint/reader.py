"""A published evenzero checkpoint as a `ShardSource`: what `evenzero.checkpoint.load` stages.

For each of this rank's shard targets, `reshard.plan_reads` finds the stored runs that
overlap its ranges (any saving world size and bucket size) and `assemble_shard` copies
them into fresh flat shards. Every file is checked against the manifest's size and
sha256 before the first tensor is read from it, so a damaged file is reported by name
and nothing of a damaged checkpoint reaches the optimizer.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from evenzero.checkpoint import files as checkpoint_io
from evenzero.checkpoint.format import EXTRA_FILE, MASTER, CheckpointError, Manifest, StoredGroup
from evenzero.checkpoint.reshard import assemble_shard, plan_reads
from evenzero.checkpoint.staging import StagedGroup
from evenzero.checkpoint.state import ShardTarget
from evenzero.checkpoint.values import decode_value


class FileSource:
    """The checkpoint in `path` described by `manifest` (already parsed and checked
    compatible); use it as a context manager, which closes the files."""

    def __init__(self, path: Path, manifest: Manifest) -> None:
        self.path = path
        self.where = str(path)
        self._manifest = manifest
        self._stored = {p.key: p for p in manifest.params}
        self._records = {f.name: f for f in manifest.files}
        self._verified: set[str] = set()
        self._reader = checkpoint_io.RangeReader(path)

    def __enter__(self) -> FileSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self._reader.__exit__(*exc)

    def _verify(self, name: str) -> None:
        """Size and checksum of `name`, once, before anything is read from it."""
        if name in self._verified:
            return
        record = self._records.get(name)
        if record is None:
            raise CheckpointError(f"{self.path / name}: not listed in the manifest")
        checkpoint_io.verify_file(self.path, record)
        self._verified.add(name)

    def group(self, target: ShardTarget) -> StagedGroup:
        reads = plan_reads(target.ranges, target.storage, self._stored)
        for name in sorted({r.file for r in reads}):
            self._verify(name)
        saved = self._manifest.group(target.group)
        flats = assemble_shard(reads, (MASTER,) + saved.state_keys, target.shard_numel,
                               self._reader.read)
        scalars = {n: decode_value(saved.scalars_of(n)) for n in target.params}
        return StagedGroup(flats=flats, param_scalars=scalars,
                           stepped=frozenset(_saved_stepped(saved, target.params, scalars)),
                           hyperparameters=decode_value(saved.hyperparameters))

    def model_extras(self) -> Mapping[str, torch.Tensor]:
        if not self._manifest.extras:
            return {}
        self._verify(EXTRA_FILE)
        extras = self._reader.read_all(EXTRA_FILE)
        want = {t.name for t in self._manifest.extras}
        if set(extras) != want:
            raise CheckpointError(f"{self.path / EXTRA_FILE}: holds {sorted(extras)[:5]}, the "
                                  f"manifest lists {sorted(want)[:5]}; the file is damaged")
        return extras

    def loss_scaler(self) -> Mapping[str, Any] | None:
        return decode_value(self._manifest.loss_scaler)

    def step_count(self) -> int | None:
        return self._manifest.step_count


def _saved_stepped(saved: StoredGroup, mine: tuple[str, ...],
                   scalars: Mapping[str, Any]) -> set[str]:
    """This shard's parameters that were stepped when saved. Older checkpoints did not
    record it: there every parameter with optimizer state was stepped."""
    if saved.stepped is not None:
        return {n for n in mine if n in saved.stepped}
    if saved.state_keys:
        return set(mine)
    return {n for n in mine if scalars.get(n)}
