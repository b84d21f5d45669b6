"""`ShardedGrad`: what `param.grad` holds once a backward's gradients have been reduced.

After a synchronised backward the gradient of a managed parameter no longer exists as
one tensor on one rank: it has been reduced, and each rank keeps only its 1/N slice in
the optimizer's fp32 gradient shard. `param.grad` then holds a `ShardedGrad`, a
placeholder with the parameter's shape, dtype and device and no storage, so that:

* `p.grad is not None` stays true, as after a backward in torch;
* clearing works however the user clears: `p.grad = None` (what `zero_grad()` does by
  default) drops the placeholder, and `p.grad.zero_()` (what
  `zero_grad(set_to_none=False)` does, from the optimizer or the module) marks it
  cleared. The optimizer reads both at the next reduction and then overwrites the shard
  instead of adding to it (`runtime/gradclear.py`);
* not clearing works too: the placeholder's layout is sparse, so autograd's
  AccumulateGrad computes `new_grad + p.grad` out of place (torch
  csrc/autograd/functions/accumulate_grad.h@v2.13.0, "Case 2.1 / 3.1: Sparse
  variable_grad + Dense new_grad") and that addition reaches `__torch_dispatch__`
  below. It is an exact, free signal that the user kept the gradient (torch semantics:
  accumulate); the placeholder returns a copy of the new, local gradient, which becomes
  the dense `p.grad` that the next reduction adds onto the shard;
* anything else done with it (`torch.nn.utils.clip_grad_norm_`, `p.grad.norm()`,
  `p.grad * 2`, ...) raises an error that says why and names the sharded equivalent,
  rather than computing on a tensor that is not the gradient.

What `p.grad` holds, by stage:

* after a synchronised backward, stages 1 and 2 alike: this placeholder. The reduced
  gradient is in the optimizer's shards; `opt.clip_grad_norm_(c)` clips and returns the
  global norm;
* during and after backwards under `opt.no_sync()`: the local, accumulated, unreduced
  gradient as a plain dense tensor, as under DDP's `no_sync()`;
* after `zero_grad()` (set_to_none=True): None.

At stage 1 a placeholder may carry a `landing`: its parameter's view of the persistent
bucket buffer, where the next gradient is copied instead of into a new tensor.

One placeholder is made per parameter and reused (creating one costs about 2 us,
assigning it to `p.grad` well under 1 us).
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

import torch

from evenzero.runtime.checks import ZeroRuntimeError

aten = torch.ops.aten

_NORMS = {aten.linalg_vector_norm.default, aten.norm.Scalar, aten.norm.ScalarOpt_dim,
          aten._foreach_norm.Scalar, aten.linalg_norm.default}
_SCALES = {aten.mul_.Tensor, aten.mul_.Scalar, aten._foreach_mul_.Tensor,
           aten._foreach_mul_.Scalar, aten._foreach_mul_.List, aten.div_.Tensor, aten.div_.Scalar}


class AddSeen(Enum):
    """What autograd found when it accumulated a new gradient onto the placeholder."""

    NONE = "none"
    """No gradient was accumulated onto it since it was installed."""
    KEPT = "kept"
    """Accumulated onto an uncleared placeholder: the reduced gradient is kept."""
    CLEARED = "cleared"
    """Accumulated onto a placeholder that `zero_()` had cleared."""


class ShardedGrad(torch.Tensor):
    """Placeholder `param.grad` standing for a gradient that lives sharded in the optimizer."""

    param_name: str
    cleared: bool
    add_seen: AddSeen
    landing: torch.Tensor | None

    @staticmethod
    def __new__(cls, param: torch.Tensor, name: str) -> ShardedGrad:
        # A sparse layout is what makes autograd add out of place (see the module
        # docstring) and lets `p.grad = placeholder` pass the dense-dtype check.
        out = torch.Tensor._make_wrapper_subclass(cls, param.shape, dtype=param.dtype,
                                                  device=param.device, layout=torch.sparse_coo)
        out.param_name = name
        out.cleared = False
        out.add_seen = AddSeen.NONE
        out.landing = None
        return out

    def __init__(self, param: torch.Tensor, name: str) -> None:  # noqa: D107 - set in __new__
        super().__init__()

    def reset(self) -> None:
        """Forget what happened to it: it now stands for the freshly reduced gradient."""
        self.cleared = False
        self.add_seen = AddSeen.NONE
        self.landing = None

    def __repr__(self, *, tensor_contents=None) -> str:  # noqa: ARG002 - torch's signature
        state = " (cleared)" if self.cleared else ""
        return (f"ShardedGrad({self.param_name!r}, shape={list(self.shape)}, dtype={self.dtype}{state}: "
                f"reduced and sharded over the ranks by ZeroOptimizer)")

    def __reduce_ex__(self, protocol):
        raise ZeroRuntimeError(f"the gradient of {self.param_name!r} is sharded by ZeroOptimizer and "
                               f"cannot be pickled; save the optimizer with opt.state_dict() or "
                               f"evenzero.checkpoint.save(opt, ...)")

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is aten.add.Tensor and _is_accumulation(args, kwargs):
            me: ShardedGrad = args[1]
            me.add_seen = AddSeen.CLEARED if me.cleared else AddSeen.KEPT
            land = me.landing
            if land is not None and land.dtype == args[0].dtype and land.shape == args[0].shape:
                # Stage 1: the new gradient lands in its persistent bucket buffer, which
                # becomes p.grad, so later micro-batches accumulate there in place.
                return land.copy_(args[0])
            return args[0].clone()
        if func is aten.zero_.default:
            args[0].cleared = True
            return args[0]
        if func is aten._foreach_zero_.default and all(isinstance(t, ShardedGrad) for t in args[0]):
            for t in args[0]:
                t.cleared = True
            return None
        if func is aten.detach_.default:
            return args[0]
        raise ZeroRuntimeError(_refusal(func, args))


def _is_accumulation(args, kwargs) -> bool:
    """`new_grad + placeholder`, as AccumulateGrad issues it, inside a backward."""
    return (len(args) == 2 and not isinstance(args[0], ShardedGrad)
            and isinstance(args[1], ShardedGrad) and kwargs.get("alpha", 1) == 1
            and args[0].layout == torch.strided and args[0].shape == args[1].shape
            and torch._C._current_graph_task_id() != -1)


def _names(args) -> str:
    found = []
    for a in args:
        items = a if isinstance(a, (list, tuple)) else [a]
        found += [t.param_name for t in items if isinstance(t, ShardedGrad)]
    return ", ".join(repr(n) for n in found[:3]) + (" ..." if len(found) > 3 else "")


def _refusal(func, args) -> str:
    what = f"{func} on the gradient of {_names(args)}"
    why = ("after a synchronised backward ZeroOptimizer has reduced the gradients and each rank "
           "keeps only its shard, so p.grad holds a placeholder, not the gradient")
    if func in _NORMS or func in _SCALES:
        return (f"{what}: {why}. Gradients are sharded by ZeroOptimizer; use "
                f"opt.clip_grad_norm_(max_norm) instead of torch.nn.utils.clip_grad_norm_: it "
                f"clips every rank's shard and returns the global norm")
    return (f"{what}: {why}. Clip with opt.clip_grad_norm_(max_norm); clear with "
            f"opt.zero_grad() or model.zero_grad(); inside opt.no_sync() p.grad is the local dense "
            f"gradient")


def placeholders(named: list[tuple[str, torch.nn.Parameter]]) -> dict[str, ShardedGrad]:
    """One reusable placeholder per parameter."""
    return {n: ShardedGrad(p, n) for n, p in named}


def drop_placeholders(params: Mapping[str, torch.nn.Parameter]) -> None:
    """Replace every placeholder left in `p.grad` (the optimizer goes away) by what torch
    would hold: zeros where the user cleared it with `zero_()` (`zero_grad(set_to_none=
    False)`), so that a parameter frozen since is still stepped on zeros by the next
    optimizer, as torch does; None otherwise (the reduced gradient is sharded and the
    optimizer that holds it is going away)."""
    for p in params.values():
        if isinstance(p.grad, ShardedGrad):
            p.grad = torch.zeros_like(p) if p.grad.cleared else None
