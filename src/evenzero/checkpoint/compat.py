"""Does a checkpoint fit this run? Compared before any tensor is read or written.

Everything that would make a load silently wrong is checked here, against a
`LocalModel` that the caller builds from the running optimizer: parameter names,
shapes and groups, expert-parallel sizes, the optimizer class and its own options, and
the model's buffers. The first difference raises a `CheckpointError` that names the
parameter (or option) and the fix.

Param-group options follow torch's `Optimizer.load_state_dict`, which takes the saved
groups whole: saved values win. Keys that LR schedulers and users add to groups
(`initial_lr`, ...) are not the optimizer's setup, so only the optimizer class's own
options (its `defaults`) must be present; keys only in the running groups are kept
(`evenzero.checkpoint.state.apply`). Saved optimizer state replaces the running state
whole, as in torch, so a checkpoint from before the first step (no state) rewinds a
trained optimizer to an empty state. Every saved option and scalar is checked to be a
value of the kind the running optimizer holds (a number for a number, finite).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from evenzero.checkpoint.format import CheckpointError, Manifest, StoredTensor, storage_name
from evenzero.checkpoint.values import decode_value, non_finite


@dataclass(frozen=True)
class LocalParam:
    """A trainable parameter as this rank sees it, for comparing against a manifest."""

    name: str
    group: str
    shape: tuple[int, ...]
    dtype: str


@dataclass(frozen=True)
class LocalModel:
    """What this rank's run looks like: the side of the comparison that is not on disk."""

    params: tuple[LocalParam, ...]
    expert_parallel_size: Mapping[str, int]
    """Plan group name -> expert-parallel size."""
    ep_ranks: Mapping[str, int]
    """Plan group name -> this rank's expert-parallel rank in it (0 for dense groups)."""
    optimizer_class: str
    option_keys: frozenset[str]
    """The optimizer class's own options (the keys of its `defaults`: lr, betas, ...)."""
    hyperparameters: Mapping[str, Mapping[str, Any]]
    """Plan group name -> its torch param group now, without "params"."""
    extras: tuple[StoredTensor, ...]


def check_compatible(m: Manifest, local: LocalModel, where: str) -> None:
    """Raise on the first difference that would make loading wrong, naming the fix."""
    if m.optimizer_class != local.optimizer_class:
        raise CheckpointError(f"{where}: saved with optimizer {m.optimizer_class}, this run uses "
                              f"{local.optimizer_class}; build the same optimizer, or "
                              f"export_consolidated() and import the parameters only")
    saved_groups = {g.name: g for g in m.groups}
    if set(saved_groups) != set(local.expert_parallel_size):
        raise CheckpointError(f"{where}: parameter groups {sorted(saved_groups)} in the "
                              f"checkpoint, {sorted(local.expert_parallel_size)} here; "
                              f"the checkpoint is from a different model")
    for name, e in local.expert_parallel_size.items():
        g = saved_groups[name]
        if g.expert_parallel_size != e:
            raise CheckpointError(f"{where}: group {name!r} was saved with expert_parallel_size "
                                  f"{g.expert_parallel_size}, this run uses {e}; resharding "
                                  f"changes only the data-parallel size, keep E={g.expert_parallel_size}")
        missing = sorted(local.option_keys - set(g.hyperparameters))
        if missing:
            raise CheckpointError(f"{where}: optimizer options of group {name!r} lack {missing}, "
                                  f"which {local.optimizer_class} defines; the checkpoint is from "
                                  f"a different optimizer setup (or a torch release without "
                                  f"these options)")
        check_options(g.hyperparameters, g.scalars, local.hyperparameters[name],
                      f"{where}: group {name!r}")
        for param, scalars in g.param_scalars.items():
            check_options({}, scalars, {}, f"{where}: parameter {param!r}")
    saved = {p.key: p for p in m.params}
    wanted: set[str] = set()
    for lp in local.params:
        e = local.expert_parallel_size[lp.group]
        wanted.update(storage_name(lp.name, e, r) for r in range(e))
        key = storage_name(lp.name, e, local.ep_ranks[lp.group])
        sp = saved.get(key)
        if sp is None:
            raise CheckpointError(f"{where}: parameter {key!r} is not in the checkpoint; "
                                  f"it is from a different model")
        if sp.group != lp.group:
            raise CheckpointError(f"{where}: parameter {lp.name!r} is in group {sp.group!r} in "
                                  f"the checkpoint but {lp.group!r} here")
        if sp.shape != lp.shape:
            raise CheckpointError(f"{where}: parameter {lp.name!r} has shape {list(sp.shape)} in "
                                  f"the checkpoint but {list(lp.shape)} here; it is from a "
                                  f"different model")
    extra = sorted(set(saved) - wanted)
    if extra:
        raise CheckpointError(f"{where}: checkpoint has parameter(s) {extra[:5]} that this model "
                              f"lacks; it is from a different model")
    saved_extras = {t.name: t for t in m.extras}
    for t in local.extras:
        s = saved_extras.get(t.name)
        if s is None:
            raise CheckpointError(f"{where}: model entry {t.name!r} (buffer or frozen parameter) "
                                  f"is not in the checkpoint; it is from a different model")
        if s.shape != t.shape:
            raise CheckpointError(f"{where}: model entry {t.name!r} has shape {list(s.shape)} in "
                                  f"the checkpoint but {list(t.shape)} here")
    missing = sorted(set(saved_extras) - {t.name for t in local.extras})
    if missing:
        raise CheckpointError(f"{where}: checkpoint has model entr(ies) {missing[:5]} that this "
                              f"model lacks; it is from a different model")


