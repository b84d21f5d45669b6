"""A finished job exits cleanly: under torchrun, on one node and on two agents, and when
the optimizer is dropped.

The failure this guards against: a gloo worker thread freeing a finished collective's
tensors during interpreter finalisation aborted the process (SIGABRT, `terminate
called without an active exception`) in most runs of the README loop, and with two
agents the other agent then hung in torchrun's end-of-job barrier. See
`evenzero.runtime.teardown`.
"""

from __future__ import annotations

import gc
import weakref
from pathlib import Path

import pytest
import torch

from dist_helpers import run_distributed, torchrun_standalone, torchrun_two_agents
from test_runtime_models import MLP, mlp_batch, mlp_loss, part

JOB = Path(__file__).with_name("readme_loop_job.py")
ENDINGS = [(), ("--bf16", "--overlap", "--end", "destroy"), ("--end", "del"), ("--end", "save")]


def assert_clean_single_node(args) -> None:
    done = torchrun_standalone(JOB, args)
    text = done.stdout[-3000:] + done.stderr[-3000:]
    assert done.returncode == 0, f"torchrun {args} exited {done.returncode}:\n{text}"
    assert "terminate called" not in done.stderr, text


def assert_clean_two_agents(args) -> None:
    for agent, (code, text) in enumerate(torchrun_two_agents(JOB, args)):
        assert code == 0, (f"agent {agent} of a two-node job {args} "
                           f"{'hung' if code is None else f'exited {code}'}:\n{text[-3000:]}")
        assert "terminate called" not in text, text[-3000:]


def test_readme_loop_exits_cleanly_under_torchrun():
    # Before the fix every two-agent run failed and the single-node loop aborted in about
    # two runs of three: one of each catches a regression (the two-agent run for certain);
    # the slow test below repeats them 20 times over every ending.
    assert_clean_single_node(ENDINGS[1])
    assert_clean_two_agents(ENDINGS[0])


@pytest.mark.slow
def test_readme_loop_exits_cleanly_20_times_on_one_node_and_on_two_agents():
    for i in range(20):
        assert_clean_single_node(ENDINGS[i % len(ENDINGS)])
        assert_clean_two_agents(ENDINGS[i % len(ENDINGS)])


def drop_job(rank: int, world: int) -> None:
    """Dropping the optimizer frees it at once (the hooks hold it weakly), finishes its
    overlapped gathers and removes every hook it put on the model."""
    from evenzero import ZeroOptimizer

    torch.manual_seed(0)
    model = MLP()
    opt = ZeroOptimizer(model, torch.optim.SGD, lr=0.1, bucket_numel=64,
                        overlap_param_gather=True)
    for step in range(2):
        mlp_loss(model, tuple(part(t, rank, world) for t in mlp_batch(step, 4 * world))).backward()
        opt.step()
        opt.zero_grad()
    assert opt._gathers.pending, "the step should return with its gathers in flight"
    pending = list(opt._gathers.pending.values())
    alive = weakref.ref(opt)
    gc.disable()  # freed by reference counting, not by a lucky collection
    try:
        del opt
        assert alive() is None, "something still holds the optimizer"
    finally:
        gc.enable()
    assert all(work.is_completed() for work in pending)
    for m in model.modules():
        assert not m._forward_hooks and not m._forward_pre_hooks, m
        assert not m._state_dict_pre_hooks, m
    for p in model.parameters():
        assert not p._post_accumulate_grad_hooks, p.shape
    # The model still trains on its own: plain autograd, no collectives left behind.
    mlp_loss(model, mlp_batch(9, 4)).backward()
    assert all(p.grad is not None for p in model.parameters())


def test_dropped_optimizer_is_freed_and_leaves_no_hooks():
    run_distributed(drop_job, 2, timeout=120)
