"""Progress of a local job: a bar whose total counts the systems that run; plain log lines."""

from __future__ import annotations

import io

from rich.console import Console

from evenzero.repro.localrun import RanksJoined
from evenzero.repro.progress import Continued, JobProgress, Planned, Status, StepDone


def events(systems: tuple[str, ...], steps: int, warmup: int) -> list:
    out: list = [RanksJoined(k, 4) for k in range(1, 5)]
    out += [Status(f"building {name}") for name in systems]
    out.append(Planned(systems, steps, warmup))
    out += [StepDone(name, step) for step in range(steps + warmup) for name in systems]
    return out


def test_terminal_bar_total_is_the_systems_that_run():
    # Five configured, DeepSpeed's two skipped: the bar must end at 3 x 4, not at 5 x 4.
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    with JobProgress(4, console) as progress:
        task = progress._bar.tasks[0]
        assert task.total is None and "launching 4 ranks" in task.description
        for event in events(("evenzero", "deepspeed-0.6-schedule", "ddp"), 2, 2):
            progress(event)
            if isinstance(event, Status):
                assert task.description == event.text  # the sub-status is what is shown
        assert task.total == 12 and task.completed == 12
        assert task.description == "step 4/4 ddp"


def test_log_gets_plain_lines_per_phase_and_round():
    buffer = io.StringIO()
    with JobProgress(4, Console(file=buffer, width=100)) as progress:
        for event in events(("evenzero", "ddp"), 2, 1):
            progress(event)
    log = buffer.getvalue()
    assert "\x1b" not in log and "\r" not in log
    lines = [line.split("] ", 1)[1] for line in log.splitlines()]
    assert lines == ["launching 4 ranks (importing torch in each)",
                     "4 ranks up; building the systems",
                     "building evenzero", "building ddp",
                     "training 2 systems x 3 steps (1 warm-up): evenzero, ddp",
                     "warm-up 1/3 done on 2 system(s)",
                     "step 2/3 done on 2 system(s)",
                     "step 3/3 done on 2 system(s)"]


def test_status_text_is_not_markup():
    buffer = io.StringIO()
    with JobProgress(2, Console(file=buffer, width=100)) as progress:
        progress(Status("install 'evenzero[deepspeed]'"))
    assert "install 'evenzero[deepspeed]'" in buffer.getvalue()


def test_more_steps_for_the_open_verdicts_extend_the_bar_and_the_log():
    """After 2 measured steps (1 warm-up) of three systems, 2 more for evenzero and ddp."""
    first = events(("evenzero", "deepspeed", "ddp"), 2, 1)
    more = [Continued(("evenzero", "ddp"), 3, 2, "verdict open after 2 steps (ddp: ...)")]
    more += [StepDone(name, step) for step in (3, 4) for name in ("evenzero", "ddp")]
    console = Console(file=io.StringIO(), force_terminal=True, width=100)
    with JobProgress(4, console) as progress:
        for event in first + more:
            progress(event)
        task = progress._bar.tasks[0]
        assert task.total == 9 + 4 and task.completed == 13
        assert task.description == "step 5/5 ddp"
    buffer = io.StringIO()
    with JobProgress(4, Console(file=buffer, width=200)) as progress:
        for event in first + more:
            progress(event)
    lines = [line.split("] ", 1)[1] for line in buffer.getvalue().splitlines()]
    assert lines[-4:] == ["step 3/3 done on 3 system(s)",
                          "verdict open after 2 steps (ddp: ...): evenzero, ddp",
                          "step 4/5 done on 2 system(s)",
                          "step 5/5 done on 2 system(s)"]
