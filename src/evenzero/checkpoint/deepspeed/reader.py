"""A DeepSpeed ZeRO-1/2 checkpoint directory, read and checked; no process group needed.

`save_checkpoint` (deepspeed/runtime/engine.py:4869-4966 @ v0.19.8) writes

    DIR/latest                                           the tag, e.g. "global_step40"
    DIR/<tag>/mp_rank_00_model_states.pt                 module, param_shapes, counters,
                                                         lr_scheduler, ds_config, client keys
    DIR/<tag>/[bf16_]zero_pp_rank_<r>_mp_rank_00_optim_states.pt    one per data-parallel rank

How the flat partitions map back to parameters: for every optimizer group, DeepSpeed
concatenates the trainable parameters in `param_shapes` order (with
`param_alignment_paddings` between them), pads the flat buffer at the tail to a multiple
of 2 * dp, and gives rank r the slice [r*P, (r+1)*P)
(deepspeed/runtime/zero/stage_1_and_2.py:387-500,586 @ v0.19.8). Each rank file holds its
fp32 master slice and the inner optimizer's state of that slice; with the tail padding
cut off, the slices of ranks 0..dp-1 concatenate to the unpadded flat buffer, from which
`FlatGroup.flat` cuts any parameter at any offset: the saved data-parallel size stops
mattering here.

Everything that would be read wrongly is refused here with a `CheckpointError`: missing
or extra rank files, truncated files, ZeRO-3, stage 0, tensor/pipeline parallelism and
MoE checkpoints, and flat sizes that do not add up to `param_shapes`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from evenzero.checkpoint.deepspeed.allowlist import ZeroStageEnum, load_file, scaler_state
from evenzero.checkpoint.format import MASTER, CheckpointError

LATEST = "latest"
MODEL_STATES = "mp_rank_00_model_states.pt"
_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
_ZERO3_MODEL = re.compile(r"^zero_pp_rank_\d+_mp_rank_\d+_model_states\.pt$")
_MP_RANK = re.compile(r"mp_rank_(\d+)")
_MOE = re.compile(r"(^|_)expert_\d+_|^expp_rank_")
_PIPELINE_LAYER = re.compile(r"^layer_\d+-model_")

ZERO3_FIX = ("evenzero runs ZeRO stages 1 and 2; write the weights with DeepSpeed's "
             "zero_to_fp32.py and load them with evenzero.checkpoint.import_consolidated "
             "(the optimizer state does not carry over)")


MOE_FIX = ("MoE checkpoints (expert parameters in layer_*_expert_* files, optimizer groups over "
           "expert-data-parallel ranks) are not supported; resume the run with DeepSpeed, or "
           "start evenzero from the weights")


@dataclass(frozen=True)
class DeepSpeedFiles:
    """What a DeepSpeed ZeRO-1/2 checkpoint holds, read and checked."""

    path: Path
    """The tag directory."""
    tag: str
    states: Mapping[str, Any]
    """The model-states file as saved (module, counters, lr_scheduler, client keys, ...)."""
    trainable: Mapping[str, tuple[int, ...]]
    """Parameters the ZeRO optimizer trained, by name (every group of `param_shapes`)."""
    groups: tuple[FlatGroup, ...]
    """The optimizer groups; empty when the optimizer files were not read."""
    zero_stage: int
    dp_world_size: int
    loss_scaler: Mapping[str, Any] | None
    """The saved loss scaler's attributes (None when the optimizer files were not read)."""
    clip_grad: float | None
    """The gradient clipping the ZeRO optimizer saved (DeepSpeed restores it on load)."""

    @property
    def module(self) -> Mapping[str, torch.Tensor]:
        return self.states["module"]

    def saved_tensor(self, name: str) -> torch.Tensor | None:
        """A model entry from `module`, else from the ZeRO-2 frozen fragments (there
        even when DeepSpeed saved with `exclude_frozen_parameters`)."""
        value = self.module.get(name)
        if value is None:
            value = (self.states.get("frozen_param_fragments") or {}).get(name)
        return value

    @property
    def shared(self) -> Mapping[str, str]:
        """Tied aliases: {alias: the name the parameter is trained under}."""
        return dict(self.states.get("shared_params") or {})


