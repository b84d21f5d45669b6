"""Plans the runtime can execute, from any planner.

The runtime reduces each bucket on one process group and looks buckets up by (group,
index). DeepSpeed's IPG buckets mix param groups, so `executable_plan` re-expresses such a
plan with single-group buckets (`split_by_group`), keeping every collective as it was.
The runtime asks for a plan here and never imports a planner itself.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from itertools import groupby

from evenzero.plan import Bucket, Collective, Plan, PlanError
from evenzero.spec import ModelSpec
from evenzero.strategies.common import PlanOptions

PlannerArg = str | Callable[[ModelSpec, int, PlanOptions], Plan]
"""A registered strategy name, or a planner callable `(spec, world_size, options) -> Plan`."""


def executable_plan(spec: ModelSpec, world_size: int, strategy: PlannerArg,
                    options: PlanOptions) -> Plan:
    """Plan with `strategy` (a registered name or a planner callable), with every bucket
    on one param group. Whether the plan fits the process groups is the caller's check."""
    if callable(strategy):
        p = strategy(spec, world_size, options)
    else:
        from evenzero.strategies import plan

        p = plan(spec, world_size, strategy, options)
    names = {g.name for g in p.groups}
    if any(b.group not in names for b in p.buckets):
        p = split_by_group(p)
    return p


def split_by_group(p: Plan) -> Plan:
    """The same schedule with each mixed IPG bucket split into single-group buckets.

    For consumers that need a bucket to live on one process group (the runtime's routes
    look a bucket up by (group, index) and use one group rank per bucket). Each run of
    consecutive backward collectives on one param group becomes a bucket of that group,
    indexed per group in issue order. It keeps the IPG bucket's size and offsets, so the
    (root, offset, numel) rows are unchanged; it lists only the params its collectives
    carry, so the rest of the buffer reads as padding. The seed case becomes (dense, 0)
    with 11 reduces, (experts, 0) with 2 and, with the gate, (dense, 1) with 1.
    """
    owner = {s.name: b.group for b in p.layouts for s in b.params}
    buckets: list[Bucket] = []
    backward: list[Collective] = []
    count: dict[str, int] = {}
    for bucket in p.buckets:
        calls = [c for c in p.backward() if c.bucket == bucket.index]
        for group, run in groupby(calls, key=lambda c: c.group):
            run = list(run)
            pieces = [x for c in run for x in c.pieces()]
            slots = tuple(s for s in bucket.params
                          if any(o < s.offset + s.numel and s.offset < o + n for o, n in pieces))
            mixed = sorted({owner[s.name] for s in slots} - {group})
            if mixed:
                # DeepSpeed merges runs of two param groups on one process group into one
                # message; a single-group bucket cannot describe that without dropping
                # the other group's gradients, so refuse rather than run it wrongly.
                raise PlanError(f"DeepSpeed's schedule merges param groups {group!r} and "
                                f"{mixed[0]!r} (same process group) into one message; run "
                                f"it with one param group per process group")
            index = count.get(group, 0)
            count[group] = index + 1
            buckets.append(Bucket(group, index, bucket.numel, slots))
            backward += [replace(c, buffer_index=index) for c in run]
    return replace(p, buckets=tuple(buckets), collectives=tuple(backward) + p.step())
