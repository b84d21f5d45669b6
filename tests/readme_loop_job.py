"""The README's training loop as a script, for the clean-exit and fault-tolerance tests.

    torchrun --standalone --nproc-per-node 2 tests/readme_loop_job.py [--bf16] [--overlap]
        [--end {nothing,destroy,del,save}]

It ends the way real jobs end: falling off the end of the script (`nothing`), with
`dist.destroy_process_group()` (`destroy`), dropping the optimizer first (`del`), or
saving a checkpoint as the last thing (`save`). Every rank must exit with status 0.

With `--out DIR` it is the README's full loop: checkpoints under DIR/ckpt every `--every`
steps with the scheduler, data position and RNG in `extra`, a resume from
`checkpoint.latest` when one exists (the log says which), and at the end the
consolidated model and optimizer in DIR/final. Rank 0 appends to DIR/log.txt one line per
attempt and one per step (the global mean loss and the world size). `--crash
KIND:STEP:ATTEMPT:RANK` makes RANK SIGKILL itself in torchrun attempt ATTEMPT
(`TORCHELASTIC_RESTART_COUNT`) during step STEP (0-based): in its `forward`, in its
`backward` (the other ranks are then in a reduce-scatter), or in the `save` after it,
half-way through writing its shard. Every batch is a function of the step alone (the
global batch is split over the ranks), so a resumed job must end where an uninterrupted
one does, at any world size.

    torchrun --standalone --nproc-per-node 4 --max-restarts 2 tests/readme_loop_job.py \\
        --out /tmp/run --steps 16 --every 4 --crash backward:6:0:2 --crash save:11:1:1
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import evenzero

GLOBAL_BATCH = 16
"""Rows of one step's batch over all ranks (each rank trains on GLOBAL_BATCH / W)."""


def build_model(dtype: torch.dtype, dropout: float) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(dropout), nn.Linear(64, 64),
                         nn.ReLU(), nn.Linear(64, 8)).to(dtype)


def batch(step: int, micro: int, rank: int, world: int, dtype: torch.dtype) -> torch.Tensor:
    """This rank's rows of micro-batch `micro` of step `step`."""
    gen = torch.Generator().manual_seed(1_000_003 * step + micro)
    rows = torch.randn(GLOBAL_BATCH, 32, generator=gen)
    per = GLOBAL_BATCH // world
    return rows[rank * per:(rank + 1) * per].to(dtype)


