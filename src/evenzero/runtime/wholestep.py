"""Step whole tensors (Muon's matrices) that this rank owns, as torch steps parameters.

A group whose inner optimizer updates whole tensors (`config.update_kind`) is laid out
matrix-aligned (`evenzero.strategies.wholetensor`): every one of its parameters lies
inside one rank's shard, whole. After the backward's one reduce-scatter per bucket the
owner holds its complete, reduced gradient, so the inner optimizer (torch.optim.Muon)
steps each owned parameter as a tensor of its own shape: a view of the master shard,
with a view of the gradient shard as its `.grad`. torch's own rules then hold per
parameter: a parameter without a gradient is skipped (no momentum update, no weight
decay), and its state is torch's (`momentum_buffer`, of the parameter's shape).

`WholeTensorStep` has `runtime/maskedstep.py`'s interface (`begin`, `step_pieces`,
`finish`, the per-parameter scalar state), so `GroupShard` and the engine drive both
alike: the engine's layout-by-layout step launches each layout's all-gather as soon as
the matrices in its piece hold their new values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Owned:
    """One parameter this rank owns whole."""

    name: str
    piece: int
    """Index of the piece (layout) of the group's shard it lies in."""
    offset: int
    """Its first element's offset in that piece."""
    shape: tuple[int, ...]
    tensor: torch.Tensor
    """The view of the master piece the inner optimizer steps."""

    @property
    def numel(self) -> int:
        return self.tensor.numel()


class WholeTensorStep:
    """Steps one optimizer param group whose parameters are this rank's owned tensors."""

    def __init__(self, optimizer: torch.optim.Optimizer, owned: Sequence[Owned]) -> None:
        self.optimizer, self.owned = optimizer, list(owned)
        ids = sorted(id(o.tensor) for o in self.owned)
        found = [pg for pg in optimizer.param_groups if sorted(map(id, pg["params"])) == ids]
        if len(found) != 1:
            raise ValueError("the owned tensors must be exactly the parameters of one optimizer "
                             "param group")
        self.group = found[0]
        self._stepped: set[str] = set()
        self._todo: dict[int, list[tuple[Owned, torch.Tensor]]] = {}

    # ------------------------------------------------------------------ stepping

    @torch.no_grad()
    def begin(self, grads: Sequence[torch.Tensor], present: Iterable[str],
              active: bool = False) -> bool:
        """Start a step with `grads` (one per piece of the group's shard) for the owned
        parameters in `present`; True when there is anything to step here (then
        `step_pieces` and `finish`, as on `MaskedStep`'s fast path). `active` is
        `MaskedStep`'s; whole tensors need nothing for it (their state keys are found
        by `state_keys`)."""
        present = present if isinstance(present, (set, frozenset)) else set(present)
        self._todo = {}
        for o in self.owned:
            if o.name in present:
                g = grads[o.piece][o.offset:o.offset + o.numel].view(o.shape)
                self._todo.setdefault(o.piece, []).append((o, g))
        return bool(self._todo)

    @torch.no_grad()
    def step_pieces(self, indices: Iterable[int]) -> None:
        """Step the present owned parameters of the pieces at `indices`."""
        batch = [t for i in indices for t in self._todo.pop(i, ())]
        if not batch:
            return
        for o, g in batch:
            o.tensor.grad = g
        try:
            self.optimizer.step()
        finally:
            for o, _ in batch:
                o.tensor.grad = None
        self._stepped.update(o.name for o, _ in batch)

    def finish(self) -> None:
        if self._todo:
            self.step_pieces(list(self._todo))

    # ------------------------------------------------------------------ state

    def param_state(self) -> dict[str, dict[str, Any]]:
        """Per owned parameter: its scalar state (torch.optim.Muon keeps none)."""
        state = self.optimizer.state
        return {o.name: {k: _clone(v) for k, v in state.get(o.tensor, {}).items()
                         if not _shaped(v, o)} for o in self.owned}

    def tensor_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per owned parameter: its state tensors of the parameter's shape (torch's own
        keys, e.g. Muon's `momentum_buffer`), not copies."""
        state = self.optimizer.state
        return {o.name: {k: v for k, v in state.get(o.tensor, {}).items() if _shaped(v, o)}
                for o in self.owned if o.tensor in state}

    def stepped(self) -> set[str]:
        return set(self._stepped)

    def load_param_state(self, states: Mapping[str, Mapping[str, Any]],
                         stepped: Iterable[str] = ()) -> None:
        """Restore the owned parameters' scalar state; `stepped` as on `MaskedStep`."""
        stepped = set(stepped)
        state = self.optimizer.state
        for o in self.owned:
            for k, v in states.get(o.name, {}).items():
                if not (torch.is_tensor(v) and v.numel() == o.numel and v.dim() > 0):
                    state[o.tensor][k] = _clone(v)
        self._stepped = {o.name for o in self.owned if o.name in stepped or states.get(o.name)}

    def step_counts(self) -> dict[str, int]:
        out = {}
        for o in self.owned:
            step = self.optimizer.state.get(o.tensor, {}).get("step", 0)
            out[o.name] = int(step.item() if isinstance(step, torch.Tensor) else step)
        return out

    def state_keys(self, dtype: torch.dtype, device: torch.device) -> tuple[str, ...]:
        """The keys of the state tensors the optimizer keeps of a parameter's shape: one
        step of a fresh optimizer of the same class and hyperparameters on a 2x2 zero
        matrix. A rank whose owned parameters never had a gradient (or that owns none)
        still holds these, as zeros, so every rank's state has the same keys."""
        probe = torch.zeros(2, 2, dtype=dtype, device=device, requires_grad=True)
        options = {k: v for k, v in self.group.items() if k != "params"}
        twin = type(self.optimizer)([{"params": [probe], **options}])
        probe.grad = torch.zeros_like(probe)
        twin.step()
        return tuple(k for k, v in twin.state[probe].items()
                     if torch.is_tensor(v) and v.shape == probe.shape)


def _shaped(v: Any, o: Owned) -> bool:
    return torch.is_tensor(v) and tuple(v.shape) == o.shape


def _clone(v: Any) -> Any:
    return v.clone() if torch.is_tensor(v) else v


__all__ = ["Owned", "WholeTensorStep"]
