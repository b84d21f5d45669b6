"""Each rank's share of a parameter group, and its one owner: `GroupShard`.

A group's shard is the concatenation, over the group's layouts in index order, of this
rank's equal slice of each layout, padding included: exactly what
`plan.shard_ranges(group, rank)` describes with `shard_offset`. Per layout it is one
`Piece`. `GroupShard` owns, for one parameter group on this rank:

* the master weights, one piece per layout, which the inner optimizer steps as separate
  tensors. When the master dtype is the parameter dtype (fp32 training) each piece *is*
  this rank's slice of the layout's flat parameter buffer (`FlatParams.owned_slice`):
  nothing is copied in before the step or out after it, a user's write to a parameter
  is a write to its master, and the masters take no memory of their own (Megatron-core
  steps fp32 parameters' own memory the same way: distrib_optimizer.py@d98e8a64:465-491).
  Otherwise (bf16/fp16 parameters with fp32 masters) the pieces are views of one flat
  master tensor: `publish` rounds a piece into the slice before its gather, and
  `pick_up_writes` reads the user's writes back (`runtime/paramwrites.py`);
* the gradient shard `grad`, where the reducer accumulates (one view of it per piece is
  the piece's gradient);
* the view of the inner optimizer's state: the optimizer keeps state per piece, and
  every shard-shaped tensor of it is a view of one flat tensor per key
  (`state_flats`), so checkpoints read and write the group's state whole;
* where each of these lives (`placement`): on the parameters' device, or, with
  `offload_optimizer="cpu"`, all three on the host, reached through a `HostLink`
  (`runtime/offload.py`): reduced gradients `land` in the host gradient shard, a stepped
  piece is `publish`ed to the device through it, and the masters are never the
  parameters' memory;
* its masked step (`runtime/maskedstep.py`).

`statedict.py`, `memory.py` and the engine read and write a group's sharded state only
through it: this is the seam where a new placement (CPU offload) or master dtype plugs in.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from evenzero.plan import STEP, Collective, Plan, PlanError
from evenzero.runtime.buckets import FlatParams
from evenzero.runtime.collectives import all_gather_flat
from evenzero.runtime.innerstep import keeps_inner_choice
from evenzero.runtime.maskedstep import MaskedStep, split_state
from evenzero.runtime.offload import Apply, HostLink, host_zeros
from evenzero.runtime.paramwrites import pick_up
from evenzero.runtime.shardruns import ShardRuns
from evenzero.runtime.wholestep import Owned, WholeTensorStep
from evenzero.spec import DTYPE_BYTES, dtype_name


@dataclass(frozen=True)
class Placement:
    """Where a group's sharded tensors live."""

    master: torch.device
    """The master pieces (the parameters' device when they are the parameters' memory)."""
    grad: torch.device
    """The gradient shard (where the reducer accumulates)."""
    optimizer_state: torch.device
    """The inner optimizer's shard-shaped state."""
    compute: torch.device | None = None
    """Where the parameters live and the collectives run (None: `master`'s device)."""
    pin: bool = False
    """Page-lock the host tensors that cross the link (offloaded, CUDA parameters)."""

    @staticmethod
    def on(device: torch.device) -> Placement:
        return Placement(device, device, device)

    @staticmethod
    def offload(device: torch.device, pin: bool) -> Placement:
        """Masters, gradient shard and optimizer state on the host; parameters on `device`."""
        host = torch.device("cpu")
        return Placement(host, host, host, device, pin and device.type == "cuda")

    @property
    def offloaded(self) -> bool:
        """Whether the shard is held apart from the parameters (`runtime/offload.py`);
        true for CPU parameters too, whose data then flows through host-to-host copies."""
        return self.compute is not None


@dataclass(frozen=True)
class Piece:
    """One layout's part of a group's shard on this rank."""

    layout: int
    """The layout's index in its group."""
    shard_offset: int
    """Where the piece starts in the group's shard."""
    numel: int
    """Its elements (this rank's equal slice of the layout, padding included)."""
    master: torch.Tensor
    """The master values: what the inner optimizer steps."""
    owned: torch.Tensor
    """This rank's slice of the layout's flat parameter buffer (what the gather sends)."""
    grad: torch.Tensor
    """The piece's view of the gradient shard."""


