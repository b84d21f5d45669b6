"""Record the collectives a third-party system issues, as `evenzero.plan.Collective`s.

evenzero's own optimizer reports what it issued (`ZeroOptimizer.trace`). DDP, FSDP2 and
DeepSpeed do not, so while a `CollectiveCapture` is active every Python-level
`torch.distributed` collective is wrapped and recorded as (op, group, group size,
group-local root, numel) in the same record format as `evenzero plan --json`.

What is not seen: DDP's C++ reducer calls the process group directly, so DDP has to run
with a Python comm hook (`torch.distributed.algorithms.ddp_comm_hooks.default_hooks
.allreduce_hook`, which is what DDP does natively, expressed in Python) to be captured.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from evenzero.plan import BACKWARD, Collective

# torch function name -> (recorded op, name of the tensor argument whose numel is the message,
# its position). The deprecated names (`reduce_scatter_tensor`, `all_gather_into_tensor`)
# forward to the `*_single` ones in torch >= 2.13; the re-entrancy guard records only
# the outermost call, so each collective is counted once whichever name was used.
_WRAPPED: dict[str, tuple[str, str, int]] = {
    "all_reduce": ("all_reduce", "tensor", 0),
    "reduce": ("reduce", "tensor", 0),
    "broadcast": ("broadcast", "tensor", 0),
    "reduce_scatter_tensor": ("reduce_scatter", "input", 1),
    "reduce_scatter_single": ("reduce_scatter", "input", 1),
    "_reduce_scatter_base": ("reduce_scatter", "input", 1),
    "reduce_scatter": ("reduce_scatter", "input_list", 1),
    "all_gather_into_tensor": ("all_gather", "output_tensor", 0),
    "all_gather_single": ("all_gather", "output_tensor", 0),
    "_all_gather_base": ("all_gather", "output_tensor", 0),
    "all_gather": ("all_gather", "tensor_list", 0),
    "all_to_all_single": ("all_to_all", "output", 0),
    "all_to_all": ("all_to_all", "output_tensor_list", 0),
    "all_reduce_coalesced": ("all_reduce", "tensors", 0),
}


@dataclasses.dataclass(frozen=True)
class CaptureOptions:
    """How captured calls are named and which ones are left out."""

    group_labels: Mapping[frozenset[int], str] = dataclasses.field(default_factory=dict)
    """Global ranks of a process group -> the parameter-group name it reduces
    (e.g. all ranks -> "dense", {0, 4} -> "ep_size_4"); others are named "ranks{...}"."""
    exclude_all_to_all_ranks: frozenset[int] | None = None
    """Ranks of the MoE token-dispatch group: all_to_all over exactly these ranks is the
    expert dispatch (forward and its backward), not gradient reduction, so it is skipped."""


class CollectiveCapture:
    """Wraps torch.distributed collectives while `active()`; `calls` holds what ran."""

    def __init__(self, options: CaptureOptions = CaptureOptions()) -> None:
        self.options = options
        self.calls: list[Collective] = []
        self.phase = BACKWARD
        self._local = threading.local()
        self._installed: list[tuple[Any, str, Callable]] = []

    @contextmanager
    def active(self, phase: str = BACKWARD) -> Iterator[list[Collective]]:
        """Record every collective issued inside the block, tagged with `phase`."""
        if self._installed:
            raise RuntimeError("CollectiveCapture.active() is not re-entrant; close the first block")
        self.phase = phase
        self._install()
        try:
            yield self.calls
        finally:
            self._uninstall()

    @contextmanager
    def phase_as(self, phase: str) -> Iterator[None]:
        """Tag calls inside the block with `phase` (e.g. "step") while staying active."""
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before

    def take(self) -> list[Collective]:
        """The calls recorded so far, and forget them."""
        out, self.calls = self.calls, []
        return out

    # ------------------------------------------------------------------ patching

    def _install(self) -> None:
        # Both namespaces: callers hold `torch.distributed.X`, while the deprecated
        # wrappers look up `X_single` in distributed_c10d's globals at call time.
        for namespace in (dist, c10d):
            for name in _WRAPPED:
                original = getattr(namespace, name, None)
                if original is None:
                    continue
                setattr(namespace, name, self._wrap(name, original))
                self._installed.append((namespace, name, original))

    def _uninstall(self) -> None:
        for namespace, name, original in reversed(self._installed):
            setattr(namespace, name, original)
        self._installed = []

    def _wrap(self, name: str, original: Callable) -> Callable:
        op, arg_name, arg_pos = _WRAPPED[name]

        def wrapper(*args, **kwargs):
            depth = getattr(self._local, "depth", 0)
            if depth == 0:
                self._record(op, name, args, kwargs, arg_name, arg_pos)
            self._local.depth = depth + 1
            try:
                return original(*args, **kwargs)
            finally:
                self._local.depth = depth

        wrapper.__wrapped__ = original  # type: ignore[attr-defined]
        return wrapper

    def _record(self, op: str, name: str, args: tuple, kwargs: dict, arg_name: str,
                arg_pos: int) -> None:
        group = kwargs.get("group")
        if group is None:
            group = _positional_group(name, args)
        ranks = _group_ranks(group)
        if op == "all_to_all" and ranks == self.options.exclude_all_to_all_ranks:
            return
        tensor = kwargs.get(arg_name, args[arg_pos] if len(args) > arg_pos else None)
        numel = _numel(tensor)
        root = None
        if op in ("reduce", "broadcast"):
            root = _root(name, args, kwargs, group)
        label = self.options.group_labels.get(ranks, "ranks{" + ",".join(map(str, sorted(ranks))) + "}")
        self.calls.append(Collective(self.phase, op, label, len(ranks), root, None, 0, numel,
                                     itemsize=_itemsize(tensor)))


def _positional_group(name: str, args: tuple) -> Any:
    # Signatures: all_reduce(tensor, op, group), reduce(tensor, dst, op, group),
    # broadcast(tensor, src, group), *_scatter/_gather(out, in, [op,] group), all_to_all_single
    # (output, input, out_splits, in_splits, group).
    position = {"all_reduce": 2, "reduce": 3, "broadcast": 2, "reduce_scatter_tensor": 3,
                "reduce_scatter_single": 3, "_reduce_scatter_base": 3, "reduce_scatter": 3,
                "all_gather_into_tensor": 2, "all_gather_single": 2, "_all_gather_base": 2,
                "all_gather": 2, "all_to_all_single": 4, "all_to_all": 2,
                "all_reduce_coalesced": 2}.get(name)
    if position is not None and len(args) > position:
        return args[position]
    return None


def _group_ranks(group: Any) -> frozenset[int]:
    if group is None or group is dist.group.WORLD:
        return frozenset(range(dist.get_world_size()))
    return frozenset(dist.get_process_group_ranks(group))


def _root(name: str, args: tuple, kwargs: dict, group: Any) -> int | None:
    if "group_dst" in kwargs and kwargs["group_dst"] is not None:
        return int(kwargs["group_dst"])
    if "group_src" in kwargs and kwargs["group_src"] is not None:
        return int(kwargs["group_src"])
    key = "dst" if name == "reduce" else "src"
    global_root = kwargs.get(key, args[1] if len(args) > 1 else None)
    if global_root is None:
        return None
    if group is None or group is dist.group.WORLD:
        return int(global_root)
    return dist.get_group_rank(group, int(global_root))


def _numel(tensor: Any) -> int:
    if isinstance(tensor, torch.Tensor):
        return tensor.numel()
    if isinstance(tensor, (list, tuple)):
        return sum(_numel(t) for t in tensor)
    return 0


def _itemsize(tensor: Any) -> int:
    if isinstance(tensor, torch.Tensor):
        return tensor.element_size()
    if isinstance(tensor, (list, tuple)) and tensor:
        return _itemsize(tensor[0])
    return 4