def tag_directory(directory: str | Path, tag: str | None = None) -> tuple[Path, str]:
    """(tag directory, tag): `tag`, else the one named in `latest`; `directory` may also
    be the tag directory itself."""
    root = Path(directory)
    if tag is None:
        latest = root / LATEST
        if latest.is_file():
            tag = latest.read_text().strip()
        elif (root / MODEL_STATES).is_file() or any(_ZERO3_MODEL.match(p.name)
                                                     for p in _listing(root)):
            return root, root.name
        else:
            found = sorted(p.name for p in _listing(root) if p.is_dir())
            raise CheckpointError(f"{root}: no '{LATEST}' file naming the checkpoint tag; pass "
                                  f"tag=... (directories here: {found[:8]})")
    path = root / str(tag)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint tag {tag!r} has no directory")
    return path, str(tag)


def is_deepspeed_checkpoint(directory: str | Path, tag: str | None = None) -> bool:
    """Whether `directory` (with `tag`, or its `latest`) looks like a DeepSpeed checkpoint.

    Cheap and never raises: it only looks at file names, so a damaged or unsupported
    DeepSpeed checkpoint (ZeRO-3, MoE, ...) also counts, and loading it gives the reason.
    """
    try:
        path, _ = tag_directory(directory, tag)
    except (CheckpointError, OSError):
        return False
    return any(p.name.endswith(("_model_states.pt", "_optim_states.pt")) for p in _listing(path))


def _listing(path: Path) -> list[Path]:
    try:
        return list(path.iterdir())
    except OSError:
        return []


def read_deepspeed(directory: str | Path, tag: str | None = None, *,
                   optimizer_states: bool = True, allow: Sequence[Any] = ()) -> DeepSpeedFiles:
    """Read and check a checkpoint; `optimizer_states=False` reads the model states only."""
    path, tag = tag_directory(directory, tag)
    names = [p.name for p in _listing(path)]
    _refuse_layouts(path, names)
    states = load_file(path / MODEL_STATES, allow)
    if not isinstance(states, Mapping) or "module" not in states:
        raise CheckpointError(f"{path / MODEL_STATES}: no 'module' entry; not a DeepSpeed "
                              f"model-states file")
    _refuse_states(path, states)
    trainable = {}
    for group in states["param_shapes"]:
        for name, shape in group.items():
            if name in trainable:
                raise CheckpointError(f"{path / MODEL_STATES}: parameter {name!r} is in two "
                                      f"optimizer groups of param_shapes; the file is damaged")
            trainable[name] = tuple(int(d) for d in shape)
    dp = int(states.get("dp_world_size") or 0)
    groups: tuple[FlatGroup, ...] = ()
    scaler = clip = None
    stage = _config_stage(states)
    if optimizer_states:
        ranks = _rank_files(path, names, dp)
        saved = [_optimizer_state(path / f, allow) for f in ranks]
        stage = _check_stages(path, ranks, saved)
        groups = flat_groups(path, ranks, saved, states["param_shapes"], dp)
        scaler = scaler_state(saved[0].get("loss_scaler"))
        clip = saved[0].get("clip_grad")
    return DeepSpeedFiles(path, tag, states, trainable, groups, stage, dp, scaler,
                          None if clip is None else float(clip))


# --------------------------------------------------------------------------- flat partitions


