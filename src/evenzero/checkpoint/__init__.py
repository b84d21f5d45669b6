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
(`evenzero.checkpoint.files`): at every instant the previous complete checkpoint, or
the new one, is loadable, also when a step or tag is saved again.

Every collective step ends in an agreement: each rank reports whether it failed and the
job raises the same `CheckpointError` on every rank, so a bad file or a full disk on one
rank never leaves the others waiting in a collective. A load validates everything
(manifest, checksums, names, shapes, optimizer, option values) and reads every tensor
before it changes any state. A published checkpoint that is damaged is reported, never
skipped for an older one.

To leave evenzero (or arrive from plain PyTorch), `export_consolidated(opt, path)` and
`import_consolidated(opt, path)` (from `evenzero.checkpoint.consolidate`, re-exported here) write
and read a whole `model.state_dict()` and a torch optimizer state dict keyed by name.
"""

from __future__ import annotations

import dataclasses
import operator
import os
import zlib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from evenzero.checkpoint import files as checkpoint_io
from evenzero.checkpoint.agree import agree, attempt
from evenzero.checkpoint.compat import check_compatible
from evenzero.checkpoint.consolidate import (
    consolidated_state_dict,
    export_consolidated,
    import_consolidated,
    load_consolidated_state_dict,
)
from evenzero.checkpoint.deepspeed import (
    DeepSpeedCheckpoint,
    is_deepspeed_checkpoint,
    load_deepspeed,
)
from evenzero.checkpoint.format import (
    EXTRA_FILE,
    MANIFEST,
    MASTER,
    CheckpointError,
    FileRecord,
    Manifest,
    StoredGroup,
    StoredParam,
    StoredTensor,
    rank_file,
    step_dirname,
)
from evenzero.checkpoint.rankindex import RankIndex, merge_indices
from evenzero.checkpoint.reshard import assemble_shard, plan_reads, runs_index, split_shard
from evenzero.checkpoint.state import (
    RankPlace,
    StagedState,
    apply,
    dtype_name,
    extra_tensors,
    group_place,
    group_state,
    local_model,
    optimizer_class,
    stepped_params,
    trainable_names,
)
from evenzero.checkpoint.userstate import read_user_state, write_user_state
from evenzero.checkpoint.values import decode_value, encode_value


def save(opt: Any, directory: str | os.PathLike, step: int | None = None, *,
         extra: Any = None, tag: str | None = None) -> Path:
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

    Saving a step or tag that already exists replaces it; until the new copy is published
    the old one stays loadable, and a crash at any point leaves one of the two.
    """
    place = RankPlace.of(opt)
    root = Path(directory)
    named, err = attempt(lambda: _checkpoint_name(opt, step, tag))
    mine = named[1] if named else None
    agree(place, err, f"saving to {root}", same=zlib.crc32(repr(named).encode()),
          differ=f"ranks passed different steps or tags to save() (this rank: {mine}); every "
                 f"rank must save the same checkpoint")
    step, name = named
    final = root / name
    made = attempt(lambda: checkpoint_io.prepare_staging(root, name)) if place.rank == 0 else None
    staging = made[0] if made else root / (checkpoint_io.STAGING + name)
    agree(place, made[1] if made else None, f"preparing {staging}")
    extras_record, err = attempt(lambda: _write_rank(opt, place, staging, extra))
    agree(place, err, f"writing {staging}")
    err = None
    if place.rank == 0:
        _, err = attempt(lambda: _finalise(opt, place, staging, final, step, extras_record))
    agree(place, err, f"publishing {final}")
    return final


