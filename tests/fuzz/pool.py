"""Spawn W gloo ranks once and run many cases on them.

Every rank runs the cases in the same order; after each case the ranks exchange their
results (`runner.agree`) and rank 0 reports the merged one. A case that leaves the ranks
in different collectives ends in the process group's timeout: the batch stops there, the
case is reported as a hang, and the caller starts a fresh batch after it.
"""

from __future__ import annotations

import datetime
import os
import queue
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch.multiprocessing as mp

from .case import Case, from_dict, to_dict

COLLECTIVE_TIMEOUT_S = 60.0


def _worker(rank: int, world: int, store: str, workdir: str, cases: list[dict], out) -> None:
    os.environ.update(OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu")
    import torch
    import torch.distributed as dist

    from evenzero.moe import expert_parallel_groups

    from .runner import agree, run_case

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    try:
        experts = expert_parallel_groups(1)
        solo = None
        for r in range(world):  # every rank creates every group, in the same order
            group = dist.new_group([r])
            solo = group if r == rank else solo
        for i, d in enumerate(cases):
            case = from_dict(d)
            result = run_case(case, rank, world, experts, os.path.join(workdir, f"c{i}"), solo)
            try:
                merged = agree(result, world)
            except Exception as e:  # noqa: BLE001 - the ranks no longer meet: a hang
                if rank == 0:
                    out.put((i, {"status": "hang", "detail": f"{result['detail']} "
                                 f"(then the ranks did not meet: {type(e).__name__})"}))
                return
            if rank == 0:
                out.put((i, merged))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _run_batch(cases: Sequence[Case], world: int, timeout: float) -> Iterator[tuple[int, dict]]:
    # DDP's "find_unused_parameters=True ... did not find any unused parameters" notice
    # would be printed by every rank for many cases: the children log errors only.
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    tmp = tempfile.mkdtemp(prefix="evenzero-fuzz-")
    data = [to_dict(c) for c in cases]
    procs = [ctx.Process(target=_worker, args=(r, world, os.path.join(tmp, "store"), tmp, data, out),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    got = 0
    deadline = time.monotonic() + timeout
    try:
        while got < len(cases):
            try:
                i, res = out.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() > deadline or not all(p.is_alive() for p in procs):
                    return
                continue
            got += 1
            deadline = time.monotonic() + timeout
            yield i, res
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(5)
        shutil.rmtree(tmp, ignore_errors=True)


def run_cases(cases: Sequence[Case], world: int, per_case_timeout: float = 120.0
              ) -> list[dict[str, Any]]:
    """Every case's merged result, in order; restarts the ranks after a hang or a crash."""
    results: list[dict[str, Any]] = []
    while len(results) < len(cases):
        start = len(results)
        for i, res in _run_batch(cases[start:], world, per_case_timeout):
            assert i == len(results) - start
            results.append(res)
        if len(results) == start:
            results.append({"status": "hang", "detail": "no result before the timeout "
                            "(a rank died or every rank waited)"})
        elif len(results) < len(cases) and results[-1]["status"] != "hang":
            results.append({"status": "hang", "detail": "the ranks stopped after this case"})
    return results


def first_failing(cases: Sequence[Case], world: int, fails, per_case_timeout: float = 120.0
                  ) -> int | None:
    """The index of the first case whose result `fails(result)`, stopping the ranks there;
    a case that hangs counts as its result {"status": "hang"}."""
    done = 0
    while done < len(cases):
        start = done
        for i, res in _run_batch(cases[start:], world, per_case_timeout):
            if fails(res):
                return start + i
            done = start + i + 1
        if done == start:  # no result: the first case hung
            if fails({"status": "hang", "detail": ""}):
                return start
            done += 1
    return None