@dataclass(frozen=True)
class FlatGroup:
    """One DeepSpeed optimizer group: its parameters in flat order and the saved slices."""

    index: int
    params: tuple[tuple[str, tuple[int, ...]], ...]
    """(name, shape) in flat order, as recorded in `param_shapes`."""
    spans: Mapping[str, tuple[int, int]]
    """Parameter name -> [start, end) in the unpadded flat buffer."""
    parts: Mapping[str, tuple[torch.Tensor, ...]]
    """Kind ("master", "exp_avg", ...) -> each rank's 1-D slice, tail padding cut."""
    scalars: Mapping[str, Any]
    """Optimizer state that is not per element (Adam's `step`)."""
    hyperparameters: Mapping[str, Any] | None
    """The inner optimizer's param group without "params" (None: not saved, elastic)."""

    def flat(self, name: str, kind: str, start: int = 0, numel: int | None = None
             ) -> torch.Tensor:
        """Elements [start, start + numel) of a parameter (default: all) of one kind, flat
        fp32 (a copy): a rank reads only the runs of its own shard."""
        first, end = self.spans[name]
        lo = first + start
        hi = end if numel is None else lo + numel
        out = torch.empty(hi - lo, dtype=torch.float32)
        start = 0
        for part in self.parts[kind]:
            end = start + part.numel()
            a, b = max(lo, start), min(hi, end)
            if a < b:
                out[a - lo:b - lo] = part[a - start:b - start]
            start = end
        return out


def flat_groups(path: Path, ranks: list[str], saved: list[Mapping[str, Any]],
                param_shapes: Sequence[Mapping[str, Any]], dp: int) -> tuple[FlatGroup, ...]:
    """Every group of `param_shapes`, from the optimizer files of ranks 0..dp-1 (`saved`),
    checked against each other and against the parameter sizes."""
    out = []
    first = saved[0]
    for i, shapes in enumerate(param_shapes):
        params = tuple((n, tuple(int(d) for d in s)) for n, s in shapes.items())
        for file, sd in zip(ranks, saved, strict=True):
            where = path / file
            counts = sd.get("partition_count") or []
            if len(sd.get("single_partition_of_fp32_groups") or []) != len(param_shapes):
                raise CheckpointError(f"{where}: {len(sd.get('single_partition_of_fp32_groups') or [])}"
                                      f" optimizer groups, the model states list "
                                      f"{len(param_shapes)}; files from two runs are mixed here")
            if i < len(counts) and int(counts[i]) != dp:
                raise CheckpointError(f"{where}: group {i} is partitioned over {counts[i]} ranks, "
                                      f"not the {dp} data-parallel ranks; {MOE_FIX}")
        pads = _alignment_paddings(path / ranks[0], first, i, len(params))
        spans, pos = {}, 0
        for (name, shape), pad in zip(params, pads, strict=True):
            spans[name] = (pos, pos + math.prod(shape))
            pos += math.prod(shape) + pad
        masters = tuple(_unpadded_master(sd, i) for sd in saved)
        total = sum(m.numel() for m in masters)
        if total != pos:
            raise CheckpointError(f"{path}: optimizer group {i} holds {total} elements over "
                                  f"{dp} files, but param_shapes needs {pos}; the files do not "
                                  f"belong to this model states file or are damaged")
        parts, scalars, hyper = _group_state(path, ranks, saved, i, masters)
        out.append(FlatGroup(i, params, spans, {MASTER: masters, **parts}, scalars, hyper))
    return tuple(out)


def _alignment_paddings(where: Path, sd: Mapping[str, Any], i: int, count: int) -> list[int]:
    """Zeros DeepSpeed put after each parameter of group `i` (`parameter_alignment`)."""
    every = sd.get("param_alignment_paddings")
    if not every:
        return [0] * count
    pads = [int(p) for p in every[i]]
    if len(pads) != count:
        raise CheckpointError(f"{where}: {len(pads)} alignment paddings for the {count} "
                              f"parameters of group {i}; the file does not belong to this "
                              f"model states file")
    return pads


def _unpadded_master(sd: Mapping[str, Any], i: int) -> torch.Tensor:
    """Group `i`'s fp32 slice without the tail padding. The ZeRO optimizer saves it cut
    (stage_1_and_2.py:3385); BF16_Optimizer (bf16 + ZeRO-1 + fp32 gradient accumulation,
    no `zero_stage` key) saves it whole (deepspeed/runtime/bf16_optimizer.py:633)."""
    master = sd["single_partition_of_fp32_groups"][i].reshape(-1)
    if "zero_stage" in sd:
        return master
    return master[:master.numel() - int(sd["group_paddings"][i])]


