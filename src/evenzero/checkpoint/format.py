"""The on-disk checkpoint format: a JSON manifest over per-rank safetensors files.

A checkpoint directory `step-000123/` holds `manifest.json`, one `rank-NNNNN.safetensors`
per rank, from rank 0 `model-extra.safetensors` (buffers and frozen parameters) and, from
each rank that passed `extra=` to `save`, `user-state-rank-NNNNN.safetensors`
(`evenzero.checkpoint.userstate`).
Each rank file stores, for every run of a parameter that the rank owns, the fp32 master
slice and the optimizer-state slices, keyed by parameter name and element range:

    "fc1.weight::master::4096"      elements [4096, 4096 + numel) of fc1.weight's master
    "fc1.weight::exp_avg::4096"     the same run of Adam's first moment

Bucket padding is never stored and nothing names a bucket or a world size, so a
checkpoint written on N ranks with one bucket size loads on M ranks with another: the
loader maps ranges by parameter name (see `evenzero.checkpoint.reshard`). Expert parameters of a
group with expert-parallel size E > 1 differ across the E expert-parallel ranks that
share a local name, so they are stored as `name@ep<e>`; E must match on load.

This module is pure data and validation; it never reads tensors. A manifest from
elsewhere is not trusted: every count is an integer in range, every file name a plain
name inside the checkpoint directory, and the runs of every parameter tile it exactly.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

FORMAT = "evenzero-checkpoint"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
EXTRA_FILE = "model-extra.safetensors"
MASTER = "master"
"""Tensor kind of the fp32 master weights; every other kind is an optimizer-state key."""
PLAIN_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]*")
"""A file name in a manifest: no separators, not hidden, not `.` or `..`."""


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
    """Non-shard optimizer state shared by the whole group, JSON-encoded: what
    checkpoints before per-parameter state held (Adam's one `step`); {} since."""
    state_keys: tuple[str, ...]
    """Shard-shaped optimizer-state kinds stored per range (exp_avg, exp_avg_sq, ...)."""
    param_scalars: Mapping[str, Any] = field(default_factory=dict)
    """Parameter name -> its own non-shard optimizer state (its `step`, ...; {} if never
    stepped), JSON-encoded. A parameter missing here has `scalars` (older checkpoints)."""

    stepped: tuple[str, ...] | None = None
    """Parameters stepped at least once (SGD's momentum makes it matter); None in
    checkpoints written before it was recorded."""

    def scalars_of(self, name: str) -> Any:
        """The JSON-encoded scalar state of parameter `name`."""
        return self.param_scalars.get(name, self.scalars)


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
    """The step the checkpoint was saved at (its `step-NNNNNN` name unless tagged)."""
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
    user_state: Mapping[int, str] = field(default_factory=dict)
    """Saving rank -> file holding the `extra=` state it passed to `save` (ranks that
    passed none are absent)."""
    bucket_numel: int | None = None
    """The saved plan's bucket size (elements) once the saving run kept it (fixed,
    refined at run time or loaded); None where the strategy cuts no buckets, while an
    "auto" size was still to be refined, and in checkpoints written before it was
    recorded. A load at the same world size adopts it (`protocol.PlanChoices`)."""
    arrival: tuple[str, ...] | None = None
    """The gradient-arrival order the saved plan was made for, when measured; None
    while it was the assumed one, and in checkpoints written before it was recorded."""
    extra: Any = None
    """Set by `load` only, never stored here: this rank's saved `extra` state (the state
    of the saving rank with the same number; rank 0's when the saving world had no such
    rank), None when that rank saved none."""

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "format_version": FORMAT_VERSION,
            "step": self.step, "step_count": self.step_count, "world_size": self.world_size,
            "strategy": self.strategy, "library_version": self.library_version,
            "optimizer": {"class": self.optimizer_class,
                          "groups": [group_json(g) for g in self.groups]},
            "loss_scaler": self.loss_scaler,
            "files": [file_json(f) for f in self.files],
            "params": {p.key: param_json(p) for p in self.params},
            "extras": {t.name: {"shape": list(t.shape), "dtype": t.dtype} for t in self.extras},
            "user_state": {str(r): name for r, name in sorted(self.user_state.items())},
            "plan": {"bucket_numel": self.bucket_numel,
                     "arrival": None if self.arrival is None else list(self.arrival)},
        }

    @staticmethod
    def from_json(data: Any, where: str) -> Manifest:
        """Parse and check internal consistency; every error names `where` and the field."""
        try:
            return _parse(data, where)
        except CheckpointError:
            raise
        except _Damaged as e:
            raise CheckpointError(f"{where}: {e}; the checkpoint is damaged, load an older "
                                  f"one") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise CheckpointError(f"{where}: malformed manifest ({type(e).__name__}: {e}); "
                                  f"the checkpoint is damaged, load an older one") from None

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=False)

    def group(self, name: str) -> StoredGroup:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(name)


