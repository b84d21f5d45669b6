"""The optimizer's state, as torch exposes it and as `evenzero.checkpoint` reads it.

`StateDictIO` is the optimizer's part that does it, reading and writing each group's
sharded state only through its `GroupShard` (via the engine):

* `state_dict()` / `load_state_dict()`: torch's contract, holding this rank's shard
  (the format and its checks are `runtime/optstate.py`). Loading is a collective: every
  rank checks its state dict, the ranks agree (re-planning first to the arrival order
  the state was saved under), and either every rank loads or every rank raises the same
  `ZeroConfigError`.
* `shard_state()` / `load_shard_state()` and the other members of
  `evenzero.checkpoint.protocol.ShardedOptimizer`, through which the checkpoint package
  saves and reshards without knowing the optimizer's internals (and without either
  package importing the other);
* `adopt_plan()`: the one way a saved run's arrival order and bucket size become this
  run's, for a state dict and for a checkpoint's `PlanChoices` alike.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping, MutableSequence, Sequence
from typing import Any

import torch
import torch.distributed as dist

from evenzero.runtime.backward import BackwardDriver
from evenzero.runtime.checks import ZeroConfigError
from evenzero.runtime.engine import ShardEngine
from evenzero.runtime.optstate import (
    SECTION,
    RankIdentity,
    layout_fingerprint,
    mismatch,
    pack,
    saved_identity,
)
from evenzero.runtime.planholder import PlanHolder
from evenzero.runtime.precision import ScalerSlot
from evenzero.runtime.shards import GroupShard

MASTER = "master"

ParamGroups = MutableSequence[dict[str, Any]]
"""The torch face's `param_groups` (the user's groups), read and replaced in place."""


class StateDictIO:
    """State dicts and the checkpoint protocol of one optimizer."""

    def __init__(self, plans: PlanHolder, engine: ShardEngine, backward: BackwardDriver,
                 scaler: ScalerSlot, params: Mapping[str, torch.nn.Parameter],
                 world_group: Any, world_size: int, rank: int) -> None:
        self.plans, self.engine, self.backward, self.scaler = plans, engine, backward, scaler
        self.params = params
        self.world_group, self.world_size, self.rank = world_group, world_size, rank

    # ------------------------------------------------------------------ torch's contract

    def state_dict(self, param_groups: ParamGroups, step_count: int) -> dict[str, Any]:
        """This rank's state: torch's `{"state", "param_groups"}` (per-parameter scalar
        state such as its own `step`, and the groups' hyperparameters) plus an "evenzero"
        section with the flat shards (master weights and elementwise optimizer state),
        the step count, the loss scaler and what identifies the shard. The optimizer
        state tensors are not copies, as in torch; the masters of groups whose masters
        are the parameters' own memory are (their pieces are not one tensor). It resumes
        this rank exactly at the same world size; for another world size use
        `evenzero.checkpoint`."""
        self.engine.gathers.wait()
        index, groups, start = {}, [], 0
        for group in param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(start, start + len(group["params"])))
            index.update({id(p): i for i, p in enumerate(group["params"], start)})
            start += len(group["params"])
            groups.append(packed)
        param_state = {}
        for shard in self.engine.groups.values():
            # A whole-tensor optimizer's parameters are owned whole, so their state shows
            # as torch keeps it (Muon's momentum_buffer, of the parameter's shape; views
            # of the flat state, as in torch no copies) on the rank that owns them.
            shaped = shard.stepper.tensor_state() if shard.whole_shapes is not None else {}
            for name, scalars in shard.stepper.param_state().items():
                if scalars or shaped.get(name):
                    param_state[index[id(self.params[name])]] = {**scalars, **shaped.get(name, {})}
        shards = {g: dict(self.shard_state(g, param_groups)["flats"]) for g in self.engine.groups}
        out = pack(groups, param_state, shards, self._identity(), step_count,
                   self.scaler.scaler.state_dict())
        out[SECTION]["arrival_measured"] = self.backward.arrival_measured
        # Which parameters were stepped: an optimizer without scalar state (SGD with
        # momentum) saves `{}` for them, as for one never stepped.
        out[SECTION]["stepped"] = {g: sorted(s.stepper.stepped())
                                   for g, s in self.engine.groups.items()}
        return out

    def load_state_dict(self, state_dict: Mapping[str, Any], param_groups: ParamGroups) -> int:
        """Load what `state_dict()` returned on this rank (a collective: every rank loads
        its own, or every rank raises the same error). As in torch, the saved groups
        replace the current ones whole, so keys a scheduler added do not matter. Returns
        the saved step count."""
        self.engine.gathers.wait()
        saved = saved_identity(state_dict)
        sizes = [len(g["params"]) for g in param_groups]
        problem = saved if isinstance(saved, str) else mismatch(
            state_dict, dataclasses.replace(self._identity(), layout=saved.layout), sizes)
        arrival = None if problem else (tuple(saved.arrival), saved.bucket_numel)
        arrivals = self._agree_load(problem, arrival)
        order, numel = arrivals[0]
        # An "auto" bucket size becomes the saved one: the shards are laid out for it.
        self.adopt_plan(order, numel, "the loaded state dict's")
        problem = mismatch(state_dict, self._identity(), sizes) or self._check_shards(state_dict)
        self._agree_load(problem, arrivals[0])
        return self._apply_state_dict(state_dict, param_groups)

    def adopt_plan(self, arrival: Sequence[str] | None, bucket_numel: int | None,
                   source: str) -> None:
        """Re-plan for a saved run's arrival order (None: keep this plan's) and bucket
        size: an "auto" one becomes `bucket_numel` and is no longer refined; a fixed one,
        or None, is kept. `source` names where they come from, in the plan's note.
        Collective where the executed plan changes: every rank calls it alike."""
        order = None if arrival is None else tuple(arrival)
        adopt = self.plans.config.auto_bucket and bucket_numel is not None
        if not adopt and (order is None or order == self.plans.plan.arrival):
            return
        self.engine.gathers.wait()
        if adopt:
            self.backward.stop_refining()
        self.plans.replan(arrival=order, bucket_numel=bucket_numel if adopt else None,
                          note=f"bucket_numel auto: {bucket_numel:,} elements, {source}"
                          if adopt else None)

    def _identity(self) -> RankIdentity:
        plan = self.plans.plan
        return RankIdentity(self.world_size, self.rank, layout_fingerprint(plan),
                            plan.arrival, plan.bucket_numel)

    def _agree_load(self, problem: str | None,
                    arrival: tuple[str, ...] | None) -> list[tuple[str, ...]]:
        """Every rank's (problem, arrival); raises the same error everywhere if any rank
        has a problem or the ranks loaded state dicts of different plans."""
        every: list = [None] * self.world_size
        dist.all_gather_object(every, (problem, arrival), group=self.world_group)
        for rank, (theirs, _) in enumerate(every):
            if theirs:
                raise ZeroConfigError(f"load_state_dict: rank {rank} cannot load its state dict: "
                                      f"{theirs}")
        arrivals = [a for _, a in every]
        if any(a != arrivals[0] for a in arrivals):
            raise ZeroConfigError("load_state_dict: the ranks' state dicts were saved under "
                                  "different plans (arrival orders or bucket sizes); load the "
                                  "files one run saved, each rank its own")
        return arrivals

    def _check_shards(self, state_dict: Mapping[str, Any]) -> str | None:
        shards = state_dict[SECTION].get("shards", {})
        for g, shard in self.engine.groups.items():
            flats = shards.get(g)
            if not isinstance(flats, Mapping) or MASTER not in flats:
                return f"it has no shard for parameter group {g!r}"
            for key, t in flats.items():
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != (shard.numel,):
                    return (f"its {key!r} shard of group {g!r} is not a tensor of shape "
                            f"{[shard.numel]}")
        return None

    def _apply_state_dict(self, state_dict: Mapping[str, Any], param_groups: ParamGroups) -> int:
        sec = state_dict[SECTION]
        by_index = {}
        for group, saved in zip(param_groups, state_dict["param_groups"], strict=True):
            by_index.update(zip(saved["params"], group["params"], strict=True))
        name_of = {id(p): n for n, p in self.params.items()}
        per_param = {name_of[id(by_index[i])]: s for i, s in state_dict["state"].items()
                     if i in by_index and id(by_index[i]) in name_of}
        hyper = [{k: v for k, v in saved.items() if k != "params"}
                 for saved in state_dict["param_groups"]]
        shards = {g: {"flats": sec["shards"][g],
                      "param_scalars": {n: per_param.get(n, {}) for n in shard.runs.names},
                      "stepped": sec.get("stepped", {}).get(g, ()),
                      "hyperparameters": hyper[i]}
                  for i, (g, shard) in enumerate(self.engine.groups.items())}
        self._write_shards(shards, param_groups, replace_groups=True)
        if sec.get("loss_scaler") is not None:
            self.scaler.scaler.load_state_dict(sec["loss_scaler"])
        if sec.get("arrival_measured"):
            self.backward.adopt_measured_arrival()
        self.engine.publish_all()
        return int(sec["step_count"])

    # ------------------------------------------------------------------ checkpoint protocol

    def shard_state(self, group: str, param_groups: ParamGroups) -> dict[str, Any]:
        """`evenzero.checkpoint.protocol.GroupShard` of plan group `group` on this rank."""
        shard = self.group(group)
        flats = shard.state_flats()
        user = param_groups[list(self.engine.groups).index(group)]
        return {"flats": {MASTER: shard.master_values(), **{k: flats[k] for k in sorted(flats)}},
                "param_scalars": shard.stepper.param_state(),
                "stepped": sorted(shard.stepper.stepped()),
                "hyperparameters": {k: v for k, v in user.items() if k != "params"}}

    def load_shard_state(self, shards: Mapping[str, Mapping[str, Any]],
                         loss_scaler: Mapping[str, Any] | None, param_groups: ParamGroups) -> None:
        """Write every group's shard state (already resharded to this rank's runs) and the
        loss scaler's (None: keep); then re-gather the parameters from the masters. Saved
        hyperparameters win; keys only the running groups hold are kept."""
        self.engine.gathers.wait()
        self._write_shards(shards, param_groups, replace_groups=False)
        if loss_scaler is not None:
            self.scaler.scaler.load_state_dict(dict(loss_scaler))
        self.engine.publish_all()

    def _write_shards(self, shards: Mapping[str, Mapping[str, Any]], param_groups: ParamGroups,
                      replace_groups: bool) -> None:
        for i, g in enumerate(self.engine.groups):
            shard = shards[g]
            flats = dict(shard["flats"])
            self.engine.load_group(g, flats.pop(MASTER), flats, shard["param_scalars"],
                                   shard.get("stepped", ()))
            user = param_groups[i]
            saved = copy.deepcopy(dict(shard["hyperparameters"]))
            kept = {} if replace_groups else {k: v for k, v in user.items() if k not in saved}
            param_groups[i] = {**saved, **kept, "params": user["params"]}

    def plan_choices(self) -> dict[str, Any]:
        """`evenzero.checkpoint.protocol.PlanChoices`: the bucket size once it is no
        longer refined, the arrival order once measured (or loaded)."""
        plan = self.plans.plan
        return {"bucket_numel": None if self.backward.refining else plan.bucket_numel,
                "arrival": plan.arrival if self.backward.arrival_measured else None}

    def adopt_plan_choices(self, choices: Mapping[str, Any]) -> None:
        """Take over a loaded checkpoint's `PlanChoices` (`adopt_plan`); its arrival
        order counts as measured, so none is measured here."""
        arrival = choices.get("arrival")
        self.adopt_plan(arrival, choices.get("bucket_numel"),
                        "the loaded checkpoint's (the saving run's choice, kept)")
        if arrival is not None:
            self.backward.adopt_measured_arrival()

    def group(self, name: str) -> GroupShard:
        """The shard of plan group `name`; KeyError naming the groups if there is none."""
        if name not in self.engine.groups:
            raise KeyError(f"no parameter group {name!r}; groups are {list(self.engine.groups)}")
        return self.engine.groups[name]
