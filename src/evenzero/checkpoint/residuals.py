"""Error-feedback residuals in a checkpoint: saved per rank, resharded by their mean.

With `grad_compression_error_feedback=True` every rank holds a residual: what its own
compressed sends have not yet delivered, one fp32 value per gradient element of the whole
model (not a shard: each rank compresses its whole bucket before the all-to-all). Each
rank writes its own as `residual-rank-NNNNN.safetensors` (one tensor per parameter, in
units of the unscaled gradient, so a loss scale that moves in between does not matter),
listed and checksummed in the manifest like every other file.

What a residual means at another world size. The step uses the mean over the W ranks of
their gradients; rank r's residual e_r is owed to that mean as e_r / W, so the whole run
owes S / W, S = sum of e_r. On W' ranks the residuals e'_r' are owed as their sum over
W'. Giving every new rank the mean of the saved ones, e' = S / W, makes the new run owe
W' * (S / W) / W' = S / W: exactly what the saving run owed, delivered over the next
steps as it would have been. Which rank's error it was cannot carry over (the new ranks
see other data), and need not: only the sum reaches the update. So:

* loaded at the saving world size: each rank gets its own residual back (a resumed run
  continues bit for bit);
* at another world size: every rank gets the mean of all saved residuals (each rank reads
  every residual file once, one at a time);
* a checkpoint without residuals (saved without error feedback) leaves them zero, and
  a run without error feedback ignores saved ones: a residual is a correction still to
  be sent, never part of the model or of the optimizer state.

The optimizer is reached through `protocol.ErrorFeedbackState` only.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from evenzero.checkpoint import files as checkpoint_io
from evenzero.checkpoint.format import CheckpointError, FileRecord, Manifest
from evenzero.checkpoint.protocol import ErrorFeedbackState

PREFIX = "residual-rank-"


def residual_file(rank: int) -> str:
    return f"{PREFIX}{rank:05d}.safetensors"


def keeps_residuals(opt: object) -> bool:
    return isinstance(opt, ErrorFeedbackState) and opt.keeps_error_feedback


def saved_residuals(opt: object) -> dict[str, torch.Tensor] | None:
    """This rank's residuals to save (CPU copies), or None if it keeps none."""
    if not keeps_residuals(opt):
        return None
    state = opt.error_feedback_state()
    return dict(state) if state else None


def write_residuals(staging: Path, rank: int, residuals: Mapping[str, torch.Tensor]) -> FileRecord:
    return checkpoint_io.write_file(staging / residual_file(rank), residuals, rank)


def residual_records(manifest: Manifest) -> dict[int, FileRecord]:
    """Saving rank -> its residual file, for a checkpoint saved with error feedback."""
    return {f.rank: f for f in manifest.files if f.name.startswith(PREFIX)}


def read_residuals(directory: Path, manifest: Manifest, rank: int, world_size: int
                   ) -> dict[str, torch.Tensor] | None:
    """The residuals rank `rank` of a `world_size` world resumes with (module docstring),
    or None when the checkpoint has none."""
    records = residual_records(manifest)
    if not records:
        return None
    if sorted(records) != list(range(manifest.world_size)):
        raise CheckpointError(f"{directory}: residual files of ranks {sorted(records)} but the "
                              f"checkpoint was saved by {manifest.world_size} ranks; it is "
                              f"damaged, load an older one")
    if world_size == manifest.world_size:
        return _read(directory, records[rank])
    total: dict[str, torch.Tensor] = {}
    for r in range(manifest.world_size):
        for name, t in _read(directory, records[r]).items():
            if name in total:
                total[name].add_(t)
            else:
                total[name] = t.clone()
    return {name: t.div_(manifest.world_size) for name, t in total.items()}


def _read(directory: Path, record: FileRecord) -> dict[str, torch.Tensor]:
    checkpoint_io.verify_file(directory, record)
    with checkpoint_io.RangeReader(directory) as reader:
        return dict(reader.read_all(record.name))


def load_residuals(opt: object, residuals: Mapping[str, torch.Tensor] | None) -> None:
    """Hand the residuals to the optimizer (None: zero), if it keeps any."""
    if isinstance(opt, ErrorFeedbackState):
        opt.load_error_feedback_state(residuals or {})
