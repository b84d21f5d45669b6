"""A stalled rank is named, not waited for in silence: when one rank stops arriving (it
sleeps, or spins in user code), the others fail at the process group's timeout (plus a
short grace) with an error naming it, the step and what they were waiting for; and the
progress records cost one store write per step, none per bucket."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch
from torch import nn

from dist_helpers import run_distributed
from evenzero.runtime.stall import StalledRankError, describe, grace_seconds

STALLED = 1
TIMEOUT = 4.0


def build(world_group, records_every_step: bool = True):
    from evenzero import ZeroOptimizer
    from evenzero.runtime import stall

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)])
    # 64-element buckets: every layer's weight is a bucket of its own (several waits).
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.1, bucket_numel=64,
                        process_group=world_group)
    if records_every_step:
        # run_distributed's store is a FileStore, where records are written only at
        # construction and when waiting; these tests want one per step.
        opt._progress.per_step = True
        stall.RECORD_EVERY_SECONDS = 0.0
    return model, opt


def stall_job(rank: int, world: int, mode: str) -> tuple:
    import torch.distributed as dist

    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=TIMEOUT))
    model, opt = build(group)
    began = time.monotonic()
    try:
        for step in range(5):
            began = time.monotonic()
            if rank == STALLED and step == 3 and mode == "sleep":
                time.sleep(TIMEOUT + grace_seconds(TIMEOUT) + 4)
            loss = model(torch.randn(8, 16)).pow(2).mean()
            loss.backward()
            if rank == STALLED and step == 3 and mode == "spin":
                # User code between backward and step that does not come back in time.
                end = time.monotonic() + TIMEOUT + grace_seconds(TIMEOUT) + 4
                while time.monotonic() < end:
                    pass
            opt.step()
            opt.zero_grad()
    except StalledRankError as e:
        return "named", str(e), e.missing, e.step, time.monotonic() - began
    except RuntimeError as e:
        # The stalled rank, back too late: its peers gave up on it.
        import traceback

        return "late", type(e).__name__, str(e)[:200], traceback.format_exc()[-3000:]
    return ("finished",)


def assert_named(results: list[tuple], waited_for: str) -> None:
    # The stalled rank, back too late, is told so when its first wait fails (its first
    # collective may also fail at launch, with torch's error, once the others are gone).
    late = results[STALLED]
    assert late[0] == "late" or (late[2] == [STALLED] and
                                 "This rank is the one that stopped arriving" in late[1]), late
    for rank, got in enumerate(results):
        if rank == STALLED:
            continue
        assert got[0] == "named", (rank, *got[:2], got[-1])
        _, message, missing, step, elapsed = got
        assert missing == [STALLED] and step == 3, got
        assert f"Rank(s) [{STALLED}] did not arrive: rank {STALLED} (its last progress record" \
            in message and "says 3 steps done" in message, message
        assert f"waiting for {waited_for}" in message and "in step 3 (opt.step_count 3)" \
            in message, message
        assert "timeout=timedelta" in message
        # Failed at the timeout (plus the grace), not later; slack for a loaded machine.
        assert TIMEOUT * 0.9 < elapsed < TIMEOUT + grace_seconds(TIMEOUT) + 20, elapsed


def test_a_sleeping_rank_is_named_in_the_backward_wait():
    results = run_distributed(stall_job, 3, args=("sleep",), timeout=180)
    # The others reduced their buckets and waited in the first one's reduce-scatter.
    assert_named(results, "bucket 0 (group 'dense', 96 elements, reduce_scatter)")


@pytest.mark.slow
def test_a_rank_spinning_in_user_code_is_named_in_the_step_check():
    results = run_distributed(stall_job, 4, args=("spin",), timeout=240)
    assert_named(results, "the step check's all-reduce")


class CountingStore:
    """A store proxy that counts the calls made through it."""

    def __init__(self, store) -> None:
        self.store, self.calls = store, []

    def __getattr__(self, name):
        self.calls.append(name)
        return getattr(self.store, name)


def store_traffic_job(rank: int, world: int) -> tuple[int, list[list[str]]]:
    from evenzero.runtime import stall

    model, opt = build(None, records_every_step=False)
    board = opt._progress
    board.store = CountingStore(board.store)
    calls = []

    def steps(n: int) -> None:
        board.store.calls = []
        for _ in range(n):
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        calls.append(board.store.calls)

    steps(2)                          # a FileStore: nothing per step
    board.per_step, stall.RECORD_EVERY_SECONDS = True, 0.0
    steps(3)                          # one write per step at most
    stall.RECORD_EVERY_SECONDS = 3600.0
    steps(3)                          # and at most one per RECORD_EVERY_SECONDS
    return len(opt.plan.buckets), calls


def test_progress_records_cost_no_store_write_per_bucket():
    for buckets, calls in run_distributed(store_traffic_job, 2, timeout=120):
        assert buckets >= 4
        assert calls == [[], ["set"] * 3, []], calls


def test_what_a_rank_waits_for_reads_well():
    assert describe(("dense", 2)) == "the parameter all-gather of layout 2 (group 'dense')"
    assert describe("the step check's all-reduce") == "the step check's all-reduce"
    assert grace_seconds(4) == 2.0 and grace_seconds(600) == 30.0 and grace_seconds(100) == 10.0
