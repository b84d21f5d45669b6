"""Progress of a local side-by-side job: a live bar on a terminal, plain lines in a log.

The first minute of `evenzero repro` is spent before any step runs: W processes import
torch, join the process group, build five copies of the model and import DeepSpeed. So
the job reports each phase, not only steps. Rank 0 sends the events below with
`RankContext.emit`; the launcher itself sends `RanksJoined` as ranks come up.

On a terminal the events drive a rich progress bar whose total is set by `Planned`,
i.e. by the systems that actually run (DeepSpeed may be skipped), with a spinner and the
seconds spent in the current phase, so a long one (a first `deepspeed.initialize` can
take a minute on CPU) visibly runs. Anywhere else (a pipe, a CI log) there is no
bar and no cursor control: one plain line per phase and one per round of steps, each
with the seconds elapsed, and a line every 15 s while a phase lasts
(`evenzero.commands.heartbeat`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import ProgressColumn
from rich.text import Text

from evenzero.commands.heartbeat import Heartbeat, PhaseClock
from evenzero.repro.localrun import RanksJoined


@dataclass(frozen=True)
class Status:
    """A phase rank 0 has entered ("building evenzero", "importing DeepSpeed")."""

    text: str


@dataclass(frozen=True)
class Planned:
    """The systems that will train, known once they are built; sets the total."""

    systems: tuple[str, ...]
    steps: int
    """Measured steps per system."""
    warmup: int
    """Warm-up steps per system, run first."""

    @property
    def total(self) -> int:
        return len(self.systems) * (self.steps + self.warmup)


@dataclass(frozen=True)
class Continued:
    """More steps for some systems, after a look at the verdicts left one open."""

    systems: tuple[str, ...]
    first_step: int
    """Index of the first new step (warm-up steps counted)."""
    steps: int
    """How many more."""
    reason: str
    """Why, for the status line."""


@dataclass(frozen=True)
class StepDone:
    """One system finished one step (0-based, warm-up steps first)."""

    system: str
    step: int


class JobProgress:
    """`with JobProgress(W) as progress: launch(..., on_event=progress)`."""

    def __init__(self, world_size: int, console: Console | None = None) -> None:
        self.console = console or Console()
        self.world_size = world_size
        self.planned: Planned | None = None
        self.done = 0
        self._round_done: dict[int, int] = {}
        self._bar: Any = None
        self._task: Any = None
        self._log: Heartbeat | None = None
        self.clock = PhaseClock()

    def __enter__(self) -> JobProgress:
        first = f"launching {self.world_size} ranks (importing torch in each)"
        if self.console.is_terminal:
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                Progress,
                SpinnerColumn,
                TextColumn,
                TimeElapsedColumn,
            )

            self._bar = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                 _PhaseSeconds(self.clock), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=self.console)
            self._bar.__enter__()
            self._task = self._bar.add_task("", total=None)
            self._status(first)
        else:
            self._log = Heartbeat(first, self.console)
            self._log.__enter__()
            self.clock = self._log.clock
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc)
        if self._log is not None:
            self._log.__exit__(*exc)

    def __call__(self, event: Any) -> None:
        if isinstance(event, RanksJoined):
            if event.joined == event.world_size:
                self._status(f"{event.world_size} ranks up; building the systems")
            elif self._bar is not None:
                self._status(f"launching {event.world_size} ranks: {event.joined} up")
        elif isinstance(event, Status):
            self._status(event.text)
        elif isinstance(event, Planned):
            self.planned = event
            if self._bar is not None:
                self._bar.update(self._task, total=event.total, completed=0)
            self._status(f"training {len(event.systems)} systems x {event.steps + event.warmup} "
                         f"steps ({event.warmup} warm-up): {', '.join(event.systems)}")
        elif isinstance(event, Continued):
            warmup = self.planned.warmup if self.planned else 0
            self.planned = Planned(event.systems, event.first_step + event.steps - warmup, warmup)
            if self._bar is not None:
                self._bar.update(self._task, total=self.done + len(event.systems) * event.steps)
            self._status(f"{event.reason}: {', '.join(event.systems)}")
        elif isinstance(event, StepDone):
            self._step(event)

    def describe_step(self, event: StepDone) -> str:
        planned = self.planned
        steps = planned.steps + planned.warmup if planned else event.step + 1
        kind = "warm-up" if planned and event.step < planned.warmup else "step"
        return f"{kind} {event.step + 1}/{steps} {event.system}"

    def _step(self, event: StepDone) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done,
                             description=escape(self.describe_step(event)))
            return
        # A log gets one line per round: when every system has done step i.
        count = self._round_done[event.step] = self._round_done.get(event.step, 0) + 1
        systems = len(self.planned.systems) if self.planned else 1
        if count == systems:
            self._line(f"{self.describe_step(event).rsplit(' ', 1)[0]} done on {systems} "
                       f"system(s)")

    def _status(self, text: str) -> None:
        if self._bar is not None:
            self.clock.enter(text)
            self._bar.update(self._task, description=escape(text))
        else:
            self._log.enter(text)

    def _line(self, text: str) -> None:
        self._log.line(text)


class _PhaseSeconds(ProgressColumn):
    """Seconds spent in the current phase, redrawn at every refresh."""

    def __init__(self, clock: PhaseClock) -> None:
        super().__init__()
        self.clock = clock

    def render(self, task: Any) -> Text:
        return Text(f"{self.clock.phase_seconds():.0f} s in phase", style="progress.elapsed")


__all__ = ["Continued", "JobProgress", "Planned", "StepDone", "Status"]
