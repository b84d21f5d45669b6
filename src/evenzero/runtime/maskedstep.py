"""Step flat shards as torch.optim steps separate parameters: absent ones untouched,
each parameter with its own step count.

torch.optim keeps state per parameter and skips a parameter whose `grad` is None: no
weight decay, no moment update, and its `step` does not advance (Adam-family bias
correction depends on it). evenzero's inner optimizer sees one flat master shard per
group instead, with one `step`. To keep torch's result for any elementwise optimizer,
the parameters of a shard are sorted into *classes* of identical scalar state
(`step`, NAdam's `mu_product`, ASGD's `eta`/`mu`, ..., or "never stepped"):

* fast path (every step in steady training): every parameter of the shard is present
  and all share one class -> one ordinary inner step;
* otherwise the largest present class steps the whole shard with its scalar state; every
  other present class steps a gathered copy of just its runs with its own scalar state;
  then the runs of absent parameters get back their master values and optimizer state,
  and the runs of the other classes get their own results.

Afterwards classes whose scalar state became equal merge again (SGD's parameters do
after their first step; an Adam parameter that missed a step stays one behind, as in
torch). The scalar state of a class is what `state_dict()` saves per parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from evenzero.runtime.shardruns import ShardRuns


@dataclass(eq=False)
class StateClass:
    """Scalar optimizer state shared by some parameters of one shard."""

    fresh: bool = True
    """Never stepped: the optimizer initialises its state lazily at the first step."""
    scalars: dict[str, Any] = field(default_factory=dict)
    """Non-shard-shaped state (`step`, ...), as the optimizer keeps it."""

    def key(self) -> tuple:
        return (self.fresh, tuple(sorted((k, _value_key(v)) for k, v in self.scalars.items())))


def _value_key(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return ("tensor", str(v.dtype), tuple(v.flatten().tolist()))
    return v


def _clone(v: Any) -> Any:
    return v.clone() if isinstance(v, torch.Tensor) else v


def split_state(state: Mapping[str, Any], numel: int) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(shard-shaped tensors, scalar state) of one optimizer state dict."""
    flats, scalars = {}, {}
    for k, v in state.items():
        if isinstance(v, torch.Tensor) and v.dim() == 1 and v.numel() == numel:
            flats[k] = v
        else:
            scalars[k] = v
    return flats, scalars


