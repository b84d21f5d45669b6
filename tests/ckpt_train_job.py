"""A small deterministic training job for the checkpoint tests.

Imported by tests/test_checkpoint*.py (the model, data and training loop) and run on
its own under torchrun by the kill-and-resume test:

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node 2 \\
        --max-restarts 2 tests/ckpt_train_job.py OUT \\
        --steps 10 --every 2 --crash step:5:0 --crash save:6:1

Every step's batch is a function of (step, rank) only and the model starts from a
fixed seed, so a job that resumes from a checkpoint must end with exactly the same
parameters as one that never stopped. `--crash KIND:STEP:ATTEMPT` makes rank 1 SIGKILL
itself on torchrun attempt ATTEMPT (TORCHELASTIC_RESTART_COUNT): `step` in the middle
of step STEP's backward (the other rank is inside a collective), `save` in the middle
of the save at step STEP, after writing half of its shard file.
"""

from __future__ import annotations

import argparse
import os
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

DIM = 24
HIDDEN = 40


@dataclass(frozen=True)
class JobOptions:
    """How the test model is built and sharded."""

    stage: int = 2
    """ZeRO stage of the optimizer."""
    bucket_numel: int = 1000
    """Small, so that the model spans several buckets and parameters straddle ranks."""
    optimizer: str = "adamw"
    """"adamw" or "sgd" (momentum), to test optimizer mismatches."""
    width: int = HIDDEN
    """Hidden width; another width is "a different model"."""
    experts: int = 1
    """Expert-parallel size E of the expert layer; 1 means no expert group."""
    seed: int = 1234


class TinyNet(nn.Module):
    """Dense layers, an optional expert layer, a frozen parameter and buffers that matter.

    `steps_seen` scales the output, so a resume that forgot the buffers diverges; the
    expert layer (E > 1) is marked like DeepSpeed's MoE (allreduce=False) and holds
    different weights on each expert-parallel rank.
    """

    def __init__(self, options: JobOptions, ep_rank: int = 0) -> None:
        super().__init__()
        w = options.width
        torch.manual_seed(options.seed)
        self.embed = nn.Linear(DIM, w)
        self.block = nn.Linear(w, w)
        self.head = nn.Linear(w, DIM)
        self.frozen_bias = nn.Parameter(torch.randn(w) * 0.01, requires_grad=False)
        self.register_buffer("steps_seen", torch.zeros((), dtype=torch.int64))
        self.expert = None
        if options.experts > 1:
            torch.manual_seed(options.seed + 1 + ep_rank)
            self.expert = nn.Linear(w, w)
            for p in self.expert.parameters():
                p.allreduce = False
                p.group_name = "experts"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.embed(x)) + self.frozen_bias
        h = h + torch.tanh(self.block(h))
        if self.expert is not None:
            h = h + torch.tanh(self.expert(h))
        if self.training:
            self.steps_seen += 1
        return self.head(h) / (1.0 + 0.01 * self.steps_seen.float())


def batch(step: int, rank: int, seed: int = 1234) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 7919 + step * 131 + rank)
    return torch.randn(8, DIM, generator=gen), torch.randn(8, DIM, generator=gen)


@dataclass(frozen=True)
class RankGroups:
    """This rank's process groups for a job on the first W ranks."""

    world: Any
    """Process group of ranks 0..W-1; None on ranks outside it."""
    experts: Any = None
    """This rank's expert-data-parallel group {r % E + kE} inside it, for E > 1."""


def make_groups(world_sizes: list[int], experts: int) -> dict[int, RankGroups]:
    """Sub-worlds of the first W ranks (with their expert groups); a collective."""
    rank, full = dist.get_rank(), dist.get_world_size()
    out = {}
    for w in world_sizes:
        world = dist.group.WORLD if w == full else dist.new_group(list(range(w)))
        edp = None
        if experts > 1 and w % experts == 0:
            for first in range(experts):
                pg = dist.new_group(list(range(first, w, experts)))
                if rank < w and rank % experts == first:
                    edp = pg
        out[w] = RankGroups(world if rank < w else None, edp)
    return out


def build(options: JobOptions, groups: RankGroups | None = None):
    """(model, ZeroOptimizer) on this rank; a collective over `groups.world`."""
    from evenzero import ZeroOptimizer

    if groups is None:
        groups = make_groups([dist.get_world_size()], options.experts)[dist.get_world_size()]
    rank = dist.get_rank(groups.world)
    model = TinyNet(options, ep_rank=rank % options.experts)
    if options.optimizer == "adamw":
        cls, kw = torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.01}
    else:
        cls, kw = torch.optim.SGD, {"lr": 1e-2, "momentum": 0.9}
    expert_groups = {"experts": groups.experts} if options.experts > 1 else None
    opt = ZeroOptimizer(model, cls, stage=options.stage, bucket_numel=options.bucket_numel,
                        process_group=groups.world, expert_groups=expert_groups, **kw)
    return model, opt


def train(model: nn.Module, opt, start: int, stop: int) -> None:
    rank = dist.get_rank(opt.world_group)
    for step in range(start, stop):
        x, y = batch(step, rank)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


# --------------------------------------------------------------------------- torchrun job


def _crashes(specs: list[str]) -> dict[str, int]:
    """{kind: step} of the crashes that apply to this rank on this attempt."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = {}
    for spec in specs:
        kind, step, when = spec.split(":")
        if int(when) == attempt and dist.get_rank() == 1:
            out[kind] = int(step)
    return out


def _arm_save_crash() -> None:
    """Make this rank's next shard write stop half-way and die, like a power cut."""
    from evenzero.checkpoint import files as checkpoint_io

    real = checkpoint_io.write_file

    def half_then_die(path, tensors, rank):
        record = real(path, tensors, rank)
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])
        os.kill(os.getpid(), signal.SIGKILL)
        return record

    checkpoint_io.write_file = half_then_die


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out", type=Path)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--stage", type=int, default=2)
    ap.add_argument("--crash", action="append", default=[])
    args = ap.parse_args()
    from evenzero import checkpoint
    from evenzero.checkpoint.consolidate import export_consolidated

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, opt = build(JobOptions(stage=args.stage))
    crashes = _crashes(args.crash)
    ckpt = args.out / "ckpt"
    start = 0
    if checkpoint.latest(ckpt) is not None:
        start = checkpoint.load(opt, ckpt).step
    if dist.get_rank() == 0:
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        with open(args.out / "attempts.log", "a") as f:
            f.write(f"attempt {attempt} start {start}\n")

    if "step" in crashes:
        # Mid-backward, once the head's bucket is reduced: the other rank goes on into the
        # next reduce-scatter and waits there for a peer that is gone.
        def die(_p, at=crashes["step"]):
            if int(model.steps_seen) == at + 1:
                os.kill(os.getpid(), signal.SIGKILL)

        model.block.weight.register_post_accumulate_grad_hook(die)

    for step in range(start, args.steps):
        train(model, opt, step, step + 1)
        done = step + 1
        if done % args.every == 0:
            if crashes.get("save") == done:
                _arm_save_crash()
            checkpoint.save(opt, ckpt, done)
    export_consolidated(opt, args.out / "final")
    # The reference: the same job, never interrupted, in the same processes.
    ref_model, ref_opt = build(JobOptions(stage=args.stage))
    train(ref_model, ref_opt, 0, args.steps)
    export_consolidated(ref_opt, args.out / "reference")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