class _Damaged(ValueError):
    """A field of a manifest that this evenzero cannot have written; the message names it."""


def _whole(value: Any, name: str, minimum: int = 0) -> int:
    """`value` if it is an int (not a bool) of at least `minimum`, else `_Damaged`."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Damaged(f"{name} is {value!r}, not an integer")
    if value < minimum:
        raise _Damaged(f"{name} is {value}, below {minimum}")
    return value


def _text(value: Any, name: str) -> str:
    if not isinstance(value, str):
        raise _Damaged(f"{name} is {value!r}, not a string")
    return value


def _plain_name(value: Any, name: str) -> str:
    if not isinstance(value, str) or not PLAIN_NAME.fullmatch(value):
        raise _Damaged(f"{name} {value!r} is not a plain file name inside the checkpoint "
                      f"directory (no path, separator, '..' or leading '.')")
    return value


def file_json(f: FileRecord) -> dict[str, Any]:
    return {"name": f.name, "rank": f.rank, "sha256": f.sha256, "bytes": f.nbytes}


def file_parse(f: Mapping[str, Any], name: str) -> FileRecord:
    digest = _text(f["sha256"], f"{name}.sha256")
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise _Damaged(f"{name}.sha256 {digest!r} is not a sha256 hex digest")
    return FileRecord(_plain_name(f["name"], f"{name}.name"), _whole(f["rank"], f"{name}.rank"),
                      digest, _whole(f["bytes"], f"{name}.bytes"))


def param_json(p: StoredParam) -> dict[str, Any]:
    return {"name": p.name, "group": p.group, "ep_rank": p.ep_rank, "shape": list(p.shape),
            "dtype": p.dtype, "ranges": [[r.file, r.start, r.numel] for r in p.ranges]}


def param_parse(key: str, p: Mapping[str, Any]) -> StoredParam:
    at = f"params[{key!r}]"
    ranges = []
    for i, run in enumerate(p["ranges"]):
        f, s, n = run
        ranges.append(StoredRange(_plain_name(f, f"{at}.ranges[{i}] file"),
                                  _whole(s, f"{at}.ranges[{i}] start"),
                                  _whole(n, f"{at}.ranges[{i}] numel")))
    return StoredParam(key, _text(p["name"], f"{at}.name"), _text(p["group"], f"{at}.group"),
                       _whole(p["ep_rank"], f"{at}.ep_rank"),
                       tuple(_whole(d, f"{at}.shape") for d in p["shape"]),
                       _text(p["dtype"], f"{at}.dtype"),
                       tuple(sorted(ranges, key=lambda r: r.start)))


def group_json(g: StoredGroup) -> dict[str, Any]:
    return {"name": g.name, "expert_parallel_size": g.expert_parallel_size, "size": g.size,
            "hyperparameters": dict(g.hyperparameters), "scalars": dict(g.scalars),
            "state_keys": list(g.state_keys), "param_scalars": dict(g.param_scalars),
            "stepped": None if g.stepped is None else list(g.stepped)}


def group_parse(g: Mapping[str, Any], at: str) -> StoredGroup:
    for part in ("hyperparameters", "scalars", "param_scalars"):
        if not isinstance(g.get(part, {}), Mapping):
            raise _Damaged(f"{at}.{part} is not an object")
    return StoredGroup(_text(g["name"], f"{at}.name"),
                       _whole(g["expert_parallel_size"], f"{at}.expert_parallel_size", 1),
                       _whole(g["size"], f"{at}.size", 1), dict(g["hyperparameters"]),
                       dict(g["scalars"]),
                       tuple(_text(k, f"{at}.state_keys") for k in g["state_keys"]),
                       dict(g.get("param_scalars", {})), _stepped_parse(g.get("stepped"), at))


def _stepped_parse(value: Any, at: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if not isinstance(value, list):
        raise _Damaged(f"{at}.stepped is not a list")
    return tuple(_text(n, f"{at}.stepped") for n in value)


def _scaler_parse(state: Any) -> Any:
    """The loss scaler's JSON state, its numbers checked (a NaN scale would stick)."""
    if state is None:
        return None
    if not isinstance(state, Mapping):
        raise _Damaged("loss_scaler is not an object")
    scale = state.get("scale", 1.0)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) \
            or not math.isfinite(scale) or scale <= 0:
        raise _Damaged(f"loss_scaler.scale is {scale!r}, not a finite positive number")
    for key in ("good_steps", "overflows"):
        if key in state:
            _whole(state[key], f"loss_scaler.{key}")
    return state


