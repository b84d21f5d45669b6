"""Sharded checkpoints of a `ZeroOptimizer`: save on N ranks, load on M.

    path = evenzero.checkpoint.save(opt, "ckpt")     # ckpt/step-000123/, every rank
    evenzero.checkpoint.load(opt, "ckpt")            # newest complete one, every rank

Each rank writes only what it owns: for every run of a parameter in its flat shard, the
fp32 master and optimizer-state slices (`evenzero.checkpoint.format`), so the files do
not depend on world size or bucket size and a load reshards by parameter name and
range (`evenzero.checkpoint.reshard`). Rank 0 adds the model's buffers and frozen parameters and,
once every rank has written and fsynced, the manifest; then it renames the staging
directory into place (`evenzero.checkpoint.files`). A crash at any point leaves the
previous checkpoint as the newest complete one.

Every collective step ends in an agreement: each rank reports whether it failed and the
job raises the same `CheckpointError` on every rank, so a bad file or a full disk on one
rank never leaves the others waiting in a collective. A load validates everything
(manifest, checksums, names, shapes, optimizer) and reads every tensor before it
changes any state.

To leave evenzero (or arrive from plain PyTorch), `export_consolidated(opt, path)` and
`import_consolidated(opt, path)` (from `evenzero.checkpoint.consolidate`, re-exported here) write
and read a whole `model.state_dict()` and a torch optimizer state dict keyed by name.
"""

from __future__ import annotations

import copy
import os
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
    RankIndex,
    StoredGroup,
    StoredParam,
    StoredTensor,
    decode_value,
    encode_value,
    merge_indices,
    rank_file,
    step_dirname,
)
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
    trainable_names,
)


def save(opt: Any, directory: str | os.PathLike, step: int | None = None) -> Path:
    """Write `directory/step-NNNNNN/` from every rank (a collective); returns its path.

    `step` defaults to the optimizer's step count. Saving a step that already exists
    replaces it.
    """
    place = RankPlace.of(opt)
    step = int(opt.step_count if step is None else step)
    root = Path(directory)
    final = root / step_dirname(step)
    tmp = root / f"{checkpoint_io.TMP_PREFIX}{final.name}"
    # Rank 0 creates the staging directory before anyone writes into it.
    made = attempt(lambda: checkpoint_io.prepare_tmp(root, tmp)) if place.rank == 0 else None
    agree(place, made[1] if made else None, "preparing " + str(tmp))
    extras_record, err = attempt(lambda: _write_rank(opt, place, tmp))
    agree(place, err, "writing shards to " + str(tmp))
    err = None
    if place.rank == 0:
        _, err = attempt(lambda: _finalise(opt, place, tmp, final, step, extras_record))
    agree(place, err, "publishing " + str(final))
    return final


def load(opt: Any, directory: str | os.PathLike) -> Manifest:
    """Load `directory` (a step-* directory, or the newest complete one under it).

    A collective: raises the same `CheckpointError` on every rank if any rank finds a
    problem, and then no state has changed.
    """
    place = RankPlace.of(opt)

    def stage() -> tuple[Manifest, StagedState]:
        path = checkpoint_io.resolve(Path(directory))
        manifest = checkpoint_io.read_manifest(path)
        check_compatible(manifest, local_model(opt, place), str(path))
        return manifest, _stage(opt, place, path, manifest)

    result, err = attempt(stage)
    step = result[0].step if result else -1
    agree(place, err, f"loading {directory}", same=step)
    manifest, staged = result
    apply(opt, staged)
    return manifest


def latest(directory: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint under `directory`, or None (no collective)."""
    return checkpoint_io.newest_complete(Path(directory))


# --------------------------------------------------------------------------- save


def _write_rank(opt: Any, place: RankPlace, tmp: Path) -> FileRecord | None:
    """Write this rank's runs (and, on rank 0, the extras); return the extras' record."""
    named = trainable_names(opt)
    file = rank_file(place.rank)
    tensors: dict[str, torch.Tensor] = {}
    params: list[StoredParam] = []
    groups: list[StoredGroup] = []
    for index, g in enumerate(opt.plan.groups):
        gp = group_place(opt, place, g.name)
        ranges = opt.plan.shard_ranges(g.name, gp.local_rank)
        flats, scalars, hyper = group_state(opt, index, g.name)
        tensors.update(split_shard(ranges, gp.storage(), flats))

        def meta(name: str, g=g, gp=gp) -> StoredParam:
            p = named[name]
            return StoredParam("", name, g.name, gp.ep_rank, tuple(p.shape), dtype_name(p.dtype),
                               ())

        params += runs_index(ranges, file, gp.storage(), meta)
        groups.append(StoredGroup(g.name, gp.expert_parallel_size, g.size, encode_value(hyper),
                                  encode_value(scalars), tuple(k for k in flats if k != MASTER)))
    record = checkpoint_io.write_file(tmp / file, tensors, place.rank)
    index_text = RankIndex(record, tuple(params), tuple(groups)).dumps()
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
    scaler = getattr(opt, "loss_scaler", None)
    manifest = Manifest(step, int(opt.step_count), place.world_size, opt.plan.strategy,
                        _version(), optimizer_class(opt.optimizer), groups, params,
                        tuple(i.file for i in indices) + ((extras_record,) if extras_record else ()),
                        extras, encode_value(scaler.state_dict()) if scaler is not None else None)
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
            # On the CPU, as torch keeps a non-capturable `step`; torch's loader moves it
            # to the device when the optimizer is capturable or fused.
            staged.scalars[g.name] = decode_value(saved.scalars)
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
    scaler = getattr(opt, "loss_scaler", None)
    if state is None or scaler is None:
        return None
    try:
        copy.deepcopy(scaler).load_state_dict(state)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{path}: loss scaler: {e}") from None
    return state


__all__ = ["CheckpointError", "Manifest", "consolidated_state_dict", "export_consolidated",
           "import_consolidated", "latest", "load", "load_consolidated_state_dict", "save"]
__all__ += ["DeepSpeedCheckpoint", "is_deepspeed_checkpoint", "load_deepspeed"]
