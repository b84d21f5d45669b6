"""The executed plan, and the one way to change it: `PlanHolder.replan`.

A `ZeroOptimizer` plans at construction (arrival order assumed to be reverse
registration) and re-plans at most a few times, always through `replan`:

* at the end of the first backward, with the measured arrival order (`runtime/backward.py`);
* once enough backwards were timed, with the refined bucket size (`runtime/autotune.py`);
* when a state dict is loaded, with the arrival order and bucket size it was saved under
  (`runtime/statedict.py`).

A new plan whose executed parts (groups, layouts, buckets, collectives) are those of the
plan in place only replaces the record (its notes, arrival); otherwise the installer
moves every buffer and shard to it (`runtime/engine.py`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Protocol

import torch

from evenzero.plan import Plan
from evenzero.runtime.config import ZeroConfig
from evenzero.runtime.setup import make_plan, plan_options
from evenzero.spec import ModelSpec
from evenzero.strategies import PlanOptions


class PlanInstaller(Protocol):
    """What executes a plan, and moves to a new one."""

    def install(self, plan: Plan, previous: Plan) -> None:
        """Make `plan` the executed one (collective: every rank installs the same plan)."""
        ...


class PlanHolder:
    """The model description, the plan executed for it, and `replan`."""

    def __init__(self, spec: ModelSpec, world_size: int, config: ZeroConfig,
                 group_sizes: Mapping[str, int], device: torch.device) -> None:
        self.spec = spec
        """The planner's view of the model; its arrival order is the agreed one."""
        self.world_size, self.config = world_size, config
        self.group_sizes, self.device = dict(group_sizes), device
        self.bucket_numel: int | None = None
        """The bucket size chosen at run time (refined or loaded); None: the config's."""
        self.plan: Plan = make_plan(spec, world_size, config, self.group_sizes, device)
        """The plan being executed."""
        self._installer: PlanInstaller | None = None

    def bind(self, installer: PlanInstaller) -> None:
        """From now on `replan` installs what changes with `installer`."""
        self._installer = installer

    def options(self) -> PlanOptions:
        """The planner's options for this run (`setup.plan_options`)."""
        return plan_options(self.config, self.device)

    def replan(self, arrival: Iterable[str] | None = None, bucket_numel: int | None = None,
               note: str | None = None) -> bool:
        """Plan again with a measured `arrival` order, a chosen `bucket_numel` (kept for
        every later re-plan), or both, and add `note` to the plan's notes; with neither,
        only the note is added. Installs the new plan if what is executed changed
        (returns True then). Collective when it installs: every rank calls it alike."""
        previous = self.plan
        if arrival is not None:
            arrival = tuple(arrival)
            self.spec = self.spec.with_arrival(arrival, "measured")
        if bucket_numel is not None:
            self.bucket_numel = bucket_numel
        if bucket_numel is None and (arrival is None or arrival == previous.arrival):
            if note:
                self.plan = replace(previous, notes=(*previous.notes, note))
            return False
        plan = make_plan(self.spec, self.world_size, self.config, self.group_sizes, self.device,
                         bucket_numel=self.bucket_numel, note=note)
        if plan == previous:
            return False
        self.plan = plan
        if _executed(plan) == _executed(previous):
            return False
        self._installer.install(plan, previous)
        return True


def _executed(plan: Plan) -> tuple:
    """What the runtime executes of a plan; the rest (notes, arrival) is record."""
    return plan.groups, plan.layouts, plan.buckets, plan.collectives
