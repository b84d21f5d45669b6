"""The on-disk checkpoint format: a JSON manifest over per-rank safetensors files.

A checkpoint directory `step-000123/` holds `manifest.json`, one `rank-NNNNN.safetensors`
per rank and, from rank 0, `model-extra.safetensors` (buffers and frozen parameters).
Each rank file stores, for every run of a parameter that the rank owns, the fp32 master
slice and the optimizer-state slices, keyed by parameter name and element range:

    "fc1.weight::master::4096"      elements [4096, 4096 + numel) of fc1.weight's master
    "fc1.weight::exp_avg::4096"     the same run of Adam's first moment

Bucket padding is never stored and nothing names a bucket or a world size, so a
checkpoint written on N ranks with one bucket size loads on M ranks with another: the
loader maps ranges by parameter name (see `evenzero.checkpoint.reshard`). Expert parameters of a
group with expert-parallel size E > 1 differ across the E expert-parallel ranks that
share a local name, so they are stored as `name@ep<e>`; E must match on load.

This module is pure data and validation; it never reads tensors.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from evenzero.spec import dtype_name

FORMAT = "evenzero-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
EXTRA_FILE = "model-extra.safetensors"
MASTER = "master"
"""Tensor kind of the fp32 master weights; every other kind is an optimizer-state key."""
SMALL_TENSOR_NUMEL = 64
"""Tensors up to this size that are not shard-shaped (Adam's `step`) go into the JSON."""


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message names the file or parameter."""


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.safetensors"


def step_dirname(step: int) -> str:
    return f"step-{step:06d}"


def storage_name(param: str, expert_parallel_size: int, ep_rank: int) -> str:
    """The name a parameter's runs are stored under (unique across expert-parallel ranks)."""
    return param if expert_parallel_size == 1 else f"{param}@ep{ep_rank}"


def tensor_key(storage: str, kind: str, start: int) -> str:
    return f"{storage}::{kind}::{start}"


# --------------------------------------------------------------------------- JSON values


def encode_value(value: Any) -> Any:
    """Optimizer hyperparameters, scalar state and loss-scaler state as exact JSON.

    Tuples and small tensors are tagged so that decoding gives back the same types
    (Adam's betas stay a tuple, its `step` a 0-d float32 tensor).
    """
    import torch

    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, torch.Tensor):
        if value.numel() > SMALL_TENSOR_NUMEL:
            raise CheckpointError(f"tensor of shape {list(value.shape)} is too large to store as "
                                  f"a scalar; only shard-shaped optimizer state is sharded")
        return {"__tensor__": {"dtype": dtype_name(value.dtype),
                               "shape": list(value.shape),
                               "values": value.detach().cpu().flatten().tolist()}}
    if isinstance(value, tuple):
        return {"__tuple__": [encode_value(v) for v in value]}
    if isinstance(value, list):
        return [encode_value(v) for v in value]
    if isinstance(value, Mapping):
        if not all(isinstance(k, str) for k in value):
            raise CheckpointError(f"cannot store a dict with non-string keys {list(value)[:4]}")
        return {k: encode_value(v) for k, v in value.items()}
    raise CheckpointError(f"cannot store a value of type {type(value).__name__} in a checkpoint")


def decode_value(value: Any, device: Any = None) -> Any:
    import torch

    if isinstance(value, list):
        return [decode_value(v, device) for v in value]
    if isinstance(value, dict):
        if set(value) == {"__tensor__"}:
            t = value["__tensor__"]
            dtype = getattr(torch, t["dtype"], None)
            if not isinstance(dtype, torch.dtype):
                raise CheckpointError(f"unknown tensor dtype {t['dtype']!r} in manifest")
            out = torch.tensor(t["values"], dtype=dtype).reshape(t["shape"])
            return out if device is None else out.to(device)
        if set(value) == {"__tuple__"}:
            return tuple(decode_value(v, device) for v in value["__tuple__"])
        return {k: decode_value(v, device) for k, v in value.items()}
    return value


