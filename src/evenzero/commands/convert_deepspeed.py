"""`evenzero convert-deepspeed DS_DIR OUT_DIR`: a DeepSpeed ZeRO-1/2 checkpoint as an
evenzero checkpoint, on one process, without DeepSpeed or torch.distributed.

    evenzero convert-deepspeed ds_ckpt/ ez_ckpt/ [--tag global_step40] [--optimizer AdamW]

writes `OUT_DIR/step-<global_steps>/` in evenzero's sharded format (loadable with
`evenzero.checkpoint.load` at any world size) and `OUT_DIR/deepspeed.json`: the tag,
counters, LR scheduler state, loss scaler, clip value, ds_config and the JSON-storable
client state.

The conversion builds a stand-in for a one-rank `ZeroOptimizer` (`OfflineRun`: the
saved model as a module, an evenzero plan for one rank, the torch optimizer over the
master shards), fills it with the same staging code `load_deepspeed` uses, and saves it
with `evenzero.checkpoint.save`, so the output is whatever that writes. Optimizer groups
are named as `ZeroOptimizer` names param groups ("dense", then "group1", ... or the
group's "name"); load it into a `ZeroOptimizer` built with the same groups and optimizer.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from evenzero.checkpoint.deepspeed import stage_deepspeed
from evenzero.checkpoint.deepspeed_files import (
    LATEST,
    DeepSpeedFiles,
    is_deepspeed_checkpoint,
    read_deepspeed,
)
from evenzero.checkpoint.deepspeed_flat import FlatGroup
from evenzero.checkpoint.deepspeed_optim import saved_decoupled
from evenzero.checkpoint.format import MASTER, CheckpointError
from evenzero.checkpoint.state import RankPlace, apply

SUMMARY_FILE = "deepspeed.json"


class OfflineRun:
    """A one-rank stand-in for `ZeroOptimizer` without a process group: it offers the
    `evenzero.checkpoint.protocol.ShardedOptimizer` members that `save` and
    `load_deepspeed`'s staging use."""

    def __init__(self, files: DeepSpeedFiles, optimizer_class: type) -> None:
        from evenzero.spec import GroupSpec, ModelSpec, ParamSpec
        from evenzero.strategies.evenzero import plan_evenzero

        self.module = _module_from(files)
        names = [group_name(g) for g in files.groups]
        dtype = {n: str(p.dtype).removeprefix("torch.") for n, p in self.module.named_parameters()}
        spec = ModelSpec(tuple(ParamSpec(n, shape, names[g.index], dtype[n])
                               for g in files.groups for n, shape in g.params),
                         tuple(GroupSpec(n) for n in names), None, "reverse-registration",
                         "deepspeed-checkpoint")
        self.plan = plan_evenzero(spec, 1)
        self.world_group = None
        # The torch optimizer only supplies its class's default options per group.
        defaults = optimizer_class([{"params": [torch.zeros(1, requires_grad=True)]}])
        self.defaults = dict(defaults.defaults)
        self._options = {n: {k: v for k, v in defaults.param_groups[0].items() if k != "params"}
                         for n in names}
        self._optimizer_class = optimizer_class
        self._flats: dict[str, dict[str, torch.Tensor]] = {
            n: {MASTER: torch.zeros(self.plan.shard_numel(n), dtype=torch.float32)} for n in names}
        self._scalars: dict[str, dict[str, Any]] = {n: {} for n in names}
        self._stepped: dict[str, list[str]] = {n: [] for n in names}
        self.loss_scaler = _loss_scaler(files.loss_scaler)
        self.step_count = 0

    @property
    def inner_optimizer_class(self) -> type:
        return self._optimizer_class

    def process_group(self, group: str) -> Any:
        return None

    def group_rank(self, group: str) -> int:
        return 0

    def shard_state(self, group: str) -> dict[str, Any]:
        return {"flats": self._flats[group], "param_scalars": self._scalars[group],
                "hyperparameters": self._options[group], "stepped": self._stepped[group]}

    def loss_scaler_state(self) -> dict[str, Any] | None:
        return None if self.loss_scaler is None else self.loss_scaler.state_dict()

    def check_loss_scaler_state(self, state: Mapping[str, Any]) -> None:
        if self.loss_scaler is not None:
            copy.deepcopy(self.loss_scaler).load_state_dict(dict(state))

    def load_shard_state(self, shards: Mapping[str, Mapping[str, Any]], step_count: int | None,
                         loss_scaler: Mapping[str, Any] | None) -> None:
        for name, shard in shards.items():
            self._flats[name] = {k: v.detach().to(torch.float32).clone()
                                 for k, v in shard["flats"].items()}
            self._scalars[name] = copy.deepcopy(dict(shard["param_scalars"]))
            self._options[name] = {**self._options[name], **shard["hyperparameters"]}
            self._stepped[name] = sorted(shard.get("stepped", ()))
        if step_count is not None:
            self.step_count = int(step_count)
        if loss_scaler is not None and self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(dict(loss_scaler))
        params = dict(self.module.named_parameters())
        with torch.no_grad():
            for g in self.plan.groups:
                master = self._flats[g.name][MASTER]
                for r in self.plan.shard_ranges(g.name, 0):
                    flat = params[r.param].view(-1)
                    flat[r.start:r.start + r.numel] = master[r.shard_offset:r.shard_offset + r.numel]


