"""Checkpoint save and load throughput of a ZeroOptimizer (AdamW) on local ranks.

    python benchmarks/checkpoint_throughput.py --params 100e6 --world 4 --load-world 2

Builds a stack of square Linear layers with about `--params` parameters, takes one
optimizer step so that AdamW's state exists, then times `evenzero.checkpoint.save` and
`load` (barrier to barrier, so the slowest rank counts) `--repeats` times. MB/s is the
checkpoint's bytes on disk (all files) divided by that time. With `--load-world M` a
second job on M ranks times the resharding load. Loads read files the save just wrote,
so they mostly come from the page cache; the figure is the format's and the code's
cost, not the disk's.
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from evenzero.repro.localrun import LaunchOptions, RankContext, launch


@dataclass(frozen=True)
class BenchConfig:
    """One benchmark job."""

    params: int
    """Target number of trainable parameters."""
    directory: str
    """Where checkpoints are written."""
    repeats: int
    """Timed saves and loads; the median is reported."""
    save: bool
    """True: train a step and save (then load); False: only load what is there."""


def layer_width(params: int, layers: int) -> int:
    # layers * (w^2 + w) ~= params
    return int((-1 + math.sqrt(1 + 4 * params / layers)) / 2)


def bench_worker(ctx: RankContext, cfg: BenchConfig) -> dict:
    import torch
    import torch.distributed as dist
    from torch import nn

    from evenzero import ZeroOptimizer, checkpoint

    layers = 12
    width = layer_width(cfg.params, layers)
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    opt = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4)
    numel = sum(p.numel() for p in model.parameters())
    model(torch.randn(2, width)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    root = Path(cfg.directory)
    saves, loads = [], []
    for _ in range(cfg.repeats):
        if cfg.save:
            dist.barrier()
            t0 = time.perf_counter()
            path = checkpoint.save(opt, root, 1)
            dist.barrier()
            saves.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        checkpoint.load(opt, root)
        dist.barrier()
        loads.append(time.perf_counter() - t0)
    path = checkpoint.latest(root)
    nbytes = sum(f.stat().st_size for f in path.iterdir())
    return {"numel": numel, "bytes": nbytes, "save_s": saves, "load_s": loads,
            "world": ctx.world_size}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--load-world", type=int, default=0,
                    help="also time a resharding load on this many ranks")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="evenzero-ckpt-bench-"))
    try:
        cfg = BenchConfig(int(args.params), str(root), args.repeats, True)
        runs = [launch(bench_worker, cfg, LaunchOptions(args.world, backend="gloo"))]
        if args.load_world:
            cfg = BenchConfig(int(args.params), str(root), args.repeats, False)
            runs.append(launch(bench_worker, cfg, LaunchOptions(args.load_world, backend="gloo")))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    table = Table(title=f"checkpoint throughput, {runs[0]['numel'] / 1e6:.1f}M params, AdamW, "
                        f"{runs[0]['bytes'] / 2**20:.0f} MiB on disk")
    for col in ("operation", "ranks", "median s", "MB/s (median)", "MB/s (best)"):
        table.add_column(col, justify="right")
    for r in runs:
        for op in ("save", "load"):
            times = r[f"{op}_s"]
            if not times:
                continue
            label = op if op == "save" or r is runs[0] else f"load (resharded from {args.world})"
            mb = r["bytes"] / 1e6
            table.add_row(label, str(r["world"]), f"{statistics.median(times):.2f}",
                          f"{mb / statistics.median(times):.0f}", f"{mb / min(times):.0f}")
    Console().print(table)


if __name__ == "__main__":
    main()
