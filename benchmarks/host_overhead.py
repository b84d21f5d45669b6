"""Host overhead: evenzero's per-parameter Python work against DDP's C++ reducer.

A deep MLP with norms (`depth` blocks of Linear + LayerNorm: 4 small parameters each,
2,000 at the default depth of 500) whose compute is tiny, so a step is mostly what the
frameworks do per parameter: hooks, bucket copies, launches, the optimizer. Trained at
4 local gloo ranks by

* `evenzero`: `ZeroOptimizer(model, torch.optim.AdamW, lr=...)`, no tuning arguments;
* `ddp`: torch DDP with its own C++ reducer (no Python comm hook) and torch AdamW,

interleaved step by step on the same batches; forward+backward+step of the slowest rank,
median, and each phase's median. The ratio evenzero / DDP is the figure (issue 9's goal:
at most 1.2x).

`--profile cprofile` then runs a few more evenzero steps under cProfile on every rank
and prints rank 0's functions by own time (cProfile inflates every Python call, so
read it for where the time goes, not for totals); `--profile torch` prints
torch.profiler's table of the same steps, with the `evenzero::` labels.

    python benchmarks/host_overhead.py [--world-size 4] [--depth 500] [--dim 32]
        [--steps 20] [--warmup 3] [--profile none|cprofile|torch] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:
    import evenzero  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from evenzero.repro.localrun import LaunchOptions, launch

PROFILE_STEPS = 5


def deep_mlp(depth: int, dim: int, seed: int = 0):
    import torch
    from torch import nn

    class DeepMLP(nn.Module):
        """`depth` residual blocks x + relu(norm(linear(x))): 4 parameters per block."""

        def __init__(self) -> None:
            super().__init__()
            self.linears = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
            self.norms = nn.ModuleList(nn.LayerNorm(dim) for _ in range(depth))

        def forward(self, x):
            for linear, norm in zip(self.linears, self.norms, strict=True):
                x = x + torch.relu(norm(linear(x)))
            return x

    torch.manual_seed(seed)
    return DeepMLP()


def mse(output, target):
    return ((output - target) ** 2).mean()


def overhead_worker(ctx, payload: dict) -> dict:
    import torch
    import torch.distributed as dist

    from evenzero.repro.baselines import DDPSystem
    from evenzero.repro.sidebyside import (
        PHASES,
        EvenzeroSystem,
        InterleaveOptions,
        run_interleaved,
    )

    depth, dim, batch = payload["depth"], payload["dim"], payload["batch"]
    evenzero = EvenzeroSystem("evenzero", deep_mlp(depth, dim), mse, weight_decay=0.0)
    # evenzero's system passes only lr/weight_decay/stage/strategy: the defaults.
    ddp = DDPSystem(deep_mlp(depth, dim), mse, weight_decay=0.0)

    def batches(step: int):
        gen = torch.Generator().manual_seed(1000 + step)
        x = torch.randn(batch * ctx.world_size, dim, generator=gen)
        y = torch.randn(batch * ctx.world_size, dim, generator=gen)
        mine = slice(ctx.rank * batch, (ctx.rank + 1) * batch)
        return x[mine], y[mine]

    dist.barrier()
    results = run_interleaved([evenzero, ddp], batches,
                              InterleaveOptions(payload["steps"], payload["warmup"], ctx.device),
                              on_step=lambda name, step: ctx.emit((name, step)))
    out = {"world_size": ctx.world_size, "params": sum(1 for _ in evenzero.model.parameters()),
           "numel": sum(p.numel() for p in evenzero.model.parameters()),
           "buckets": len(evenzero.optimizer.plan.buckets),
           "plan_notes": list(evenzero.optimizer.plan.notes),
           "systems": {r.name: {"median_ms": r.median_step_ms, "step_ms": r.step_ms,
                                "phase_ms": {p: r.median_phase_ms(p) for p in PHASES},
                                "losses": r.losses} for r in results}}
    if payload["profile"] != "none":
        out["profile"] = _profile(evenzero, batches, payload, payload["profile"])
    return out


def _profile(system, batches, payload: dict, kind: str) -> str:
    """Rank 0's profile of PROFILE_STEPS more evenzero steps (every rank runs them)."""
    import cProfile
    import io
    import pstats

    import torch.distributed as dist

    def steps() -> None:
        for step in range(PROFILE_STEPS):
            system.backward(system.loss(batches(10_000 + step)))
            system.step()

    dist.barrier()
    if kind == "cprofile":
        prof = cProfile.Profile()
        prof.enable()
        steps()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        return text.getvalue()
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        steps()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--depth", type=int, default=500, help="blocks (4 parameters each)")
    p.add_argument("--dim", type=int, default=32, help="width of every block")
    p.add_argument("--batch", type=int, default=8, help="rows per rank per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--profile", choices=("none", "cprofile", "torch"), default="none")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    payload = {k: getattr(args, k) for k in ("depth", "dim", "batch", "steps", "warmup",
                                             "profile")}
    r = launch(overhead_worker, payload, LaunchOptions(args.world_size, "gloo", timeout_s=1800))
    ez, ddp = r["systems"]["evenzero"], r["systems"]["ddp"]
    print(f"deep MLP: {r['params']:,} parameters, {r['numel']:,} elements, {r['world_size']} "
          f"gloo ranks; evenzero defaults: {r['buckets']} bucket(s)")
    for note in r["plan_notes"]:
        print(f"  plan note: {note}")
    for name, s in r["systems"].items():
        phases = "  ".join(f"{p} {ms:.2f}" for p, ms in s["phase_ms"].items())
        print(f"{name:9s} median {s['median_ms']:8.2f} ms  (min {min(s['step_ms']):.2f}, "
              f"max {max(s['step_ms']):.2f});  {phases} ms")
    loss_diff = max(abs(a - b) / max(abs(b), 1e-12)
                    for a, b in zip(ez["losses"], ddp["losses"], strict=True))
    print(f"evenzero / ddp = {ez['median_ms'] / ddp['median_ms']:.2f}x  (goal <= 1.2x; "
          f"losses agree to {loss_diff:.1e} relative)")
    if "profile" in r:
        print(f"\n===== rank 0, {PROFILE_STEPS} evenzero steps, {args.profile}\n{r['profile']}")
    print(f"command: python {' '.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])}")
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