def load(opt: Any, path: str | os.PathLike, *, tag: str | None = None) -> Manifest:
    """Load a checkpoint into `opt` and its model on every rank (a collective).

    `path` is a checkpoint directory, or a directory of them: then the newest published
    `step-*` one; with `tag`, `path/<tag>`. Any world size and bucket size load. Raises the
    same `CheckpointError` on every rank if any rank finds a problem, and then no state
    has changed. Returns the manifest, whose `extra` is this rank's saved `extra` (the
    saving rank with the same number; rank 0's when the saving world was smaller), or
    None if that rank saved none.
    """
    place = RankPlace.of(opt)

    def stage() -> tuple[Manifest, StagedState]:
        found = checkpoint_io.resolve(Path(path), tag)
        manifest = checkpoint_io.read_manifest(found)
        check_compatible(manifest, local_model(opt, place), str(found))
        staged = _stage(opt, place, found, manifest)
        return dataclasses.replace(manifest, extra=read_user_state(found, manifest,
                                                                   place.rank)), staged

    result, err = attempt(stage)
    step = result[0].step if result else -1
    agree(place, err, f"loading {path}" + (f" tag {tag!r}" if tag is not None else ""),
          same=step)
    manifest, staged = result
    apply(opt, staged)
    return manifest


def latest(directory: str | os.PathLike) -> Path | None:
    """The newest published `step-*` checkpoint under `directory`, or None (no collective).

    Tagged checkpoints are not ordered by step; load them by tag.
    """
    return checkpoint_io.newest(Path(directory))


def _checkpoint_name(opt: Any, step: Any, tag: str | None) -> tuple[int, str]:
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


# --------------------------------------------------------------------------- save


def _write_rank(opt: Any, place: RankPlace, tmp: Path, extra: Any) -> FileRecord | None:
    """Write this rank's runs and user state (and, on rank 0, the model extras); return the
    model extras' record."""
    user = write_user_state(tmp, place.rank, extra) if extra is not None else None
    named = trainable_names(opt)
    file = rank_file(place.rank)
    tensors: dict[str, torch.Tensor] = {}
    params: list[StoredParam] = []
    groups: list[StoredGroup] = []
    for g in opt.plan.groups:
        gp = group_place(opt, place, g.name)
        ranges = opt.plan.shard_ranges(g.name, gp.local_rank)
        flats, param_scalars, hyper = group_state(opt, g.name)
        tensors.update(split_shard(ranges, gp.storage(), flats))

        def meta(name: str, g=g, gp=gp) -> StoredParam:
            p = named[name]
            return StoredParam("", name, g.name, gp.ep_rank, tuple(p.shape), dtype_name(p.dtype),
                               ())

        params += runs_index(ranges, file, gp.storage(), meta)
        groups.append(StoredGroup(g.name, gp.expert_parallel_size, g.size, encode_value(hyper),
                                  {}, tuple(k for k in flats if k != MASTER),
                                  {n: encode_value(v) for n, v in param_scalars.items()},
                                  tuple(sorted(stepped_params(opt, g.name)))))
    record = checkpoint_io.write_file(tmp / file, tensors, place.rank)
    index_text = RankIndex(record, tuple(params), tuple(groups), user).dumps()
    checkpoint_io.write_text(tmp / _index_name(place.rank), index_text)
    if place.rank != 0:
        return None
    return checkpoint_io.write_file(tmp / EXTRA_FILE, extra_tensors(opt), 0)


def _finalise(opt: Any, place: RankPlace, tmp: Path, final: Path, step: int,
              extras_record: FileRecord | None) -> None:
    indices = [RankIndex.loads((tmp / _index_name(r)).read_text())
               for r in range(place.world_size)]
    params, groups = merge_indices(indices)
    extras = tuple(StoredTensor(n, tuple(t.shape), dtype_name(t.dtype))
                   for n, t in extra_tensors(opt).items())
    scaler = opt.loss_scaler_state()
    users = tuple(i.user_state for i in indices if i.user_state is not None)
    manifest = Manifest(step, int(opt.step_count), place.world_size, opt.plan.strategy,
                        _version(), optimizer_class(opt), groups, params,
                        tuple(i.file for i in indices) + users +
                        ((extras_record,) if extras_record else ()),
                        extras, encode_value(scaler) if scaler is not None else None,
                        {u.rank: u.name for u in users})
    # Parse what we are about to publish: a manifest that does not tile every parameter
    # would only be caught at load time, when the previous checkpoint may be gone.
    Manifest.from_json(manifest.to_json(), str(tmp / MANIFEST))
    checkpoint_io.write_text(tmp / MANIFEST, manifest.dumps())
    for r in range(place.world_size):
        (tmp / _index_name(r)).unlink()
    checkpoint_io.publish(tmp, final)


