"""Sharded checkpoints of a `ZeroOptimizer`: save on N ranks, load on M.

    path = evenzero.checkpoint.save(opt, "ckpt", extra={"scheduler": sched.state_dict()})
    manifest = evenzero.checkpoint.load(opt, "ckpt")    # newest complete one, every rank
    sched.load_state_dict(manifest.extra["scheduler"])

Each rank writes only what it owns: for every run of a parameter in its flat shard, the
fp32 master and optimizer-state slices (`evenzero.checkpoint.format`), so the files do
not depend on world size or bucket size and a load reshards by parameter name and
range (`evenzero.checkpoint.reshard`). Rank 0 adds the model's buffers and frozen
parameters; every rank that passes `extra=` adds its own training state (scheduler,
data position, RNG: `evenzero.checkpoint.userstate`). Once every rank has written and
fsynced, rank 0 writes the manifest and publishes the staging directory
(`evenzero.checkpoint.writer`, `evenzero.checkpoint.files`): at every instant the
previous complete checkpoint, or the new one, is loadable, also when a step or tag is
saved again. With `blocking=False` the writing happens on a background thread while
training goes on, from a snapshot taken when `save` returns
(`evenzero.checkpoint.background`); `wait()` waits for it.

Every transfer of state goes through one `staging.stage()`, fed by a `ShardSource`: the
running optimizer (save), a checkpoint's files (load), whole-model state dicts
(consolidated import) or a DeepSpeed checkpoint (`evenzero.checkpoint.deepspeed`); the
optimizer is reached only through `evenzero.checkpoint.protocol.ShardedOptimizer`.

Every collective step ends in an agreement: each rank reports whether it failed and the
job raises the same `CheckpointError` on every rank, so a bad file or a full disk on one
rank never leaves the others waiting in a collective. A load validates everything
(manifest, checksums, names, shapes, optimizer, option values) and reads every tensor
before it changes any value. At the saving world size it first re-plans the optimizer
for what the saving run settled (a bucket size refined at run time, the measured
arrival order: `evenzero.checkpoint.planchoices`), so a run resumed with the default
`bucket_numel="auto"` executes the same plan as the run it continues. A published
checkpoint that is damaged is reported, never skipped for an older one.

To leave evenzero (or arrive from plain PyTorch), `export_consolidated(opt, path)` and
`import_consolidated(opt, path)` (from `evenzero.checkpoint.consolidate`, re-exported here) write
and read a whole `model.state_dict()` and a torch optimizer state dict keyed by name.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import zlib
from pathlib import Path

from evenzero.checkpoint import background
from evenzero.checkpoint import files as checkpoint_io
from evenzero.checkpoint.agree import agree, attempt
from evenzero.checkpoint.compat import check_compatible
from evenzero.checkpoint.consolidate import (
    ConsolidatedCheckpoint,
    consolidated_state_dict,
    export_consolidated,
    import_consolidated,
    load_consolidated_state_dict,
    read_consolidated,
)
from evenzero.checkpoint.deepspeed import (
    DeepSpeedCheckpoint,
    is_deepspeed_checkpoint,
    load_deepspeed,
)
from evenzero.checkpoint.format import CheckpointError, Manifest, step_dirname
from evenzero.checkpoint.planchoices import choices_to_adopt
from evenzero.checkpoint.protocol import PlanChoices, ShardedOptimizer
from evenzero.checkpoint.reader import FileSource
from evenzero.checkpoint.residuals import keeps_residuals, load_residuals, read_residuals
from evenzero.checkpoint.staging import StagedState, apply, stage
from evenzero.checkpoint.state import RankPlace, local_model
from evenzero.checkpoint.userstate import read_user_state
from evenzero.checkpoint.writer import publish, snapshot


def save(opt: ShardedOptimizer, directory: str | os.PathLike, step: int | None = None, *,
         extra: object = None, tag: str | None = None, blocking: bool = True) -> Path:
    """Write a checkpoint under `directory` from every rank (a collective); returns its path.

    Args:
        step: recorded in the manifest and naming the directory `step-NNNNNN`; defaults
            to the optimizer's step count. A non-negative integer.
        extra: this rank's own training state (scheduler `state_dict()`, data position,
            RNG states, ...): any nesting of dict, list, tuple, str, int, float, bool, None
            and torch tensors. Ranks may pass different values (RNG states differ); `load`
            gives each rank its own back as `Manifest.extra`.
        tag: save as `directory/<tag>` instead of `step-NNNNNN` (DeepSpeed's tag): one
            directory name, without separators, not empty and not starting with `.`.
        blocking: False returns as soon as this rank's state is copied off the live
            tensors (a snapshot), and the files are written and published by a background
            thread while training goes on (`evenzero.checkpoint.background`). The
            checkpoint is published when `wait()` returns; the next `save`, `wait()`,
            `load` and a clean interpreter exit wait for it, and a failure is raised by
            the next `save`, `wait()` or `load`, on every rank. One save is in flight at a
            time; its snapshot is held in CPU buffers reused by every background save:
            per rank, 4 bytes x (1 + elementwise state tensors, 2 for AdamW) x this rank's
            shard elements, i.e. about 12 bytes x parameters / world size for AdamW (plus,
            on rank 0, the buffers and frozen parameters, and a copy of `extra`'s
            tensors). Call `wait()` before `dist.destroy_process_group()`.

    Saving a step or tag that already exists replaces it; until the new copy is published
    the old one stays loadable, and a crash at any point leaves one of the two.
    """
    background.wait()
    place = RankPlace.of(opt)
    root = Path(directory)
    copies = None if blocking else background.buffers()

    def take() -> tuple[tuple[int, str], object]:
        named = _checkpoint_name(opt, step, tag)
        taken = snapshot(opt, place, extra, copies.copy if copies is not None else None)
        if copies is not None:
            copies.settle()
        return named, taken

    result, err = attempt(take)
    named = result[0] if result else None
    mine = named[1] if named else None
    agree(place, err, f"saving to {root}", same=zlib.crc32(repr(named).encode()),
          differ=f"ranks passed different steps or tags to save() (this rank: {mine}); every "
                 f"rank must save the same checkpoint")
    (step, name), snap = result
    if blocking:
        return publish(snap, place, root, name, step)
    quiet = background.save_place(place)
    background.start(lambda: publish(snap, quiet, root, name, step), root / name, root)
    return root / name


def wait() -> Path | None:
    """Wait for this process's background save (`save(..., blocking=False)`), if any.

    Returns the checkpoint it published (None when no save was in flight). If it failed,
    raises its `CheckpointError`, the same on every rank (the ranks agree on the outcome
    of every step), once. Not a collective: each rank waits for its own thread.
    """
    return background.wait()


def load(opt: ShardedOptimizer, path: str | os.PathLike, *, tag: str | None = None) -> Manifest:
    """Load a checkpoint into `opt` and its model on every rank (a collective).

    `path` is a checkpoint directory, or a directory of them: then the newest published
    `step-*` one; with `tag`, `path/<tag>`. Any world size and bucket size load. Raises the
    same `CheckpointError` on every rank if any rank finds a problem, and then no value
    has changed. Returns the manifest, whose `extra` is this rank's saved `extra` (the
    saving rank with the same number; rank 0's when the saving world was smaller), or
    None if that rank saved none. A background save in flight is waited for first (and
    its failure raised).

    At the world size (and strategy) it was saved at, the optimizer first takes over
    what the saving run settled about its plan (`evenzero.checkpoint.planchoices`): its
    measured gradient-arrival order and, where `opt`'s bucket size is "auto", the bucket
    size it had refined, which `opt` then keeps and no longer refines. The resumed run
    so executes the saving run's plan and, with the RNG and data position restored
    through `extra`, trains bit for bit as the run that was never interrupted. A fixed
    bucket size is kept. If reading the tensors then fails, the plan stays re-made for
    those choices (the values are unchanged). At another world size the optimizer keeps
    its own choices and refines its bucket size for its own world.
    """
    background.wait()
    place = RankPlace.of(opt)
    doing = f"loading {path}" + (f" tag {tag!r}" if tag is not None else "")

    def find() -> tuple[Path, Manifest, PlanChoices | None]:
        found = checkpoint_io.resolve(Path(path), tag)
        manifest = checkpoint_io.read_manifest(found)
        check_compatible(manifest, local_model(opt, place), str(found))
        return found, manifest, choices_to_adopt(manifest, opt, place, str(found))

    located, err = attempt(find)
    # Every rank re-plans alike, or none does: the same checkpoint, the same choices.
    agree(place, err, doing, same=zlib.crc32(repr((located[1].step, located[2])).encode())
          if located else -1,
          differ=f"ranks found different checkpoints (this rank: step "
                 f"{located[1].step if located else '?'}); another job may be saving into "
                 f"the same directory")
    directory, manifest, choices = located

    def read() -> tuple[Manifest, StagedState, dict | None]:
        if choices is not None:
            # Collective, and before staging: the shards are read for the adopted plan.
            # Nothing here can fail on one rank only: every rank passes the same choices.
            opt.adopt_plan_choices(choices)
        with FileSource(directory, manifest) as source:
            staged = stage(opt, place, source)
        residuals = (read_residuals(directory, manifest, place.rank, place.world_size)
                     if keeps_residuals(opt) else None)
        return dataclasses.replace(manifest, extra=read_user_state(directory, manifest,
                                                                   place.rank)), staged, residuals

    result, err = attempt(read)
    agree(place, err, doing, same=manifest.step)
    manifest, staged, residuals = result
    apply(opt, staged)
    load_residuals(opt, residuals)
    return manifest


def latest(directory: str | os.PathLike) -> Path | None:
    """The newest published `step-*` checkpoint under `directory`, or None (no collective).

    Tagged checkpoints are not ordered by step; load them by tag. A background save of
    this process into `directory` is waited for first (its failure stays for the next
    `save`, `wait()` or `load` to raise), so every rank sees the same newest one.
    """
    if background.pending_under(Path(directory)):
        background.wait(raise_error=False)
    return checkpoint_io.newest(Path(directory))


def _checkpoint_name(opt: ShardedOptimizer, step: object, tag: str | None) -> tuple[int, str]:
    """(step, directory name) of a save, refusing what `load` and `latest` could not find."""
    value = opt.step_count if step is None else step
    try:
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise CheckpointError(f"save(step={value!r}): the step must be a non-negative integer, "
                              f"not {type(value).__name__}") from None
    if value < 0:
        raise CheckpointError(f"save(step={value}): the step must be a non-negative integer")
    return value, step_dirname(value) if tag is None else checkpoint_io.check_tag(tag)


__all__ = ["CheckpointError", "ConsolidatedCheckpoint", "Manifest", "consolidated_state_dict", "export_consolidated",
           "import_consolidated", "latest", "load", "load_consolidated_state_dict", "read_consolidated", "save",
           "wait"]
__all__ += ["DeepSpeedCheckpoint", "is_deepspeed_checkpoint", "load_deepspeed"]
