"""Gradient clearing with torch's semantics, over gradients that live in shards.

In torch, gradients accumulate across backwards until the user clears them, however
they clear them: `opt.zero_grad()`, `model.zero_grad()`, `set_to_none` either way,
`p.grad = None`. A step does not clear them. evenzero keeps that rule exactly, per
parameter:

* after a synchronised backward every managed parameter's `p.grad` is its
  `ShardedGrad` placeholder (`runtime/shardedgrad.py`), on every rank alike, so that
  what the user does to it next is the same on every rank;
* at the first gradient accumulated for a parameter since its last reduction (its
  post-accumulate hook, under `no_sync()` or not) the tracker decides whether the user
  cleared it: autograd added onto the uncleared placeholder -> kept; onto a placeholder
  `zero_()` cleared, or onto None -> cleared. A parameter with no gradient in the
  backward that reduces is decided at that reduction from what `p.grad` holds then;
* when its bucket's reduced chunk is added into this rank's shard, the runs of cleared
  parameters are overwritten instead of accumulated (`add_reduced`).

The tracker also keeps, per parameter, whether torch would hold a gradient at all
(`has_grad`: False after `p.grad = None` until a gradient arrives), which decides
whether the step touches the parameter (`runtime/maskedstep.py`).

Under `no_sync()` `p.grad` is the local dense gradient. Replacing it between
micro-batches (`p.grad = None`) clears it as in torch; changing it in place while the
earlier reduced gradient is still kept (e.g. `model.zero_grad(set_to_none=False)`
between micro-batches without clearing after the last step) cannot be told apart from
scaling it, so it is reported as a problem instead of guessed.
"""

from __future__ import annotations

import weakref
from collections.abc import Mapping, Sequence

import torch

from evenzero.runtime.shardedgrad import AddSeen, ShardedGrad


