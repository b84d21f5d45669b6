"""Backward hooks: a post-accumulate-grad hook per parameter, a gradient hook on the
module's outputs, and an end-of-backward callback.

`register_post_accumulate_grad_hook` is attached to the Parameter object itself, so it
survives `param.data = ...` and dtype re-casts inside forward. (DeepSpeed's hook hangs
off the parameter's AccumulateGrad node, which a re-cast replaces: that is how the seed
case lost the MoE gate's gradient without a word.) It fires after autograd has summed
the new gradient into `param.grad`, once per parameter per backward, tied parameters
included (one Parameter object, one hook).

Backward starts at whichever fires first: a parameter hook, or the gradient hook that
a forward hook puts on every output tensor of the root module. The output hook matters
on a rank whose backward reaches no managed parameter (a data-dependent branch, every
token routed around the experts): no parameter hook fires there, and without the output
hook that rank would never launch its share of the bucket collectives while the other
ranks wait for it forever. With it, the rank's end-of-backward callback still runs and
reduces zeros, and the step's presence check names the parameter.

Backward start queues a callback on autograd's engine, which runs once the whole
backward graph is done: that is where unfinished buckets are flushed.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch


def _tensors(value: Any) -> list[torch.Tensor]:
    """Tensors inside a forward's output (tensor, or nested tuples, lists, dicts)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return []


def _accumulates(grad_fn) -> bool:
    """True if the running backward accumulates into leaves (`.backward()`), False for
    `torch.autograd.grad`, which must not count as a training backward."""
    seen, stack = set(), [grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if type(node).__name__ == "AccumulateGrad":
            try:
                return bool(torch._C._will_engine_execute_node(node))
            except RuntimeError:  # raised for leaves under torch.autograd.grad
                return False
        stack.extend(f for f, _ in node.next_functions)
    return False


class BackwardHooks:
    """Calls `on_start()` when a backward through the module begins, `on_grad(name)` as
    each gradient lands and `on_end()` when that backward finishes."""

    def __init__(self, module: torch.nn.Module, named: Sequence[tuple[str, torch.nn.Parameter]],
                 on_grad: Callable[[str], None], on_end: Callable[[], None],
                 on_start: Callable[[], None] = lambda: None) -> None:
        self.on_grad, self.on_end, self.on_start = on_grad, on_end, on_start
        self.in_backward = False
        self.arrival: list[str] | None = None
        self._recorded: set[str] = set()
        self._task = -1  # graph task whose backward started from a parameter hook
        self._probed = -1  # graph task whose end is already being watched
        self.handles = [p.register_post_accumulate_grad_hook(functools.partial(self._hook, n))
                        for n, p in named]
        self.handles.append(module.register_forward_hook(self._watch_outputs))

    def record_arrival(self) -> None:
        """Record the order gradients arrive in during the next backward."""
        self.arrival, self._recorded = [], set()

    def take_arrival(self) -> list[str] | None:
        order, self.arrival = self.arrival, None
        return order

    def _watch_outputs(self, _module, _args, output) -> None:
        if not torch.is_grad_enabled():
            return
        for t in _tensors(output):
            if t.requires_grad:
                t.register_hook(functools.partial(self._output_grad, t.grad_fn))

    def _output_grad(self, grad_fn, _grad: torch.Tensor) -> None:
        task = torch._C._current_graph_task_id()
        if task != self._probed:
            self._probed = task
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(self._probe, task, grad_fn))

    def _probe(self, task: int, grad_fn) -> None:
        """End of a backward through the module's outputs. If no parameter hook fired in
        it, this rank's backward reached no managed parameter: run the end-of-backward
        path anyway (it reduces zeros), so the other ranks' collectives are matched."""
        if self._task == task or not _accumulates(grad_fn):
            return  # the parameter hooks took care of it, or it was torch.autograd.grad
        self._task = task
        self.in_backward = True
        self.on_start()
        self._end()

    def _begin(self) -> None:
        if not self.in_backward:
            self.in_backward = True
            self._task = torch._C._current_graph_task_id()
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
            self.on_start()

    def _hook(self, name: str, _param: torch.Tensor) -> None:
        self._begin()
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
