"""Run a function on W gloo processes from a test, with tracebacks and a hard timeout.

    results = run_distributed(check_something, world_size=4, args=(...,))

`fn(rank, world_size, *args)` must be a top-level (picklable) function; the process
group is initialised (gloo, file rendezvous) before it runs and destroyed after. Its return
values come back as a list indexed by rank. If any rank raises, the test fails with
that rank's traceback; if the job outlives `timeout` seconds, every process is killed
and the test fails naming the ranks that had not finished, so a hang never hangs CI.

Whole scripts run under torchrun with `torchrun_standalone` (one agent) and
`torchrun_two_agents` (two agents on a c10d rendezvous on 127.0.0.1, as two nodes would).
"""

from __future__ import annotations

import faulthandler
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp


class DistributedTestError(AssertionError):
    """A rank failed or the job timed out; the message carries the rank's traceback."""


def _worker(fn, rank: int, world_size: int, store: str, args: Sequence[Any], out,
            stack_file: str) -> None:
    # On timeout the parent sends SIGUSR1 and reports where every thread was stuck.
    stacks = open(stack_file, "w")  # noqa: SIM115 - must outlive this frame until exit
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        # A file rendezvous: no port to race for with other test processes on the machine.
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                                world_size=world_size)
        result = fn(rank, world_size, *args)
        out.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - every failure must reach the parent
        out.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, args: Sequence[Any] = (),
                    timeout: float = 120.0) -> list[Any]:
    """Run `fn(rank, world_size, *args)` on `world_size` gloo ranks; returns per-rank results."""
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    stack_dir = Path(tempfile.mkdtemp(prefix="dist-test-"))
    store = str(stack_dir / "store")
    stack_files = [str(stack_dir / f"rank{r}.txt") for r in range(world_size)]
    procs = [ctx.Process(target=_worker, args=(fn, r, world_size, store, tuple(args), out,
                                               stack_files[r]), daemon=True)
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                missing = sorted(set(range(world_size)) - set(results) - set(errors))
                detail = "".join(f"\n--- rank {r} raised ---\n{e}" for r, e in sorted(errors.items()))
                detail += _stacks(procs, missing, stack_files)
                raise DistributedTestError(f"timed out after {timeout:.0f}s; ranks {missing} did "
                                           f"not finish{detail}")
            try:
                rank, status, payload = out.get(timeout=min(left, 1.0))
            except queue.Empty:
                dead = [r for r, p in enumerate(procs)
                        if not p.is_alive() and p.exitcode not in (0, None)
                        and r not in results and r not in errors]
                if dead:
                    raise DistributedTestError(f"rank(s) {dead} died with exit code "
                                               f"{procs[dead[0]].exitcode} without reporting") from None
                continue
            (results if status == "ok" else errors)[rank] = payload
            if errors and len(results) + len(errors) < world_size:
                # Give the other ranks a moment to report their own (usually matching) error.
                deadline = min(deadline, time.monotonic() + 10.0)
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    shutil.rmtree(stack_dir, ignore_errors=True)
    if errors:
        first = min(errors)
        raise DistributedTestError(f"rank {first} failed:\n{errors[first]}")
    return [results[r] for r in range(world_size)]


def _stacks(procs, ranks: list[int], files: list[str]) -> str:
    """Where each hung rank is stuck (Python stacks of all its threads)."""
    for r in ranks:
        if procs[r].is_alive():
            os.kill(procs[r].pid, signal.SIGUSR1)
    time.sleep(1.0)
    out = ""
    for r in ranks:
        text = Path(files[r]).read_text() if Path(files[r]).exists() else ""
        out += f"\n--- rank {r} stacks ---\n{text[-4000:] or '(none)'}"
    return out


def run_checks(checks: dict[str, Callable[[], None]], barrier: bool = False) -> dict[str, str | None]:
    """Run every check inside one spawned job; a failure is kept (with its traceback) by
    name instead of aborting the rest, so one spawn serves many pytest cases."""
    out: dict[str, str | None] = {}
    for name, check in checks.items():
        try:
            check()
            out[name] = None
        except Exception:  # noqa: BLE001 - reported per check to the parent
            out[name] = traceback.format_exc()
        if barrier:
            import torch.distributed as dist

            dist.barrier()
    return out


def expect(case: Callable[[], None], expected: tuple | None) -> None:
    """Run `case`. With `expected` = (error type, *fragments) it must raise that error
    with every fragment in its message; with None it must succeed."""
    if expected is None:
        case()
        return
    error_type, *fragments = expected
    try:
        case()
    except error_type as e:
        missing = [f for f in fragments if f not in str(e)]
        assert not missing, f"message lacks {missing}: {e}"
        return
    raise AssertionError(f"expected {error_type.__name__}, nothing was raised")


def expected_cases_job(namespace: Mapping[str, Any], expected: Mapping[str, tuple | None],
                       rank: int, world: int, seed: int | None = None) -> dict[str, str | None]:
    """On one rank, run each `case_<name>(rank, world)` of `namespace` (a test module's
    globals) and `expect` what `expected[name]` says; every rank meets at a barrier after
    each case, so a case that hangs on one rank shows as a timeout, not a later failure."""

    def one(name: str) -> None:
        if seed is not None:
            torch.manual_seed(seed)
        expect(partial(namespace[f"case_{name}"], rank, world), expected[name])

    return run_checks({name: partial(one, name) for name in expected}, barrier=True)


class CheckResults:
    """Spawns `job` once per argument tuple and caches what `run_checks` returned on each
    rank; `assert_passed` then fails a pytest case with the first failing rank's traceback."""

    def __init__(self, job: Callable[..., dict[str, str | None]], timeout: float) -> None:
        self.job, self.timeout = job, timeout
        self._cache: dict[tuple, list[dict[str, str | None]]] = {}

    def assert_passed(self, check: str, world: int, *args: Any) -> None:
        key = (world, *args)
        if key not in self._cache:
            self._cache[key] = run_distributed(self.job, world, args, timeout=self.timeout)
        failures = [(r, res[check]) for r, res in enumerate(self._cache[key]) if res[check]]
        assert not failures, f"rank {failures[0][0]}:\n{failures[0][1]}"


# --------------------------------------------------------------------------- torchrun


def _torchrun_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def torchrun_standalone(script: Path, args: Sequence[str] = (), nproc: int = 2,
                        timeout: float = 120.0) -> subprocess.CompletedProcess:
    """Run `script` under one torchrun agent with `nproc` local workers; returns the
    agent's completed process (its return code is the job's)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), "--monitor-interval", "0.1", str(script), *args]
    return subprocess.run(cmd, env=_torchrun_env(), capture_output=True, text=True,
                          timeout=timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_two_agents(script: Path, args: Sequence[str] = (),
                        timeout: float = 120.0) -> list[tuple[int | None, str]]:
    """Run `script` as a two-node job: two torchrun agents, started separately, one
    worker each, meeting on a c10d rendezvous on 127.0.0.1. Returns (return code, output)
    per agent; the code is None for an agent still running at `timeout` (both are
    killed then), which is how a hang in torchrun's end-of-job barrier shows."""
    endpoint = f"127.0.0.1:{_free_port()}"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
           "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id",
           uuid.uuid4().hex[:12], "--monitor-interval", "0.1", str(script), *args]
    agents = [subprocess.Popen(cmd, env=_torchrun_env(), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
              for _ in range(2)]
    deadline = time.monotonic() + timeout
    out: list[tuple[int | None, str]] = []
    for agent in agents:
        try:
            text, _ = agent.communicate(timeout=max(1.0, deadline - time.monotonic()))
            out.append((agent.returncode, text))
        except subprocess.TimeoutExpired:
            os.killpg(agent.pid, signal.SIGKILL)
            text, _ = agent.communicate()
            out.append((None, text))
    return out
