"""Where one optimizer is in its step, as one enum with its transitions in one place.

Modelled on FSDP2's `TrainingState` (torch/distributed/fsdp/_fully_shard/_fsdp_common.py
@v2.13.0:101). `Lifecycle` is the only code that changes the state; `ZeroOptimizer` asks
it (`require`) whether `step()` or `clip_grad_norm_()` may run, and the answer is the
table `STEPPABLE` / `REFUSALS` below, raised as the same error on every rank (every
rank reaches the same state, because every state change rides on a collective or on a
call every rank makes).

    IDLE --backward--> BACKWARD --end--> REDUCED --clip--> CHECKED --step--> IDLE
                          |       (no_sync) UNSYNCED      \\--problem--> FAILED
                          \\--raised--> ABORTED --zero_grad/forward/step: settled-->
    zero_grad(): any state --> IDLE

A backward that raised never runs its end callback, so it is found lazily: the state
is still BACKWARD while no autograd graph task runs on this thread (`is_dead_backward`).

Beside it, whether the parameters may be read is one state too, `ParamState`, held by
the step's gathers (`runtime/prefetch.py`, the only code that changes it):

    READY --step launches the gathers--> GATHERING --wait()--> READY
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum, auto

import torch

from evenzero.runtime.checks import ZeroRuntimeError
from evenzero.runtime.gradstats import GradStats


class TrainingState(Enum):
    """Where the optimizer is between two steps."""

    IDLE = auto()
    """No gradients since construction, the last step or zero_grad()."""
    BACKWARD = auto()
    """A backward through the module is running."""
    ABORTED = auto()
    """A backward raised before it ended; its collectives are not finished yet."""
    UNSYNCED = auto()
    """The last backward ran under no_sync(): local gradients, nothing reduced."""
    REDUCED = auto()
    """A synced backward ended: gradients are reduced into the shards."""
    CHECKED = auto()
    """The step check (clip_grad_norm_) ran and passed; step() reuses its result."""
    FAILED = auto()
    """The step check raised on every rank; only zero_grad() goes on."""


class ParamState(Enum):
    """Whether every parameter holds its value (the step's all-gathers are done)."""

    READY = auto()
    """Every parameter holds its current value; anything may read or write it."""
    GATHERING = auto()
    """The last step's all-gathers are in flight (`overlap_param_gather=True`): a
    parameter may be read only inside the forward of a module that holds it, or after
    the one wait (`ParamGathers.wait`, `opt.wait_for_params()`)."""


STEPPABLE = frozenset({TrainingState.REDUCED, TrainingState.CHECKED})
"""States in which step() and clip_grad_norm_() run."""

REFUSALS: dict[TrainingState, str] = {
    TrainingState.IDLE: "called without a backward() since the last step or zero_grad(); run "
                        "loss.backward() first",
    TrainingState.BACKWARD: "called during backward; call it after loss.backward() returns",
    TrainingState.UNSYNCED: "the last backward ran under no_sync(), so its gradients were never "
                            "reduced; run the last micro-batch's backward outside no_sync()",
    TrainingState.FAILED: "this step's gradients already failed the step check on every rank; "
                          "call zero_grad() and run the next step",
}
"""Why step() and clip_grad_norm_() refuse to run, by state (ABORTED settles first)."""


@dataclass
class StepRecord:
    """What the current step has gathered so far; replaced whole when a step ends."""

    presence: list[float]
    """1.0 for each parameter (in registration order) that produced a gradient."""
    problem: str | None = None
    """A problem this rank alone found, raised at the step check on every rank."""
    stats: GradStats | None = None
    """The step check's result, once it ran (clip and step share it)."""
    micro_batches: int = 0
    """Backwards under no_sync() since the last step (checked equal on every rank)."""


def in_backward() -> bool:
    """Whether this thread is running an autograd graph task now."""
    return torch._C._current_graph_task_id() != -1


class Lifecycle:
    """The state, the backward mode and the step record of one optimizer."""

    def __init__(self, num_params: int) -> None:
        self.num_params = num_params
        self.state = TrainingState.IDLE
        self.sync = True
        """False inside no_sync(): backward passes communicate nothing."""
        self.measuring = True
        """The next backward records the gradient-arrival order instead of reducing."""
        self.backward_synced = True
        """Whether the current (or aborted) backward runs outside no_sync()."""
        self.record = StepRecord([0.0] * num_params)

    # ------------------------------------------------------------------ backward

    def is_dead_backward(self) -> bool:
        """A backward started and can no longer end: it raised (checked outside backward)."""
        if self.state is TrainingState.BACKWARD and not in_backward():
            self.state = TrainingState.ABORTED
        return self.state is TrainingState.ABORTED

    def begin_backward(self) -> None:
        if self.state is TrainingState.FAILED:
            # Gradients that failed the check are still there; keep them refused.
            self.record.problem = self.record.problem or REFUSALS[TrainingState.FAILED]
        self.state = TrainingState.BACKWARD
        self.backward_synced = self.sync
        if not self.sync:
            self.record.micro_batches += 1
        self.record.stats = None

    def end_backward(self) -> None:
        """A backward ended, or one that raised was settled (from BACKWARD or ABORTED)."""
        self.state = TrainingState.REDUCED if self.backward_synced else TrainingState.UNSYNCED

    def note_problem(self, problem: str | None) -> None:
        """Keep the first problem of the step (raised at the step check)."""
        self.record.problem = self.record.problem or problem

    # ------------------------------------------------------------------ step

    def require(self, what: str) -> None:
        """Raise unless `what` (step, clip_grad_norm_) may run in the current state.
        Inside any running backward (a tensor hook, say) it may not, even before the
        first parameter's gradient has told the optimizer that a backward began."""
        state = TrainingState.BACKWARD if in_backward() else self.state
        if state not in STEPPABLE:
            raise ZeroRuntimeError(f"{what}() {REFUSALS[state]}")

    def checked(self, stats: GradStats) -> None:
        self.record.stats = stats
        self.state = TrainingState.CHECKED

    def failed(self) -> None:
        self.record.stats = None
        self.state = TrainingState.FAILED

    def reset(self) -> None:
        """A step ended (stepped, skipped or zeroed): back to IDLE with an empty record."""
        self.state = TrainingState.IDLE
        self.record = StepRecord([0.0] * self.num_params)
