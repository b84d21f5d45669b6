"""Where the seed model's step time goes: backward vs optimizer step, and a torch.profiler
table of rank 0's last step, for evenzero at several bucket sizes and for DDP.

Systems are interleaved step by step as in `evenzero repro`; times are the slowest
rank's median. The profiler table is rank 0's own CPU time: time spent waiting inside a
blocking collective shows as the self time of the op that called it.

    python benchmarks/seed_profile.py [--buckets 0 1048576 4194304] [--steps 10]
                                      (0 = the runtime's default bucket size)
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

try:
    import evenzero  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from evenzero.repro.localrun import LaunchOptions, launch


def profile_worker(ctx, payload: dict) -> dict:
    import torch
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from evenzero.moe import expert_parallel_groups
    from evenzero.repro.baselines import DDPSystem
    from evenzero.repro.seedmodel import SeedModel, SeedModelConfig, seed_batch, seed_loss
    from evenzero.repro.sidebyside import EvenzeroSystem

    m = SeedModelConfig()
    groups = expert_parallel_groups(m.ep_size)
    systems = [EvenzeroSystem(f"evenzero bucket={b or 'default'}", SeedModel(m, groups), seed_loss,
                              bucket_numel=b or None,
                              expert_groups={m.expert_group_name: groups.edp_group})
               for b in payload["buckets"]]
    systems.append(DDPSystem(SeedModel(m, groups), seed_loss, expert_group=groups.edp_group))
    phases = {s.name: ([], []) for s in systems}
    tables = {}
    total = payload["steps"] + 2
    for step in range(total):
        batch = seed_batch(m, step, ctx.rank, ctx.world_size)
        shift = step % len(systems)
        for s in systems[shift:] + systems[:shift]:
            loss = s.loss(batch)
            dist.barrier()
            prof = profile(activities=[ProfilerActivity.CPU]) if step == total - 1 else None
            if prof is not None:
                prof.__enter__()
            t0 = time.perf_counter()
            backward_s = _backward_and_step(s, loss, t0)
            t2 = time.perf_counter()
            if prof is not None:
                prof.__exit__(None, None, None)
                tables[s.name] = prof.key_averages().table(sort_by="self_cpu_time_total",
                                                           row_limit=12)
            if step >= 2:
                phases[s.name][0].append(backward_s)
                phases[s.name][1].append(t2 - t0 - backward_s)
            ctx.emit((s.name, step))
    out = {}
    for name, (bwd, stp) in phases.items():
        t = torch.tensor([statistics.median(bwd), statistics.median(stp)], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        out[name] = {"backward_ms": 1e3 * t[0].item(), "step_ms": 1e3 * t[1].item()}
    return {"phases": out, "tables": tables}


def _backward_and_step(system, loss, t0: float) -> float:
    """Run backward (with the gradient reduction) then the step; return backward seconds."""
    if hasattr(system, "experts"):  # DDP: expert grads are reduced right after backward
        loss.backward()
        system.experts.finish()
        backward_s = time.perf_counter() - t0
        system.optimizer.step()
        system.optimizer.zero_grad(set_to_none=True)
        return backward_s
    loss.backward()
    backward_s = time.perf_counter() - t0
    system.optimizer.step()
    system.optimizer.zero_grad()
    return backward_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--buckets", type=int, nargs="+", default=[0, 2**20, 2**22])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-tables", action="store_true", help="skip the profiler tables")
    args = p.parse_args(argv)
    result = launch(profile_worker, {"buckets": args.buckets, "steps": args.steps},
                    LaunchOptions(args.world_size, "gloo", timeout_s=1200))
    for name, ph in result["phases"].items():
        print(f"{name:28s} backward {ph['backward_ms']:7.1f} ms   step {ph['step_ms']:7.1f} ms   "
              f"total {ph['backward_ms'] + ph['step_ms']:7.1f} ms")
    if not args.no_tables:
        for name, table in result["tables"].items():
            print(f"\n===== rank 0, last step: {name}\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
