"""Backward hooks: a post-accumulate-grad hook per parameter, a gradient hook on the
module's outputs, and an end-of-backward callback.

`register_post_accumulate_grad_hook` is attached to the Parameter object itself, so it
survives `param.data = ...` and dtype re-casts inside forward. (DeepSpeed's hook hangs
off the parameter's AccumulateGrad node, which a re-cast replaces: that is how the seed
case lost the MoE gate's gradient without a word.) It fires after autograd has summed
the new gradient into `param.grad`, once per parameter per backward, tied parameters
included (one Parameter object, one hook).

Backward starts at whichever fires first: a parameter hook, or the gradient hook that
a forward hook puts on every output tensor of the root module, found in outputs of any
structure (tuples, dicts, namedtuples, dataclasses, Hugging Face `ModelOutput`s, nested
ones) with torch's pytree. The output hook matters on a rank whose backward reaches no
managed parameter (a data-dependent branch, every token routed around the experts): no
parameter hook fires there, and without the output hook that rank would never launch
its share of the bucket collectives while the other ranks wait for it forever. With it,
the rank's end-of-backward callback still runs and reduces zeros, and the step's
presence check names the parameter.

Backward start queues a callback on autograd's engine, which runs once the whole
backward graph is done: that is where unfinished buckets are flushed. A root forward
pre-hook tells the owner a forward begins (where a backward that raised is settled).

The hooks hold their owner (the optimizer's backward driver) only weakly: the model
must not keep a dropped optimizer alive.
"""

from __future__ import annotations

import dataclasses
import functools
import weakref
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import torch
from torch.profiler import record_function
from torch.utils import _pytree as pytree

from evenzero.runtime.backwardclock import ArrivalClock

_profiling = torch._C._autograd._profiler_enabled
"""Whether a profiler records now (torch.profiler or torch.autograd.profiler)."""


class BackwardObserver(Protocol):
    """What the hooks report to (the optimizer's backward driver, `runtime/backward.py`)."""

    def backward_running(self) -> bool: ...

    def on_forward(self) -> None: ...

    def on_backward_start(self) -> None: ...

    def on_grad(self, name: str) -> None: ...

    def on_backward_end(self) -> None: ...


def output_tensors(value: Any) -> list[torch.Tensor]:
    """Every tensor in a forward's output, whatever its structure.

    torch's pytree flattens the containers it knows (tuple, list, dict, OrderedDict,
    namedtuple, and any type registered with it, as Hugging Face registers `ModelOutput`
    when installed). It leaves dataclasses and subclasses of dict, list and tuple whole,
    so those leaves are opened here: dataclass fields, mapping values, sequence items."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [value]
    while stack:
        for leaf in pytree.tree_leaves(stack.pop()):
            if id(leaf) in seen:
                continue
            seen.add(id(leaf))
            if isinstance(leaf, torch.Tensor):
                out.append(leaf)
            elif dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
                stack.extend(getattr(leaf, f.name, None) for f in dataclasses.fields(leaf))
            elif isinstance(leaf, Mapping):
                stack.extend(leaf.values())
            elif isinstance(leaf, (list, tuple)):
                stack.extend(leaf)
    return out


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
    """Reports to `owner` when a backward through the module begins, as each gradient
    lands and when that backward finishes; records the arrival order on request."""

    def __init__(self, module: torch.nn.Module, named: Sequence[tuple[str, torch.nn.Parameter]],
                 owner: BackwardObserver) -> None:
        self._owner = weakref.ref(owner)
        self.arrival: list[str] | None = None
        self.clock: ArrivalClock | None = None
        """Set while backwards are timed for the bucket size (`runtime/backwardclock.py`)."""
        self._recorded: set[str] = set()
        self._task = -1  # graph task whose backward started from a parameter hook
        self._probed = -1  # graph task whose end is already being watched
        self.handles = [p.register_post_accumulate_grad_hook(functools.partial(self._hook, n))
                        for n, p in named]
        self.handles.append(module.register_forward_pre_hook(self._before_forward))
        self.handles.append(module.register_forward_hook(self._watch_outputs))

    def record_arrival(self) -> None:
        """Record the order gradients arrive in during the next backward."""
        self.arrival, self._recorded = [], set()

    def take_arrival(self) -> list[str] | None:
        order, self.arrival = self.arrival, None
        return order

    def _before_forward(self, _module, _args) -> None:
        owner = self._owner()
        if owner is not None:
            owner.on_forward()
            if self.clock is not None:
                self.clock.forward_began()

    def _watch_outputs(self, _module, _args, output) -> None:
        if not torch.is_grad_enabled() or self._owner() is None:
            return
        if self.clock is not None:
            self.clock.forward_ended()
        for t in output_tensors(output):
            if t.requires_grad:
                t.register_hook(functools.partial(self._output_grad, t.grad_fn))

    def _output_grad(self, grad_fn, _grad: torch.Tensor) -> None:
        if self.clock is not None:
            self.clock.output_grad()
        task = torch._C._current_graph_task_id()
        if task != self._probed:
            self._probed = task
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(self._probe, task, grad_fn))

    def _probe(self, task: int, grad_fn) -> None:
        """End of a backward through the module's outputs. If no parameter hook fired in
        it, this rank's backward reached no managed parameter: run the end-of-backward
        path anyway (it reduces zeros), so the other ranks' collectives are matched."""
        owner = self._owner()
        if owner is None or self._task == task or not _accumulates(grad_fn):
            return  # the parameter hooks took care of it, or it was torch.autograd.grad
        self._task = task
        owner.on_backward_start()
        owner.on_backward_end()

    def _hook(self, name: str, _param: torch.Tensor) -> None:
        # Runs once per parameter per backward: on a model of thousands of small
        # parameters this is the runtime's hot path, so the profiler label is entered
        # only while a profiler records (entering one costs a few microseconds).
        owner = self._owner()
        if owner is None:
            return
        if _profiling():
            with record_function("evenzero::backward_hook"):
                self._run(owner, name)
        else:
            self._run(owner, name)

    def _run(self, owner: BackwardObserver, name: str) -> None:
        if not owner.backward_running():
            self._task = torch._C._current_graph_task_id()
            torch.autograd.Variable._execution_engine.queue_callback(self._end)
            owner.on_backward_start()
        if self.clock is not None:
            self.clock.grad(name)
        if self.arrival is not None and name not in self._recorded:
            self._recorded.add(name)
            self.arrival.append(name)
        owner.on_grad(name)

    def _end(self) -> None:
        owner = self._owner()
        if owner is not None:
            owner.on_backward_end()

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
