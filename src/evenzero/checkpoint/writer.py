"""Writing a checkpoint: each rank's files, rank 0's manifest, the publish.

A save is two halves. `snapshot` takes this rank's state at one instant
(`staging.stage` over the running optimizer): the live tensors for a blocking save,
copies for a background one (`evenzero.checkpoint.background`). `publish` then writes
it, never touching the optimizer, as a sequence of steps that each end in an agreement
of the ranks (`evenzero.checkpoint.agree`):

1. rank 0 prepares `.tmp-<name>/`, first finishing or clearing what crashed saves left;
2. every rank writes its runs (`rank-NNNNN.safetensors`), its `extra=` state and, next to
   them, a small JSON `RankIndex` (its file and the runs in it); rank 0 also writes the
   buffers and frozen parameters; every file is fsynced;
3. rank 0 merges the indices into the manifest (checking that the ranks agree), writes
   it last and publishes the directory with atomic renames (`evenzero.checkpoint.files`).

Ranks exchange no Python objects while saving: the indices travel as files, so nothing
is pickled between ranks.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from evenzero.checkpoint import files as checkpoint_io
from evenzero.checkpoint.agree import agree, attempt
from evenzero.checkpoint.compat import LocalParam
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
    file_json,
    file_parse,
    group_json,
    group_parse,
    param_json,
    param_parse,
    rank_file,
)
from evenzero.checkpoint.planchoices import saved_choices
from evenzero.checkpoint.protocol import PlanChoices, ShardedOptimizer
from evenzero.checkpoint.reshard import runs_index, split_shard
from evenzero.checkpoint.residuals import saved_residuals, write_residuals
from evenzero.checkpoint.staging import OptimizerSource, StagedState, stage
from evenzero.checkpoint.state import RankPlace, local_params, optimizer_class
from evenzero.checkpoint.userstate import (
    EncodedUserState,
    encode_user_state,
    write_encoded_user_state,
)
from evenzero.checkpoint.values import encode_value
from evenzero.spec import dtype_name


@dataclass(frozen=True)
class RankSnapshot:
    """Everything this rank writes for one checkpoint, taken from the optimizer at one
    instant; writing it reads nothing else of the optimizer."""

    rank: int
    world_size: int
    state: StagedState
    """The shards, scalar state, options, extras (rank 0), loss scaler and step count."""
    params: Mapping[str, LocalParam]
    """Every trained parameter: group, shape and dtype as the model holds it."""
    group_sizes: Mapping[str, int]
    """Plan group -> its data-parallel size (recorded in the manifest)."""
    strategy: str
    optimizer_class: str
    user: EncodedUserState | None
    """This rank's `extra=` state, or None."""
    choices: PlanChoices
    """What the run settled about its plan (recorded in the manifest, which a load at
    the same world size adopts)."""
    residuals: Mapping[str, torch.Tensor] | None = None
    """This rank's error-feedback residuals (`evenzero.checkpoint.residuals`), or None."""

    def nbytes(self) -> int:
        """Bytes of tensor data this snapshot holds (shards, extras, `extra=` tensors)."""
        tensors = [t for g in self.state.groups.values() for t in g.flats.values()]
        tensors += list(self.state.extras.values())
        tensors += list(self.user.tensors.values()) if self.user else []
        tensors += list(self.residuals.values()) if self.residuals else []
        return sum(t.numel() * t.element_size() for t in tensors)


def snapshot(opt: ShardedOptimizer, place: RankPlace, extra: Any,
             copier: Callable[[tuple[str, ...], torch.Tensor], torch.Tensor] | None = None
             ) -> RankSnapshot:
    """This rank's part of a checkpoint; no collective. With `copier` every tensor is a
    copy (see `staging.OptimizerSource`), else the live tensors: write it before the
    next step."""
    user = (encode_user_state(extra, copy_tensors=copier is not None)
            if extra is not None else None)
    state = stage(opt, place, OptimizerSource(opt, extras=place.rank == 0, copier=copier))
    return RankSnapshot(rank=place.rank, world_size=place.world_size, state=state,
                        params=local_params(opt),
                        group_sizes={g.name: g.size for g in opt.plan.groups},
                        strategy=opt.plan.strategy, optimizer_class=optimizer_class(opt),
                        user=user, choices=saved_choices(opt), residuals=saved_residuals(opt))