class GroupShard:
    """One parameter group's sharded state on this rank (see the module docstring)."""

    def __init__(self, name: str, process_group: Any, size: int, rank: int,
                 param_dtype: torch.dtype, reduce_dtype: torch.dtype, master_dtype: torch.dtype,
                 options: Mapping[str, Any], placement: Placement,
                 whole_shapes: Mapping[str, tuple[int, ...]] | None = None) -> None:
        self.name = name
        """Group name in the plan."""
        self.process_group = process_group
        """Process group the gradients are reduced and the parameters gathered over."""
        self.size = size
        """Ranks in `process_group`."""
        self.rank = rank
        """This rank's rank within `process_group`."""
        self.param_dtype = param_dtype
        """Dtype of the model parameters (and of the flat parameter buffers)."""
        self.reduce_dtype = reduce_dtype
        """Dtype gradients travel in."""
        self.master_dtype = master_dtype
        """Dtype of the master weights, the gradient shard and the optimizer state."""
        self.options = options
        """Optimizer keyword overrides for this group."""
        self.placement = placement
        self.whole_shapes = dict(whole_shapes) if whole_shapes is not None else None
        """Shapes of the group's parameters when its inner optimizer updates whole tensors
        (Muon): it then steps the ones this rank owns as tensors of their own shape
        (`runtime/wholestep.py`); None: it steps the flat pieces (`MaskedStep`)."""
        self.owned: tuple[Owned, ...] = ()
        self._ever_active = False
        self.aliased = master_dtype == param_dtype and not placement.offloaded
        """The master pieces are this rank's slices of the flat parameter buffers."""
        self.link = HostLink(placement.compute, placement.pin) if placement.offloaded else None
        """The copies to and from the device when offloaded (None otherwise)."""
        self.grad = torch.zeros(0, dtype=master_dtype, device=placement.grad)
        """This rank's accumulated, averaged gradient shard (the whole group's)."""
        self.pieces: tuple[Piece, ...] = ()
        self.runs = ShardRuns(0, {})
        """Which runs of the shard belong to which parameter."""
        self.stepper: MaskedStep | WholeTensorStep | None = None
        self._master: torch.Tensor | None = None
        self._by_layout: dict[int, int] = {}
        self._optimizer: torch.optim.Optimizer | None = None
        self._state_flats: dict[str, torch.Tensor] = {}
        self._state_views: dict[str, list[torch.Tensor]] = {}
        self._stepping = False
        self._unstepped: set[int] = set()
        self._state_keys: tuple[str, ...] = ()

    @property
    def numel(self) -> int:
        """Elements of the shard, padding included."""
        return self.grad.numel()

    # ------------------------------------------------------------------ layout

    def lay_out(self, plan: Plan, flat: FlatParams) -> None:
        """Take this rank's shard of `plan` (construction): masters from the parameters'
        current values, a zero gradient shard."""
        n = plan.shard_numel(self.name)
        if not self.aliased:
            self._master = self._zeros(n, self.placement.master, self.placement.pin)
        self.grad = self._zeros(n, self.placement.grad, False)
        self._place(plan, flat)
        if not self.aliased:
            for p in self.pieces:
                p.master.copy_(p.owned)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Step with `optimizer`, one of whose param groups holds exactly `optimizer_params()`."""
        self._optimizer = optimizer
        self.stepper = self._make_stepper()

    def _make_stepper(self) -> MaskedStep | WholeTensorStep:
        if self.whole_shapes is not None:
            return WholeTensorStep(self._optimizer, self.owned)
        return MaskedStep(self._optimizer, self.optimizer_params(), self.runs)

    def optimizer_params(self) -> list[torch.Tensor]:
        """What the inner optimizer's param group of this group holds: the master pieces,
        or, for a whole-tensor optimizer, views of them shaped as the parameters this
        rank owns whole."""
        if self.whole_shapes is not None:
            return [o.tensor for o in self.owned]
        return [p.master for p in self.pieces]

    def _units(self) -> list[tuple[torch.Tensor, int, int]]:
        """(optimizer parameter, shard offset, numel) of what the optimizer keeps state for."""
        if self.whole_shapes is not None:
            return [(o.tensor, self.pieces[o.piece].shard_offset + o.offset, o.numel)
                    for o in self.owned]
        return [(p.master, p.shard_offset, p.numel) for p in self.pieces]

    def relayout(self, old: Plan, new: Plan, flat: FlatParams) -> None:
        """Move to the shard of `new` (collective over the group): masters, optimizer
        state and gradients already reduced in this step (a re-plan after an earlier
        backward that measured nothing) keep their values. Aliased masters move with the
        flat buffers, which `flat` already rebuilt from the parameters' current values."""
        flats = {k: reshard(v, old, new, self) for k, v in self._state_flats.items()}
        if not self.aliased:
            self._master = reshard(self._master, old, new, self)
        self.grad = reshard(self.grad, old, new, self)
        state = self._optimizer.state
        for t, _, _ in self._units():
            state.pop(t, None)
        group = self.stepper.group
        self._place(new, flat)
        group["params"] = self.optimizer_params()
        self._bind_flats(flats)
        self.stepper = self._make_stepper()

    def _zeros(self, n: int, device: torch.device, pin: bool) -> torch.Tensor:
        if pin:
            return host_zeros(n, self.master_dtype, True)
        return torch.zeros(n, dtype=self.master_dtype, device=device)

    def _place(self, plan: Plan, flat: FlatParams) -> None:
        pieces = []
        for s in plan.layout_shards(self.name):
            owned = flat.owned_slice(self.name, s.layout)
            lo, hi = s.shard_offset, s.shard_offset + s.numel
            master = owned if self.aliased else self._master[lo:hi]
            pieces.append(Piece(s.layout, lo, s.numel, master, owned, self.grad[lo:hi]))
        self.pieces = tuple(pieces)
        self._by_layout = {p.layout: i for i, p in enumerate(pieces)}
        self.runs = ShardRuns.of(plan, self.name, self.rank)
        if self.whole_shapes is not None:
            self.owned = tuple(self._owned(plan))

    def _owned(self, plan: Plan) -> list[Owned]:
        """The parameters this rank owns whole, as views of the master pieces; raises if
        the plan gives one to several ranks (a layout that is not matrix-aligned)."""
        out = []
        starts = [p.shard_offset for p in self.pieces]
        for name in self.runs.names:
            (off, n), *more = self.runs.runs[name]
            shape = tuple(self.whole_shapes[name])
            if more or n != math.prod(shape):
                raise PlanError(f"parameter {name!r} of shape {list(shape)} is split across "
                                f"ranks by the {plan.strategy!r} plan, but group {self.name!r} "
                                f"updates whole tensors; use strategy='evenzero', which lays "
                                f"such groups out matrix-aligned")
            i = bisect_right(starts, off) - 1
            piece = self.pieces[i]
            local = off - piece.shard_offset
            out.append(Owned(name, i, local, shape,
                             piece.master[local:local + n].view(shape)))
        return out

    # ------------------------------------------------------------------ the step

    def pick_up_writes(self, scratch: torch.Tensor | None = None) -> None:
        """Bring the user's writes to the parameters into the masters (nothing to do when
        the masters are the parameters' memory). `scratch`: see `paramwrites.pick_up`."""
        if self.aliased:
            return
        for p in self.pieces:
            owned = p.owned if self.link is None else self.link.fetch(p.owned)
            pick_up(p.master, owned, scratch)

    def set_hyperparameters(self, user: Mapping[str, Any]) -> None:
        """The user's group options (lr, betas, ...) as the next step sees them."""
        group = self.stepper.group
        for key, value in user.items():
            if key != "params" and not keeps_inner_choice(key, value):
                group[key] = value

    def begin_step(self, present: Iterable[str], active: bool,
                   grads: Sequence[torch.Tensor] | None = None) -> None:
        """Start stepping the parameters in `present` (`MaskedStep.begin`); `grads` (one
        per piece) replaces the gradient shard. On the fast path the pieces are stepped by
        `step_layouts`, layout by layout; otherwise the whole step happens here."""
        grads = [p.grad for p in self.pieces] if grads is None else grads
        self._ever_active = self._ever_active or active
        self._stepping = self.stepper.begin(grads, present, active)
        self._unstepped = set(range(len(self.pieces))) if self._stepping else set()

    def step_layouts(self, layouts: Iterable[int]) -> None:
        """Step the pieces of `layouts` together (those not stepped yet in this step)."""
        todo = [i for i in (self._by_layout[lay] for lay in layouts) if i in self._unstepped]
        if todo:
            self._unstepped.difference_update(todo)
            self.stepper.step_pieces(todo)

    def finish_step(self) -> None:
        """Every piece holds its new master values."""
        if self._stepping:
            if self._unstepped:
                self.stepper.step_pieces(sorted(self._unstepped))
                self._unstepped = set()
            self.stepper.finish()
            self._stepping = False
        self._bind_state()

    def publish(self, layout: int) -> None:
        """This rank's slice of layout `layout`'s flat buffer := its master piece (in the
        parameter dtype; nothing to do when the master is that slice)."""
        if not self.aliased:
            p = self.pieces[self._by_layout[layout]]
            if self.link is not None:
                self.link.publish(layout, p.owned, p.master)
            else:
                p.owned.copy_(p.master)

    # ------------------------------------------------------------------ gradients

    def land(self, sources: Sequence[torch.Tensor], apply: Apply) -> None:
        """`apply(sources)` on the gradient shard's side: at once, or with the host copies
        of `sources` once they arrive (`HostLink.land`)."""
        if self.link is None:
            apply(list(sources))
        else:
            self.link.land(sources, apply)

    def drain_grads(self) -> None:
        """Every landed gradient is in the gradient shard (end of a backward)."""
        if self.link is not None:
            self.link.drain()

    def zero_grad_(self) -> None:
        if self.link is not None:
            self.link.discard()
        self.grad.zero_()

    def scale_grad_(self, factor: float) -> None:
        self.grad.mul_(factor)

    def clear_grad_runs(self, names: Iterable[str]) -> None:
        """Zero the runs of `names` in the gradient shard (gradients the user cleared)."""
        for name in names:
            for off, n in self.runs.runs.get(name, ()):
                self.grad[off:off + n].zero_()

    # ------------------------------------------------------------------ state, as a whole

    def master_values(self) -> torch.Tensor:
        """The master shard, flat. A copy when the masters are the parameters' memory
        (their pieces are not contiguous); the master tensor itself otherwise."""
        if self.aliased:
            return torch.cat([p.master for p in self.pieces]) if self.pieces else self.grad.new_empty(0)
        return self._master

    def state_flats(self) -> dict[str, torch.Tensor]:
        """The inner optimizer's shard-shaped state, one flat tensor per key (not copies)."""
        return dict(self._state_flats)

    def load(self, master: torch.Tensor, flats: Mapping[str, torch.Tensor]) -> None:
        """Replace the master values and the shard-shaped optimizer state (the scalar
        state is the masked step's, `MaskedStep.load_param_state`)."""
        for p in self.pieces:
            p.master.copy_(master[p.shard_offset:p.shard_offset + p.numel])
        state = self._optimizer.state
        for t, _, _ in self._units():
            state[t].clear()
        self._ever_active = self._ever_active or bool(flats)
        self._state_flats, self._state_views = {}, {}
        self._bind_flats({k: v.detach().to(self.placement.optimizer_state, self.master_dtype).clone()
                          for k, v in flats.items()})

    def _bind_flats(self, flats: Mapping[str, torch.Tensor]) -> None:
        state = self._optimizer.state
        self._state_flats, self._state_views = {}, {}
        for key, flat in flats.items():
            views = [flat[o:o + n].view(t.shape) for t, o, n in self._units()]
            for (t, _, _), v in zip(self._units(), views, strict=True):
                state[t][key] = v
            self._state_flats[key], self._state_views[key] = flat, views

    def _bind_state(self) -> None:
        """Make every piece's shard-shaped optimizer state a view of one flat tensor per
        key. The optimizer creates its state per piece at the first step (and could
        replace a tensor later): those are copied into the flat tensor once, then
        updated in place through the views."""
        if self.whole_shapes is not None:
            self._bind_whole_state()
            return
        state = self._optimizer.state
        per = [split_state(state.get(p.master, {}), p.numel)[0] for p in self.pieces]
        keys = [k for k in per[0] if all(k in f for f in per)] if per else []
        for k in [k for k in self._state_flats if k not in keys]:
            del self._state_flats[k], self._state_views[k]
        for k in keys:
            views = self._state_views.get(k)
            if views is not None and all(f[k] is v for f, v in zip(per, views, strict=True)):
                continue
            if len(self.pieces) == 1:
                flat, views = per[0][k], [per[0][k]]
            else:
                flat = self._state_flats.get(k)
                like = per[0][k]
                if flat is None or flat.dtype != like.dtype:
                    flat = torch.empty(self.numel, dtype=like.dtype,
                                       device=self.placement.optimizer_state)
                views = [flat[p.shard_offset:p.shard_offset + p.numel] for p in self.pieces]
                for p, f, v in zip(self.pieces, per, views, strict=True):
                    if f[k] is not v:
                        v.copy_(f[k])
                        state[p.master][k] = v
            self._state_flats[k], self._state_views[k] = flat, views

    def _bind_whole_state(self) -> None:
        """`_bind_state` for whole tensors: one flat tensor per state key over the shard
        (zeros where no owned parameter has that state: padding, parameters never
        stepped), each owned parameter's state a view of it, shaped as the parameter.
        Once the group stepped on any rank, every rank holds the keys the optimizer keeps
        (`WholeTensorStep.state_keys`), so checkpoints find the same keys everywhere."""
        if not self._ever_active:
            return
        state = self._optimizer.state
        keys = self._state_keys or self.stepper.state_keys(self.master_dtype,
                                                           self.placement.optimizer_state)
        self._state_keys = keys
        units = self._units()
        for k in keys:
            flat = self._state_flats.get(k)
            if flat is None:
                flat = torch.zeros(self.numel, dtype=self.master_dtype,
                                   device=self.placement.optimizer_state)
            views = [flat[o:o + n].view(t.shape) for t, o, n in units]
            for (t, _, _), v in zip(units, views, strict=True):
                have = state.get(t, {}).get(k)
                if have is not None and have is not v:
                    v.copy_(have)
                    state[t][k] = v
            self._state_flats[k], self._state_views[k] = flat, views

    # ------------------------------------------------------------------ memory

    def nbytes_by_device(self) -> dict[str, int]:
        """Bytes of the masters, gradient shard, optimizer state and the link's staging,
        by the device they live on."""
        out: dict[str, int] = {}
        p = self.placement
        for dev, n in ((p.master, self.master_nbytes()), (p.grad, self.grad_nbytes()),
                       (p.optimizer_state, self.state_nbytes()),
                       (p.master, self.link.staging_nbytes() if self.link else 0)):
            if n:
                out[str(dev)] = out.get(str(dev), 0) + n
        return out

    def staging_nbytes(self) -> int:
        """Host bytes the offload link holds for its copies (0 without offload)."""
        return self.link.staging_nbytes() if self.link is not None else 0

    def master_nbytes(self) -> int:
        """Bytes the masters take of their own (0 when they are the parameters' memory)."""
        return 0 if self.aliased else _nbytes(self._master)

    def grad_nbytes(self) -> int:
        return _nbytes(self.grad)

    def state_nbytes(self) -> int:
        """Bytes of the inner optimizer's state for this group (flat and scalar)."""
        total = sum(_nbytes(f) for f in self._state_flats.values())
        state = self._optimizer.state if self._optimizer is not None else {}
        for t, _, _ in self._units():
            for k, v in state.get(t, {}).items():
                if torch.is_tensor(v) and k not in self._state_flats:
                    total += _nbytes(v)
        return total


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def param_values(plan: Plan, shard: torch.Tensor, group: GroupShard) -> dict[str, torch.Tensor]:
    """Every parameter of the group, whole and flat, gathered from the ranks' shards."""
    out: dict[str, torch.Tensor] = {}
    layouts = plan.group_layouts(group.name)
    for lay, part in zip(layouts, plan.layout_shards(group.name), strict=True):
        full = torch.empty(lay.numel, dtype=shard.dtype, device=shard.device)
        mine = shard[part.shard_offset:part.shard_offset + part.numel].contiguous()
        all_gather_flat(full, mine, group.process_group)
        for s in lay.params:
            out[s.name] = full[s.offset:s.offset + s.numel]
    return out


