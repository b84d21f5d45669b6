"""The step phase with bf16 parameters against fp32 ones (issue 17's bf16 target).

Issue 17: with bf16 parameters (fp32 masters, the pick-up of writes, the bf16 gathers) the
step phase of the 59M GPT at 4 ranks must be no slower than the fp32 step phase of the
runtime as it was before that work. This script trains two `ZeroOptimizer` systems with
defaults side by side, interleaved step by step on the same batches: one on fp32
parameters, one on a bf16 copy (AdamW, lr 1e-3, weight decay 0.01); it prints each
phase (forward, backward, step + zero_grad) as the slowest rank's median.

It uses only `evenzero.ZeroOptimizer` and `evenzero.repro.gptmodel`, which older checkouts
have too, so the same script times an older runtime on the same machine:

    python benchmarks/bf16_step.py [--world-size 4] [--steps 6] [--json FILE]
    PYTHONPATH=/path/to/old/checkout/src python benchmarks/bf16_step.py   # the old runtime
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

try:
    import evenzero  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

PHASES = ("forward", "backward", "step")


def worker(rank: int, world: int, init_file: str, args: argparse.Namespace, out: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world)
    from evenzero import ZeroOptimizer
    from evenzero.repro.gptmodel import GPT, GPT_SIZES, gpt_batch, gpt_loss

    config = GPT_SIZES[args.model]
    torch.manual_seed(0)
    base = GPT(config)
    systems = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = copy.deepcopy(base).to(dtype)
        systems[name] = (model, ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3,
                                              weight_decay=0.01))
    times = {name: [] for name in systems}
    for step in range(args.warmup + args.steps):
        x, y = gpt_batch(config, step, rank, world)
        names = list(systems)
        names = names[step % 2:] + names[:step % 2]  # the order alternates
        for name in names:
            model, opt = systems[name]
            dist.barrier()
            t0 = time.perf_counter()
            loss = gpt_loss(model(x), y).float()
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            opt.step()
            opt.zero_grad()
            t3 = time.perf_counter()
            if step >= args.warmup:
                times[name].append([t1 - t0, t2 - t1, t3 - t2, t3 - t0])
    result = {}
    for name, rows in times.items():
        slowest = torch.tensor(rows, dtype=torch.float64)
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        result[name] = {ph: statistics.median(slowest[:, i].tolist()) * 1e3
                        for i, ph in enumerate((*PHASES, "whole"))}
    if rank == 0:
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--model", default="bench-50m")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        mp.spawn(worker, (args.world_size, os.path.join(tmp, "init"), args, out),
                 nprocs=args.world_size)
        result = json.loads(Path(out).read_text())
    import evenzero

    print(f"{args.model}, {args.world_size} ranks, slowest rank's median of {args.steps} "
          f"interleaved steps, ms (evenzero from {Path(evenzero.__file__).parent})")
    print("| parameters | forward | backward | step + zero_grad | whole step |")
    print("|---|---:|---:|---:|---:|")
    for name, ms in result.items():
        print(f"| {name} | {ms['forward']:.1f} | {ms['backward']:.1f} | {ms['step']:.1f} | "
              f"{ms['whole']:.1f} |")
    print(f"bf16 step / fp32 step: {result['bf16']['step'] / result['fp32']['step']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
