"""Training stall of a background checkpoint save against a blocking one.

    python benchmarks/checkpoint_async.py [--world 4] [--model bench-50m] [--steps 4]
                                          [--repeats 3] [--dir DIR] [--json FILE]
                                          [--threads-per-rank T]

Trains the 59M-parameter GPT of `evenzero bench` (`evenzero.repro.gptmodel`, AdamW,
ZeroOptimizer with `bucket_numel` 4M as the benchmark uses) on local ranks and times
windows of `--steps` training steps, barrier to barrier, so the slowest rank counts:

* plain: the steps alone;
* blocking: `checkpoint.save(opt, dir)` and then the steps;
* background: `checkpoint.save(opt, dir, blocking=False)`, the steps, and then
  `checkpoint.wait()`, so a write that the steps did not hide counts too.

The stall of a save is the median over repeats of its window minus the plain window of
the same repeat (the three run back to back): the extra time training spent because of it (for the background save: the snapshot copy, what
the writer took from the training ranks' cores and disk, and any wait). Windows of the
three kinds are interleaved, after warm-up steps and one untimed save of each kind (the
first background save creates its process group and buffers). Every save replaces the
same tag per kind, so the disk holds two checkpoints.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

try:
    import evenzero  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from rich.console import Console
from rich.table import Table

from evenzero.repro.gptmodel import GPT_SIZES
from evenzero.repro.localrun import LaunchOptions, RankContext, launch

BUCKET_NUMEL = 2**22
"""As `evenzero bench` (repro/bench.py DEFAULT_BUCKET_NUMEL)."""
KINDS = ("plain", "blocking", "background")


@dataclass(frozen=True)
class StallConfig:
    model: str
    """A `GPT_SIZES` key."""
    steps: int
    """Training steps per timed window."""
    repeats: int
    """Timed windows of each kind."""
    warmup: int
    directory: str


def stall_worker(ctx: RankContext, cfg: StallConfig) -> dict:
    import torch
    import torch.distributed as dist

    from evenzero import ZeroOptimizer, checkpoint
    from evenzero.checkpoint import background
    from evenzero.repro.gptmodel import GPT, gpt_batch, gpt_loss

    c = GPT_SIZES[cfg.model]
    model = GPT(c).to(ctx.device)
    opt = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4, bucket_numel=BUCKET_NUMEL)
    numel = sum(p.numel() for p in model.parameters())
    step = 0

    def train(n: int) -> None:
        nonlocal step
        for _ in range(n):
            x, y = (t.to(ctx.device) for t in gpt_batch(c, step, ctx.rank, ctx.world_size))
            gpt_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            step += 1

    root = Path(cfg.directory)

    def window(kind: str) -> dict:
        dist.barrier()
        t0 = time.perf_counter()
        if kind == "blocking":
            checkpoint.save(opt, root, tag="blocking")
        elif kind == "background":
            checkpoint.save(opt, root, tag="background", blocking=False)
        returned = time.perf_counter() - t0
        train(cfg.steps)
        trained = time.perf_counter() - t0
        if kind == "background":
            checkpoint.wait()
        dist.barrier()
        return {"total": time.perf_counter() - t0, "save_returned": returned,
                "steps_done": trained}

    train(cfg.warmup)
    for kind in ("blocking", "background"):
        window(kind)  # untimed: directories, the save group, the snapshot buffers
    times: dict[str, list[dict]] = {k: [] for k in KINDS}
    for _ in range(cfg.repeats):
        for kind in KINDS:
            times[kind].append(window(kind))
    checkpoint.wait()
    nbytes = sum(f.stat().st_size for f in (root / "blocking").iterdir())
    return {"numel": numel, "bytes": nbytes, "times": times, "world": ctx.world_size,
            "snapshot_buffer_bytes": background.buffer_bytes()}


def summarise(result: dict, steps: int) -> dict:
    times = result["times"]
    med = {k: statistics.median(w["total"] for w in times[k]) for k in KINDS}
    # Each repeat runs the three windows back to back: the difference to its own plain
    # window cancels a slow drift of the machine's load.
    stall = {k: statistics.median(w["total"] - p["total"] for w, p in zip(times[k],
                                                                          times["plain"],
                                                                          strict=True))
             for k in ("blocking", "background")}
    returned = statistics.median(w["save_returned"] for w in times["background"])
    blocking_save = statistics.median(w["save_returned"] for w in times["blocking"])
    return {"step_s": med["plain"] / steps, "window_s": med, "stall_s": stall,
            "stall_ratio": stall["background"] / stall["blocking"] if stall["blocking"] > 0
            else float("nan"),
            "blocking_save_s": blocking_save, "background_save_returned_s": returned}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--model", default="bench-50m", choices=sorted(GPT_SIZES))
    ap.add_argument("--steps", type=int, default=4, help="training steps per timed window")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--backend", default="gloo", choices=("gloo", "nccl", "auto"))
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    ap.add_argument("--json", help="write the measurements here")
    ap.add_argument("--threads-per-rank", type=int, default=None,
                    help="torch threads per rank (default: the cores shared evenly, so every "
                         "core trains); fewer leave cores free, as GPU training does")
    args = ap.parse_args()
    root = Path(args.dir or tempfile.mkdtemp(prefix="evenzero-ckpt-async-"))
    cfg = StallConfig(args.model, args.steps, args.repeats, args.warmup, str(root))
    try:
        result = launch(stall_worker, cfg, LaunchOptions(
            args.world, backend=args.backend, timeout_s=3600,
            threads_per_rank=args.threads_per_rank))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    summary = summarise(result, args.steps)
    table = Table(title=f"checkpoint stall, {result['numel'] / 1e6:.1f}M params, AdamW, "
                        f"{result['world']} ranks, {result['bytes'] / 2**20:.0f} MiB per "
                        f"checkpoint")
    for col in ("window", f"median s ({args.steps} steps)", "stall s", "stall / blocking"):
        table.add_column(col, justify="right")
    for kind in KINDS:
        stall = summary["stall_s"].get(kind)
        ratio = "" if stall is None else f"{stall / summary['stall_s']['blocking']:.0%}"
        table.add_row(kind, f"{summary['window_s'][kind]:.2f}",
                      "" if stall is None else f"{stall:.2f}", ratio)
    console = Console()
    console.print(table)
    console.print(f"blocking save {summary['blocking_save_s']:.2f} s; background save returned "
                  f"after {summary['background_save_returned_s']:.2f} s (the snapshot); "
                  f"snapshot buffers {result['snapshot_buffer_bytes'] / 2**20:.0f} MiB on rank 0")
    if args.json:
        Path(args.json).write_text(json.dumps({"config": asdict(cfg), "world": args.world,
                                               "summary": summary, "raw": result}, indent=1))


if __name__ == "__main__":
    main()
