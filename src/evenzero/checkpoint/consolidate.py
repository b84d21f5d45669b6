"""Leaving evenzero and arriving: whole-model state dicts in plain PyTorch formats.

`export_consolidated(opt, path)` writes what a single-process job would hold:

* `model.safetensors`: `module.state_dict()` with every trained parameter whole;
* `optimizer.pt`: a torch optimizer state dict keyed by parameter name, the format of
  `torch.distributed.checkpoint.state_dict.get_optimizer_state_dict` (load it into a
  plain optimizer with `set_optimizer_state_dict(model, optimizer, osd)`);
* `master-fp32.safetensors`, only when some parameter is stored below fp32: the fp32
  master weights, which the lower-precision model state cannot hold.

With expert groups (E > 1) the module on a rank holds only its expert-parallel rank's
experts, so there is one such set per distinct module, in `ep-<e>/` (`ep-<e1>-<e2>/`
with several expert groups), written by the rank that is rank 0 of its expert
data-parallel groups; a rank imports the directory of its own expert-parallel rank.

`import_consolidated` / `load_consolidated_state_dict` go the other way, from those
files or from in-memory state dicts: a torch optimizer state dict keyed by name, or by
position (the usual format, positions as in `module.parameters()`).

`read_consolidated(path)` needs no optimizer and no process group: it assembles every
parameter's fp32 master, whole, from a checkpoint directory's rank files (DeepSpeed's
`zero_to_fp32` does this for its own files; the drop-in's does it for both).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from evenzero.checkpoint import files as checkpoint_files
from evenzero.checkpoint.agree import agree, attempt
from evenzero.checkpoint.format import EXTRA_FILE, MASTER, CheckpointError, tensor_key
from evenzero.checkpoint.protocol import ShardedOptimizer
from evenzero.checkpoint.reshard import fill_shard, scatter_shard
from evenzero.checkpoint.staging import StagedGroup, apply, stage
from evenzero.checkpoint.state import (
    RankPlace,
    ShardTarget,
    extra_tensors,
    group_params,
    group_state,
    stepped_params,
    trainable_names,
)
from evenzero.checkpoint.userstate import read_user_state

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"
MASTER_FILE = "master-fp32.safetensors"


def consolidated_state_dict(opt: ShardedOptimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any],
                                               dict[str, torch.Tensor]]:
    """(model state dict, optimizer state dict keyed by name, fp32 masters) of this rank's
    module, whole and on the CPU. A collective over every group's process group."""
    named = trainable_names(opt)
    masters: dict[str, torch.Tensor] = {}
    state: dict[str, dict[str, Any]] = {}
    param_groups = []
    order = {n: i for i, (n, _) in enumerate(opt.module.named_parameters())}
    for g in opt.plan.groups:
        flats, scalars, hyper = group_state(opt, g.name)
        scalars, stepped = _gather_scalars(opt, g.name, g.size, scalars,
                                           stepped_params(opt, g.name))
        whole = {kind: {s.name: torch.empty(s.numel, dtype=torch.float32)
                        for b in opt.plan.group_layouts(g.name) for s in b.params}
                 for kind in flats}
        for kind, flat in flats.items():
            for source, shard in enumerate(_gather(opt, g.name, g.size, flat)):
                scatter_shard(opt.plan.shard_ranges(g.name, source), shard,
                              whole[kind].__getitem__)
        names = sorted(whole[MASTER], key=order.__getitem__)
        for name in names:
            shape = named[name].shape
            masters[name] = whole[MASTER][name].reshape(shape)
            entry = {k: whole[k][name].reshape(shape) for k in flats if k != MASTER}
            mine = scalars.get(name, {})
            if name in stepped or mine:  # as torch: a parameter never stepped has no state
                state[name] = {**entry, **{k: _copy(v) for k, v in mine.items()}}
        param_groups.append({**hyper, "params": names})
    model = {}
    for name, t in opt.module.state_dict(keep_vars=True).items():
        if isinstance(t, torch.Tensor):
            source = masters.get(name)
            model[name] = (source.to(t.dtype) if source is not None
                           else t.detach().to("cpu", copy=True))
    # Tied aliases are in the state dict under their own names; give them the master too.
    for alias, p in opt.module.named_parameters(remove_duplicate=False):
        for name, q in named.items():
            if q is p and alias != name:
                model[alias] = model[name]
    return model, {"state": state, "param_groups": param_groups}, masters


