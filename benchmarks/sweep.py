"""evenzero over world sizes and bucket sizes on CPU gloo: measured vs the cost model.

For each world size W (one local job each), the job first calibrates a cost model on its
own process group (`evenzero.calibration.measure`), then trains a dense GPT with one
evenzero system per bucket size, interleaved step by step, and records the median
backward+step time. Each system's plan (`ZeroOptimizer.plan`) is priced by
`evenzero.cost.predict` on the `gloo-local` preset and on the calibrated model.

The prediction covers communication only (collectives issued serially), while the
measurement also holds backward compute and the optimizer step, and evenzero overlaps
reduce-scatters with backward. So compare columns within a world size: the question is
whether the model orders bucket sizes the way the machine does.

    python benchmarks/sweep.py [--world-sizes 2 4 8] [--buckets 262144 1048576 4194304 0]
                               [--steps 6] [--json FILE]      (0 = the runtime's default)
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

from evenzero.repro.gptmodel import GPTConfig
from evenzero.repro.localrun import LaunchOptions, launch

MODEL = GPTConfig(vocab=4096, seq=64, dim=384, layers=8, heads=6)
CALIBRATION_SIZES = (2**12, 2**16, 2**18, 2**20, 2**22)


def sweep_worker(ctx, payload: dict) -> dict:
    import torch.distributed as dist

    from evenzero.calibration import measure
    from evenzero.cost import predict
    from evenzero.cost.presets import cost_preset
    from evenzero.repro.gptmodel import GPT, gpt_batch, gpt_loss
    from evenzero.repro.sidebyside import EvenzeroSystem, InterleaveOptions, run_interleaved

    calibrated = measure(sizes=CALIBRATION_SIZES, repeats=3, name=f"calibrated-w{ctx.world_size}")
    preset = cost_preset("gloo-local")
    systems = [EvenzeroSystem(f"bucket={b or 'default'}", GPT(MODEL), gpt_loss, bucket_numel=b or None)
               for b in payload["buckets"]]
    dist.barrier()
    results = run_interleaved(systems, lambda s: gpt_batch(MODEL, s, ctx.rank, ctx.world_size),
                              InterleaveOptions(payload["steps"], payload["warmup"], ctx.device),
                              on_step=lambda name, step: ctx.emit((name, step)))
    rows = []
    for system, result in zip(systems, results, strict=True):
        plan = system.optimizer.plan
        on_preset = predict(plan, preset)
        on_calibrated = predict(plan, calibrated)
        rows.append({
            "world_size": ctx.world_size, "system": result.name,
            "buckets": len(plan.buckets), "backward_calls": len(result.backward_collectives()),
            "measured_ms": result.median_step_ms,
            "predicted_gloo_local_ms": 1e3 * (on_preset.backward_seconds + on_preset.step_seconds),
            "predicted_calibrated_ms": 1e3 * (on_calibrated.backward_seconds
                                              + on_calibrated.step_seconds),
        })
    return {"rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--buckets", type=int, nargs="+", default=[2**18, 2**20, 2**22, 0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    rows = []
    for w in args.world_sizes:
        out = launch(sweep_worker, {"buckets": args.buckets, "steps": args.steps,
                                    "warmup": args.warmup},
                     LaunchOptions(w, "gloo", timeout_s=1200))
        rows += out["rows"]
    _print(rows)
    if args.json:
        args.json.write_text(json.dumps({"model_numel": MODEL.numel(), "rows": rows}, indent=1))
        print(f"wrote {args.json}")
    return 0


def _print(rows: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"evenzero, GPT {MODEL.numel():,} params, CPU gloo: backward+step, "
                    f"measured (median) vs predicted communication")
    for col in ("W", "bucket", "buckets", "measured ms", "predicted gloo-local ms",
                "predicted calibrated ms"):
        t.add_column(col, justify="right")
    for r in rows:
        t.add_row(str(r["world_size"]), r["system"].removeprefix("bucket="), str(r["buckets"]),
                  f"{r['measured_ms']:.1f}", f"{r['predicted_gloo_local_ms']:.1f}",
                  f"{r['predicted_calibrated_ms']:.1f}")
    Console(width=120).print(t)


if __name__ == "__main__":
    sys.exit(main())