def publish(snap: RankSnapshot, place: RankPlace, root: Path, name: str, step: int) -> Path:
    """Write `snap` as checkpoint `root/name` with every rank (a collective over
    `place.group`); see the module docstring. Returns the published directory."""
    final = root / name
    made = attempt(lambda: checkpoint_io.prepare_staging(root, name)) if place.rank == 0 else None
    staging = made[0] if made else root / (checkpoint_io.STAGING + name)
    agree(place, made[1] if made else None, f"preparing {staging}")
    extras_record, err = attempt(lambda: write_rank(snap, staging))
    agree(place, err, f"writing {staging}")
    err = None
    if place.rank == 0:
        _, err = attempt(lambda: finalise(snap, staging, final, step, extras_record))
    agree(place, err, f"publishing {final}")
    return final


def write_rank(snap: RankSnapshot, staging: Path) -> FileRecord | None:
    """Write this rank's runs and user state (and, on rank 0, the model extras) into
    `staging`; return the model extras' record."""
    user = (write_encoded_user_state(staging, snap.rank, snap.user)
            if snap.user is not None else None)
    file = rank_file(snap.rank)
    tensors: dict[str, torch.Tensor] = {}
    params: list[StoredParam] = []
    groups: list[StoredGroup] = []
    for name, g in snap.state.groups.items():
        target = snap.state.targets[name]
        tensors.update(split_shard(target.ranges, target.storage, g.flats))

        def meta(param: str, target=target) -> StoredParam:
            p = snap.params[param]
            return StoredParam(key="", name=param, group=target.group, ep_rank=target.ep_rank,
                               shape=p.shape, dtype=p.dtype, ranges=())

        params += runs_index(target.ranges, file, target.storage, meta)
        groups.append(StoredGroup(
            name=name, expert_parallel_size=target.expert_parallel_size,
            size=snap.group_sizes[name], hyperparameters=encode_value(dict(g.hyperparameters)),
            scalars={}, state_keys=tuple(k for k in g.flats if k != MASTER),
            param_scalars={n: encode_value(dict(v)) for n, v in g.param_scalars.items()},
            stepped=tuple(sorted(g.stepped))))
    # Through the module attribute, so a test can make this write die half-way.
    record = checkpoint_io.write_file(staging / file, tensors, snap.rank)
    residuals = (write_residuals(staging, snap.rank, snap.residuals)
                 if snap.residuals else None)
    index = RankIndex(record, tuple(params), tuple(groups), user, residuals)
    checkpoint_io.write_text(staging / index_name(snap.rank), index.dumps())
    if snap.rank != 0:
        return None
    return checkpoint_io.write_file(staging / EXTRA_FILE, snap.state.extras, 0)


def finalise(snap: RankSnapshot, staging: Path, final: Path, step: int,
             extras_record: FileRecord | None) -> None:
    """Rank 0: merge every rank's index into the manifest, write it and publish."""
    indices = [RankIndex.loads((staging / index_name(r)).read_text())
               for r in range(snap.world_size)]
    params, groups = merge_indices(indices)
    extras = tuple(StoredTensor(n, tuple(t.shape), dtype_name(t.dtype))
                   for n, t in snap.state.extras.items())
    scaler = snap.state.loss_scaler
    users = tuple(i.user_state for i in indices if i.user_state is not None)
    users += tuple(i.residuals for i in indices if i.residuals is not None)
    manifest = Manifest(
        step=step, step_count=int(snap.state.step_count or 0), world_size=snap.world_size,
        strategy=snap.strategy, library_version=_version(),
        optimizer_class=snap.optimizer_class, groups=groups, params=params,
        files=tuple(i.file for i in indices) + users + ((extras_record,) if extras_record else ()),
        extras=extras, loss_scaler=encode_value(dict(scaler)) if scaler is not None else None,
        user_state={i.user_state.rank: i.user_state.name for i in indices
                    if i.user_state is not None},
        bucket_numel=snap.choices["bucket_numel"],
        arrival=snap.choices["arrival"])
    # Parse what we are about to publish: a manifest that does not tile every parameter
    # would only be caught at load time, when the previous checkpoint may be gone.
    Manifest.from_json(manifest.to_json(), str(staging / MANIFEST))
    checkpoint_io.write_text(staging / MANIFEST, manifest.dumps())
    for r in range(snap.world_size):
        (staging / index_name(r)).unlink()
    checkpoint_io.publish(staging, final)


