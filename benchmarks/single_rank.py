"""World size 1 on the CPU: evenzero against a plain `torch.optim.AdamW` loop.

With one rank there is nothing to communicate, so whatever separates the two is the
ZeRO machinery: hooks, the bucket path, the step check, the master copies, the inner
step. Target (issue 17): evenzero at most 1.05x the plain loop, both with defaults
(evenzero: `ZeroOptimizer(model, AdamW, lr=1e-3, weight_decay=0.01)`; plain:
`AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)`, torch's CPU default
single-tensor implementation). `torch-fused` (the plain loop with `fused=True`) is shown
for reference: it is what the inner step's implementation alone is worth.

Model: a stack of 12 Linear(1024, 1024) + ReLU (12,595,200 parameters, fp32), batch 64,
MSE loss. Systems interleaved step by step (`evenzero.repro.sidebyside.run_interleaved`),
forward+backward+step+zero_grad timed, median over the measured steps.

    python benchmarks/single_rank.py [--steps 20] [--warmup 3] [--threads 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import statistics
import sys
from pathlib import Path

try:
    import evenzero  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
import torch.distributed as dist
from torch import nn

from evenzero.repro.sidebyside import EvenzeroSystem, InterleaveOptions, run_interleaved

TARGET = 1.05
LR, WEIGHT_DECAY = 1e-3, 0.01
WIDTH, DEPTH, BATCH = 1024, 12, 64


def mlp_stack() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU())
                           for _ in range(DEPTH)])


def mse(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.mse_loss(output, target)


def batch(step: int):
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)


class PlainSystem:
    """The model and a torch AdamW, nothing else."""

    def __init__(self, name: str, model: nn.Module, **optimizer_kwargs) -> None:
        self.name, self.model = name, model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                           **optimizer_kwargs)

    def loss(self, b):
        x, y = b
        return mse(self.model(x), y)

    def backward(self, loss) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad()

    def capture_next_step(self) -> None:
        """Nothing to capture: a plain loop issues no collective."""

    def collectives(self):
        return []


def _init_single_rank() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="measured steps per system")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per system")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    _init_single_rank()
    base = mlp_stack()
    systems = [PlainSystem("torch", copy.deepcopy(base)),
               EvenzeroSystem("evenzero", copy.deepcopy(base), mse, lr=LR,
                              weight_decay=WEIGHT_DECAY),
               PlainSystem("torch-fused", copy.deepcopy(base), fused=True)]
    results = run_interleaved(systems, batch, InterleaveOptions(args.steps, args.warmup))
    ez = systems[1].optimizer
    by = {r.name: statistics.median(r.step_ms) for r in results}
    params = sum(q.numel() for q in base.parameters())
    print(f"world size 1, CPU, {params:,} parameters, {args.threads} thread(s), "
          f"median of {args.steps} interleaved steps (forward+backward+step)")
    for r in results:
        phases = "  ".join(f"{ph} {statistics.median(r.phase_ms[ph]):.1f}" for ph in r.phase_ms)
        print(f"  {r.name:12s} {by[r.name]:8.1f} ms   {by[r.name] / by['torch']:.3f}x torch   "
              f"({phases})   last loss {r.losses[-1]:.6f}")
    ratio = by["evenzero"] / by["torch"]
    print(f"evenzero / torch: {ratio:.3f} (target <= {TARGET}: {'met' if ratio <= TARGET else 'not met'})")
    print(f"evenzero collectives in the last step: "
          f"{sorted({c.algorithm for c in ez.trace})}; inner step: {ez.config.optimizer_impl}")
    if args.json:
        args.json.write_text(json.dumps({"params": params, "threads": args.threads,
                                         "steps": args.steps, "median_ms": by,
                                         "step_ms": {r.name: r.step_ms for r in results},
                                         "ratio": ratio, "target": TARGET}, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