def reshard(shard: torch.Tensor, old: Plan, new: Plan, group: GroupShard) -> torch.Tensor:
    """The same values, moved from this rank's shard under `old` to its shard under `new`
    (gathered on the parameters' device: an offloaded shard's host copy goes there)."""
    compute = group.placement.compute or shard.device
    values = param_values(old, shard.to(compute), group)
    out = torch.zeros(new.shard_numel(group.name), dtype=shard.dtype, device=compute)
    for r in new.shard_ranges(group.name, group.rank):
        out[r.shard_offset:r.shard_offset + r.numel] = values[r.param][r.start:r.start + r.numel]
    if out.device == shard.device:
        return out
    return out.to(shard.device).pin_memory() if shard.is_pinned() else out.to(shard.device)


def gather_order(plan: Plan, groups: Mapping[str, GroupShard]) -> tuple[Collective, ...]:
    """The plan's all-gathers if they are one whole gather per layout, else our own."""
    layouts = {(lay.group, lay.index): lay.numel for lay in plan.layouts}
    planned = tuple(c for c in plan.step() if c.op == "all_gather")
    if (sorted((c.group, c.buffer_index) for c in planned) == sorted(layouts)
            and all(c.offset == 0 and not c.segments and c.numel == layouts[(c.group, c.buffer_index)]
                    for c in planned)):
        return planned
    return tuple(Collective(STEP, "all_gather", lay.group, groups[lay.group].size, None, lay.index,
                            0, lay.numel,
                            itemsize=DTYPE_BYTES[dtype_name(groups[lay.group].param_dtype)])
                 for lay in plan.layouts)