def check_options(saved: Mapping[str, Any], scalars: Mapping[str, Any],
                  now: Mapping[str, Any], where: str) -> None:
    """Saved param-group options and scalar state (JSON-encoded) hold finite values of the
    kind the running group holds; a counter such as Adam's `step` is not negative."""
    try:
        options, state = decode_value(dict(saved)), decode_value(dict(scalars))
    except (CheckpointError, KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{where}: undecodable option or state ({e}); the checkpoint is "
                              f"damaged") from None
    for kind, values in (("option", options), ("optimizer state", state)):
        for key, value in values.items():
            bad = non_finite(value, repr(key))
            if bad:
                raise CheckpointError(f"{where}: {kind} {bad} is {value!r}, not finite; the "
                                      f"checkpoint is damaged")
            if key in now and not _same_kind(value, now[key]):
                raise CheckpointError(f"{where}: {kind} {key!r} is {value!r} in the checkpoint but "
                                      f"{now[key]!r} here, a value of another kind; the checkpoint "
                                      f"is damaged")
    step = state.get("step")
    if step is not None and (not _is_number(step) or float(step) < 0):
        raise CheckpointError(f"{where}: optimizer state 'step' is {step!r}, not a non-negative "
                              f"count; the checkpoint is damaged")


def _is_number(value: Any) -> bool:
    """An int or float (not a bool), or a one-element real tensor (torch allows a tensor lr)."""
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() == 1 and value.dtype != torch.bool and not value.is_complex()
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _same_kind(saved: Any, now: Any) -> bool:
    """Could `saved` stand where the running group holds `now`? Numbers go with numbers;
    a bool flag may be None (`foreach`, `fused`); an option that is None now (unset) takes
    any value."""
    if _is_number(now):
        return _is_number(saved)
    if isinstance(now, bool):
        return saved is None or isinstance(saved, bool)
    if isinstance(now, str):
        return saved is None or isinstance(saved, str)
    if isinstance(now, (tuple, list)):
        return isinstance(saved, (tuple, list)) and len(saved) == len(now) and \
            all(_same_kind(a, b) for a, b in zip(saved, now, strict=True))
    return True
