"""What `ZeroOptimizer.state_dict()` holds on one rank, and what must match to load it.

torch's shape, so code that handles optimizer state dicts (torch.save, Hugging Face's
Trainer, Lightning) handles this one, plus one section only evenzero reads:

    {"state": {i: {"step": tensor(k), ...}},    # per parameter, scalar state only
     "param_groups": [{"lr": ..., "betas": ..., ..., "params": [i, ...]}],
     "evenzero": {
         "format": 1,
         "world_size": W, "rank": r,            # this state belongs to rank r of W
         "layout": "3f9c...",                   # fingerprint of the plan's shard layout
         "arrival": [names],                    # gradient-arrival order the plan was made for
         "bucket_numel": B,                     # bucket size the plan was cut with
         "step_count": n, "loss_scaler": {...},
         "stepped": {group: [names]},           # parameters stepped at least once
         "shards": {group: {"master": fp32 shard, "exp_avg": shard, ...}}}}

* `state[i]` is the scalar state of parameter `i` (numbered as torch numbers them: in
  `param_groups` order) that has elements in this rank's shard: its own `step` (it
  does not advance on steps where the parameter had no gradient, as in torch) and any
  other non-elementwise state of the optimizer. The elementwise state (`exp_avg`, ...)
  is not split per parameter: it lives flat, with the fp32 master weights, in
  `evenzero.shards`, exactly as this rank owns it.
* `param_groups` are the user's groups with their current hyperparameters; loading
  replaces them wholesale, as torch does, so keys a scheduler added (`initial_lr`) or
  did not add yet never make a state dict "different".

A rank's state dict resumes that rank exactly, at the same world size, plan and rank.
Anything else (another world size, bucket size, model) goes through
`evenzero.checkpoint`, which stores runs by parameter name and reshards.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from evenzero.plan import Plan

FORMAT = 1
SECTION = "evenzero"
RESHARD_HINT = ("save and load it with evenzero.checkpoint.save(opt, dir) / "
                "evenzero.checkpoint.load(opt, dir), which reshard to any world size")


def layout_fingerprint(plan: Plan) -> str:
    """A short hash of everything a rank's shard layout depends on."""
    text = repr((plan.strategy, plan.world_size, plan.groups, plan.layouts))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class RankIdentity:
    """Which shard a rank's state belongs to."""

    world_size: int
    rank: int
    """Rank in the optimizer's data-parallel world group."""
    layout: str
    """`layout_fingerprint` of the executed plan."""
    arrival: tuple[str, ...]
    """The arrival order that plan was made for (a loader re-plans with it first)."""
    bucket_numel: int | None = None
    """The bucket size that plan was cut with (a loader whose size is "auto" adopts it)."""


def pack(param_groups: Sequence[Mapping[str, Any]], param_state: Mapping[int, Mapping[str, Any]],
         shards: Mapping[str, Mapping[str, torch.Tensor]], who: RankIdentity, step_count: int,
         loss_scaler: Mapping[str, Any] | None) -> dict[str, Any]:
    """A rank's state dict; `param_groups` are already packed (`params` as indices)."""
    return {
        "state": {i: dict(s) for i, s in param_state.items()},
        "param_groups": [dict(g) for g in param_groups],
        SECTION: {"format": FORMAT, "world_size": who.world_size, "rank": who.rank,
                  "layout": who.layout, "arrival": list(who.arrival),
                  "bucket_numel": who.bucket_numel,
                  "step_count": int(step_count),
                  "loss_scaler": dict(loss_scaler) if loss_scaler is not None else None,
                  "shards": {g: dict(t) for g, t in shards.items()}},
    }


def saved_identity(state_dict: Any) -> RankIdentity | str:
    """Who saved it, or why it is not a ZeroOptimizer rank state dict."""
    if not isinstance(state_dict, Mapping) or "param_groups" not in state_dict:
        return "it is not an optimizer state dict (no 'param_groups')"
    sec = state_dict.get(SECTION)
    if not isinstance(sec, Mapping):
        return ("it has no 'evenzero' section: it comes from a plain torch optimizer, not from "
                "ZeroOptimizer.state_dict(); to start from a torch model and optimizer state, "
                "use evenzero.checkpoint.import_consolidated(opt, path)")
    if sec.get("format") != FORMAT:
        return (f"its evenzero format is {sec.get('format')!r}, this version reads {FORMAT}; "
                f"{RESHARD_HINT}")
    try:
        numel = sec.get("bucket_numel")
        return RankIdentity(int(sec["world_size"]), int(sec["rank"]), str(sec["layout"]),
                            tuple(sec["arrival"]), None if numel is None else int(numel))
    except (KeyError, TypeError, ValueError) as e:
        return f"its evenzero section is damaged ({e!r})"


def mismatch(state_dict: Any, here: RankIdentity, group_sizes: Sequence[int]) -> str | None:
    """Why `state_dict` cannot be loaded into this rank as it is, or None."""
    saved = saved_identity(state_dict)
    if isinstance(saved, str):
        return saved
    if saved.world_size != here.world_size:
        return (f"it was saved at world size {saved.world_size}, this run has "
                f"{here.world_size}; a ZeroOptimizer state dict holds one rank's shard, so "
                f"{RESHARD_HINT}")
    if saved.rank != here.rank:
        return (f"it was saved by rank {saved.rank} and this is rank {here.rank}; each rank "
                f"must load its own state dict (e.g. a file named by rank)")
    if saved.layout != here.layout:
        return (f"it was saved under a different shard layout (model, bucket_numel, "
                f"alignment, strategy or parameter groups differ); {RESHARD_HINT}")
    groups = state_dict["param_groups"]
    if [len(g.get("params", ())) for g in groups] != list(group_sizes):
        return (f"its parameter groups hold {[len(g.get('params', ())) for g in groups]} "
                f"parameters, this optimizer's hold {list(group_sizes)}")
    return None