def _group_state(path: Path, ranks: list[str], saved: list[Mapping[str, Any]], i: int,
                 masters: tuple[torch.Tensor, ...]) -> tuple[dict, dict, dict | None]:
    """(per-element state by kind, scalar state, hyperparameters) of group `i`."""
    per_rank: list[dict[str, Any]] = []
    hyper = None
    for file, sd, master in zip(ranks, saved, masters, strict=True):
        base = sd.get("base_optimizer_state")
        where = path / file
        if isinstance(base, Mapping):  # the default (rigid) format: the inner state_dict()
            group = base["param_groups"][i]
            state = dict(base["state"].get(group["params"][0], {}))
            pad = int(sd["group_paddings"][i])
            if group.get("moe"):
                raise CheckpointError(f"{where}: optimizer group {i} holds expert parameters; "
                                      f"{MOE_FIX}")
            if hyper is None:
                hyper = {k: v for k, v in group.items() if k != "params"}
        elif isinstance(base, Sequence):  # elastic_checkpoint: cut per group, no groups
            state, pad = dict(base[i]), 0
        else:
            raise CheckpointError(f"{where}: no base_optimizer_state; the file is damaged")
        for key, value in state.items():
            if isinstance(value, torch.Tensor) and value.dim() == 1 and key != "step":
                if value.numel() != master.numel() + pad:
                    raise CheckpointError(f"{where}: optimizer state {key!r} of group {i} has "
                                          f"{value.numel()} elements, expected "
                                          f"{master.numel() + pad}; the file is damaged")
                state[key] = value[:master.numel()]
        per_rank.append(state)
    keys = set(per_rank[0])
    parts, scalars = {}, {}
    for r, state in enumerate(per_rank):
        if set(state) != keys:
            raise CheckpointError(f"{path / ranks[r]}: optimizer state keys {sorted(state)} differ "
                                  f"from rank 0's {sorted(keys)}; files from two runs are mixed")
    for key in sorted(keys):
        values = [s[key] for s in per_rank]
        if key != "step" and all(isinstance(v, torch.Tensor) and v.dim() == 1 for v in values):
            parts[key] = tuple(values)
            continue
        for r, v in enumerate(values):
            if not same_value(v, values[0]):
                raise CheckpointError(f"{path / ranks[r]}: optimizer state {key!r} of group {i} "
                                      f"is {v}, rank 0 has {values[0]}; files from two runs "
                                      f"are mixed here")
        scalars[key] = values[0]
    return parts, scalars, hyper


