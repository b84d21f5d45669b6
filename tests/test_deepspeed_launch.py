"""Set-up under every launcher a DeepSpeed script meets: torchrun, DeepSpeed's own
launcher (which also passes `--local_rank=N`), OpenMPI's mpirun (OMPI_COMM_WORLD_*), and
none. The environment rules are checked in-process; the script itself is launched for
real as 2 processes under DeepSpeed's launcher and under an OpenMPI environment, and
(slow) under torchrun against real DeepSpeed."""

from __future__ import annotations

import argparse
import base64
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from evenzero.deepspeed import add_config_arguments
from evenzero.deepspeed.launch import (
    LaunchError,
    fill_env_from_launcher,
    local_rank_from_env,
    reconcile_args_local_rank,
)

TESTS = Path(__file__).resolve().parent
SCRIPT = TESTS / "ds_train_script.py"
LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
               "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
               "OMPI_COMM_WORLD_LOCAL_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_NTASKS",
               "MV2_COMM_WORLD_SIZE")


@pytest.fixture
def clean_env(monkeypatch):
    for var in LAUNCH_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_torch_launcher_environment_is_used_as_is(clean_env):
    for var, value in (("RANK", "1"), ("WORLD_SIZE", "2"), ("LOCAL_RANK", "1"),
                       ("MASTER_ADDR", "10.0.0.1"), ("MASTER_PORT", "1234")):
        clean_env.setenv(var, value)
    assert fill_env_from_launcher() == "env"
    assert os.environ["MASTER_ADDR"] == "10.0.0.1"


def test_openmpi_environment_fills_torch_variables(clean_env):
    for var, value in (("OMPI_COMM_WORLD_RANK", "3"), ("OMPI_COMM_WORLD_SIZE", "4"),
                       ("OMPI_COMM_WORLD_LOCAL_RANK", "3"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "4")):
        clean_env.setenv(var, value)
    assert fill_env_from_launcher(distributed_port=4321) == "openmpi"
    assert [os.environ[v] for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                    "MASTER_PORT")] == ["3", "4", "3", "127.0.0.1", "4321"]
    assert local_rank_from_env() == 3


def test_openmpi_across_nodes_needs_master_addr(clean_env):
    for var, value in (("OMPI_COMM_WORLD_RANK", "5"), ("OMPI_COMM_WORLD_SIZE", "8"),
                       ("OMPI_COMM_WORLD_LOCAL_RANK", "1"), ("OMPI_COMM_WORLD_LOCAL_SIZE", "4")):
        clean_env.setenv(var, value)
    with pytest.raises(LaunchError, match="MASTER_ADDR"):
        fill_env_from_launcher()
    clean_env.setenv("MASTER_ADDR", "node0")
    assert fill_env_from_launcher() == "openmpi" and os.environ["RANK"] == "5"


def test_conflicting_launchers_are_refused(clean_env):
    clean_env.setenv("OMPI_COMM_WORLD_RANK", "1")
    clean_env.setenv("OMPI_COMM_WORLD_SIZE", "2")
    clean_env.setenv("RANK", "0")
    with pytest.raises(LaunchError, match="RANK=0 but OMPI_COMM_WORLD says 1"):
        fill_env_from_launcher()
    clean_env.setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1")
    clean_env.setenv("LOCAL_RANK", "0")
    with pytest.raises(LaunchError, match="OMPI_COMM_WORLD_LOCAL_RANK"):
        local_rank_from_env()


@pytest.mark.parametrize("var", ["PMI_SIZE", "SLURM_NTASKS"])
def test_unreadable_multi_process_launchers_are_refused(clean_env, var):
    """Never several unrelated one-process runs."""
    clean_env.setenv(var, "4")
    with pytest.raises(LaunchError, match=var):
        fill_env_from_launcher()


def test_no_launcher_is_one_process(clean_env):
    assert fill_env_from_launcher() == "single"
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == \
           ("0", "1", "0")


def test_local_rank_argument_is_reconciled_like_deepspeed():
    args = argparse.Namespace(local_rank=-1)
    reconcile_args_local_rank(args, 1)
    assert args.local_rank == 1
    reconcile_args_local_rank(argparse.Namespace(local_rank=None), 0)
    with pytest.raises(LaunchError, match="Mismatch in local rank setting"):
        reconcile_args_local_rank(argparse.Namespace(local_rank=0), 1)


