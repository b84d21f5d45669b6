"""Where the seed model's step time goes: forward, backward and step per system, against
DDP (its C++ reducer) and the comm-free floor, and a torch.profiler table of rank 0's step.

Systems, interleaved step by step in one job as in `evenzero repro`:

* evenzero at each bucket size of `--buckets` (0 = the runtime's default, "auto"), no
  other argument;
* `ddp`: torch DDP, its C++ reducer (no comm hook), expert gradients all-reduced over
  their expert-data-parallel group;
* `floor`: no reduction and no gather, AdamW on this rank's shard only (1/W of the dense
  elements, 1/2 of the expert elements): what any data-parallel step costs at least.

Each phase is the slowest rank's time per step, median over the measured steps; the whole
step is each rank's sum, slowest rank, median (so it need not equal the sum of the phase
medians). The profiler tables are rank 0's own CPU time in one more step per system: time
spent waiting inside a blocking collective shows as the self time of the op that waits.

    python benchmarks/seed_profile.py [--world-size 8] [--buckets 0 1048576 4194304]
                                      [--steps 10] [--no-tables] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

try:
    import evenzero  # noqa: F401
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from evenzero.repro.localrun import LaunchOptions, launch

WARMUP = 2


def profile_worker(ctx, payload: dict) -> dict:
    import torch.distributed as dist
    from torch.profiler import ProfilerActivity, profile

    from evenzero.moe import expert_parallel_groups
    from evenzero.repro.seedmodel import SeedModel, SeedModelConfig, seed_batch, seed_loss
    from evenzero.repro.sidebyside import (
        PHASES,
        EvenzeroSystem,
        InterleaveOptions,
        run_interleaved,
    )
    from evenzero.repro.systems import Workload, build_systems

    m = SeedModelConfig()
    groups = expert_parallel_groups(m.ep_size)
    experts = {m.expert_group_name: groups.edp_group}
    systems = [EvenzeroSystem(f"evenzero bucket={b or 'auto'}", SeedModel(m, groups), seed_loss,
                              bucket_numel=b or None, expert_groups=experts)
               for b in payload["buckets"]]
    baselines, _ = build_systems(ctx, ("ddp", "floor"),
                                 Workload(lambda: SeedModel(m, groups), seed_loss,
                                          m.tokens_per_rank, expert_groups=experts))
    systems += baselines

    def batch(step: int):
        return seed_batch(m, step, ctx.rank, ctx.world_size)

    results = run_interleaved(systems, batch, InterleaveOptions(payload["steps"], WARMUP),
                              on_step=lambda name, step: ctx.emit((name, step)))
    tables = {}
    if payload["tables"]:
        x, y = batch(WARMUP + payload["steps"])
        for s in systems:
            dist.barrier()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                s.backward(s.loss((x, y)))
                s.step()
            tables[s.name] = prof.key_averages().table(sort_by="self_cpu_time_total",
                                                       row_limit=12)
    return {"world_size": ctx.world_size, "steps": payload["steps"],
            "systems": {r.name: {**{p: r.median_phase_ms(p) for p in PHASES},
                                 "whole": r.median_step_ms, "step_ms": r.step_ms,
                                 "losses": r.losses} for r in results},
            "tables": tables}


def markdown(report: dict) -> list[str]:
    systems = report["systems"]
    ddp, floor = systems["ddp"]["whole"], systems["floor"]["whole"]
    floor_step = systems["floor"]["step"]
    lines = [f"Seed model, {report['world_size']} gloo ranks, ms, slowest rank, median of "
             f"{report['steps']} steps",
             "",
             "| system | forward | backward | step + zero_grad | whole step | x DDP | x floor "
             "| step x floor's step |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for name, r in systems.items():
        lines.append(f"| {name} | {r['forward']:.1f} | {r['backward']:.1f} | {r['step']:.1f} | "
                     f"{r['whole']:.1f} | {r['whole'] / ddp:.2f} | {r['whole'] / floor:.2f} | "
                     f"{r['step'] / floor_step:.2f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--buckets", type=int, nargs="+", default=[0, 2**20, 2**22])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--no-tables", action="store_true", help="skip the profiler tables")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    result = launch(profile_worker, {"buckets": args.buckets, "steps": args.steps,
                                     "tables": not args.no_tables},
                    LaunchOptions(args.world_size, "gloo", timeout_s=1800))
    print("\n".join(markdown(result)))
    for name, table in result["tables"].items():
        print(f"\n===== rank 0, one more step: {name}\n{table}")
    print(f"command: python {' '.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