# --------------------------------------------------------------------------- manifest


@dataclass(frozen=True)
class FileRecord:
    """One data file of the checkpoint and how to verify it."""

    name: str
    """File name inside the checkpoint directory."""
    rank: int
    """Rank that wrote it."""
    sha256: str
    """Hex digest of the whole file."""
    nbytes: int
    """File size in bytes (a shorter file is truncated)."""


@dataclass(frozen=True)
class StoredRange:
    """A run of a parameter's flattened elements stored in one file."""

    file: str
    start: int
    numel: int


@dataclass(frozen=True)
class StoredParam:
    """A trainable parameter and where its runs are."""

    key: str
    """Storage name (`storage_name`): the parameter name, plus `@ep<e>` for experts."""
    name: str
    """Parameter name, as in `named_parameters()`."""
    group: str
    """Plan group it belongs to."""
    ep_rank: int
    """Expert-parallel rank whose copy this is (0 for dense groups)."""
    shape: tuple[int, ...]
    dtype: str
    """Dtype of the model parameter; masters and state are always stored in fp32."""
    ranges: tuple[StoredRange, ...]
    """Runs sorted by start; together they cover [0, numel) exactly once."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class StoredGroup:
    """One plan group and the inner optimizer's param group for it."""

    name: str
    expert_parallel_size: int
    size: int
    """Data-parallel size of the group when saved (informational; any size loads)."""
    hyperparameters: Mapping[str, Any]
    """The torch param group without "params", JSON-encoded with `encode_value`."""
    scalars: Mapping[str, Any]
    """Non-shard optimizer state (Adam's `step`), JSON-encoded."""
    state_keys: tuple[str, ...]
    """Shard-shaped optimizer-state kinds stored per range (exp_avg, exp_avg_sq, ...)."""


@dataclass(frozen=True)
class StoredTensor:
    """A whole tensor of the model that is not trained by evenzero (buffer, frozen param)."""

    name: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class Manifest:
    """Everything needed to validate and load a checkpoint before reading any tensor."""

    step: int
    """The step the checkpoint directory is named after."""
    step_count: int
    """The optimizer's step counter when saved."""
    world_size: int
    strategy: str
    library_version: str
    optimizer_class: str
    """Module-qualified class of the inner torch optimizer."""
    groups: tuple[StoredGroup, ...]
    params: tuple[StoredParam, ...]
    files: tuple[FileRecord, ...]
    extras: tuple[StoredTensor, ...] = ()
    """Buffers and frozen parameters, stored whole in EXTRA_FILE by rank 0."""
    loss_scaler: Any = None
    """The loss scaler's state dict, JSON-encoded; None when there is none."""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "step": self.step, "step_count": self.step_count, "world_size": self.world_size,
            "strategy": self.strategy, "library_version": self.library_version,
            "optimizer": {"class": self.optimizer_class,
                          "groups": [_group_json(g) for g in self.groups]},
            "loss_scaler": self.loss_scaler,
            "files": [{"name": f.name, "rank": f.rank, "sha256": f.sha256, "bytes": f.nbytes}
                      for f in self.files],
            "params": {p.key: _param_json(p) for p in self.params},
            "extras": {t.name: {"shape": list(t.shape), "dtype": t.dtype} for t in self.extras},
        }

    @staticmethod
    def from_json(data: Any, where: str) -> Manifest:
        """Parse and check internal consistency; every error names `where` and the field."""
        try:
            return _parse(data, where)
        except (KeyError, TypeError, ValueError) as e:
            if isinstance(e, CheckpointError):
                raise
            raise CheckpointError(f"{where}: malformed manifest ({type(e).__name__}: {e}); "
                                  f"the checkpoint is damaged, load an older one") from None

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=False)

    def group(self, name: str) -> StoredGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)


def _param_json(p: StoredParam) -> dict[str, Any]:
    return {"name": p.name, "group": p.group, "ep_rank": p.ep_rank, "shape": list(p.shape),
            "dtype": p.dtype, "ranges": [[r.file, r.start, r.numel] for r in p.ranges]}


