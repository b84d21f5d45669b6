"""Checks that every rank agrees, done so that a disagreement is an error, never a hang.

At construction every rank describes what it is about to train (parameter names,
shapes, dtypes, groups, settings) and whether its local checks passed. One small
all-gather of a fixed-size digest compares them; only on a mismatch does a follow-up
`all_gather_object` exchange the descriptions, so that every rank can name the first
differing parameter and raise the *same* error. A rank whose local checks failed still
takes part in the collective, which is what keeps the others from waiting forever.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from evenzero.runtime.collectives import all_gather_flat


class ZeroConfigError(ValueError):
    """Bad construction input or ranks that disagree; the message names the fix."""


class ZeroRuntimeError(RuntimeError):
    """Misuse during training (step without backward, mismatched gradients, ...)."""


@dataclass(frozen=True)
class RankDescription:
    """What one rank is about to train, compared across ranks at construction."""

    params: tuple[tuple[str, tuple[int, ...], str, str], ...]
    """(name, shape, dtype, group) of each trainable parameter in registration order."""
    groups: tuple[tuple[str, int], ...]
    """(name, process-group size) of each parameter group."""
    settings: tuple[tuple[str, str], ...]
    """Engine settings that must match (stage, strategy, bucket size, ...)."""
    error: str | None = None
    """This rank's local check failure, if any."""

    def digest(self) -> list[int]:
        text = repr((self.params, self.groups, self.settings)).encode()
        raw = hashlib.sha256(text).digest()
        return [int.from_bytes(raw[i:i + 7], "little") for i in range(0, 28, 7)]


def agree(desc: RankDescription, world_group, device: torch.device) -> None:
    """Raise the same `ZeroConfigError` on every rank unless all ranks match and passed."""
    world = dist.get_world_size(world_group)
    mine = torch.tensor([1 if desc.error else 0, *desc.digest()], dtype=torch.int64, device=device)
    every = torch.empty(world * mine.numel(), dtype=torch.int64, device=device)
    all_gather_flat(every, mine, world_group)
    rows = every.view(world, -1).tolist()
    if all(r[0] == 0 for r in rows) and all(r[1:] == rows[0][1:] for r in rows):
        return
    descs: list[RankDescription | None] = [None] * world
    dist.all_gather_object(descs, desc, group=world_group)
    raise ZeroConfigError(explain_mismatch(descs))


def explain_mismatch(descs: Sequence[RankDescription]) -> str:
    """One line naming the first failure or difference, identical on every rank."""
    for r, d in enumerate(descs):
        if d.error:
            return f"rank {r}: {d.error}"
    ref = descs[0]
    for field_name, what in (("params", "parameter"), ("groups", "parameter group"),
                             ("settings", "setting")):
        a_items = getattr(ref, field_name)
        for d in descs[1:]:
            b_items = getattr(d, field_name)
            for i in range(max(len(a_items), len(b_items))):
                a = a_items[i] if i < len(a_items) else None
                b = b_items[i] if i < len(b_items) else None
                if a != b:
                    differing = [k for k, other in enumerate(descs)
                                 if (getattr(other, field_name)[i:i + 1] or [None])[0] != a]
                    return (f"{what} #{i} differs across ranks: rank 0 has {_fmt(a)}, ranks "
                            f"{differing} have {_fmt(b)}; build the same model and pass the same "
                            f"settings on every rank")
    return "ranks disagree on the model description (digest mismatch); build the same model on every rank"


def _fmt(item) -> str:
    if item is None:
        return "nothing"
    if len(item) == 4:
        name, shape, dtype, group = item
        return f"{name!r} shape {list(shape)} {dtype} in group {group!r}"
    return repr(item)


def check_group_partition(memberships: Sequence[tuple[int, ...]], world_group,
                          device: torch.device, group_names: Sequence[str]) -> None:
    """Each parameter group's process groups must partition the world into equal groups.

    `memberships[g]` lists the ranks (within the data-parallel world group) in this rank's process group for group g.
    All ranks exchange membership bit vectors (the digest check has made the sizes
    equal), so every rank reaches the same verdict.
    """
    world = dist.get_world_size(world_group)
    bits = torch.zeros(len(memberships), world, dtype=torch.int64, device=device)
    for g, ranks in enumerate(memberships):
        bits[g, list(ranks)] = 1
    every = torch.empty(world * bits.numel(), dtype=torch.int64, device=device)
    all_gather_flat(every, bits.flatten(), world_group)
    table = every.view(world, len(memberships), world).tolist()
    for g, name in enumerate(group_names):
        for r in range(world):
            members = [m for m in range(world) if table[r][g][m]]
            bad = [m for m in members if table[m][g] != table[r][g]]
            if r not in members or bad:
                raise ZeroConfigError(
                    f"process groups of parameter group {name!r} are inconsistent: rank {r} is "
                    f"in {members}, but rank(s) {bad or [r]} disagree; create every process "
                    f"group on every rank in the same order (e.g. evenzero.moe."
                    f"expert_parallel_groups) and pass each rank the group it belongs to")


def check_presence(counts: Sequence[float], names: Sequence[str], world: int,
                   allow_partial: bool) -> None:
    """Every gradient must exist on all ranks or none (unless partial grads are allowed).

    `counts[i]` is how many ranks produced a gradient for parameter i since the last step.
    """
    if allow_partial:
        return
    for name, count in zip(names, counts, strict=True):
        k = int(round(count))
        if 0 < k < world:
            raise ZeroRuntimeError(
                f"gradient of {name!r} was produced on {k} of {world} ranks since the last step; "
                f"every rank must use the same parameters, or pass allow_partial_grads=True to "
                f"count a missing gradient as zeros (like DDP's find_unused_parameters)")


def backward_problems(module: torch.nn.Module, managed: set[int],
                      frozen: set[int] = frozenset()) -> list[str]:
    """What this rank alone can see went wrong in the backward that just ended with
    parameters it does not manage. `frozen` holds the ids of parameters that were frozen
    when the optimizer was built. (A parameter read before its gather finished is the
    gathers' own check: `ParamGathers.end_backward`.)"""
    problems = []
    named = module.named_parameters() if _any_unmanaged_grad(module, managed) else ()
    for name, p in named:
        if p.grad is not None and id(p) not in managed and p.requires_grad and p.numel():
            if id(p) in frozen:
                problems.append(
                    f"parameter {name!r} was frozen (requires_grad=False) when ZeroOptimizer "
                    f"was built, so it has no shard and no optimizer state, and it was unfrozen "
                    f"since; build ZeroOptimizer with it trainable (freezing it later with "
                    f"requires_grad_(False) is fine), or close() this one and build a new one")
            else:
                problems.append(
                    f"parameter {name!r} has a gradient but ZeroOptimizer does not manage it "
                    f"(added or replaced after construction); build ZeroOptimizer after the "
                    f"model is final")
            break
    return problems


def _any_unmanaged_grad(module: torch.nn.Module, managed: set[int]) -> bool:
    """Whether a trainable parameter outside `managed` holds a gradient. Runs after every
    backward: a walk over the modules' own dicts costs a fifth of `named_parameters()`
    (no names built), which then runs only to name the first such parameter. An empty
    parameter is never managed (nothing to reduce or step) and keeps its empty gradient,
    as under DDP."""
    seen, stack = set(), [module]
    while stack:
        m = stack.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        for p in m._parameters.values():
            if (p is not None and id(p) not in managed and p.requires_grad
                    and p.grad is not None and p.numel()):
                return True
        stack.extend(c for c in m._modules.values() if c is not None)
    return False