def crashes_here(specs: list[str]) -> dict[str, int]:
    """{kind: step} of the `--crash` specs for this rank in this torchrun attempt."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    out = {}
    for spec in specs:
        kind, step, when, rank = spec.split(":")
        if int(when) == attempt and int(rank) == dist.get_rank():
            out[kind] = int(step)
    return out


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def arm_save_crash() -> None:
    """This rank's next shard write stops half-way and the process dies, like a power cut."""
    from evenzero.checkpoint import files as checkpoint_io

    real = checkpoint_io.write_file

    def half_then_die(path, tensors, rank):
        record = real(path, tensors, rank)
        data = Path(path).read_bytes()
        Path(path).write_bytes(data[: len(data) // 2])
        die()
        return record

    checkpoint_io.write_file = half_then_die


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--overlap", action="store_true", help="overlap_param_gather=True")
    parser.add_argument("--end", choices=("nothing", "destroy", "del", "save"),
                        default="nothing")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--out", type=Path, help="the full loop: checkpoints, resume, export")
    parser.add_argument("--every", type=int, default=4, help="checkpoint every N steps")
    parser.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--crash", action="append", default=[], help="KIND:STEP:ATTEMPT:RANK")
    parser.add_argument("--step-sleep", type=float, default=0.0,
                        help="seconds each step takes at least (gives a test time to act)")
    parser.add_argument("--pids", type=Path, help="each worker writes <agent pid>.<rank> here")
    args = parser.parse_args()

    evenzero.init_process_group("gloo")
    rank = dist.get_rank()
    if args.pids is not None:
        args.pids.mkdir(parents=True, exist_ok=True)
        (args.pids / f"{os.getppid()}.{rank}").write_text(str(os.getpid()))
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = build_model(dtype, args.dropout if args.out else 0.0)
    opt = evenzero.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.01,
                                 stage=2, bucket_numel=2**10,
                                 overlap_param_gather=args.overlap)
    if args.out is None:
        generator = torch.Generator().manual_seed(rank)
        for _ in range(args.steps):
            loss = model(torch.randn(16, 32, generator=generator).to(dtype)).float().mean()
            loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
    else:
        full_loop(args, model, opt, dtype)
    if args.end == "save":
        # One directory for every rank of this torchrun job, removed once all have written.
        where = Path(tempfile.gettempdir()) / f"evenzero-exit-{os.environ['TORCHELASTIC_RUN_ID']}"
        from evenzero import checkpoint

        checkpoint.save(opt, where)
        dist.barrier()
        if dist.get_rank() == 0:
            shutil.rmtree(where, ignore_errors=True)
    if args.end == "del":
        del opt
    if args.end in ("destroy", "del"):
        dist.destroy_process_group()


def full_loop(args, model: nn.Module, opt, dtype: torch.dtype) -> None:
    from evenzero import checkpoint

    rank, world = dist.get_rank(), dist.get_world_size()
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    args.out.mkdir(parents=True, exist_ok=True)
    log = (args.out / "log.txt").open("a") if rank == 0 else None
    ckpt = args.out / "ckpt"
    crashes = crashes_here(args.crash)

    # The README's resume, as written there.
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10))
    start = 0
    found = checkpoint.latest(ckpt)
    if found is not None:
        resumed = checkpoint.load(opt, found)      # every rank; raises alike on every rank
        sched.load_state_dict(resumed.extra["scheduler"])
        torch.set_rng_state(resumed.extra["rng"])
        start = resumed.extra["data"]["next_batch"]
    if log is not None:
        where = f"resumed from {found.name}" if found is not None else "started fresh"
        print(f"[readme loop] attempt {attempt}: world {world}, {where}, at step {start}",
              flush=True)
        log.write(f"attempt {attempt} world {world} start {start} "
                  f"from {found.name if found is not None else '-'}\n")
        log.flush()

    now = {"step": -1}
    if "forward" in crashes:
        model[3].register_forward_pre_hook(
            lambda *_: die() if now["step"] == crashes["forward"] else None)
    if "backward" in crashes:
        # Once the head's bucket is reduced: the other ranks go on into the next
        # reduce-scatter and wait there for a peer that is gone.
        model[3].weight.register_post_accumulate_grad_hook(
            lambda _p: die() if now["step"] == crashes["backward"] else None)

    for step in range(start, args.steps):
        began = time.monotonic()
        now["step"] = step
        total = torch.zeros((), dtype=torch.float64)
        for micro in range(args.accum):
            x = batch(step, micro, rank, world, dtype)
            loss = model(x).float().pow(2).mean() / args.accum
            total += loss.detach().double()
            if micro < args.accum - 1:
                with opt.no_sync():
                    loss.backward()
            else:
                loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        dist.all_reduce(total)
        if log is not None:
            log.write(f"step {step} loss {float(total) / world!r} world {world}\n")
            log.flush()
        if (step + 1) % args.every == 0:
            if crashes.get("save") == step:
                arm_save_crash()
            checkpoint.save(opt, ckpt, extra={"scheduler": sched.state_dict(),
                                              "data": {"next_batch": step + 1},
                                              "rng": torch.get_rng_state()})
        time.sleep(max(0.0, args.step_sleep - (time.monotonic() - began)))
    checkpoint.export_consolidated(opt, args.out / "final")
    if log is not None:
        log.write(f"finished world {world}\n")
        log.close()


if __name__ == "__main__":
    main()
