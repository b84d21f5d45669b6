"""The optimizer a Lightning module configures, as a `ZeroOptimizer` its schedulers drive.

`configure_optimizers()` (or the script, under Fabric) builds a plain torch optimizer over
the module's parameters and often LR schedulers bound to it. `zero_optimizer_from` builds
a `ZeroOptimizer` of the same class over the same module, with the same param groups in
the same order and every group's options as they are now (including the keys that the
schedulers' constructors added: `initial_lr`, OneCycleLR's `max_lr`, ...).
`repoint_schedulers` then makes the schedulers step the new optimizer:

* each scheduler's `optimizer` (and, for SequentialLR / ChainedScheduler, each child's)
  is re-bound to the `ZeroOptimizer`, and the new optimizer's `step` carries torch's
  marker that a scheduler watches for, so `scheduler.step()` after `optimizer.step()`
  warns no more than it does with the plain optimizer
  (torch/optim/lr_scheduler.py@v2.13.0, `LRScheduler.__init__` and `step`);
* the user's optimizer object shares the `ZeroOptimizer`'s `param_groups` list, so code
  that kept a reference to it (a custom scheduler, a logger reading `lr`) reads and
  moves the live hyperparameters.

Nothing here imports Lightning: Trainer and Fabric strategies of either Lightning
package call it.
"""

from __future__ import annotations

import gc
import inspect
import weakref
from collections.abc import Iterable
from functools import wraps
from typing import Any

import torch

from evenzero.runtime import ZeroConfig, ZeroConfigError, ZeroOptimizer

GROUP_NAME_KEY = "name"
"""A key users put in param groups for logging (Lightning's LearningRateMonitor reads it)."""


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside Lightning's `LightningOptimizer` / Fabric's `_FabricOptimizer`."""
    seen = set()
    while not isinstance(optimizer, ZeroOptimizer) and id(optimizer) not in seen:
        seen.add(id(optimizer))
        inner = optimizer.__dict__.get("_optimizer") if hasattr(optimizer, "__dict__") else None
        if inner is None:
            break
        optimizer = inner
    return optimizer


def conversion_problem(module: torch.nn.Module, optimizer: Any) -> str | None:
    """Why `optimizer` cannot become a ZeroOptimizer over `module`, or None.

    Only what `ZeroOptimizer` cannot say itself: it checks the class (elementwise), that
    every trainable parameter is in a group and that groups hold parameters of the module.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        return (f"the optimizer is a {type(optimizer).__name__}, not a torch.optim.Optimizer; "
                f"evenzero shards torch optimizers (AdamW, SGD, ...)")
    if isinstance(optimizer, ZeroOptimizer):
        return None
    if any(optimizer.state.values()):
        return (f"the {type(optimizer).__name__} already holds optimizer state (it was stepped or "
                f"loaded before training started); evenzero builds the sharded optimizer from "
                f"its class and param groups and would drop that state. Return a fresh "
                f"optimizer and resume through the Trainer's ckpt_path / fabric.load instead")
    trainable = {id(p) for p in module.parameters() if p.requires_grad and p.numel() > 0}
    for i, group in enumerate(optimizer.param_groups):
        if not any(id(p) in trainable for p in group["params"]):
            return (f"param group {i} of the {type(optimizer).__name__} holds no trainable "
                    f"parameter of the module (all frozen or empty); evenzero plans one shard "
                    f"layout per group, so every group must hold one: remove the group, or "
                    f"unfreeze its parameters before training starts")
    return None


def zero_optimizer_from(module: torch.nn.Module, optimizer: torch.optim.Optimizer,
                        config: ZeroConfig) -> ZeroOptimizer:
    """A `ZeroOptimizer` over `module` with `optimizer`'s class, groups and options (a
    collective: every rank calls it). `optimizer` keeps its object but from now on shares
    the new optimizer's `param_groups`; use `repoint_schedulers` for its schedulers."""
    # A Trainer or Fabric that trained this module before and is no longer referenced
    # still holds its ZeroOptimizer until the cycle collector runs (trainer <-> strategy):
    # collect it now, so that the module is free for this one.
    gc.collect()
    cls = type(optimizer)
    groups = []
    for group in optimizer.param_groups:
        options = {k: v for k, v in group.items() if k not in ("params", GROUP_NAME_KEY)}
        groups.append({"params": list(group["params"]), **options})
    zero = ZeroOptimizer(module, cls, groups, config=config, **constructor_defaults(optimizer))
    if len(zero.param_groups) != len(optimizer.param_groups):
        # conversion_problem() ran before on every rank; this would be a runtime change.
        raise ZeroConfigError(f"the {cls.__name__} has {len(optimizer.param_groups)} param groups "
                              f"but the ZeroOptimizer {len(zero.param_groups)}")
    for mine, theirs in zip(zero.param_groups, optimizer.param_groups, strict=True):
        if GROUP_NAME_KEY in theirs:
            mine[GROUP_NAME_KEY] = theirs[GROUP_NAME_KEY]
    optimizer.param_groups = zero.param_groups
    return zero


def constructor_defaults(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """`optimizer.defaults` restricted to its class's constructor arguments."""
    accepted = set(inspect.signature(type(optimizer).__init__).parameters) - {"self", "params"}
    return {k: v for k, v in optimizer.defaults.items() if k in accepted}


def repoint_schedulers(schedulers: Iterable[Any], old: Any, zero: ZeroOptimizer) -> None:
    """Make every scheduler bound to `old` drive `zero` instead."""
    rebound = False
    for scheduler in schedulers:
        rebound |= _rebind(scheduler, old, zero)
    if rebound:
        _track_step_called(zero)


def _rebind(scheduler: Any, old: Any, zero: ZeroOptimizer) -> bool:
    found = False
    if getattr(scheduler, "optimizer", None) is old:
        scheduler.optimizer = zero
        found = True
    for child in getattr(scheduler, "_schedulers", ()) or ():  # SequentialLR, ChainedScheduler
        found |= _rebind(child, old, zero)
    return found


def _track_step_called(zero: ZeroOptimizer) -> None:
    """What torch's `LRScheduler.__init__` does to the optimizer it is given: an instance
    `step` that records the call, marked so that `LRScheduler.step` knows
    (torch/optim/lr_scheduler.py@v2.13.0:153-172). Without it the first scheduler step
    would warn that `optimizer.step()` was overridden."""
    if hasattr(zero.step, "_wrapped_by_lr_sched"):
        return
    owner = weakref.ref(zero)  # as torch's: the optimizer must not keep itself alive

    @wraps(type(zero).step)
    def step(*args: Any, **kwargs: Any) -> Any:
        opt = owner()
        opt._opt_called = True
        return type(opt).step(opt, *args, **kwargs)

    step._wrapped_by_lr_sched = True
    zero.step = step