def index_name(rank: int) -> str:
    return f"rank-{rank:05d}.index.json"


def _version() -> str:
    from evenzero import __version__

    return __version__


# --------------------------------------------------------------------------- rank indices


@dataclass(frozen=True)
class RankIndex:
    """What one rank wrote: its file and the runs in it. Rank 0 merges these into the
    manifest; they travel as small JSON files next to the data so that no Python objects
    are pickled between ranks."""

    file: FileRecord
    params: tuple[StoredParam, ...]
    """This rank's runs only (every range points at `file`)."""
    groups: tuple[StoredGroup, ...]
    """This rank's view of hyperparameters and scalar state, checked equal on merge."""
    user_state: FileRecord | None = None
    """The file with this rank's `extra=` state, if it passed one."""
    residuals: FileRecord | None = None
    """The file with this rank's error-feedback residuals, if it keeps any."""

    def dumps(self) -> str:
        return json.dumps({"file": file_json(self.file),
                           "params": {p.key: param_json(p) for p in self.params},
                           "groups": [group_json(g) for g in self.groups],
                           "user_state": file_json(self.user_state) if self.user_state else None,
                           "residuals": file_json(self.residuals) if self.residuals else None})

    @staticmethod
    def loads(text: str) -> RankIndex:
        d = json.loads(text)
        user = d.get("user_state")
        residuals = d.get("residuals")
        return RankIndex(file_parse(d["file"], "file"),
                         tuple(param_parse(k, p) for k, p in d["params"].items()),
                         tuple(group_parse(g, "group") for g in d["groups"]),
                         file_parse(user, "user_state") if user else None,
                         file_parse(residuals, "residuals") if residuals else None)


def merge_indices(indices: list[RankIndex]) -> tuple[tuple[StoredParam, ...],
                                                     tuple[StoredGroup, ...]]:
    """All ranks' runs per parameter, and the groups, checking that ranks agree."""
    merged: dict[str, StoredParam] = {}
    for idx in indices:
        for p in idx.params:
            have = merged.get(p.key)
            if have is None:
                merged[p.key] = p
                continue
            if (have.name, have.group, have.ep_rank, have.shape) != (p.name, p.group, p.ep_rank,
                                                                     p.shape):
                raise CheckpointError(f"ranks disagree on parameter {p.key!r} (shape "
                                      f"{list(have.shape)} vs {list(p.shape)}); every rank must "
                                      f"build the same model")
            merged[p.key] = replace(p, ranges=tuple(sorted(have.ranges + p.ranges,
                                                           key=lambda r: r.start)))
    # Each rank knows the per-parameter state of the parameters it holds runs of.
    groups = tuple(replace(g, param_scalars={}, stepped=()) for g in indices[0].groups)
    per_param: dict[str, dict[str, Any]] = {g.name: {} for g in groups}
    stepped: dict[str, set[str]] = {g.name: set() for g in groups}
    for idx in indices:
        if tuple(replace(g, param_scalars={}, stepped=()) for g in idx.groups) != groups:
            raise CheckpointError(f"rank {idx.file.rank} and rank {indices[0].file.rank} disagree "
                                  f"on optimizer hyperparameters or state keys; every rank must "
                                  f"build the same optimizer")
        for g in idx.groups:
            stepped[g.name].update(g.stepped or ())
            for name, value in g.param_scalars.items():
                if per_param[g.name].setdefault(name, value) != value:
                    raise CheckpointError(f"ranks disagree on the optimizer state of parameter "
                                          f"{name!r}; every rank must build the same optimizer")
    return tuple(merged.values()), tuple(replace(g, param_scalars=per_param[g.name],
                                                 stepped=tuple(sorted(stepped[g.name])))
                                         for g in groups)