def group_name(group: FlatGroup) -> str:
    """The name `ZeroOptimizer` gives the param group at this position."""
    name = (group.hyperparameters or {}).get("name")
    return str(name) if name else ("dense" if group.index == 0 else f"group{group.index}")


def _module_from(files: DeepSpeedFiles) -> nn.Module:
    """A module with the saved state dict's names: trained and frozen parameters,
    persistent buffers, and tied aliases sharing their source parameter."""
    root = nn.Module()
    buffers = set(files.states.get("buffer_names") or ())
    shared = files.shared

    def owner(name: str) -> tuple[nn.Module, str]:
        mod = root
        *path, leaf = name.split(".")
        for part in path:
            child = mod._modules.get(part)
            if child is None:
                child = nn.Module()
                mod.add_module(part, child)
            mod = child
        return mod, leaf

    fragments = files.states.get("frozen_param_fragments") or {}
    for name in [*files.module, *(n for n in fragments if n not in files.module)]:
        value = files.saved_tensor(name)
        if name in shared:
            continue
        mod, leaf = owner(name)
        tensor = value.detach().clone()
        if name in buffers:
            mod.register_buffer(leaf, tensor)
        else:
            mod.register_parameter(leaf, nn.Parameter(tensor, requires_grad=name in files.trainable))
    params = dict(root.named_parameters())
    for alias, source in shared.items():
        if source not in params:
            raise CheckpointError(f"{files.path}: shared_params ties {alias!r} to {source!r}, "
                                  f"which the saved module lacks; the file is damaged")
        mod, leaf = owner(alias)
        mod.register_parameter(leaf, params[source])
    return root


def _loss_scaler(saved: Mapping[str, Any] | None) -> Any:
    """evenzero's scaler for a DeepSpeed fp16 run (None for bf16/fp32: nothing to carry)."""
    from evenzero.runtime.precision import LossScaleConfig, LossScaler

    if not saved or (not saved.get("dynamic") and float(saved.get("cur_scale", 1.0)) == 1.0):
        return None
    if not saved.get("dynamic"):
        return LossScaler(True, LossScaleConfig(init_scale=float(saved["cur_scale"])), dynamic=False)
    factor = float(saved["scale_factor"])
    return LossScaler(True, LossScaleConfig(
        init_scale=float(saved["cur_scale"]), growth_factor=factor, backoff_factor=1.0 / factor,
        growth_interval=int(saved["scale_window"]), min_scale=float(saved["min_scale"])))


def optimizer_class_for(files: DeepSpeedFiles, name: str | None = None) -> type:
    """`name` (a torch.optim class), else the Adam flavour DeepSpeed ran."""
    if name is not None:
        cls = getattr(torch.optim, name, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)):
            raise CheckpointError(f"--optimizer {name!r} is not a torch.optim optimizer class "
                                  f"(e.g. AdamW, Adam)")
        return cls
    decoupled = saved_decoupled(files.groups[0], files.states.get("ds_config"))
    if decoupled is None:
        raise CheckpointError(f"{files.path}: the checkpoint does not say which optimizer "
                              f"DeepSpeed ran (a client optimizer); pass --optimizer, e.g. AdamW")
    return torch.optim.AdamW if decoupled else torch.optim.Adam


def convert_deepspeed(source: str | os.PathLike, out: str | os.PathLike, tag: str | None = None,
                      *, optimizer: str | None = None, allow: Any = ()) -> Path:
    """Write an evenzero checkpoint of a DeepSpeed ZeRO-1/2 one; returns its directory."""
    from evenzero.checkpoint import save

    if dist.is_available() and dist.is_initialized():
        raise CheckpointError("convert_deepspeed runs on one process without torch.distributed "
                              "(use `evenzero convert-deepspeed`); in a distributed job, use "
                              "load_deepspeed(opt, ...) instead")
    files = read_deepspeed(source, tag, allow=allow)
    run = OfflineRun(files, optimizer_class_for(files, optimizer))
    apply(run, stage_deepspeed(run, RankPlace.of(run), files, True))
    path = save(run, out, step=int(files.states.get("global_steps") or 0))
    summary, skipped = _summary(files)
    (Path(out) / SUMMARY_FILE).write_text(json.dumps(summary, indent=1))
    if skipped:
        print(f"note: client_state key(s) {skipped} are not JSON-storable and were left out of "
              f"{Path(out) / SUMMARY_FILE}", file=sys.stderr)
    return path


