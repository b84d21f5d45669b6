"""What a new user meets says the truth (issue 21): suggested commands run, errors name the
CLI's own flags, long phases show that they are alive, the help lists every command."""

from __future__ import annotations

import io
import json
import time

import pytest
from rich.console import Console

from evenzero import cli
from evenzero.commands import MAX_LOCAL_RANKS
from evenzero.commands.heartbeat import Heartbeat, PhaseClock


def plan_notes(capsys, world_size: int) -> str:
    assert cli.main(["plan", "seed-moe", "--world-size", str(world_size), "--cost", "gloo-local",
                     "--strategy", "evenzero", "--json"]) == 0
    return "\n".join(json.loads(capsys.readouterr().out)["plans"][0]["summary"]["notes"])


def test_plan_suggests_a_calibration_that_runs(capsys):
    far = plan_notes(capsys, 128)
    assert "fitted at 8 ranks, not 128" in far
    assert "--world-size 128" not in far  # calibrate refuses more than 64 local ranks
    assert f"calibrate --world-size {MAX_LOCAL_RANKS} --json FILE" in far
    assert "-m evenzero.cli calibrate --json FILE" in far and "extrapolated from it to 128" in far
    # The suggested command is accepted (its arguments parse; nothing is measured here).
    assert cli.main(["calibrate", "--world-size", str(MAX_LOCAL_RANKS), "--json",
                     "/nonexistent-dir/x.json"]) == 2
    assert "over the limit" not in capsys.readouterr().err
    near = plan_notes(capsys, 16)
    assert "run `evenzero calibrate --world-size 16 --json FILE`" in near


def test_convert_deepspeed_names_a_missing_path_and_the_tag_flag(tmp_path, capsys):
    def error(*argv: str) -> str:
        assert cli.main(["convert-deepspeed", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        return err

    missing = tmp_path / "no_such_ckpt"
    assert f"DS_DIR {missing}: does not exist" in error(str(missing), str(tmp_path / "out"))
    (tmp_path / "save" / "global_step4").mkdir(parents=True)
    err = error(str(tmp_path / "save"), str(tmp_path / "out"))
    assert "no 'latest' file" in err and "pass --tag TAG" in err and "tag=" not in err
    assert "directories here: global_step4" in err
    (tmp_path / "file").write_text("x")
    assert "is not a directory" in error(str(tmp_path / "file"), str(tmp_path / "out"))


def test_top_level_help_lists_every_command(capsys):
    with pytest.raises(SystemExit):
        cli.main(["--help"])
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip()]
    first = next(line for line in lines if line.startswith("The `evenzero` command"))
    assert first == f"The `evenzero` command: {', '.join(cli.COMMANDS)}."
    assert "convert-deepspeed" in first


def test_heartbeat_in_a_log_says_the_phase_and_keeps_beating():
    out = io.StringIO()
    with Heartbeat("calibrating 8 local gloo ranks: measuring", Console(file=out, width=200),
                   every_s=0.2) as beat:
        time.sleep(0.9)
        beat.enter("building deepspeed (deepspeed.initialize)")
        time.sleep(0.9)
    lines = out.getvalue().splitlines()
    assert "\x1b" not in out.getvalue()
    assert lines[0].endswith("] calibrating 8 local gloo ranks: measuring")
    assert any("... still calibrating 8 local gloo ranks: " in line for line in lines)
    assert any(line.endswith("] building deepspeed (deepspeed.initialize)") for line in lines)
    assert any("... still building deepspeed (deepspeed.initialize): " in line for line in lines)


def test_phase_clock_renders_its_elapsed_seconds():
    clock = PhaseClock("importing DeepSpeed")
    out = io.StringIO()
    Console(file=out, width=80).print(clock)
    assert out.getvalue().strip() == "importing DeepSpeed (0 s)"