def _gather(opt: ShardedOptimizer, group: str, size: int, flat: torch.Tensor) -> list[torch.Tensor]:
    if size == 1:
        return [flat.detach().cpu()]
    # An offloaded shard lives on the host; the collective runs where the group's
    # backend does (the control device).
    flat = flat.detach().to(opt.control_device).contiguous()
    parts = [torch.empty_like(flat) for _ in range(size)]
    dist.all_gather(parts, flat, group=opt.process_group(group))
    return [p.cpu() for p in parts]


def _gather_scalars(opt: ShardedOptimizer, group: str, size: int, mine: dict[str, Any],
                    stepped: set[str]) -> tuple[dict[str, Any], set[str]]:
    """Every parameter's scalar state, and which were stepped: each rank knows those of
    the parameters it has runs of."""
    if size == 1:
        return mine, stepped
    every: list = [None] * size
    dist.all_gather_object(every, (mine, sorted(stepped)), group=opt.process_group(group))
    return ({n: s for theirs, _ in every for n, s in theirs.items()},
            {n for _, done in every for n in done})


def _copy(v: Any) -> Any:
    return v.detach().clone() if isinstance(v, torch.Tensor) else v


def expert_view(opt: ShardedOptimizer, place: RankPlace) -> tuple[str | None, bool]:
    """(sub-directory of this rank's module, or None without experts; whether it writes)."""
    experts = [g for g in opt.plan.groups if g.expert_parallel_size > 1]
    if not experts:
        return None, place.rank == 0
    label = "ep-" + "-".join(str(place.ep_ranks[g.name]) for g in experts)
    # Rank r's label is determined by r mod lcm(E...) (E+D layout), so ranks below the
    # lcm are exactly one writer per label, also when expert groups differ in E.
    return label, place.rank < math.lcm(*(g.expert_parallel_size for g in experts))


def export_consolidated(opt: ShardedOptimizer, path: str | os.PathLike) -> Path:
    """Write the plain-PyTorch files (see the module docstring); a collective."""
    place = RankPlace.of(opt)
    root = Path(path)
    model, optim, masters = consolidated_state_dict(opt)
    label, writes = expert_view(opt, place)
    here = root if label is None else root / label

    def write() -> None:
        from safetensors.torch import save_file

        here.mkdir(parents=True, exist_ok=True)
        # safetensors refuses tensors that share storage (tied weights): store copies.
        save_file({k: v.contiguous().clone() for k, v in model.items()}, here / MODEL_FILE)
        torch.save(optim, here / OPTIMIZER_FILE)
        if any(p.dtype != torch.float32 for p in trainable_names(opt).values()):
            save_file({k: v.contiguous() for k, v in masters.items()}, here / MASTER_FILE)

    _, err = attempt(write) if writes else (None, None)
    agree(place, err, f"exporting to {here}")
    return root


def import_consolidated(opt: ShardedOptimizer, path: str | os.PathLike, optimizer_state: bool = True) -> None:
    """Load files written by `export_consolidated` (or by hand in the same layout)."""
    place = RankPlace.of(opt)
    label, _ = expert_view(opt, place)
    here = Path(path) if label is None else Path(path) / label

    def read() -> tuple[dict, dict | None]:
        from safetensors.torch import load_file

        if not (here / MODEL_FILE).exists():
            raise CheckpointError(f"{here / MODEL_FILE}: missing; export_consolidated() writes it")
        model = load_file(str(here / MODEL_FILE))
        if (here / MASTER_FILE).exists():
            model.update(load_file(str(here / MASTER_FILE)))
        optim = None
        if optimizer_state:
            try:
                optim = torch.load(here / OPTIMIZER_FILE, weights_only=True)
            except FileNotFoundError:
                raise CheckpointError(f"{here / OPTIMIZER_FILE}: missing; pass "
                                      f"optimizer_state=False to load the model only") from None
        return model, optim

    loaded, err = attempt(read)
    agree(place, err, f"reading {here}")
    load_consolidated_state_dict(opt, *loaded)


