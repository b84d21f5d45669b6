"""A long phase that shows it is alive: what runs, and for how long it has been running.

On a terminal, a spinner with the phase and its elapsed seconds, redrawn in place; in a
log (a pipe, CI), no cursor control: one line when the phase starts and one every
`every_s` seconds while it lasts, each stamped with the seconds since the start.
`evenzero calibrate` wraps its measurement in one; `evenzero repro` / `bench` show
their phases (`evenzero.repro.progress`) with the same clock.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from rich.console import Console
from rich.text import Text

HEARTBEAT_S = 15.0
"""Seconds between the lines a log gets while one phase lasts."""


class PhaseClock:
    """The phase in progress and when it began; its text is redrawn with the elapsed time."""

    def __init__(self, text: str = "") -> None:
        self.start = time.monotonic()
        self.text = text
        self.since = self.start

    def enter(self, text: str) -> None:
        self.text, self.since = text, time.monotonic()

    def phase_seconds(self) -> float:
        return time.monotonic() - self.since

    def total_seconds(self) -> float:
        return time.monotonic() - self.start

    def __rich__(self) -> Text:  # rich calls it at every refresh: the seconds tick
        return Text(f"{self.text} ({self.phase_seconds():.0f} s)")


class Heartbeat:
    """`with Heartbeat("calibrating 8 ranks"): long_call()`; `enter(text)` starts a new phase."""

    def __init__(self, text: str, console: Console | None = None,
                 every_s: float = HEARTBEAT_S) -> None:
        self.console = console or Console(stderr=True)
        self.clock = PhaseClock(text)
        self.every_s = every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._status: Any = None
        self._said = 0.0

    def __enter__(self) -> Heartbeat:
        if self.console.is_terminal:
            self._status = self.console.status(self.clock)
            self._status.__enter__()
        else:
            self.line(self.clock.text)
            self._thread = threading.Thread(target=self._beat, daemon=True,
                                            name="evenzero-heartbeat")
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        if self._status is not None:
            self._status.__exit__(*exc)

    def enter(self, text: str) -> None:
        """A new phase: shown now, and its own seconds counted from here."""
        self.clock.enter(text)
        if self._status is None:
            self.line(text)

    def line(self, text: str) -> None:
        """One plain line, stamped with the seconds since the start."""
        self._said = time.monotonic()
        self.console.print(f"[{self.clock.total_seconds():5.0f}s] {text}", markup=False,
                           highlight=False, soft_wrap=True)

    def _beat(self) -> None:
        while not self._stop.wait(0.5):
            if time.monotonic() - self._said >= self.every_s:
                self.line(f"... still {_gerund(self.clock.text)}: {self.clock.phase_seconds():.0f} s "
                          f"in this phase")


def _gerund(text: str) -> str:
    """The phase's first clause: "calibrating 8 local gloo ranks (...)"."""
    return text.split(";")[0].split(": ")[0]


__all__ = ["HEARTBEAT_S", "Heartbeat", "PhaseClock"]
