"""What each rank writes next to its data during a save, and how rank 0 merges them.

Ranks exchange no Python objects while saving: each writes a small JSON `RankIndex`
(its file and the runs in it) beside its safetensors file, and rank 0 merges them into
the manifest (`evenzero.checkpoint.format.Manifest`), checking that the ranks agree.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

from evenzero.checkpoint.format import (
    CheckpointError,
    FileRecord,
    StoredGroup,
    StoredParam,
    file_json,
    file_parse,
    group_json,
    group_parse,
    param_json,
    param_parse,
)


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

    def dumps(self) -> str:
        return json.dumps({"file": file_json(self.file),
                           "params": {p.key: param_json(p) for p in self.params},
                           "groups": [group_json(g) for g in self.groups],
                           "user_state": file_json(self.user_state) if self.user_state else None})

    @staticmethod
    def loads(text: str) -> RankIndex:
        d = json.loads(text)
        user = d.get("user_state")
        return RankIndex(file_parse(d["file"], "file"),
                         tuple(param_parse(k, p) for k, p in d["params"].items()),
                         tuple(group_parse(g, "group") for g in d["groups"]),
                         file_parse(user, "user_state") if user else None)


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
            merged[p.key] = StoredParam(p.key, p.name, p.group, p.ep_rank, p.shape, p.dtype,
                                        tuple(sorted(have.ranges + p.ranges,
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
