"""Backward hooks: a post-accumulate-grad hook per parameter and an end-of-backward callback.

`register_post_accumulate_grad_hook` is attached to the Parameter object itself, so it
survives `param.data = ...` and dtype re-casts inside forward. (DeepSpeed's hook hangs
off the parameter's AccumulateGrad node, which a re-cast replaces: that is how the seed
case lost the MoE gate's gradient without a word.) It fires after autograd has summed
the new gradient into `param.grad`, once per parameter per backward, tied parameters
included (one Parameter object, one hook).

The first hook of a backward queues a callback on autograd's engine, which runs once the
whole backward graph is done: that is where unfinished buckets are flushed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import torch


class BackwardHooks:
    """Calls `on_grad(name)` as each gradient lands and `on_end()` when backward finishes."""

    def __init__(self, named: Sequence[tuple[str, torch.nn.Parameter]],
                 on_grad: Callable[[str], None], on_end: Callable[[], None]) -> None:
        self.on_grad, self.on_end = on_grad, on_end
        self.in_backward = False
        self.arrival: list[str] | None = None
        self._recorded: set[str] = set()
        self.handles = [p.register_post_accumulate_grad_hook(functools.partial(self._hook, n))
                        for n, p in named]

    def record_arrival(self) -> None:
        """Record the order gradients arrive in during the next backward."""
        self.arrival, self._recorded = [], set()

    def take_arrival(self) -> list[str] | None:
        order, self.arrival = self.arrival, None
        return order

    def _hook(self, name: str, _param: torch.Tensor) -> None:
        if not self.in_backward:
            self.in_backward = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
        if self.arrival is not None and name not in self._recorded:
            self._recorded.add(name)
            self.arrival.append(name)
        self.on_grad(name)

    def _end(self) -> None:
        self.in_backward = False
        self.on_end()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
