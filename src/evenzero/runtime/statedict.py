"""The optimizer's state, as torch exposes it and as `evenzero.checkpoint` reads it.

`ShardStateSide` is a mixin of `ZeroOptimizer`:

* `state_dict()` / `load_state_dict()`: torch's contract, holding this rank's shard
  (the format and its checks are `runtime/optstate.py`). Loading is a collective: every
  rank checks its state dict, the ranks agree (re-planning first to the arrival order
  the state was saved under), and either every rank loads or every rank raises the same
  `ZeroConfigError`.
* `shard_state()` / `load_shard_state()` and the other members of
  `evenzero.checkpoint.protocol.ShardedOptimizer`, through which the checkpoint package
  saves and reshards without knowing the optimizer's internals (and without either
  package importing the other).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from evenzero.runtime.checks import ZeroConfigError
from evenzero.runtime.maskedstep import split_state
from evenzero.runtime.optstate import (
    SECTION,
    RankIdentity,
    layout_fingerprint,
    mismatch,
    pack,
    saved_identity,
)
from evenzero.runtime.setup import make_plan
from evenzero.runtime.shards import GroupState

if TYPE_CHECKING:
    from evenzero.runtime.optimizer import ZeroOptimizer

MASTER = "master"


class ShardStateSide:
    """State dicts and the checkpoint protocol; mixed into `ZeroOptimizer`."""

    # ------------------------------------------------------------------ torch's contract

    def state_dict(self: ZeroOptimizer) -> dict[str, Any]:
        """This rank's state: torch's `{"state", "param_groups"}` (per-parameter scalar
        state such as its own `step`, and the groups' hyperparameters) plus an "evenzero"
        section with the flat shards (fp32 masters and elementwise optimizer state),
        the step count, the loss scaler and what identifies the shard. Tensors are not
        copies, as in torch. It resumes this rank exactly at the same world size; for
        another world size use `evenzero.checkpoint`."""
        self._prefetch.wait_all()
        index, groups, start = {}, [], 0
        for group in self.param_groups:
            packed = {k: v for k, v in group.items() if k != "params"}
            packed["params"] = list(range(start, start + len(group["params"])))
            index.update({id(p): i for i, p in enumerate(group["params"], start)})
            start += len(group["params"])
            groups.append(packed)
        param_state = {}
        for g in self.groups:
            for name, scalars in self._stepper.param_state(g).items():
                if scalars:
                    param_state[index[id(self.params[name])]] = scalars
        shards = {g: dict(self.shard_state(g)["flats"]) for g in self.groups}
        out = pack(groups, param_state, shards, self._identity(), self.step_count,
                   self.loss_scaler.state_dict())
        out[SECTION]["arrival_measured"] = self._hooks.arrival is None
        # Which parameters were stepped: an optimizer without scalar state (SGD with
        # momentum) saves `{}` for them, as for one never stepped.
        out[SECTION]["stepped"] = {g: sorted(self._stepper.stepped(g)) for g in self.groups}
        return out

    def load_state_dict(self: ZeroOptimizer, state_dict: Mapping[str, Any]) -> None:
        """Load what `state_dict()` returned on this rank (a collective: every rank loads
        its own, or every rank raises the same error). As in torch, the saved groups
        replace the current ones whole, so keys a scheduler added do not matter."""
        self._prefetch.wait_all()
        saved = saved_identity(state_dict)
        sizes = [len(g["params"]) for g in self.param_groups]
        problem = saved if isinstance(saved, str) else mismatch(
            state_dict, dataclasses.replace(self._identity(), layout=saved.layout), sizes)
        arrival = None if problem else (tuple(saved.arrival), saved.bucket_numel)
        arrivals = self._agree_load(problem, arrival)
        order, numel = arrivals[0]
        # An "auto" bucket size becomes the saved one: the shards are laid out for it.
        adopt = self.config.auto_bucket and numel is not None
        if order != self.plan.arrival or adopt:
            self.spec = self.spec.with_arrival(order, "measured")
            plan = make_plan(self.spec, self.world_size, self.config, self._setup.group_sizes,
                             self._setup.device, bucket_numel=numel if adopt else None,
                             note=f"bucket_numel auto: {numel:,} elements, the loaded state "
                                  f"dict's" if adopt else None)
            if adopt:
                self._stop_refining()
            if plan != self.plan:
                self._install(plan, previous=self.plan)
        problem = mismatch(state_dict, self._identity(), sizes) or self._check_shards(state_dict)
        self._agree_load(problem, arrivals[0])
        self._apply_state_dict(state_dict)

    def _identity(self: ZeroOptimizer) -> RankIdentity:
        return RankIdentity(self.world_size, self.rank, layout_fingerprint(self.plan),
                            self.plan.arrival, self.plan.bucket_numel)

    def _agree_load(self: ZeroOptimizer, problem: str | None,
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

    def _check_shards(self: ZeroOptimizer, state_dict: Mapping[str, Any]) -> str | None:
        shards = state_dict[SECTION].get("shards", {})
        for g, st in self.groups.items():
            flats = shards.get(g)
            if not isinstance(flats, Mapping) or MASTER not in flats:
                return f"it has no shard for parameter group {g!r}"
            for key, t in flats.items():
                if not isinstance(t, torch.Tensor) or tuple(t.shape) != tuple(st.master.shape):
                    return (f"its {key!r} shard of group {g!r} is not a tensor of shape "
                            f"{list(st.master.shape)}")
        return None

    def _apply_state_dict(self: ZeroOptimizer, state_dict: Mapping[str, Any]) -> None:
        sec = state_dict[SECTION]
        by_index = {}
        for group, saved in zip(self.param_groups, state_dict["param_groups"], strict=True):
            by_index.update(zip(saved["params"], group["params"], strict=True))
        name_of = {id(p): n for n, p in self.params.items()}
        per_param = {name_of[id(by_index[i])]: s for i, s in state_dict["state"].items()
                     if i in by_index and id(by_index[i]) in name_of}
        hyper = [{k: v for k, v in saved.items() if k != "params"}
                 for saved in state_dict["param_groups"]]
        shards = {g: {"flats": sec["shards"][g],
                      "param_scalars": {n: per_param.get(n, {}) for n in self._runs[g].names},
                      "stepped": sec.get("stepped", {}).get(g, ()),
                      "hyperparameters": hyper[i]}
                  for i, g in enumerate(t.name for t in self._setup.groups)}
        self._write_shards(shards, replace_groups=True)
        self.step_count = int(sec["step_count"])
        if sec.get("loss_scaler") is not None:
            self.loss_scaler.load_state_dict(sec["loss_scaler"])
        if sec.get("arrival_measured") and self._hooks.arrival is not None:
            self._hooks.take_arrival()
            self._life.measuring = self._refine.pending
        self.sync_params_from_master()

    # ------------------------------------------------------------------ checkpoint protocol

    @property
    def inner_optimizer_class(self: ZeroOptimizer) -> type[torch.optim.Optimizer]:
        """The torch optimizer class stepping the flat shards."""
        return type(self._inner)

    @property
    def control_device(self: ZeroOptimizer) -> torch.device:
        """Where small agreement tensors live (the CUDA device under NCCL, else the CPU)."""
        return self._setup.control_device

    def shard_state(self: ZeroOptimizer, group: str) -> dict[str, Any]:
        """`evenzero.checkpoint.protocol.GroupShard` of plan group `group` on this rank."""
        st = self._group(group)
        flats, _ = split_state(self._inner.state.get(st.master, {}), st.master.numel())
        user = self.param_groups[[g.name for g in self._setup.groups].index(group)]
        return {"flats": {MASTER: st.master, **{k: flats[k] for k in sorted(flats)}},
                "param_scalars": self._stepper.param_state(group),
                "stepped": sorted(self._stepper.stepped(group)),
                "hyperparameters": {k: v for k, v in user.items() if k != "params"}}

    def loss_scaler_state(self: ZeroOptimizer) -> dict[str, Any]:
        return self.loss_scaler.state_dict()

    def check_loss_scaler_state(self: ZeroOptimizer, state: Mapping[str, Any]) -> None:
        """Raise ValueError (or KeyError, TypeError) if `state` would not load."""
        copy.deepcopy(self.loss_scaler).load_state_dict(dict(state))

    def load_shard_state(self: ZeroOptimizer, shards: Mapping[str, Mapping[str, Any]],
                         step_count: int | None, loss_scaler: Mapping[str, Any] | None) -> None:
        """Write every group's shard state (already resharded to this rank's runs), the
        step count and the loss scaler; then re-gather the parameters from the masters.
        Saved hyperparameters win; keys only the running groups hold are kept."""
        self._prefetch.wait_all()
        self._write_shards(shards, replace_groups=False)
        if step_count is not None:
            self.step_count = int(step_count)
        if loss_scaler is not None:
            self.loss_scaler.load_state_dict(dict(loss_scaler))
        self.sync_params_from_master()

    def _write_shards(self: ZeroOptimizer, shards: Mapping[str, Mapping[str, Any]],
                      replace_groups: bool) -> None:
        with torch.no_grad():
            for i, g in enumerate(t.name for t in self._setup.groups):
                st, shard = self.groups[g], shards[g]
                flats = dict(shard["flats"])
                st.master.copy_(flats.pop(MASTER))
                state = self._inner.state[st.master]
                state.clear()
                state.update({k: v.detach().to(st.master.device, torch.float32).clone()
                              for k, v in flats.items()})
                scalars = shard["param_scalars"]
                self._stepper.load_param_state(g, {n: scalars.get(n, {})
                                                   for n in self._runs[g].names},
                                               shard.get("stepped", ()))
                user = self.param_groups[i]
                saved = copy.deepcopy(dict(shard["hyperparameters"]))
                kept = {} if replace_groups else {k: v for k, v in user.items() if k not in saved}
                self.param_groups[i] = {**saved, **kept, "params": user["params"]}

    # ------------------------------------------------------------------ shards

    def master_shard(self: ZeroOptimizer, group: str) -> torch.Tensor:
        """This rank's flat master shard of `group` (padding included, zeros)."""
        return self._group(group).master

    @torch.no_grad()
    def step_masters_on_zero_grads(self: ZeroOptimizer) -> None:
        """Step every parameter once on zero gradients (DeepSpeed's stage-0 mixed-precision
        wrappers do this when built; `evenzero.deepspeed` follows them), then gather the
        parameters from the masters. DeepSpeed leaves its bf16 weights alone until the
        first real step; here they follow the masters at once, because a parameter that
        differs from its master is a user's write (runtime/paramwrites.py) and would
        undo the step. They differ by at most one bf16 ulp, where the step crossed one."""
        grads = {name: torch.zeros_like(st.master) for name, st in self.groups.items()}
        self._stepper.step(grads, set(self._names), set(self.groups))
        self._stepped_outside_step = True  # step_count stays 0, as in DeepSpeed
        self.sync_params_from_master()

    def group_rank(self: ZeroOptimizer, group: str) -> int:
        return self._group(group).rank

    def process_group(self: ZeroOptimizer, group: str) -> Any:
        return self._group(group).process_group

    def sync_params_from_master(self: ZeroOptimizer) -> None:
        """Re-gather the model parameters from the master shards (after loading them);
        returns with every parameter gathered."""
        with torch.no_grad():
            self._prefetch.wait_all()
            self._flat.repoint_moved()
            self._prefetch.launch(None, overlap=False)

    def _group(self: ZeroOptimizer, name: str) -> GroupState:
        if name not in self.groups:
            raise KeyError(f"no parameter group {name!r}; groups are {list(self.groups)}")
        return self.groups[name]
