"""DeepSpeed's `deepspeed` launcher command on torchrun (`evenzero.deepspeed.launcher`):
its flags read as DeepSpeed 0.19.8 reads them, the refusals by name, and a real
two-process launch under `evenzero run` whose workers get what DeepSpeed's per-node
launcher gives them (`--local_rank=R`, DeepSpeed's environment, bound cores)."""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from evenzero.deepspeed.launcher import runner
from evenzero.deepspeed.launcher.runner import LauncherError, local_slots, parse_args

SRC = Path(__file__).resolve().parent.parent / "src"
RANK_EXEC = SRC / "evenzero" / "deepspeed" / "launcher" / "rank_exec.py"


@pytest.fixture(autouse=True)
def no_visible_devices(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("KMP_AFFINITY", raising=False)


def slots(*flags: str, devices: int = 4) -> list[int]:
    return local_slots(parse_args([*flags, "train.py"]), devices)


def test_device_slots_follow_deepspeeds_filters():
    assert slots() == [0, 1, 2, 3]
    assert slots("--num_gpus", "2") == [0, 1]
    assert slots("--num_accelerators", "3") == [0, 1, 2]
    assert slots("--num_nodes", "1", "--num_gpus", "2") == [0, 1]
    assert slots("--include", "localhost:1,3") == [1, 3]
    assert slots("-e", "localhost:0") == [1, 2, 3]
    assert slots("-i", "localhost") == [0, 1, 2, 3]


def test_visible_devices_become_the_include_filter(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert slots() == [2, 3]
    assert slots("--num_gpus", "1") == [0]  # DeepSpeed ignores it when --num_gpus is given


@pytest.mark.parametrize("flags, message", [
    (["--num_nodes", "2"], "--num_nodes 2"),
    (["--node_rank", "1"], "--node_rank"),
    (["--no_ssh"], "--no_ssh"),
    (["--force_multi"], "--force_multi"),
    (["--launcher", "openmpi"], "--launcher"),
    (["--launcher_args", "-x FOO"], "--launcher_args"),
    (["--autotuning", "tune"], "--autotuning"),
    (["--save_pid"], "--save_pid"),
    (["--enable_each_rank_log", "logs"], "--enable_each_rank_log"),
    (["--ssh_port", "22"], "--ssh_port"),
    (["--include", "worker-1:0"], "host 'worker-1'"),
    (["--include", "localhost:7"], "No slot '7'"),
    (["--num_gpus", "2", "--include", "localhost:0"], "Cannot specify num_nodes/gpus"),
    (["--include", "localhost:0", "--exclude", "localhost:1"], "mutually exclusive"),
])
def test_flags_with_no_meaning_here_are_refused_by_name(flags, message):
    with pytest.raises(LauncherError, match=message):
        slots(*flags)


def test_a_hostfile_is_a_multi_node_launch(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("worker-0 slots=8\nworker-1 slots=8\n")
    with pytest.raises(LauncherError, match="hostfile"):
        slots("-H", str(hostfile))


def test_bind_core_list_and_modes():
    args = parse_args(["--bind_cores_to_rank", "--bind_core_list", "0,2-4", "x.py"])
    assert runner.rank_spec(args, 2)["bind_cores"] == [0, 2, 3, 4]
    with pytest.raises(LauncherError, match="At least one core"):
        runner.rank_spec(parse_args(["--bind_cores_to_rank", "--bind_core_list", "0", "x.py"]), 2)
    with pytest.raises(LauncherError, match="ascend order"):
        runner.parse_range_list("3,1")
    with pytest.raises(LauncherError, match="'--no_python' flag and the '--module'"):
        runner.rank_spec(parse_args(["--no_python", "--module", "x.py"]), 1)
    spec = importlib.util.spec_from_file_location("rank_exec", RANK_EXEC)
    rank_exec = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(rank_exec)
    base = {"local_rank_arg": True}
    assert rank_exec.program({**base, "mode": "python"}, "t.py", ["--a"], 1) == \
        [sys.executable, "-u", "t.py", "--local_rank=1", "--a"]
    assert rank_exec.program({**base, "mode": "module"}, "pkg.t", [], 0) == \
        [sys.executable, "-u", "-m", "pkg.t", "--local_rank=0"]
    assert rank_exec.program({"mode": "no_python", "local_rank_arg": False}, "./t.sh", ["x"], 0) \
        == ["./t.sh", "x"]
    assert rank_exec.bound_cores([0, 1, 2, 3, 4], 2, 1) == (2, [2, 3])


WORKER = r"""
import json, os, sys
keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE",
        "MASTER_ADDR", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
out = {"argv": sys.argv[1:], "env": {k: os.environ.get(k) for k in keys},
       "affinity": sorted(os.sched_getaffinity(0)),
       "deepspeed": __import__("importlib.util").util.find_spec("deepspeed").origin}
with open(os.path.join(sys.argv[-1], "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(out, f)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_deepspeed_command_runs_two_ranks_as_deepspeeds_launcher_would(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "RANK",
                                                            "LOCAL_RANK", "WORLD_SIZE")}
    env.update(PYTHONPATH=os.pathsep.join([str(SRC), env.get("PYTHONPATH", "")]),
               DS_ACCELERATOR="cpu")
    cores = runner.physical_cores()
    bind = ["--bind_cores_to_rank"] if cores >= 2 else []
    cmd = [sys.executable, "-m", "evenzero.cli", "run", "deepspeed", "--num_gpus", "2",
           "--master_port", str(_free_port()), *bind, str(script), "--flag", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in (0, 1):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["argv"] == [f"--local_rank={rank}", "--flag", str(tmp_path)]
        assert got["env"] | {"MASTER_ADDR": None, "OMP_NUM_THREADS": None} == {
            "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_SIZE": "2",
            "CROSS_RANK": "0", "CROSS_SIZE": "1", "MASTER_ADDR": None,
            "CUDA_VISIBLE_DEVICES": "0,1", "OMP_NUM_THREADS": None}
        assert got["env"]["MASTER_ADDR"] == "127.0.0.1"
        assert "evenzero-deepspeed-" in got["deepspeed"]
        if bind:
            per = cores // 2
            assert got["affinity"] == list(range(per * rank, per * (rank + 1)))
            assert got["env"]["OMP_NUM_THREADS"] == str(per)
        else:  # torchrun's OMP_NUM_THREADS=1 is undone: DeepSpeed's launcher sets none
            assert got["env"]["OMP_NUM_THREADS"] is None
