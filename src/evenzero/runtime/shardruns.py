"""Which runs of this rank's flat shard of a group belong to which parameter.

A rank's shard of a group concatenates its equal slice of every layout, so one
parameter owns zero, one or (when a layout boundary cuts it) several contiguous runs of
it, and padding owns the rest. Per-parameter rules applied to the shard (overwrite
the runs of gradients the user cleared, leave the runs of parameters that had no
gradient untouched by the step, step a parameter with its own step count) all start
from this map. It is `plan.shard_ranges(group, rank)` regrouped by parameter.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from evenzero.plan import Plan


@dataclass(frozen=True)
class ShardRuns:
    """The runs of one rank's shard of one group, by parameter."""

    numel: int
    """Elements in the shard, padding included."""
    runs: Mapping[str, tuple[tuple[int, int], ...]]
    """Parameter name -> its (shard offset, numel) runs, in shard order; only parameters
    with at least one element in this shard appear."""

    @staticmethod
    def of(plan: Plan, group: str, rank: int) -> ShardRuns:
        """From the plan: `rank` is the rank inside the group's process group."""
        runs: dict[str, list[tuple[int, int]]] = {}
        for r in plan.shard_ranges(group, rank):
            runs.setdefault(r.param, []).append((r.shard_offset, r.numel))
        return ShardRuns(plan.shard_numel(group), {n: tuple(v) for n, v in runs.items()})

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.runs)

    def of_params(self, names: Iterable[str]) -> list[tuple[int, int]]:
        """The runs of `names` (those with elements here), sorted, adjacent ones merged."""
        spans = sorted(r for n in names for r in self.runs.get(n, ()))
        merged: list[tuple[int, int]] = []
        for off, n in spans:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((off, n))
        return merged

    def covered(self, names: Iterable[str]) -> int:
        """Elements of the shard that belong to `names`."""
        return sum(n for _, n in self.of_params(names))