class MaskedStep:
    """Steps an optimizer whose groups each hold one flat master shard, per parameter."""

    def __init__(self, optimizer: torch.optim.Optimizer, masters: Mapping[str, torch.Tensor],
                 runs: Mapping[str, ShardRuns]) -> None:
        """`masters[g]` is the single parameter of one of `optimizer`'s groups;
        `runs[g]` says which of its elements belong to which model parameter."""
        self.optimizer, self.masters, self.runs = optimizer, dict(masters), dict(runs)
        self._group = {}
        for g, m in self.masters.items():
            found = [pg for pg in optimizer.param_groups if any(p is m for p in pg["params"])]
            if len(found) != 1 or len(found[0]["params"]) != 1:
                raise ValueError(f"master of group {g!r} must be the only parameter of exactly "
                                 f"one optimizer param group")
            self._group[g] = found[0]
        self.class_of: dict[str, dict[str, StateClass]] = {}
        self._aliased: dict[str, StateClass | None] = {}
        for g, r in self.runs.items():
            fresh = StateClass()
            self.class_of[g] = dict.fromkeys(r.names, fresh)
            self._aliased[g] = None

    # ------------------------------------------------------------------ stepping

    @torch.no_grad()
    def step(self, grads: Mapping[str, torch.Tensor], present: Iterable[str],
             active: Iterable[str] = ()) -> list[str]:
        """Step with `grads[g]` as each master's gradient, touching only parameters in
        `present`. Returns the groups in which something was stepped here. `active`
        names the groups stepped on some rank: one with nothing present on this rank
        still gets its optimizer-state tensors, so every rank of a group holds the same
        kinds of state (what checkpoints gather)."""
        present = set(present)
        fast, slow = [], []
        for g, r in self.runs.items():
            here = [n for n in r.names if n in present]
            if not here:
                if g in active:
                    self._materialize(g)
                continue
            classes = {id(self.class_of[g][n]) for n in here}
            (fast if len(classes) == 1 and len(here) == len(r.names) else slow).append(g)
        if fast:
            for g in fast:
                self._load(g, self.class_of[g][self.runs[g].names[0]])
            self._step_groups({g: (self.masters[g], grads[g]) for g in fast})
            for g in fast:
                self._store(g, self.class_of[g][self.runs[g].names[0]])
        for g in slow:
            self._step_slow(g, grads[g], present)
        return fast + slow

    def _step_groups(self, which: Mapping[str, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """One optimizer step in which only `which` (group -> (param, grad)) move; the
        param temporarily replaces the group's master when they differ."""
        saved = []
        for g, m in self.masters.items():
            pg = self._group[g]
            saved.append((pg, pg["params"], m.grad))
            m.grad = None
            if g in which:
                p, grad = which[g]
                pg["params"] = [p]
                p.grad = grad
        try:
            self.optimizer.step()
        finally:
            for pg, params, grad in saved:
                for p in pg["params"]:
                    p.grad = None
                pg["params"] = params
                params[0].grad = grad

    def _materialize(self, g: str) -> None:
        """Create group `g`'s state tensors without stepping anything: step a copy of
        the master with a zero gradient and empty state, then put the master back. The
        state's values belong to parameters that stay "never stepped" here."""
        m = self.masters[g]
        state = self.optimizer.state[m]
        if split_state(state, m.numel())[0]:
            return
        keep = m.detach().clone()
        state.clear()
        self._aliased[g] = None
        self._step_groups({g: (m, torch.zeros_like(m))})
        m.copy_(keep)
        for key in list(split_state(state, m.numel())[1]):
            del state[key]

    def _load(self, g: str, cls: StateClass) -> None:
        """Make `cls` the scalar state the optimizer sees for group `g`'s master."""
        if self._aliased[g] is cls:
            return
        m = self.masters[g]
        state = self.optimizer.state[m]
        flats, scalars = split_state(state, m.numel())
        state.clear()
        if not cls.fresh:
            state.update(flats)
            state.update({k: _clone(v) for k, v in cls.scalars.items()})
        self._aliased[g] = None

    def _store(self, g: str, cls: StateClass) -> None:
        m = self.masters[g]
        cls.fresh = False
        cls.scalars = split_state(self.optimizer.state[m], m.numel())[1]
        self._aliased[g] = cls

    def _step_slow(self, g: str, grad: torch.Tensor, present: set[str]) -> None:
        runs, m = self.runs[g], self.masters[g]
        members: dict[int, list[str]] = {}
        classes: dict[int, StateClass] = {}
        for n in runs.names:
            if n in present:
                cls = self.class_of[g][n]
                members.setdefault(id(cls), []).append(n)
                classes[id(cls)] = cls
        order = sorted(members, key=lambda c: -runs.covered(members[c]))
        lead, others = order[0], order[1:]
        lead_names = set(members[lead])
        keep = [n for n in runs.names if n not in lead_names]  # not stepped with the lead
        keep_idx = _index(runs, keep, m.device)
        state = self.optimizer.state[m]
        flats, _ = split_state(state, m.numel())
        saved = {"": m.index_select(0, keep_idx)}
        saved.update({k: v.index_select(0, keep_idx) for k, v in flats.items()})

        # The other present classes, each on a gathered copy of its own runs.
        results = []
        for c in others:
            idx = _index(runs, members[c], m.device)
            cls = classes[c]
            sub = m.index_select(0, idx)
            sub_state = {} if cls.fresh else {k: v.index_select(0, idx) for k, v in flats.items()}
            if not cls.fresh:
                sub_state.update({k: _clone(v) for k, v in cls.scalars.items()})
            self._aliased[g] = None
            self.optimizer.state[sub] = sub_state
            try:
                self._step_groups({g: (sub, grad.index_select(0, idx))})
            finally:
                sub_state = self.optimizer.state.pop(sub)
            sub_flats, sub_scalars = split_state(sub_state, sub.numel())
            results.append((idx, members[c], cls, sub, sub_flats, sub_scalars))

        # The lead class on the whole shard. If some of its members are absent, the
        # optimizer must step a copy of its scalar state, not the state they keep.
        if len(lead_names) < sum(1 for c in self.class_of[g].values() if c is classes[lead]):
            self._aliased[g] = None
        self._load(g, classes[lead])
        self._step_groups({g: (m, grad)})
        lead_cls = self._assign(g, classes[lead], members[lead])
        if lead_cls is classes[lead]:
            self._store(g, lead_cls)
        else:
            lead_cls.fresh, lead_cls.scalars = False, {
                k: _clone(v) for k, v in split_state(state, m.numel())[1].items()}

        # Put back what the lead step must not have changed, then the others' results.
        flats, _ = split_state(state, m.numel())
        m.index_copy_(0, keep_idx, saved[""])
        for k, v in flats.items():
            if k in saved:
                v.index_copy_(0, keep_idx, saved[k])
        for idx, names, cls, sub, sub_flats, sub_scalars in results:
            m.index_copy_(0, idx, sub)
            for k, v in sub_flats.items():
                if k in flats:
                    flats[k].index_copy_(0, idx, v)
            new = self._assign(g, cls, names)
            new.fresh, new.scalars = False, sub_scalars
        self._merge(g)

    def _assign(self, g: str, cls: StateClass, stepped: list[str]) -> StateClass:
        """The class object the stepped members of `cls` belong to from now on: `cls`
        itself if all of its members stepped, else a new one (the rest stay in `cls`)."""
        everyone = [n for n, c in self.class_of[g].items() if c is cls]
        if len(everyone) == len(stepped):
            return cls
        new = StateClass(cls.fresh, dict(cls.scalars))
        for n in stepped:
            self.class_of[g][n] = new
        return new

    def _merge(self, g: str) -> None:
        """Classes whose scalar state became equal are one class again."""
        by_key: dict[tuple, StateClass] = {}
        for n, cls in self.class_of[g].items():
            first = by_key.setdefault(cls.key(), cls)
            if first is not cls:
                self.class_of[g][n] = first
                if self._aliased[g] is cls:
                    self._aliased[g] = None

    # ------------------------------------------------------------------ state

    def param_state(self, group: str) -> dict[str, dict[str, Any]]:
        """Per parameter of this shard: its scalar state ({} if never stepped)."""
        return {n: {k: _clone(v) for k, v in cls.scalars.items()}
                for n, cls in self.class_of[group].items()}

    def stepped(self, group: str) -> set[str]:
        """Parameters of this shard stepped at least once. `param_state` alone cannot
        say so for an optimizer without scalar state (SGD with momentum: `{}` either way)."""
        return {n for n, cls in self.class_of[group].items() if not cls.fresh}

    def load_param_state(self, group: str, states: Mapping[str, Mapping[str, Any]],
                         stepped: Iterable[str] = ()) -> None:
        """Restore per-parameter scalar state; `{}` means never stepped, unless the
        parameter is in `stepped`. Parameters with equal state share a class, so a
        uniform state steps on the fast path."""
        runs = self.runs[group]
        missing = sorted(set(runs.names) - set(states))
        if missing:
            raise KeyError(f"no optimizer state for parameter(s) {missing[:5]} of group {group!r}")
        stepped = set(stepped)
        by_key: dict[tuple, StateClass] = {}
        for n in runs.names:
            s = states[n]
            cls = StateClass(not s and n not in stepped, {k: _clone(v) for k, v in s.items()})
            self.class_of[group][n] = by_key.setdefault(cls.key(), cls)
        self._aliased[group] = None

    def take_state_of(self, previous: MaskedStep, world_group) -> None:
        """Per-parameter state of `previous` (the stepper of the plan before a re-layout)
        for these runs. A rank may now own runs of parameters whose scalar state only
        other ranks kept, so every rank shares what it has: collective over `world_group`."""
        mine = {g: (previous.param_state(g), previous.stepped(g)) for g in previous.runs}
        every: list = [None] * dist.get_world_size(world_group)
        dist.all_gather_object(every, mine, group=world_group)
        for g, runs in self.runs.items():
            theirs = [e.get(g, ({}, set())) for e in every]
            known = {n: s for states, _ in theirs for n, s in states.items()}
            stepped = set().union(*(done for _, done in theirs))
            self.load_param_state(g, {n: known.get(n, {}) for n in runs.names}, stepped)

    def step_counts(self, group: str) -> dict[str, int]:
        """Per parameter of this shard: how many times it was stepped, where the
        optimizer keeps a `step` (0 if never stepped)."""
        out = {}
        for n, cls in self.class_of[group].items():
            step = cls.scalars.get("step", 0)
            out[n] = int(step.item() if isinstance(step, torch.Tensor) else step)
        return out


def _index(runs: ShardRuns, names: Iterable[str], device: torch.device) -> torch.Tensor:
    spans = runs.of_params(names)
    if not spans:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat([torch.arange(o, o + n, device=device) for o, n in spans])
