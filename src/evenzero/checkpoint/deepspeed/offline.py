"""Converting a DeepSpeed ZeRO-1/2 checkpoint to an evenzero one offline: on one process,
without DeepSpeed or torch.distributed (`evenzero convert-deepspeed`).

    convert_deepspeed("ds_ckpt/", "ez_ckpt/", tag="global_step40", optimizer="AdamW")

writes `OUT_DIR/step-<global_steps>/` in evenzero's sharded format (loadable with
`evenzero.checkpoint.load` at any world size) and `OUT_DIR/deepspeed.json`: the tag,
counters, LR scheduler state, loss scaler, clip value, ds_config and the JSON-storable
client state.

The conversion builds `OfflineRun`, a stand-in for a one-rank `ZeroOptimizer` (the
saved model as a module, an evenzero plan for one rank, the master shards and optimizer
state as plain tensors, the loss scale), fills it through the same `DeepSpeedSource`
and `stage()` that `load_deepspeed` uses, and saves it with `evenzero.checkpoint.save`,
so the output is whatever that writes. Optimizer groups are named as `ZeroOptimizer`
names param groups ("dense", then "group1", ... or the group's "name"); load it into a
`ZeroOptimizer` built with the same groups and optimizer.
"""

from __future__ import annotations

import copy
import json
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from evenzero.checkpoint.deepspeed.load import DeepSpeedSource
from evenzero.checkpoint.deepspeed.optim_state import saved_decoupled
from evenzero.checkpoint.deepspeed.reader import DeepSpeedFiles, FlatGroup, read_deepspeed
from evenzero.checkpoint.format import MASTER, CheckpointError
from evenzero.checkpoint.protocol import GroupShard, PlanChoices
from evenzero.checkpoint.staging import apply, stage
from evenzero.checkpoint.state import RankPlace
from evenzero.spec import GroupSpec, ModelSpec, ParamSpec
from evenzero.strategies.evenzero import plan_evenzero

SUMMARY_FILE = "deepspeed.json"


class OfflineRun:
    """A one-rank stand-in for `ZeroOptimizer` without a process group: a
    `evenzero.checkpoint.protocol.ShardedOptimizer` over plain tensors, which the
    DeepSpeed staging fills and `evenzero.checkpoint.save` writes."""

    def __init__(self, files: DeepSpeedFiles, optimizer_class: type[torch.optim.Optimizer]
                 ) -> None:
        self._module = _module_from(files)
        names = [group_name(g) for g in files.groups]
        dtype = {n: str(p.dtype).removeprefix("torch.") for n, p in self.module.named_parameters()}
        spec = ModelSpec(tuple(ParamSpec(n, shape, names[g.index], dtype[n])
                               for g in files.groups for n, shape in g.params),
                         tuple(GroupSpec(n) for n in names), None, "reverse-registration",
                         "deepspeed-checkpoint")
        self.plan = plan_evenzero(spec, 1)
        self.world_group = None
        self.control_device = torch.device("cpu")
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
    def module(self) -> nn.Module:
        return self._module

    @property
    def inner_optimizer_class(self) -> type[torch.optim.Optimizer]:
        return self._optimizer_class

    def process_group(self, group: str) -> Any:
        return None

    def group_rank(self, group: str) -> int:
        return 0

    def shard_state(self, group: str) -> GroupShard:
        return {"flats": self._flats[group], "param_scalars": self._scalars[group],
                "hyperparameters": self._options[group], "stepped": self._stepped[group]}

    def loss_scaler_state(self) -> dict[str, Any] | None:
        return None if self.loss_scaler is None else self.loss_scaler.state_dict()

    def check_loss_scaler_state(self, state: Mapping[str, Any]) -> None:
        if self.loss_scaler is not None:
            copy.deepcopy(self.loss_scaler).load_state_dict(dict(state))

    def plan_choices(self) -> PlanChoices:
        # Nothing measured: a load of the converted checkpoint plans for its own run.
        return {"bucket_numel": None, "arrival": None}

    def adopt_plan_choices(self, choices: PlanChoices) -> None:
        """Nothing to adopt: the stand-in runs no backward and cuts no buckets of its own."""

    def load_shard_state(self, shards: Mapping[str, GroupShard], step_count: int | None,
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
        params = dict(self._module.named_parameters())
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


@dataclass(frozen=True)
class ScaleSettings:
    """A dynamic loss scale's schedule (`protocol.ScaleSchedule`), as DeepSpeed saved it."""

    growth_interval: int = 1000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 1.0


class OfflineLossScale:
    """The loss scale a resumed fp16 run continues with (`protocol.LossScaling`): the
    state of evenzero's `LossScaler`, in its `state_dict()` format, which a
    `ZeroOptimizer` built with the matching `loss_scale` loads."""

    enabled = True

    def __init__(self, scale: float, dynamic: bool, config: ScaleSettings) -> None:
        self.scale = scale
        self.dynamic = dynamic
        self.config = config
        self.good_steps = 0
        self.overflows = 0

    def state_dict(self) -> dict[str, Any]:
        return {"enabled": True, "dynamic": self.dynamic, "scale": self.scale,
                "good_steps": self.good_steps, "overflows": self.overflows}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state.get("enabled"):
            raise ValueError("loss scaler state is of a run without loss scaling")
        self.scale = float(state["scale"])
        self.good_steps = int(state["good_steps"])
        self.overflows = int(state.get("overflows", 0))


def _loss_scaler(saved: Mapping[str, Any] | None) -> OfflineLossScale | None:
    """The scale of a DeepSpeed fp16 run (None for bf16/fp32: nothing to carry)."""
    if not saved or (not saved.get("dynamic") and float(saved.get("cur_scale", 1.0)) == 1.0):
        return None
    if not saved.get("dynamic"):
        return OfflineLossScale(float(saved["cur_scale"]), False, ScaleSettings())
    factor = float(saved["scale_factor"])
    return OfflineLossScale(float(saved["cur_scale"]), True, ScaleSettings(
        growth_interval=int(saved["scale_window"]), growth_factor=factor,
        backoff_factor=1.0 / factor, min_scale=float(saved["min_scale"])))


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
    apply(run, stage(run, RankPlace.of(run), DeepSpeedSource(run, files, optimizer_states=True)))
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


__all__ = ["OfflineRun", "convert_deepspeed", "group_name", "optimizer_class_for"]