def load_consolidated_state_dict(opt: ShardedOptimizer, model: dict[str, torch.Tensor],
                                 optimizer: dict[str, Any] | None = None) -> None:
    """Set masters, optimizer state and model from whole-model state dicts; a collective.

    Without `optimizer` the optimizer state is cleared (a fresh start from the weights).
    """
    place = RankPlace.of(opt)
    staged, err = attempt(lambda: stage(opt, place, ConsolidatedSource(opt, model, optimizer)))
    agree(place, err, "importing a consolidated state dict")
    apply(opt, staged)


class ConsolidatedSource:
    """Whole-model state dicts as a `staging.ShardSource`: each rank cuts its shards out
    of the whole parameters (and, by name, of the optimizer state)."""

    where = "consolidated state dict"

    def __init__(self, opt: ShardedOptimizer, model: Mapping[str, torch.Tensor],
                 optimizer: dict[str, Any] | None) -> None:
        named = trainable_names(opt)
        for name, p in named.items():
            t = model.get(name)
            if t is None:
                raise CheckpointError(f"model state dict has no parameter {name!r}; it is from a "
                                      f"different model")
            if tuple(t.shape) != tuple(p.shape):
                raise CheckpointError(f"parameter {name!r} has shape {list(t.shape)} in the state "
                                      f"dict but {list(p.shape)} here")
        self._extras = {}
        for name, t in extra_tensors(opt).items():
            if name not in model or tuple(model[name].shape) != tuple(t.shape):
                raise CheckpointError(f"model state dict lacks {name!r} of shape {list(t.shape)} "
                                      f"(buffer or frozen parameter)")
            self._extras[name] = model[name]
        self._opt = opt
        self._model = model
        self._shapes = {n: tuple(p.shape) for n, p in named.items()}
        self._by_name = _state_by_name(opt, optimizer) if optimizer is not None else None

    def group(self, target: ShardTarget) -> StagedGroup:
        names = group_params(self._opt, target.group)
        hyper = dict(self._opt.shard_state(target.group)["hyperparameters"])
        masters = fill_shard(target.ranges, target.shard_numel,
                             lambda n: self._model[n].float())
        if self._by_name is None:
            # Without optimizer state: a fresh start from the weights.
            return StagedGroup(flats={MASTER: masters}, param_scalars={n: {} for n in names},
                               stepped=frozenset(), hyperparameters=hyper)
        states, scalars, hyper = _group_from(self._by_name, names, self._shapes, target.group,
                                             hyper, target.ranges, target.shard_numel)
        stepped = frozenset(n for n in names if self._by_name["state"].get(n))
        return StagedGroup(flats={MASTER: masters, **states}, param_scalars=scalars,
                           stepped=stepped, hyperparameters=hyper)

    def model_extras(self) -> Mapping[str, torch.Tensor]:
        return self._extras

    def loss_scaler(self) -> None:
        return None

    def step_count(self) -> None:
        return None


def _state_by_name(opt: ShardedOptimizer, sd: dict[str, Any]) -> dict[str, Any]:
    """The optimizer state dict with positions replaced by parameter names."""
    if not isinstance(sd, dict) or "state" not in sd or "param_groups" not in sd:
        raise CheckpointError("optimizer state dict must have 'state' and 'param_groups'")
    order = [n for n, _ in opt.module.named_parameters()]

    def name_of(key: Any) -> str:
        if isinstance(key, str):
            return key
        if isinstance(key, int) and 0 <= key < len(order):
            return order[key]
        raise CheckpointError(f"optimizer state refers to parameter {key!r}, which is neither a "
                              f"name nor a position in module.parameters() (0..{len(order) - 1})")

    groups = [{**g, "params": [name_of(k) for k in g["params"]]} for g in sd["param_groups"]]
    return {"state": {name_of(k): v for k, v in sd["state"].items()}, "param_groups": groups}