def _param_parse(key: str, p: Mapping[str, Any]) -> StoredParam:
    ranges = tuple(sorted((StoredRange(str(f), int(s), int(n)) for f, s, n in p["ranges"]),
                          key=lambda r: r.start))
    return StoredParam(key, p["name"], p["group"], int(p["ep_rank"]),
                       tuple(int(d) for d in p["shape"]), p["dtype"], ranges)


def _group_json(g: StoredGroup) -> dict[str, Any]:
    return {"name": g.name, "expert_parallel_size": g.expert_parallel_size, "size": g.size,
            "hyperparameters": dict(g.hyperparameters), "scalars": dict(g.scalars),
            "state_keys": list(g.state_keys)}


def _group_parse(g: Mapping[str, Any]) -> StoredGroup:
    return StoredGroup(g["name"], int(g["expert_parallel_size"]), int(g["size"]),
                       dict(g["hyperparameters"]), dict(g["scalars"]), tuple(g["state_keys"]))


def _parse(data: Any, where: str) -> Manifest:
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not an evenzero checkpoint manifest")
    if data.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{where}: format version {data.get('format_version')!r}, this "
                              f"evenzero reads version {FORMAT_VERSION}; load it with a matching "
                              f"evenzero release and export_consolidated() it")
    files = tuple(FileRecord(f["name"], int(f["rank"]), str(f["sha256"]), int(f["bytes"]))
                  for f in data["files"])
    known = {f.name for f in files}
    params = []
    for key, p in data["params"].items():
        sp = _param_parse(key, p)
        _check_coverage(sp, known, where)
        params.append(sp)
    opt = data["optimizer"]
    groups = tuple(_group_parse(g) for g in opt["groups"])
    extras = tuple(StoredTensor(n, tuple(int(d) for d in t["shape"]), t["dtype"])
                   for n, t in data.get("extras", {}).items())
    return Manifest(int(data["step"]), int(data["step_count"]), int(data["world_size"]),
                    str(data["strategy"]), str(data["library_version"]), str(opt["class"]),
                    groups, tuple(params), files, extras, data.get("loss_scaler"))


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

    def dumps(self) -> str:
        return json.dumps({"file": {"name": self.file.name, "rank": self.file.rank,
                                    "sha256": self.file.sha256, "bytes": self.file.nbytes},
                           "params": {p.key: _param_json(p) for p in self.params},
                           "groups": [_group_json(g) for g in self.groups]})

    @staticmethod
    def loads(text: str) -> RankIndex:
        d = json.loads(text)
        f = d["file"]
        return RankIndex(FileRecord(f["name"], int(f["rank"]), f["sha256"], int(f["bytes"])),
                         tuple(_param_parse(k, p) for k, p in d["params"].items()),
                         tuple(_group_parse(g) for g in d["groups"]))


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
    groups = indices[0].groups
    for idx in indices[1:]:
        if idx.groups != groups:
            raise CheckpointError(f"rank {idx.file.rank} and rank {indices[0].file.rank} disagree "
                                  f"on optimizer hyperparameters or state keys; every rank must "
                                  f"build the same optimizer")
    return tuple(merged.values()), groups


def _check_coverage(p: StoredParam, files: set[str], where: str) -> None:
    """The runs of a parameter must tile it exactly; anything else is a damaged manifest."""
    pos = 0
    for r in p.ranges:
        if r.file not in files:
            raise CheckpointError(f"{where}: parameter {p.key!r} points at {r.file!r}, which the "
                                  f"manifest does not list; the checkpoint is damaged")
        if r.start != pos or r.numel <= 0:
            raise CheckpointError(f"{where}: parameter {p.key!r} has runs that do not tile it "
                                  f"(gap or overlap at element {pos}); the checkpoint is damaged")
        pos += r.numel
    if pos != p.numel:
        raise CheckpointError(f"{where}: parameter {p.key!r} stores {pos} of {p.numel} elements; "
                              f"the checkpoint is damaged or incomplete")
