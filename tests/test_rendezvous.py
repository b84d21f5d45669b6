"""`evenzero.init_process_group`: torch's signature and errors, and a process group that
forms again on a store an earlier attempt of the job used (torchrun's shared store after
a restart, a store or file the user keeps)."""

from __future__ import annotations

import inspect
import multiprocessing
import os
import random
import subprocess
import sys
import textwrap
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

import evenzero
from dist_helpers import _free_port, run_distributed
from evenzero.rendezvous import RendezvousError, agree_round


def test_signature_is_torchs():
    ours = inspect.signature(evenzero.init_process_group).parameters
    theirs = inspect.signature(dist.init_process_group).parameters
    assert [(p.name, p.default, p.kind) for p in ours.values()] == \
        [(p.name, p.default, p.kind) for p in theirs.values()]


# --------------------------------------------------------------------------- the agreement


def agree_all(store, world: int, ranks=None, timeout: float = 20.0) -> dict[int, int]:
    """Every rank of `ranks` (default: all) runs `agree_round` on its own thread, started
    in a random order; returns {rank: round}."""
    out: dict[int, object] = {}

    def one(rank: int) -> None:
        try:
            out[rank] = agree_round(store, rank, world, timedelta(seconds=timeout))
        except Exception as e:  # noqa: BLE001 - returned to the test
            out[rank] = e

    order = list(range(world) if ranks is None else ranks)
    random.shuffle(order)
    threads = [threading.Thread(target=one, args=(r,)) for r in order]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out  # type: ignore[return-value]


def test_every_attempt_agrees_on_a_round_no_earlier_attempt_had():
    random.seed(0)
    store = dist.HashStore()
    seen = []
    for world in (4, 4, 2, 3, 4):
        got = agree_all(store, world)
        assert len(set(got.values())) == 1, got
        seen.append(next(iter(got.values())))
    assert len(set(seen)) == len(seen), seen


def test_tickets_of_an_attempt_that_died_half_way_do_not_confuse_the_next():
    store = dist.HashStore()
    first = set(agree_all(store, 4).values())
    # Ranks 0 and 2 of the next attempt took tickets (and voted) and were killed before
    # the other two arrived.
    dead = agree_all(store, 4, ranks=[0, 2], timeout=0.3)
    assert all(isinstance(e, RendezvousError) for e in dead.values()), dead
    again = set(agree_all(store, 4).values())
    assert len(again) == 1 and again != first


def test_a_rank_that_never_arrives_is_named():
    store = dist.HashStore()
    got = agree_all(store, 3, ranks=[0, 2], timeout=0.3)
    for e in got.values():
        assert isinstance(e, RendezvousError)
        assert "ranks [1] did not arrive" in str(e), e


# --------------------------------------------------------------------------- torch's rules


def test_misuse_raises_torchs_errors():
    with pytest.raises(AssertionError, match="Cannot specify both init_method and store"):
        evenzero.init_process_group("gloo", init_method="env://", store=dist.HashStore())
    with pytest.raises(TypeError, match="Expected timeout argument to be of type"):
        evenzero.init_process_group("gloo", timeout=30, store=dist.HashStore(), rank=0,
                                    world_size=1)
    with pytest.raises(AssertionError, match="world_size must be positive"):
        evenzero.init_process_group("gloo", store=dist.HashStore())
    assert not dist.is_initialized()


def initialised_twice(rank: int, world: int) -> str:
    with pytest.raises(ValueError) as ours:
        evenzero.init_process_group("gloo")
    with pytest.raises(ValueError) as theirs:
        dist.init_process_group("gloo")
    assert str(ours.value) == str(theirs.value)
    return str(ours.value)


def test_initialising_twice_is_torchs_error():
    assert run_distributed(initialised_twice, 2, timeout=120)[0] == \
        "trying to initialize the default process group twice!"


# --------------------------------------------------------------------------- real groups


def attempt_on_kept_store(port: int, rank: int, world: int, out) -> None:
    import torch
    import torch.distributed as dist

    import evenzero

    store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                          timeout=timedelta(seconds=60))
    evenzero.init_process_group("gloo", store=store, rank=rank, world_size=world,
                                timeout=timedelta(seconds=60))
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    sub = dist.new_group([0, 1])  # sub-groups live in the attempt's namespace too
    dist.all_reduce(t, group=sub)
    out.put((rank, float(t)))
    dist.destroy_process_group()


def test_a_store_kept_across_attempts_forms_a_fresh_group_each_time():
    # The user's store outlives the attempts, as torchrun's shared store does: without a
    # namespace per attempt, the second group reads the first one's peer addresses.
    world = 2
    server = dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                           timeout=timedelta(seconds=60))
    ctx = multiprocessing.get_context("spawn")
    for _attempt in range(2):
        out = ctx.Queue()
        procs = [ctx.Process(target=attempt_on_kept_store, args=(server.port, r, world, out))
                 for r in range(world)]
        for p in procs:
            p.start()
        results = dict(out.get(timeout=120) for _ in range(world))
        for p in procs:
            p.join(timeout=30)
            assert p.exitcode == 0
        assert results == {0: 6.0, 1: 6.0}, results


PLAIN_ENV_JOB = textwrap.dedent("""
    import torch, torch.distributed as dist, evenzero
    evenzero.init_process_group("gloo")
    t = torch.ones(1)
    dist.all_reduce(t)
    print(dist.get_rank(), dist.get_world_size(), int(t))
    dist.destroy_process_group()
""")


def test_plain_env_without_torchrun(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(PLAIN_ENV_JOB)
    port = str(_free_port())
    procs = [subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "RANK": str(r), "WORLD_SIZE": "2",
                                   "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port})
             for r in range(2)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert sorted(o.strip() for o, _ in outs) == ["0 2 2", "1 2 2"]


RESTART_JOB = textwrap.dedent("""
    import os, signal, sys, torch, torch.distributed as dist, evenzero
    evenzero.init_process_group("gloo")
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    for step in range(4):
        t = torch.ones(1000)
        dist.all_reduce(t)
        if step == 2 and attempt < 2 and dist.get_rank() == 1 + attempt:
            os.kill(os.getpid(), signal.SIGKILL)
    print(f"attempt {attempt} rank {dist.get_rank()} finished", flush=True)
    dist.destroy_process_group()
""")


@pytest.mark.slow
def test_torchrun_restarts_twice_at_4_ranks_on_the_shared_store(tmp_path):
    # torch 2.13's default (the agent's store shared with the workers); with torch's own
    # init_process_group the second restart fails in gloo's connectFullMesh.
    script = tmp_path / "job.py"
    script.write_text(RESTART_JOB)
    env = {k: v for k, v in os.environ.items() if k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                           "--nproc-per-node", "4", "--max-restarts", "2", "--monitor-interval",
                           "0.1", str(script)], env={**env, "OMP_NUM_THREADS": "1"},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(done.stdout.split("\n"))[1:] == [f"attempt 2 rank {r} finished"
                                                   for r in range(4)]


def test_module_imports_nothing_above_it():
    text = Path(evenzero.rendezvous.__file__).read_text()
    assert "from evenzero" not in text and "import evenzero" not in text