def _group_from(sd: dict[str, Any], names: list[str], shapes: dict[str, tuple[int, ...]],
                group: str, hyper_now: dict[str, Any], ranges: Any,
                numel: int) -> tuple[dict, dict, dict]:
    """(shard state, scalars, hyperparameters) of one plan group from a by-name state dict."""
    holders = [g for g in sd["param_groups"] if set(names) & set(g["params"])]
    if not holders:
        raise CheckpointError(f"optimizer state dict has no param group with the parameters of "
                              f"group {group!r} (e.g. {names[0]!r})")
    hyper = {k: v for k, v in holders[0].items() if k != "params"}
    for h in holders[1:]:
        if {k: v for k, v in h.items() if k != "params"} != hyper:
            raise CheckpointError(f"parameters of group {group!r} are in optimizer param groups "
                                  f"with different options; evenzero has one set per group")
    if set(hyper) != set(hyper_now):
        raise CheckpointError(f"optimizer options {sorted(set(hyper) ^ set(hyper_now))} differ "
                              f"between the state dict and this optimizer (group {group!r})")
    per = {n: sd["state"].get(n, {}) for n in names}
    # As in torch, each parameter has its own state, and one never stepped has none.
    stepped = [n for n in names if per[n]]
    keys = frozenset(per[stepped[0]]) if stepped else frozenset()
    for n in stepped:
        if frozenset(per[n]) != keys:
            raise CheckpointError(f"optimizer state of {n!r} has keys {sorted(per[n])} but "
                                  f"{stepped[0]!r} has {sorted(keys)}; the state dict mixes "
                                  f"optimizers")
    states, scalars = {}, {n: {} for n in names}
    for key in sorted(keys):
        # Anything shaped like every parameter is per-element state, sharded like the
        # master (zeros for parameters never stepped); the rest is per-parameter scalars.
        if key != "step" and all(isinstance(per[n][key], torch.Tensor)
                                 and tuple(per[n][key].shape) == shapes[n] for n in stepped):
            states[key] = fill_shard(ranges, numel, lambda n, key=key: (
                per[n][key].float() if per[n] else torch.zeros(shapes[n])))
            continue
        for n in stepped:
            scalars[n][key] = _copy(per[n][key])
    return states, scalars, hyper


@dataclass(frozen=True)
class ConsolidatedCheckpoint:
    """A checkpoint read whole on one process (`read_consolidated`)."""

    params: dict[str, torch.Tensor]
    """Every trained parameter's fp32 master, whole and in its shape, in stored order."""
    extras: dict[str, torch.Tensor]
    """What rank 0 saved of the model besides them: buffers and frozen parameters."""
    user_state: Any
    """Rank 0's `extra` (None if it saved none)."""


def read_consolidated(path: str | os.PathLike) -> ConsolidatedCheckpoint:
    """Read the checkpoint at `path` (a `step-NNNNNN` or tag directory) whole, without an
    optimizer or a process group. Every file read is checked against its checksum first.
    Checkpoints with expert-parallel groups hold one set of experts per expert-parallel
    rank and are refused (`export_consolidated` in the job writes them)."""
    path = Path(path)
    manifest = checkpoint_files.read_manifest(path)
    experts = [g.name for g in manifest.groups if g.expert_parallel_size > 1]
    if experts:
        raise CheckpointError(f"{path}: expert-parallel groups {experts} keep one set of experts "
                              f"per expert-parallel rank; consolidate them with "
                              f"evenzero.checkpoint.export_consolidated in the job")
    records = {f.name: f for f in manifest.files}
    wanted = {s.file for p in manifest.params for s in p.ranges}
    if manifest.extras:
        wanted.add(EXTRA_FILE)
    for name in sorted(wanted):
        if name not in records:
            raise CheckpointError(f"{path / name}: not listed in the manifest")
        checkpoint_files.verify_file(path, records[name])
    user_state = read_user_state(path, manifest, 0) if manifest.user_state else None
    params: dict[str, torch.Tensor] = {}
    with checkpoint_files.RangeReader(path) as reader:
        stored = reader.read_all(EXTRA_FILE) if manifest.extras else {}
        extras = {t.name: stored[t.name] for t in manifest.extras if t.name in stored}
        for p in manifest.params:
            flat = torch.empty(p.numel, dtype=torch.float32)
            for s in p.ranges:
                flat[s.start:s.start + s.numel] = reader.read(
                    s.file, tensor_key(p.key, MASTER, s.start), 0, s.numel)
            params[p.name] = flat.view(p.shape)
    return ConsolidatedCheckpoint(params, extras, user_state)