def _summary(files: DeepSpeedFiles) -> tuple[dict[str, Any], list[str]]:
    s = files.states
    engine = {"module", "optimizer", "param_shapes", "frozen_param_shapes",
              "frozen_param_fragments", "shared_params", "buffer_names", "lr_scheduler",
              "ds_config", "ds_version", "global_steps", "global_samples", "skipped_steps",
              "dp_world_size", "mp_world_size", "data_sampler", "random_ltd",
              "checkpoint_parallel_dimensions"}
    client, skipped = {}, []
    for key, value in s.items():
        if key in engine:
            continue
        try:
            client[key] = _json(value)
        except (TypeError, ValueError):
            skipped.append(key)
    scaler = {k: v for k, v in (files.loss_scaler or {}).items() if k != "dtype"}
    out = {"tag": files.tag, "global_steps": s.get("global_steps"),
           "global_samples": s.get("global_samples"), "skipped_steps": s.get("skipped_steps"),
           "lr_scheduler": _json(s.get("lr_scheduler")), "clip_grad": files.clip_grad,
           "loss_scaler": _json(scaler), "zero_stage": files.zero_stage,
           "dp_world_size": files.dp_world_size, "ds_version": s.get("ds_version"),
           "ds_config": _json(s.get("ds_config")), "client_state": client}
    return out, skipped


SMALL_TENSOR_NUMEL = 64
"""Tensors up to this size are written into the JSON summary as lists."""


def _json(value: Any) -> Any:
    """`value` as JSON data (small tensors as lists); TypeError if it has no JSON form."""
    def small(v: Any) -> Any:
        if isinstance(v, torch.Tensor) and v.numel() <= SMALL_TENSOR_NUMEL:
            return v.tolist()
        raise TypeError(f"{type(v).__name__} has no JSON form")

    return json.loads(json.dumps(value, default=small))


# --------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="DS_DIR",
                        help="DeepSpeed save_dir (with 'latest') or a tag directory")
    parser.add_argument("out", metavar="OUT_DIR", help="where to write the evenzero checkpoint")
    parser.add_argument("--tag", help="checkpoint tag to convert (default: the one in 'latest')")
    parser.add_argument("--optimizer", metavar="NAME",
                        help="torch.optim class the run continues with (default: AdamW or "
                             "Adam, as DeepSpeed ran)")


def main(args: argparse.Namespace) -> int:
    problem = source_problem(Path(args.source), args.tag)
    if problem is not None:
        print(f"evenzero convert-deepspeed: error: {problem}", file=sys.stderr)
        return 2
    try:
        path = convert_deepspeed(args.source, args.out, args.tag, optimizer=args.optimizer)
    except (CheckpointError, OSError) as e:
        print(f"evenzero convert-deepspeed: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} and {Path(args.out) / SUMMARY_FILE}")
    return 0


def source_problem(source: Path, tag: str | None) -> str | None:
    """What is wrong with DS_DIR in command-line terms, before the library reads it, or
    None: a path that does not exist, and a save_dir without `latest` and no --tag."""
    try:
        if not source.exists():
            return (f"DS_DIR {source}: does not exist; give the directory DeepSpeed's "
                    f"save_checkpoint wrote (it holds 'latest' and one directory per tag)")
        if not source.is_dir():
            return f"DS_DIR {source}: is not a directory"
        if tag is not None or (source / LATEST).is_file() or is_deepspeed_checkpoint(source):
            return None
        tags = sorted(p.name for p in source.iterdir() if p.is_dir())
    except OSError as e:
        return f"DS_DIR {source}: {e.strerror or type(e).__name__}"
    found = (f"directories here: {', '.join(tags[:8])}{', ...' if len(tags) > 8 else ''}"
             if tags else "it holds no directories; is it DeepSpeed's save_dir?")
    return (f"DS_DIR {source}: no '{LATEST}' file naming the checkpoint tag; pass --tag TAG "
            f"({found})")


__all__ = ["OfflineRun", "convert_deepspeed", "group_name", "source_problem"]
