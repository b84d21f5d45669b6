"""The lifecycle table, the control-tensor device rule and the readable schedules
(no processes)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from evenzero.model_presets import preset
from evenzero.plan import Schedule
from evenzero.runtime.checks import ZeroRuntimeError
from evenzero.runtime.collectives import TraceRecorder, control_device
from evenzero.runtime.gradstats import GradStats
from evenzero.runtime.lifecycle import REFUSALS, STEPPABLE, Lifecycle, TrainingState
from evenzero.strategies import plan


@pytest.mark.parametrize("state", list(TrainingState))
def test_step_is_allowed_exactly_where_the_table_says(state):
    life = Lifecycle(3)
    life.state = state
    if state in STEPPABLE:
        life.require("step")
    elif state is TrainingState.ABORTED:
        assert state not in REFUSALS  # settled by the optimizer instead of refused
    else:
        with pytest.raises(ZeroRuntimeError, match=r"^step\(\) " + REFUSALS[state][:20]):
            life.require("step")


def test_transitions_of_a_step():
    life = Lifecycle(2)
    assert life.state is TrainingState.IDLE
    life.begin_backward()
    assert life.state is TrainingState.BACKWARD
    # Outside any autograd graph task, a backward that never ended has raised.
    assert life.is_dead_backward() and life.state is TrainingState.ABORTED
    life.end_backward()  # settled
    assert life.state is TrainingState.REDUCED
    life.checked(GradStats(1.0, False))
    assert life.state is TrainingState.CHECKED and life.record.stats.norm == 1.0
    life.reset()
    assert life.state is TrainingState.IDLE and life.record.presence == [0.0, 0.0]
    life.sync = False
    life.begin_backward()
    life.end_backward()
    assert life.state is TrainingState.UNSYNCED
    life.failed()
    life.begin_backward()  # another backward on top of gradients that failed the check
    assert life.record.problem == REFUSALS[TrainingState.FAILED]


def test_control_device_follows_the_backend_and_the_model(monkeypatch):
    for backend, device, expected in (("gloo", "cpu", "cpu"), ("gloo", "cuda", "cpu"),
                                      ("cpu:gloo,cuda:nccl", "cpu", "cpu")):
        monkeypatch.setattr(dist, "get_backend", lambda group, b=backend: b)
        assert control_device(None, torch.device(device)) == torch.device(expected)
    if torch.cuda.is_available():
        monkeypatch.setattr(dist, "get_backend", lambda group: "cpu:gloo,cuda:nccl")
        assert control_device(None, torch.device("cuda")).type == "cuda"


def test_the_checkpoint_uses_the_runtime_device_rule():
    import inspect

    from evenzero.checkpoint import state

    source = inspect.getsource(state.RankPlace.of)
    # Through the optimizer's protocol (`control_device`), not a rule of its own.
    assert "opt.control_device" in source and '"nccl" in' not in source


def test_schedules_print_as_tables_and_stay_tuples():
    p = plan(preset("seed-moe"), 8, "deepspeed-0.6")
    backward = p.backward()
    assert isinstance(backward, Schedule) and backward == tuple(backward)
    lines = str(backward).splitlines()
    assert lines[0].split() == ["#", "phase", "op", "group", "ranks", "root", "buffer", "offset",
                                "elements", "bytes/el", "algorithm"]
    assert len(lines) == 1 + len(backward)
    assert lines[1].split()[:6] == ["0", "backward", "reduce", "dense", "8", str(backward[0].root)]
    assert f"{backward[0].numel:,}" in lines[1]
    assert "(" not in str(p.step()), "no raw tuples"
    recorder = TraceRecorder()
    for c in backward[:2]:
        recorder.record(c, "all_to_all+sum")
    recorder.close_step()
    assert recorder.last == backward[:2]
    assert all(line.endswith("all_to_all+sum") for line in str(recorder.last).splitlines()[1:])
    assert str(Schedule()) == "(no collectives)"
