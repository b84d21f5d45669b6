"""Seed model, 8 CPU ranks: forward+backward+step with and without `overlap_param_gather`.

In the side-by-side harness of `evenzero repro` every system's step starts after a
barrier, which would wait out evenzero's pending parameter gathers outside the timed
region. So here each system runs blocks of K consecutive iterations (its asynchronous
gather overlaps its own next forward), the systems are rotated per round, and each block
ends with every pending gather waited for inside the timed region. DDP is its C++
reducer.

    python benchmarks/overlap.py [--k 3] [--rounds 6] [--overlap 1 0]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

try:
    import evenzero  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def worker(ctx, payload):
    import torch
    import torch.distributed as dist

    from evenzero.moe import expert_parallel_groups
    from evenzero.repro.baselines import DDPSystem
    from evenzero.repro.seedmodel import SeedModel, SeedModelConfig, seed_batch, seed_loss
    from evenzero.repro.sidebyside import EvenzeroSystem
    from evenzero.runtime.config import ZeroConfig
    m = SeedModelConfig()
    groups = expert_parallel_groups(m.ep_size)
    systems = []
    has_flag = "overlap_param_gather" in ZeroConfig.field_names()
    for ov in payload["overlap"]:
        if ov and not has_flag:
            continue
        extra = {"overlap_param_gather": ov} if has_flag else {}
        systems.append(EvenzeroSystem(f"evenzero overlap={ov}", SeedModel(m, groups), seed_loss,
                                      bucket_numel=2**20, extra=extra,
                                      expert_groups={m.expert_group_name: groups.edp_group}))
    systems.append(DDPSystem(SeedModel(m, groups), seed_loss, expert_group=groups.edp_group))
    K, R = payload["k"], payload["rounds"]
    times = torch.zeros(len(systems), R, dtype=torch.float64)
    for r in range(R + 1):
        order = list(range(len(systems)))
        order = order[r % len(order):] + order[:r % len(order)]
        for i in order:
            s = systems[i]
            dist.barrier()
            t0 = time.perf_counter()
            for k in range(K):
                batch = seed_batch(m, r * K + k, ctx.rank, ctx.world_size)
                loss = s.loss(batch)
                s.backward(loss)
                s.step()
            if hasattr(s, "optimizer") and hasattr(s.optimizer, "wait_for_params"):
                s.optimizer.wait_for_params()
            t1 = time.perf_counter()
            if r > 0:
                times[i, r - 1] = (t1 - t0) * 1e3 / K
        ctx.emit(r)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    return {s.name: times[i].tolist() for i, s in enumerate(systems)}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--k", type=int, default=3)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--overlap", type=int, nargs="+", default=[1, 0])
    a = p.parse_args()
    from evenzero.repro.localrun import LaunchOptions, launch
    payload = {"k": a.k, "rounds": a.rounds, "overlap": [bool(x) for x in a.overlap]}
    res = launch(worker, payload, LaunchOptions(8, "gloo", timeout_s=1200))
    ddp = statistics.median(res["ddp"])
    for name, t in res.items():
        med = statistics.median(t)
        print(f"{name:26s} median fwd+bwd+step {med:7.1f} ms/iter  x ddp {med / ddp:5.2f}  "
              f"all {[round(x) for x in t]}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()
