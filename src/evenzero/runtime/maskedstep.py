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

One `MaskedStep` steps one group's shard (`GroupShard` owns it, `runtime/shards.py`).
The inner optimizer sees that shard as its pieces, one tensor per layout (`pieces`),
which together are the flat shard the runs describe, so that on the fast path the step
can go layout by layout (`begin`, `step_pieces`, `finish`) and each layout's all-gather
starts as soon as its piece holds the new values (`runtime/engine.py`). Elementwise
optimizers give the same result whichever way a shard is cut into pieces.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
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


class SplitShard:
    """Consecutive tensors that together are one flat shard (a group's pieces, or the
    optimizer state of each piece): indexing over the whole, without concatenating it."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        self.starts = [0]
        for t in self.tensors:
            self.starts.append(self.starts[-1] + t.numel())

    @property
    def numel(self) -> int:
        return self.starts[-1]

    def _split(self, idx: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
        """(piece, its local indices) for sorted shard indices `idx`."""
        if len(self.tensors) == 1:
            return [(0, idx)]
        cuts = torch.searchsorted(idx, torch.tensor(self.starts, device=idx.device)).tolist()
        return [(i, idx[cuts[i]:cuts[i + 1]] - self.starts[i])
                for i in range(len(self.tensors)) if cuts[i + 1] > cuts[i]]

    def take(self, idx: torch.Tensor) -> torch.Tensor:
        """A new tensor of the elements at sorted shard indices `idx`."""
        parts = [self.tensors[i].index_select(0, local) for i, local in self._split(idx)]
        if not parts:
            return self.tensors[0].new_empty(0)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def put_(self, idx: torch.Tensor, values: torch.Tensor) -> None:
        """Write `values` at sorted shard indices `idx` (the inverse of `take`)."""
        pos = 0
        for i, local in self._split(idx):
            self.tensors[i].index_copy_(0, local, values[pos:pos + local.numel()])
            pos += local.numel()


class MaskedStep:
    """Steps one optimizer param group, whose parameters are one flat shard's pieces, per
    model parameter."""

    def __init__(self, optimizer: torch.optim.Optimizer, pieces: Sequence[torch.Tensor],
                 runs: ShardRuns) -> None:
        """`pieces` are exactly the parameters of one of `optimizer`'s param groups, in
        shard order; `runs` says which elements of their concatenation belong to which
        model parameter."""
        self.optimizer, self.pieces, self.runs = optimizer, list(pieces), runs
        self.shard = SplitShard(self.pieces)
        if self.shard.numel != runs.numel:
            raise ValueError(f"the pieces hold {self.shard.numel} elements, the runs describe "
                             f"{runs.numel}")
        ids = sorted(map(id, self.pieces))
        found = [pg for pg in optimizer.param_groups if sorted(map(id, pg["params"])) == ids]
        if len(found) != 1:
            raise ValueError("the pieces must be exactly the parameters of one optimizer param "
                             "group")
        self.group = found[0]
        fresh = StateClass()
        self.class_of: dict[str, StateClass] = dict.fromkeys(runs.names, fresh)
        self._loaded: StateClass | None = None
        """The class whose scalar state the optimizer's state holds now (by reference)."""
        self._fast: tuple[StateClass, Sequence[torch.Tensor]] | None = None

    # ------------------------------------------------------------------ stepping

    @torch.no_grad()
    def step(self, grads: Sequence[torch.Tensor], present: Iterable[str],
             active: bool = False) -> bool:
        """One whole step with `grads` (one per piece) as the shard's gradient; returns
        whether anything was stepped here (see `begin`)."""
        present = present if isinstance(present, (set, frozenset)) else set(present)
        if self.begin(grads, present, active):
            self.step_pieces(range(len(self.pieces)))
            self.finish()
        return any(n in present for n in self.runs.names)

    @torch.no_grad()
    def begin(self, grads: Sequence[torch.Tensor], present: Iterable[str],
              active: bool = False) -> bool:
        """Start a step with `grads` (one per piece), touching only parameters in
        `present`. True: the fast path (every parameter here present, all in one
        class); the caller then steps every piece once with `step_pieces`, in any order,
        and calls `finish`. False: the step is already done. `active` says that the group
        stepped on some rank: with nothing present here it still gets its optimizer-state
        tensors, so every rank of a group holds the same kinds of state (what checkpoints
        gather)."""
        present = present if isinstance(present, (set, frozenset)) else set(present)
        here = [n for n in self.runs.names if n in present]
        if not here:
            if active:
                self._materialize()
            return False
        cls = self.class_of[here[0]]
        if len(here) == len(self.runs.names) and all(self.class_of[n] is cls for n in here):
            self._load(cls)
            self._fast = (cls, grads)
            return True
        self._step_slow(grads, present)
        return False

    @torch.no_grad()
    def step_pieces(self, indices: Iterable[int]) -> None:
        """The fast path: step the pieces at `indices` (each piece once per step)."""
        _, grads = self._fast
        indices = list(indices)
        self._step_tensors([self.pieces[i] for i in indices], [grads[i] for i in indices])

    def finish(self) -> None:
        """The fast path: every piece was stepped."""
        cls, _ = self._fast
        self._fast = None
        self._store(cls)

    def _step_tensors(self, tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        """One optimizer step in which only `tensors` move (every other parameter of the
        optimizer has no gradient outside a step)."""
        for t, g in zip(tensors, grads, strict=True):
            t.grad = g
        try:
            self.optimizer.step()
        finally:
            for t in tensors:
                t.grad = None

    def _step_sub(self, sub: torch.Tensor, grad: torch.Tensor) -> None:
        """One optimizer step of `sub` alone, standing in for the group's pieces."""
        params = self.group["params"]
        self.group["params"] = [sub]
        try:
            self._step_tensors([sub], [grad])
        finally:
            self.group["params"] = params

    def _materialize(self) -> None:
        """Create the state tensors without stepping anything: step the pieces with a
        zero gradient and empty state, then put their values back. The state's values
        belong to parameters that stay "never stepped" here."""
        state = self.optimizer.state
        if self._flats():
            return
        keep = [t.detach().clone() for t in self.pieces]
        for t in self.pieces:
            state[t].clear()
        self._loaded = None
        self._step_tensors(self.pieces, [torch.zeros_like(t) for t in self.pieces])
        for t, k in zip(self.pieces, keep, strict=True):
            t.copy_(k)
            for key in list(split_state(state[t], t.numel())[1]):
                del state[t][key]

    def _flats(self) -> dict[str, SplitShard]:
        """The shard-shaped optimizer state, key by key, over the pieces."""
        per = [split_state(self.optimizer.state.get(t, {}), t.numel())[0] for t in self.pieces]
        return {k: SplitShard([p[k] for p in per]) for k in per[0] if all(k in p for p in per)}

    def _load(self, cls: StateClass) -> None:
        """Make `cls` the scalar state the optimizer sees for every piece."""
        if self._loaded is cls:
            return
        for t in self.pieces:
            state = self.optimizer.state[t]
            flats, _ = split_state(state, t.numel())
            state.clear()
            if not cls.fresh:
                state.update(flats)
                state.update({k: _clone(v) for k, v in cls.scalars.items()})
        self._loaded = None

    def _store(self, cls: StateClass) -> None:
        cls.fresh = False
        first = self.pieces[0]
        cls.scalars = split_state(self.optimizer.state[first], first.numel())[1]
        self._loaded = cls

    def _step_slow(self, grads: Sequence[torch.Tensor], present: set[str]) -> None:
        runs, shard = self.runs, self.shard
        device = self.pieces[0].device
        grad = SplitShard(grads)
        members: dict[int, list[str]] = {}
        classes: dict[int, StateClass] = {}
        for n in runs.names:
            if n in present:
                cls = self.class_of[n]
                members.setdefault(id(cls), []).append(n)
                classes[id(cls)] = cls
        order = sorted(members, key=lambda c: -runs.covered(members[c]))
        lead, others = order[0], order[1:]
        lead_names = set(members[lead])
        keep = [n for n in runs.names if n not in lead_names]  # not stepped with the lead
        keep_idx = _index(runs, keep, device)
        flats = self._flats()
        saved = {"": shard.take(keep_idx)}
        saved.update({k: v.take(keep_idx) for k, v in flats.items()})

        # The other present classes, each on a gathered copy of its own runs.
        results = []
        for c in others:
            idx = _index(runs, members[c], device)
            cls = classes[c]
            sub = shard.take(idx)
            sub_state = {} if cls.fresh else {k: v.take(idx) for k, v in flats.items()}
            if not cls.fresh:
                sub_state.update({k: _clone(v) for k, v in cls.scalars.items()})
            self._loaded = None
            self.optimizer.state[sub] = sub_state
            try:
                self._step_sub(sub, grad.take(idx))
            finally:
                sub_state = self.optimizer.state.pop(sub)
            sub_flats, sub_scalars = split_state(sub_state, sub.numel())
            results.append((idx, members[c], cls, sub, sub_flats, sub_scalars))

        # The lead class on the whole shard. If some of its members are absent, the
        # optimizer must step a copy of its scalar state, not the state they keep.
        if len(lead_names) < sum(1 for c in self.class_of.values() if c is classes[lead]):
            self._loaded = None
        self._load(classes[lead])
        self._step_tensors(self.pieces, grads)
        lead_cls = self._assign(classes[lead], members[lead])
        if lead_cls is classes[lead]:
            self._store(lead_cls)
        else:
            first = self.pieces[0]
            lead_cls.fresh, lead_cls.scalars = False, {
                k: _clone(v) for k, v in split_state(self.optimizer.state[first],
                                                     first.numel())[1].items()}

        # Put back what the lead step must not have changed, then the others' results.
        flats = self._flats()
        shard.put_(keep_idx, saved[""])
        for k, v in flats.items():
            if k in saved:
                v.put_(keep_idx, saved[k])
        for idx, names, cls, sub, sub_flats, sub_scalars in results:
            shard.put_(idx, sub)
            for k, v in sub_flats.items():
                if k in flats:
                    flats[k].put_(idx, v)
            new = self._assign(cls, names)
            new.fresh, new.scalars = False, sub_scalars
        self._merge()

    def _assign(self, cls: StateClass, stepped: list[str]) -> StateClass:
        """The class object the stepped members of `cls` belong to from now on: `cls`
        itself if all of its members stepped, else a new one (the rest stay in `cls`)."""
        everyone = [n for n, c in self.class_of.items() if c is cls]
        if len(everyone) == len(stepped):
            return cls
        new = StateClass(cls.fresh, dict(cls.scalars))
        for n in stepped:
            self.class_of[n] = new
        return new

    def _merge(self) -> None:
        """Classes whose scalar state became equal are one class again."""
        by_key: dict[tuple, StateClass] = {}
        for n, cls in self.class_of.items():
            first = by_key.setdefault(cls.key(), cls)
            if first is not cls:
                self.class_of[n] = first
                if self._loaded is cls:
                    self._loaded = None

    # ------------------------------------------------------------------ state

    def param_state(self) -> dict[str, dict[str, Any]]:
        """Per parameter of this shard: its scalar state ({} if never stepped)."""
        return {n: {k: _clone(v) for k, v in cls.scalars.items()}
                for n, cls in self.class_of.items()}

    def stepped(self) -> set[str]:
        """Parameters of this shard stepped at least once. `param_state` alone cannot
        say so for an optimizer without scalar state (SGD with momentum: `{}` either way)."""
        return {n for n, cls in self.class_of.items() if not cls.fresh}

    def load_param_state(self, states: Mapping[str, Mapping[str, Any]],
                         stepped: Iterable[str] = ()) -> None:
        """Restore per-parameter scalar state; `{}` means never stepped, unless the
        parameter is in `stepped`. Parameters with equal state share a class, so a
        uniform state steps on the fast path."""
        missing = sorted(set(self.runs.names) - set(states))
        if missing:
            raise KeyError(f"no optimizer state for parameter(s) {missing[:5]}")
        stepped = set(stepped)
        by_key: dict[tuple, StateClass] = {}
        for n in self.runs.names:
            s = states[n]
            cls = StateClass(not s and n not in stepped, {k: _clone(v) for k, v in s.items()})
            self.class_of[n] = by_key.setdefault(cls.key(), cls)
        self._loaded = None

    def step_counts(self) -> dict[str, int]:
        """Per parameter of this shard: how many times it was stepped, where the
        optimizer keeps a `step` (0 if never stepped)."""
        out = {}
        for n, cls in self.class_of.items():
            step = cls.scalars.get("step", 0)
            out[n] = int(step.item() if isinstance(step, torch.Tensor) else step)
        return out


def share_param_state(previous: Mapping[str, MaskedStep], world_group
                      ) -> dict[str, tuple[dict[str, dict[str, Any]], set[str]]]:
    """Per group, every parameter's scalar state and whether it was stepped, from the
    steppers of the plan before a re-layout, as all ranks together know them: a rank may
    now own runs of parameters whose scalar state only other ranks kept, so every rank
    shares what it has. Collective over `world_group`."""
    mine = {g: (s.param_state(), s.stepped()) for g, s in previous.items()}
    every: list = [None] * dist.get_world_size(world_group)
    dist.all_gather_object(every, mine, group=world_group)
    out = {}
    for g in previous:
        theirs = [e.get(g, ({}, set())) for e in every]
        out[g] = ({n: s for states, _ in theirs for n, s in states.items()},
                  set().union(*(done for _, done in theirs)))
    return out


def _index(runs: ShardRuns, names: Iterable[str], device: torch.device) -> torch.Tensor:
    spans = runs.of_params(names)
    if not spans:
        return torch.zeros(0, dtype=torch.long, device=device)
    return torch.cat([torch.arange(o, o + n, device=device) for o, n in spans])