def _plan_parse(data: Any) -> tuple[int | None, tuple[str, ...] | None]:
    """(bucket size, arrival order) of the saved plan; (None, None) in manifests written
    before they were recorded (the format is the same: absent fields read as None)."""
    if data is None:
        return None, None
    if not isinstance(data, Mapping):
        raise _Damaged("plan is not an object")
    numel = data.get("bucket_numel")
    arrival = data.get("arrival")
    if arrival is not None:
        if not isinstance(arrival, list):
            raise _Damaged("plan.arrival is not a list")
        arrival = tuple(_text(n, "plan.arrival") for n in arrival)
        if len(set(arrival)) != len(arrival):
            raise _Damaged("plan.arrival lists a parameter twice")
    return None if numel is None else _whole(numel, "plan.bucket_numel", 1), arrival


def _parse(data: Any, where: str) -> Manifest:
    if not isinstance(data, Mapping) or data.get("format") != FORMAT:
        raise CheckpointError(f"{where}: not an evenzero checkpoint manifest")
    if data.get("format_version") != FORMAT_VERSION:
        raise CheckpointError(f"{where}: format version {data.get('format_version')!r}, this "
                              f"evenzero reads version {FORMAT_VERSION}; load it with a matching "
                              f"evenzero release and export_consolidated() it")
    world = _whole(data["world_size"], "world_size", 1)
    files = tuple(file_parse(f, f"files[{i}]") for i, f in enumerate(data["files"]))
    known = {f.name for f in files}
    if len(known) != len(files):
        raise _Damaged("files lists a file name twice")
    for f in files:
        if f.rank >= world:
            raise _Damaged(f"file {f.name!r} is written by rank {f.rank} of {world}")
    params = []
    for key, p in data["params"].items():
        sp = param_parse(key, p)
        _check_coverage(sp, known, where)
        params.append(sp)
    opt = data["optimizer"]
    groups = tuple(group_parse(g, f"optimizer.groups[{i}]") for i, g in enumerate(opt["groups"]))
    if len({g.name for g in groups}) != len(groups):
        raise _Damaged("optimizer.groups lists a group name twice")
    extras = tuple(StoredTensor(n, tuple(_whole(d, f"extras[{n!r}].shape") for d in t["shape"]),
                                _text(t["dtype"], f"extras[{n!r}].dtype"))
                   for n, t in data.get("extras", {}).items())
    user_state = {}
    for r, name in data.get("user_state", {}).items():
        if not r.isdigit() or int(r) >= world or name not in known:
            raise _Damaged(f"user_state entry {r!r}: {name!r} is not a listed file of a rank "
                          f"below {world}")
        user_state[int(r)] = name
    bucket_numel, arrival = _plan_parse(data.get("plan"))
    return Manifest(_whole(data["step"], "step"), _whole(data["step_count"], "step_count"), world,
                    _text(data["strategy"], "strategy"),
                    _text(data["library_version"], "library_version"),
                    _text(opt["class"], "optimizer.class"), groups, tuple(params), files, extras,
                    _scaler_parse(data.get("loss_scaler")), user_state, bucket_numel, arrival)


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