def same_value(a: Any, b: Any) -> bool:
    """Equal values, tensors compared by content (a saved `step` may be either)."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return set(a) == set(b) and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        a, b = torch.as_tensor(a), torch.as_tensor(b)
        return a.shape == b.shape and bool(torch.equal(a, b))
    return bool(a == b)


# --------------------------------------------------------------------------- refusals


def _refuse_layouts(path: Path, names: list[str]) -> None:
    if MODEL_STATES not in names:
        if any(_ZERO3_MODEL.match(n) for n in names):
            raise CheckpointError(f"{path}: a ZeRO-3 checkpoint (per-rank model states); "
                                  f"{ZERO3_FIX}")
        raise CheckpointError(f"{path / MODEL_STATES}: missing; the checkpoint is incomplete "
                              f"(DeepSpeed's data-parallel rank 0 writes it)")
    if any(_PIPELINE_LAYER.match(n) for n in names):
        raise CheckpointError(f"{path}: a pipeline-parallel checkpoint (layer_*-model_* files); "
                              f"evenzero is data-parallel only and cannot resume it")
    other_mp = sorted(n for n in names if any(m != "00" for m in _MP_RANK.findall(n)))
    if other_mp:
        raise CheckpointError(f"{path}: a tensor/pipeline-parallel checkpoint ({other_mp[0]}); "
                              f"evenzero is data-parallel only and resumes mp_rank_00 "
                              f"checkpoints with one model-parallel rank")
    if any(_MOE.search(n) for n in names):
        raise CheckpointError(f"{path}: {MOE_FIX}")


def _config_stage(states: Mapping[str, Any]) -> int:
    config = states.get("ds_config")
    zero = config.get("zero_optimization") if isinstance(config, Mapping) else None
    stage = zero.get("stage", 0) if isinstance(zero, Mapping) else 0
    try:
        return int(stage)
    except (TypeError, ValueError):
        return 0


def _refuse_states(path: Path, states: Mapping[str, Any]) -> None:
    where = path / MODEL_STATES
    if _config_stage(states) == 3:
        raise CheckpointError(f"{where}: a ZeRO-3 checkpoint; {ZERO3_FIX}")
    dims = states.get("checkpoint_parallel_dimensions") or {}
    if int(states.get("mp_world_size") or 1) != 1 or any(
            int(dims.get(k) or 1) != 1 for k in ("pp_degree", "tp_degree")):
        raise CheckpointError(f"{where}: saved with model parallelism (mp_world_size="
                              f"{states.get('mp_world_size')}, {dict(dims)}); evenzero is "
                              f"data-parallel only")
    if states.get("num_experts") is not None:
        raise CheckpointError(f"{where}: {MOE_FIX}")
    if states.get("param_shapes") is None:
        raise CheckpointError(f"{where}: a DeepSpeed stage-0 checkpoint (no ZeRO partitions); "
                              f"its plain torch optimizer state is under 'optimizer': load "
                              f"'module' and it with evenzero.checkpoint.load_consolidated_"
                              f"state_dict")
    if not states.get("dp_world_size"):
        raise CheckpointError(f"{where}: no dp_world_size; not a DeepSpeed ZeRO checkpoint")


def _rank_files(path: Path, names: list[str], dp: int) -> list[str]:
    found: dict[int, list[str]] = {}
    for n in names:
        m = _OPTIM.match(n)
        if m:
            found.setdefault(int(m.group(2)), []).append(n)
    if not found:
        raise CheckpointError(f"{path}: no zero_pp_rank_*_optim_states.pt files; the optimizer "
                              f"state was not saved here (load with load_optimizer_states=False "
                              f"for the weights only)")
    prefix = "bf16_" if any(n.startswith("bf16_") for fs in found.values() for n in fs) else ""
    missing = [r for r in range(dp) if r not in found]
    if missing:
        raise CheckpointError(f"{path / f'{prefix}zero_pp_rank_{missing[0]}_mp_rank_00_optim_states.pt'}"
                              f": missing; the checkpoint was written by {dp} data-parallel ranks "
                              f"and needs all {dp} optimizer files")
    extra = sorted(r for r in found if r >= dp)
    if extra:
        raise CheckpointError(f"{path}: optimizer files for ranks {sorted(found)} but the model "
                              f"states say dp_world_size={dp}; files from two runs are mixed here")
    twice = [fs for fs in found.values() if len(fs) > 1]
    if twice:
        raise CheckpointError(f"{path}: both {twice[0]}; files from a bf16 and another run "
                              f"are mixed here")
    return [found[r][0] for r in range(dp)]


def _optimizer_state(file: Path, allow: Sequence[Any]) -> Mapping[str, Any]:
    saved = load_file(file, allow)
    sd = saved.get("optimizer_state_dict") if isinstance(saved, Mapping) else None
    if not isinstance(sd, Mapping):
        raise CheckpointError(f"{file}: no 'optimizer_state_dict'; not a DeepSpeed ZeRO "
                              f"optimizer file")
    return sd


def _check_stages(path: Path, ranks: list[str], saved: list[Mapping[str, Any]]) -> int:
    stages = set()
    for file, sd in zip(ranks, saved, strict=True):
        stage = sd.get("zero_stage")
        if stage is None and "single_partition_of_fp32_groups" in sd:
            stage = ZeroStageEnum.optimizer_states  # BF16_Optimizer, DeepSpeed's bf16 ZeRO-1
        if stage is None or int(stage) == ZeroStageEnum.weights or "fp32_flat_groups" in sd:
            raise CheckpointError(f"{path / file}: a ZeRO-3 optimizer file; {ZERO3_FIX}")
        stages.add(int(stage))
    if len(stages) != 1:
        raise CheckpointError(f"{path}: optimizer files of different ZeRO stages {sorted(stages)}; "
                              f"files from two runs are mixed here")
    return stages.pop()
