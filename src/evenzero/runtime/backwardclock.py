"""Timing the first backwards, for the runtime's `bucket_numel="auto"`.

With an "auto" bucket size on two or more ranks, `ZeroOptimizer` times its first
backwards, up to the end of the `MEASURED_BACKWARDS`-th synced one: like the first
(which records the arrival order), they reduce nothing until their end, so the
gradient hooks' timestamps are pure compute. `RefinementSchedule` says when that is
over (never under `no_sync()`, whose gradients stay in the plan in place). Then
`evenzero.runtime.autotune.refine_bucket_numel` turns the timings into one size every
rank agrees on, and the optimizer re-plans with it, once.

The hooks feed the clock (`ArrivalClock`): forward begin and end, the gradient reaching
the module's output, each parameter's gradient, backward's end.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from time import perf_counter

from evenzero.cost.compute import ComputeProfile, median_profile, profile_from_arrivals

MEASURED_BACKWARDS = 2
"""Backwards timed before the bucket size is refined. The first pays one-time costs
(allocations, first calls), so when another was timed it is left out."""


@dataclass
class BackwardTiming:
    """Clock readings (`time.perf_counter` seconds) of one measuring backward."""

    start: float
    """When the gradient reached the module's output (the loss's own backward is not
    the model's), or, if no output hook fired, the first gradient."""
    events: list[tuple[str, float]] = field(default_factory=list)
    """(parameter, when its gradient hook fired), in firing order."""
    end: float | None = None
    """When the whole backward had finished (the end-of-backward callback)."""
    forward_s: float | None = None
    """The module's forward before this backward, if the hooks saw it begin and end."""

    def profile(self) -> ComputeProfile:
        return profile_from_arrivals(self.events, self.start, self.end, self.forward_s,
                                     source="measured gradient arrivals")


class ArrivalClock:
    """What the hooks report while backwards are measured: forward begin and end, the
    gradient reaching the module's output, each parameter's gradient, backward's end."""

    def __init__(self) -> None:
        self.timings: list[BackwardTiming] = []
        self._forward: tuple[float, float | None] | None = None
        self._current: BackwardTiming | None = None

    def forward_began(self) -> None:
        self._forward = (perf_counter(), None)

    def forward_ended(self) -> None:
        if self._forward is not None:
            self._forward = (self._forward[0], perf_counter())

    def output_grad(self) -> None:
        """The gradient reached the module's output: the model's backward begins."""
        if self._current is None:
            self._begin(perf_counter())

    def grad(self, name: str) -> None:
        now = perf_counter()
        if self._current is None:
            self._begin(now)
        self._current.events.append((name, now))

    def backward_ended(self) -> None:
        if self._current is not None:
            self._current.end = perf_counter()
            self.timings.append(self._current)
        self._current, self._forward = None, None

    def discard(self) -> None:
        """The running backward raised: what it measured is dropped."""
        self._current, self._forward = None, None

    def take(self) -> list[BackwardTiming]:
        out, self.timings = self.timings, []
        self._current = self._forward = None
        return out

    def _begin(self, now: float) -> None:
        forward = self._forward
        forward_s = forward[1] - forward[0] if forward and forward[1] is not None else None
        self._current = BackwardTiming(now, forward_s=forward_s)


def measured_profile(timings: Sequence[BackwardTiming]) -> ComputeProfile:
    """The compute profile of the measured backwards: the first is left out when there
    are more (it pays one-time costs); several give a per-parameter median (backwards
    whose arrival order differs from the last one's are left out)."""
    usable = [t for t in timings if t.events and t.end is not None]
    if not usable:
        raise ValueError("no complete measured backward with a gradient")
    if len(usable) > 1:
        usable = usable[1:]
    profiles = [t.profile() for t in usable]
    order = [n for n, _ in profiles[-1].backward]
    alike = [p for p in profiles if [n for n, _ in p.backward] == order]
    return alike[0] if len(alike) == 1 else median_profile(alike)


class RefinementSchedule:
    """Whether backwards are still timed for the bucket size, and when that ends.

    The refinement is collective, so every rank must reach it at the same backward. It
    is due at the end of the `backwards`-th synced backward: ranks run the same synced
    backwards (each ends in the same bucket collectives; a rank whose backward raised
    settles it with them, `runtime/backward.py`), while the number of backwards under
    `no_sync()` may differ (an error the step check raises on every rank, after this).
    Every backward in between is timed, synced or not."""

    def __init__(self, enabled: bool, backwards: int = MEASURED_BACKWARDS) -> None:
        self.clock: ArrivalClock | None = ArrivalClock() if enabled else None
        """Fed by the hooks while timing; None once the refinement ran (or never)."""
        self.backwards = backwards
        self.synced = 0
        """Synced backwards that ended (or raised) while timing."""
        self.optimizer_seconds: tuple[float, int] | None = None
        """(seconds, master elements) of the last optimizer step, timed while pending."""

    @property
    def pending(self) -> bool:
        return self.clock is not None

    def backward_ended(self, aborted: bool, synced: bool,
                       arrival_known: bool) -> list[BackwardTiming] | None:
        """Count a backward that ended (or raised); the timings once the refinement is
        due (the `backwards`-th synced one, the arrival order agreed), after which the
        schedule is over; None otherwise."""
        clock = self.clock
        if clock is None:
            return None
        if aborted:
            clock.discard()
        else:
            clock.backward_ended()
        self.synced += synced
        if not synced or not arrival_known or self.synced < self.backwards:
            return None
        self.clock = None
        return clock.take()


__all__ = ["MEASURED_BACKWARDS", "ArrivalClock", "BackwardTiming", "RefinementSchedule",
           "measured_profile"]