def test_add_config_arguments_equals_deepspeeds():
    deepspeed = pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    ours, theirs = (add_config_arguments(argparse.ArgumentParser()),
                    deepspeed.add_config_arguments(argparse.ArgumentParser()))

    def options(parser):
        return sorted((tuple(a.option_strings), a.default, a.type, a.nargs, a.const)
                      for a in parser._actions)

    assert options(ours) == options(theirs)
    args = ours.parse_args(["--deepspeed", "--deepspeed_config", "ds.json"])
    assert args.deepspeed and args.deepspeed_config == "ds.json"
    with pytest.raises(SystemExit):  # like DeepSpeed's, it does not add --local_rank
        ours.parse_args(["--local_rank", "0"])


# --------------------------------------------------------------------------- real launches

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(**extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARS}
    src = str(TESTS.parent / "src")
    env.update(PYTHONPATH=os.pathsep.join([src, str(TESTS), env.get("PYTHONPATH", "")]),
               DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **extra)
    return env


def _run(cmds: list[list[str]], envs: list[dict], timeout: float = 300) -> None:
    procs = [subprocess.Popen(c, env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True) for c, e in zip(cmds, envs, strict=True)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-4000:]


def _script(impl: str, case: str, out: Path, epochs: int = 1) -> list[str]:
    return [str(SCRIPT), "--impl", impl, "--case", case, "--out", str(out),
            "--epochs", str(epochs)]


def _deepspeed_launcher(impl: str, case: str, out: Path) -> dict:
    """`deepspeed`'s per-node launcher: sets the env and passes --local_rank=N."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    world = base64.urlsafe_b64encode(json.dumps({"localhost": [0, 1]}).encode()).decode()
    cmd = [sys.executable, "-m", "deepspeed.launcher.launch", f"--world_info={world}",
           "--master_addr=127.0.0.1", f"--master_port={_free_port()}"] + _script(impl, case, out)
    _run([cmd], [_env()])
    return json.loads(out.read_text())


@pytest.mark.slow
def test_deepspeed_launcher_and_openmpi_launches_agree(tmp_path):
    """The script as 2 processes under DeepSpeed's launcher (env + `--local_rank=N`) and
    with only OpenMPI's variables, as `mpirun -np 2` starts them: same run."""
    launched = _deepspeed_launcher("evenzero", "zero1_adam_l2", tmp_path / "ds.json")
    assert launched["args_local_rank"] == 0  # --local_rank=0 reached rank 0 and agreed
    assert launched["global_steps"] == launched["micro_steps"] // launched["batch"][2] > 0
    port = str(_free_port())
    out = tmp_path / "mpi.json"
    envs = [_env(OMPI_COMM_WORLD_RANK=str(r), OMPI_COMM_WORLD_SIZE="2",
                 OMPI_COMM_WORLD_LOCAL_RANK=str(r), OMPI_COMM_WORLD_LOCAL_SIZE="2",
                 MASTER_PORT=port) for r in range(2)]
    _run([[sys.executable, *_script("evenzero", "zero1_adam_l2", out)]] * 2, envs)
    mpi = json.loads(out.read_text())
    assert mpi["losses"] == launched["losses"] and mpi["params"] == launched["params"]
    assert mpi["args_local_rank"] == 0


@pytest.mark.slow
def test_torchrun_script_equals_deepspeed(tmp_path):
    """The script under torchrun, with `training_data` (DeepSpeed's loader with two
    workers), once with `import deepspeed` and once with evenzero's."""
    pytest.importorskip("deepspeed", reason="DeepSpeed is not installed")
    results = {}
    for impl in ("deepspeed", "evenzero"):
        out = tmp_path / f"{impl}.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
               "--master-port", str(_free_port()), *_script(impl, "zero2_adam", out, epochs=2)]
        _run([cmd], [_env()])
        results[impl] = json.loads(out.read_text())
    ds, ez = results["deepspeed"], results["evenzero"]
    assert ds["lrs"] == ez["lrs"] and ds["global_steps"] == ez["global_steps"]
    assert max(abs(a - b) for a, b in zip(ds["losses"], ez["losses"], strict=True)) <= 1e-5
