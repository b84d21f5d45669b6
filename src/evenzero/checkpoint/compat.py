"""Does a checkpoint fit this run? Compared before any tensor is read or written.

Everything that would make a load silently wrong is checked here, against a
`LocalModel` that the caller builds from the running optimizer: parameter names,
shapes and groups, expert-parallel sizes, the optimizer class and its option and state
keys, and the model's buffers. The first difference raises a `CheckpointError` that
names the parameter (or option) and the fix.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from evenzero.checkpoint.format import CheckpointError, Manifest, StoredTensor, storage_name


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
    hyperparameter_keys: Mapping[str, frozenset[str]]
    """Plan group name -> keys of its torch param group (lr, betas, ...)."""
    state_keys: Mapping[str, frozenset[str]]
    """Plan group name -> optimizer-state keys present now; empty before the first step."""
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
        saved_hyper = frozenset(g.hyperparameters)
        if saved_hyper != local.hyperparameter_keys[name]:
            diff = sorted(saved_hyper ^ local.hyperparameter_keys[name])
            raise CheckpointError(f"{where}: optimizer options of group {name!r} differ in "
                                  f"{diff}; the checkpoint is from a different optimizer setup")
        now = local.state_keys.get(name, frozenset())
        saved = frozenset(g.state_keys) | frozenset(g.scalars)
        if now and now != saved:
            raise CheckpointError(f"{where}: optimizer state of group {name!r} has keys "
                                  f"{sorted(saved)} in the checkpoint but {sorted(now)} here; "
                                  f"the checkpoint is from a different optimizer")
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