def _index_name(rank: int) -> str:
    return f"rank-{rank:05d}.index.json"


def _version() -> str:
    from evenzero import __version__

    return __version__


# --------------------------------------------------------------------------- load


def _stage(opt: Any, place: RankPlace, path: Path, manifest: Manifest) -> StagedState:
    stored = {p.key: p for p in manifest.params}
    per_group = []
    for g in opt.plan.groups:
        gp = group_place(opt, place, g.name)
        reads = plan_reads(opt.plan.shard_ranges(g.name, gp.local_rank), gp.storage(), stored)
        per_group.append((g, reads))
    files = {r.file for _, reads in per_group for r in reads}
    if manifest.extras:
        files.add(EXTRA_FILE)
    records = {f.name: f for f in manifest.files}
    for name in sorted(files):
        if name not in records:
            raise CheckpointError(f"{path / name}: not listed in the manifest")
        checkpoint_io.verify_file(path, records[name])

    staged = StagedState({}, {}, {}, {}, {}, _check_scaler(opt, manifest, path),
                         manifest.step_count)
    with checkpoint_io.RangeReader(path) as reader:
        for g, reads in per_group:
            saved = manifest.group(g.name)
            kinds = (MASTER,) + saved.state_keys
            flats = assemble_shard(reads, kinds, opt.plan.shard_numel(g.name), reader.read)
            staged.masters[g.name] = flats.pop(MASTER)
            staged.states[g.name] = flats
            # On the CPU, as torch keeps a non-capturable `step`.
            gp = group_place(opt, place, g.name)
            mine = dict.fromkeys(r.param for r in opt.plan.shard_ranges(g.name, gp.local_rank))
            staged.param_scalars[g.name] = {n: decode_value(saved.scalars_of(n)) for n in mine}
            staged.stepped[g.name] = _saved_stepped(saved, mine, staged.param_scalars[g.name])
            staged.hyperparameters[g.name] = decode_value(saved.hyperparameters)
        if manifest.extras:
            staged.extras = reader.read_all(EXTRA_FILE)
            want = {t.name for t in manifest.extras}
            if set(staged.extras) != want:
                raise CheckpointError(f"{path / EXTRA_FILE}: holds {sorted(staged.extras)[:5]}, "
                                      f"the manifest lists {sorted(want)[:5]}; the file is damaged")
    return staged


def _check_scaler(opt: Any, manifest: Manifest, path: Path) -> Any:
    """The saved loss-scaler state, after a dry run of loading it into a copy."""
    state = decode_value(manifest.loss_scaler)
    if state is None or opt.loss_scaler_state() is None:
        return None
    try:
        opt.check_loss_scaler_state(state)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: loss scaler: {e}") from None
    return state



def _saved_stepped(saved: StoredGroup, mine: Any, scalars: Mapping[str, Any]) -> set[str]:
    """This shard's parameters that were stepped when saved. Older checkpoints did not
    record it: there every parameter with optimizer state was stepped."""
    if saved.stepped is not None:
        return {n for n in mine if n in saved.stepped}
    if saved.state_keys:
        return set(mine)
    return {n for n in mine if scalars.get(n)}


__all__ = ["CheckpointError", "Manifest", "consolidated_state_dict", "export_consolidated",
           "import_consolidated", "latest", "load", "load_consolidated_state_dict", "save"]
__all__ += ["DeepSpeedCheckpoint", "is_deepspeed_checkpoint", "load_deepspeed"]
