"""A refusal under `evenzero run` ends the job with one message, printed once, and a
non-zero exit status: no rank tracebacks, no launcher report (`evenzero.deepspeed.uncaught`).
The keys used stay refused (ZeRO-3, parameter offload, NVMe optimizer offload, pipeline
modules)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from evenzero.deepspeed import uncaught
from evenzero.deepspeed.config_keys import DeepSpeedConfigError
from evenzero.deepspeed.refusals import RefusedModuleError, missing_module, unsupported

SRC = Path(__file__).resolve().parent.parent / "src"

SCRIPT = r"""
import json, sys, torch, deepspeed
deepspeed.init_distributed()
model = torch.nn.Linear(4, 4)
config = {"train_micro_batch_size_per_gpu": 1,
          "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
          "zero_optimization": json.loads(sys.argv[1])}
deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
print("initialized")
"""


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))
           and k not in ("EVENZERO_DEBUG", uncaught.STANDIN_ENV)}
    env.update(PYTHONPATH=os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]),
               DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **extra)
    return env


def evenzero_run(*command: str, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "evenzero.cli", "run", *command], cwd=cwd,
                          env=_env(**env), capture_output=True, text=True, timeout=240)


def _lines(proc: subprocess.CompletedProcess, text: str) -> list[str]:
    return [line for line in (proc.stdout + proc.stderr).splitlines() if text in line]


def test_a_refused_key_under_torchrun_is_one_message_without_tracebacks(tmp_path):
    """The acceptance test: 2 ranks under torchrun both refuse `offload_optimizer` on NVMe;
    the message is printed once, after the job, with the ranks; no traceback of a rank,
    no `[rank0]:` prefix, no torchrun ChildFailedError; the exit status is torchrun's 1."""
    (tmp_path / "train.py").write_text(SCRIPT)
    proc = evenzero_run("torchrun", "--nproc-per-node", "2", "train.py",
                        '{"stage": 2, "offload_optimizer": {"device": "nvme"}}', cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1, out[-3000:]
    refused = _lines(proc, "zero_optimization.offload_optimizer")
    assert len(refused) == 1, out
    assert refused[0].startswith("evenzero run: refused on ranks 0-1: config key "
                                 "'zero_optimization.offload_optimizer.device' = 'nvme'"), refused
    assert "not supported" in refused[0]
    for noise in ("Traceback", "[rank0]", "[rank1]", "ChildFailedError", "DeepSpeedConfigError",
                  "initialized"):
        assert noise not in out, (noise, out[-3000:])
    assert _lines(proc, "the job ended with exit status 1") == [
        "evenzero run: the job ended with exit status 1; the tracebacks of its 3 processes "
        "(ranks and launcher) are not shown (EVENZERO_DEBUG=1 shows them)"]


@pytest.mark.slow
def test_a_refused_stage_in_one_process(tmp_path):
    """Slow set (a third `evenzero run`, ~10 s on a shared machine): `python script`, one
    process and no launcher; the rank-side path is the torchrun test's."""
    (tmp_path / "train.py").write_text(SCRIPT)
    proc = evenzero_run(sys.executable, "train.py", '{"stage": 3}', cwd=tmp_path)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert _lines(proc, "refused") == [
        "evenzero run: refused on rank 0: config key 'zero_optimization.stage' = 3: ZeRO stage 3 "
        "(parameter partitioning) is not supported by evenzero.deepspeed; use stage 1 or 2"]
    assert "its traceback is not shown (EVENZERO_DEBUG=1 shows them)" in proc.stderr


def test_caught_refusals_keep_fallbacks_and_other_errors_keep_tracebacks(tmp_path):
    """A refusal the script catches is its business; a later ordinary error is a bug,
    printed in full. Python's own sitecustomize, if one is on the path, still runs."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import os\nos.environ['THEIRS_RAN'] = '1'\n")
    script = ("import os\n"
              "try:\n    import deepspeed.nvme\n"
              "except ImportError as e:\n    print('fallback:', e)\n"
              "print('theirs ran:', os.environ.get('THEIRS_RAN'))\n"
              "raise ValueError('an ordinary bug')\n")
    env = _env()
    proc = subprocess.run([sys.executable, "-m", "evenzero.cli", "run", sys.executable, "-c",
                           script], cwd=tmp_path, capture_output=True, text=True, timeout=240,
                          env=env | {"PYTHONPATH": os.pathsep.join([env["PYTHONPATH"],
                                                                    str(site)])})
    assert proc.returncode == 1
    assert "fallback: No module named 'deepspeed.nvme': NVMe offload" in proc.stdout
    assert "theirs ran: 1" in proc.stdout
    assert "Traceback" in proc.stderr and "ValueError: an ordinary bug" in proc.stderr
    assert "evenzero run: refused" not in proc.stderr


def test_what_counts_as_a_refusal():
    assert uncaught.is_refusal(DeepSpeedConfigError("x"))
    assert uncaught.is_refusal(unsupported("deepspeed.zero.Init", "no"))
    assert uncaught.is_refusal(RefusedModuleError(missing_module("deepspeed.runtime.pipe")))
    assert not uncaught.is_refusal(ModuleNotFoundError("No module named 'mpi4py'"))
    assert isinstance(unsupported("a", "b"), NotImplementedError)  # what scripts catch
    assert not uncaught.is_refusal(NotImplementedError("a plain one"))
    assert not uncaught.is_refusal(ValueError("a bug"))
    try:  # a framework that wraps it: the refusal is found among the causes
        try:
            raise DeepSpeedConfigError("config key 'x': no")
        except DeepSpeedConfigError as e:
            raise RuntimeError("setup failed") from e
    except RuntimeError as wrapped:
        assert str(uncaught.refusal_in(wrapped)) == "config key 'x': no"
    assert uncaught.refusal_in(ValueError("a bug")) is None


@pytest.mark.parametrize("debug", ["", "1"])
def test_hook_records_refusals_and_silences_what_follows(tmp_path, monkeypatch, debug):
    """In process: the hook records a refusal and prints nothing, then silences a later
    error of another kind; with EVENZERO_DEBUG=1 it passes everything on."""
    monkeypatch.setenv(uncaught.STANDIN_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("EVENZERO_DEBUG", debug)
    passed: list[BaseException] = []

    def previous(kind, value, tb):
        passed.append(value)

    refusal = DeepSpeedConfigError("config key 'zero_optimization.stage' = 3: use stage 1 or 2")
    uncaught.excepthook(type(refusal), refusal, None, previous)
    later = RuntimeError("the launcher saw a rank fail")
    uncaught.excepthook(type(later), later, None, previous)
    interrupt = KeyboardInterrupt()
    uncaught.excepthook(type(interrupt), interrupt, None, previous)
    if debug:
        assert passed == [refusal, later, interrupt]
        assert uncaught.summary(tmp_path, 1) == []
        return
    assert passed == [interrupt]  # Ctrl-C is never hidden
    assert uncaught.summary(tmp_path, 1) == [
        "evenzero run: refused on rank 3: config key 'zero_optimization.stage' = 3: use stage "
        "1 or 2",
        "evenzero run: the job ended with exit status 1; the tracebacks of its 2 processes "
        "(ranks and launcher) are not shown (EVENZERO_DEBUG=1 shows them)"]


def test_summary_groups_ranks_and_names_disagreement(tmp_path, monkeypatch):
    monkeypatch.setenv(uncaught.STANDIN_ENV, str(tmp_path))
    monkeypatch.delenv("EVENZERO_DEBUG", raising=False)
    for rank, message in [(0, "a"), (1, "a"), (2, "a"), (5, "a"), (4, "b")]:
        monkeypatch.setenv("RANK", str(rank))
        monkeypatch.setattr(os, "getpid", lambda rank=rank: 1000 + rank)
        error = DeepSpeedConfigError(message)
        uncaught.excepthook(type(error), error, None, lambda *a: None)
    lines = uncaught.summary(tmp_path, 1)
    assert lines[:3] == ["evenzero run: refused on ranks 0-2, 5: a",
                         "evenzero run: refused on rank 4: b",
                         "evenzero run: the ranks were refused for different reasons: their "
                         "configs or code paths differ"]
    assert uncaught.summary(tmp_path / "none", 0) == []


def test_the_banner_points_to_help_that_ships_and_lists_the_refusals(capsys):
    """Issue 29: the banner named docs/why.md, which a pip install does not have."""
    from evenzero import cli
    from evenzero.commands.run import NOTICE
    from evenzero.deepspeed.config_keys import REFUSED_SECTIONS, ZERO_REFUSED
    from evenzero.deepspeed.refusals import REFUSED_MODULES

    assert "docs/" not in NOTICE and "`evenzero run --help` lists what it refuses" in NOTICE
    with pytest.raises(SystemExit) as done:
        cli.main(["run", "--help"])
    assert done.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # unwrapped
    for key in [*ZERO_REFUSED, *REFUSED_SECTIONS, *(f"deepspeed.{m}" for m in REFUSED_MODULES)]:
        assert f"{key}" in text, key
    assert "stage: 3 (ZeRO-3)" in text and '"auto" values' in text
    assert "printed once by `evenzero run`" in text