class ClearTracker:
    """Per parameter: cleared since its last reduction? would torch hold a gradient?"""

    def __init__(self, params: Mapping[str, torch.nn.Parameter],
                 placeholders: Mapping[str, ShardedGrad]) -> None:
        self.params = params
        self.placeholders = dict(placeholders)
        """Name -> the placeholder installed last (what `p.grad` holds after a reduction)."""
        self._made = {(n, ph.dtype): ph for n, ph in placeholders.items()}
        self.pending: dict[str, bool] = {}
        """Name -> cleared, decided at its first accumulation since its last reduction."""
        self.has_grad: dict[str, bool] = dict.fromkeys(params, False)
        self._local: dict[str, tuple[weakref.ref, int]] = {}

    # ------------------------------------------------------------------ hooks

    def accumulated(self, name: str) -> str | None:
        """A gradient was accumulated into `p.grad` (post-accumulate hook). Returns a
        problem to raise at the step (on every rank), or None."""
        p = self.params[name]
        self.has_grad[name] = True
        problem = None
        if name not in self.pending:
            ph = self.placeholders[name]
            self.pending[name] = ph.add_seen is not AddSeen.KEPT
            ph.add_seen = AddSeen.NONE
        else:
            problem = self._check_local(name, p.grad, in_hook=True)
        self._remember(name, p.grad)
        return problem

    def _remember(self, name: str, grad: torch.Tensor | None) -> None:
        if grad is None or isinstance(grad, ShardedGrad):
            self._local.pop(name, None)
        else:
            self._local[name] = (weakref.ref(grad), grad._version)

    def _check_local(self, name: str, grad: torch.Tensor | None, in_hook: bool) -> str | None:
        """Between two looks at the local gradient of `name` (no reduction between):
        was it replaced or changed by someone other than autograd's accumulation?"""
        seen = self._local.get(name)
        expected = 1 if in_hook else 0
        if seen is not None and seen[0]() is grad and (grad._version == seen[1] + expected
                                                       or grad._is_view()):
            # Only autograd's in-place accumulation touched it. (A stage-1 landing view
            # shares its version counter with the whole bucket buffer, so for views only
            # the identity is checked.)
            return None
        if seen is not None and seen[0]() is grad:
            # Same tensor, written in place by someone else (zero_, mul_, clipping).
            if not self.pending[name]:
                return (f"the local gradient of {name!r} was changed in place between "
                        f"backwards under no_sync() while the gradient reduced before it "
                        f"was kept (not cleared after the last step); clear gradients with "
                        f"zero_grad() after step(), or leave p.grad alone under no_sync()")
            return None
        if in_hook and grad is not None and grad.requires_grad:
            return None  # create_graph=True: autograd accumulated out of place
        # Replaced (p.grad = None, or a tensor the user assigned): cleared, as in torch.
        self.pending[name] = True
        return None

    # ------------------------------------------------------------------ reduction

    def cleared(self, name: str) -> bool:
        """Decide, when its bucket is reduced, whether `name`'s runs are overwritten."""
        p, ph = self.params[name], self.placeholders[name]
        grad = p.grad
        if name in self.pending:
            if grad is None:  # cleared to None after its last accumulation
                self.pending[name] = True
                self.has_grad[name] = False
            elif not isinstance(grad, ShardedGrad):
                self._check_local(name, grad, in_hook=False)
            return self.pending[name]
        if grad is ph:
            return ph.cleared
        if grad is None:
            self.has_grad[name] = False
        else:  # a tensor the user assigned to p.grad: it replaces the gradient
            self.has_grad[name] = True
        return True

    def reduced(self, name: str) -> None:
        """Its bucket was reduced: `p.grad` becomes the placeholder again."""
        self.pending.pop(name, None)
        self._local.pop(name, None)
        p = self.params[name]
        # One placeholder per dtype the parameter is seen in: a forward that re-casts
        # `p.data` (the seed case's gate) leaves it in another dtype during backward.
        ph = self._made.get((name, p.dtype))
        if ph is None or ph.shape != p.shape or ph.device != p.device:
            ph = self._made[(name, p.dtype)] = ShardedGrad(p, name)
        ph.reset()
        self.placeholders[name] = ph
        p.grad = ph

    # ------------------------------------------------------------------ step

    def settle(self) -> list[str]:
        """At a step: apply clears made since the last reduction. Returns the names whose
        runs must be zeroed (a zeroed placeholder or `p.grad = None`); afterwards
        `has_grad` says which parameters torch would step on this rank."""
        zeroed = []
        for name, p in self.params.items():
            if name in self.pending:
                continue  # accumulated under no_sync only: the step refuses that anyway
            grad, ph = p.grad, self.placeholders[name]
            if grad is None:
                if self.has_grad[name]:
                    zeroed.append(name)
                self.has_grad[name] = False
            elif grad is ph and ph.cleared:
                zeroed.append(name)
                ph.cleared = False
        return zeroed

    def forget(self) -> None:
        """Everything was dropped (a void step): no gradient anywhere, nothing pending."""
        self.pending.clear()
        self._local.clear()
        self.has_grad = dict.fromkeys(self.params, False)
        for ph in self.placeholders.values():
            ph.reset()

    def clear_all(self, set_to_none: bool) -> None:
        """The optimizer's own zero_grad(): every gradient is cleared (pending decisions
        of no_sync() micro-batches included, which a clear in place could not tell)."""
        for name in self.pending:
            self.pending[name] = True
        self._local.clear()
        if set_to_none:
            self.has_grad = dict.fromkeys(self.params, False)

    def drop_absent(self, absent: Sequence[str]) -> None:
        """After a step: parameters no rank had a gradient for show `p.grad = None`, as in
        torch (their shard runs are zero, so clearing them changes nothing)."""
        for name in absent:
            if self.params[name].grad is self.placeholders[name]:
                self.params[name].grad = None


def add_reduced(shard: torch.Tensor, offset: int, chunk: torch.Tensor, scale: float,
                cleared: Sequence[tuple[int, int]]) -> None:
    """`shard[offset:offset + len(chunk)] += chunk * scale`, except that where the
    window meets the runs in `cleared` ((shard offset, numel), sorted) it is
    overwritten instead."""
    hi = offset + chunk.numel()
    window = shard[offset:hi]
    spans = [(max(o, offset) - offset, min(o + n, hi) - max(o, offset)) for o, n in cleared
             if o < hi and o + n > offset]
    if not spans:
        window.add_(chunk, alpha=scale)
        return
    if spans == [(0, window.numel())]:
        if chunk.dtype == window.dtype:
            torch.mul(chunk, scale, out=window)
        else:  # upcast first, then scale in the shard's dtype, as add_ would
            window.copy_(chunk)
            window.mul_(scale)
        return
    for off, n in spans:
        window[off:off + n].zero_()
    window.add_(chunk, alpha=scale)
