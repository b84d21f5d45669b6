"""Predicted vs measured step time: the planner's timeline after calibration, against real runs.

For each case (model, world size), one local gloo job:

1. calibrates a cost model on its own ranks (`evenzero.cost.calibrate.measure`: the
   collectives the runtime issues, at the world's and the expert groups' sizes, and
   the compute of a rank while every rank computes), as `evenzero calibrate` does;
2. picks evenzero's bucket size with it, as the planner's default does at plan time
   (`choose_bucket_numel`, compute from the model's FLOPs at the run's tokens);
3. times each parameter's backward compute with gradient-hook timestamps in backwards
   that communicate nothing (a plain copy of the model; every rank at once);
4. trains `ZeroOptimizer` with that bucket size and DDP side by side, interleaved step
   by step: forward+backward+step of the slowest rank, median;
5. predicts both steps with the timeline, from the plans the runs executed, once with
   compute from FLOPs and once with the measured compute.

The cases are the seed case at 8 ranks and the dense GPT of `benchmarks/gpt_dense.py`
(`bench-50m`, 59M parameters) at 2, 4 and 8 ranks. The goal is |error| <= 25% for the
FLOPs prediction; the measured-compute column separates the communication model from
the compute estimate. Run it on an otherwise idle machine; prints a Markdown table.

    python benchmarks/predict_vs_measured.py [--cases seed:8 gpt:2 gpt:4 gpt:8]
        [--steps 6] [--warmup 2] [--scale full|tiny] [--json FILE]

`--scale tiny` (small models, short sweeps) checks the pipeline end to end in a minute.
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

from evenzero.repro.localrun import LaunchOptions, launch

DEFAULT_CASES = ("seed:8", "gpt:2", "gpt:4", "gpt:8")
CALIBRATION = {"full": ((2**10, 2**14, 2**16, 2**18, 2**20, 2**22), 5),
               "tiny": ((2**10, 2**16, 2**20), 3)}
"""(sizes, repeats) of the collective sweep per scale."""
PROFILE_BACKWARDS = 3
"""Backwards timed for the measured compute profile (median per parameter)."""


def case_worker(ctx, payload: dict) -> dict:
    import dataclasses

    import torch.distributed as dist

    from evenzero.cost.autobucket import choose_bucket_numel
    from evenzero.cost.calibrate import measure
    from evenzero.cost.compute import estimate_profile
    from evenzero.cost.timeline import simulate
    from evenzero.repro.sidebyside import EvenzeroSystem, InterleaveOptions, run_interleaved
    from evenzero.strategies import PlanOptions, plan

    sizes, repeats = CALIBRATION[payload["scale"]]
    cost = measure(sizes=sizes, repeats=repeats, name=f"calibrated-w{ctx.world_size}")
    model = _Case(payload["model"], payload["scale"], ctx)
    spec = model.spec()
    choice = choose_bucket_numel(spec, ctx.world_size, cost)
    measured = model.measured_profile()
    evenzero = EvenzeroSystem("evenzero", model.build(), model.loss, bucket_numel=choice.numel,
                              expert_groups=model.expert_groups())
    ddp = model.ddp()
    dist.barrier()
    results = run_interleaved(
        [evenzero, ddp], model.batch,
        InterleaveOptions(payload["steps"], payload["warmup"], ctx.device),
        on_step=lambda name, step: ctx.emit((name, step)))
    executed = evenzero.optimizer.plan  # re-planned on the measured arrival order
    spec = spec.with_arrival(executed.arrival, "measured")
    flops = estimate_profile(spec, cost.compute)
    ddp_plan = plan(spec, ctx.world_size, "ddp", PlanOptions())
    rows = []
    for result, p in zip(results, (executed, ddp_plan), strict=True):
        by_flops, by_time = simulate(p, cost, flops), simulate(p, cost, measured)
        rows.append({"system": result.name, "measured_ms": result.median_step_ms,
                     "step_ms": result.step_ms, "backward_calls": len(p.backward()),
                     "predicted_flops_ms": by_flops.total_s * 1e3,
                     "predicted_measured_compute_ms": by_time.total_s * 1e3,
                     "predicted_exposed_comm_ms": by_flops.exposed_comm_s * 1e3})
    return {"case": payload["model"], "world_size": ctx.world_size, "numel": spec.numel,
            "tokens": spec.tokens, "bucket_numel": choice.numel, "buckets": len(executed.buckets),
            "choice_note": choice.note, "cost_model": cost.to_json(),
            "compute": dataclasses.asdict(cost.compute),
            "measured_compute": {"backward_ms": measured.backward_s * 1e3,
                                 "forward_ms": measured.forward_s * 1e3,
                                 "flops_backward_ms": flops.backward_s * 1e3,
                                 "flops_forward_ms": flops.forward_s * 1e3},
            "rows": rows}


class _Case:
    """One model of the benchmark, built the same way on every rank."""

    def __init__(self, kind: str, scale: str, ctx) -> None:
        self.kind, self.ctx = kind, ctx
        if kind == "seed":
            from evenzero.moe import expert_parallel_groups
            from evenzero.repro.seedmodel import SeedModelConfig

            self.config = SeedModelConfig() if scale == "full" else SeedModelConfig(dim=128)
            self.groups = expert_parallel_groups(self.config.ep_size)
        elif kind == "gpt":
            from evenzero.repro.gptmodel import GPT_SIZES

            self.config = GPT_SIZES["bench-50m" if scale == "full" else "tiny"]
        else:
            raise ValueError(f"unknown case {kind!r}; use seed or gpt")

    def build(self):
        if self.kind == "seed":
            from evenzero.repro.seedmodel import SeedModel

            return SeedModel(self.config, self.groups).to(self.ctx.device)
        from evenzero.repro.gptmodel import GPT

        return GPT(self.config).to(self.ctx.device)

    def loss(self, output, target):
        from evenzero.repro.gptmodel import gpt_loss
        from evenzero.repro.seedmodel import seed_loss

        return (seed_loss if self.kind == "seed" else gpt_loss)(output, target)

    def batch(self, step: int):
        if self.kind == "seed":
            from evenzero.repro.seedmodel import seed_batch

            return seed_batch(self.config, step, self.ctx.rank, self.ctx.world_size)
        from evenzero.repro.gptmodel import gpt_batch

        return gpt_batch(self.config, step, self.ctx.rank, self.ctx.world_size)

    @property
    def tokens(self) -> int:
        c = self.config
        return c.tokens_per_rank if self.kind == "seed" else c.batch_per_rank * c.seq

    def expert_groups(self):
        return {self.config.expert_group_name: self.groups.edp_group} if self.kind == "seed" else None

    def ddp(self):
        from evenzero.repro.baselines import DDPSystem

        extra = {"expert_group": self.groups.edp_group} if self.kind == "seed" else {}
        return DDPSystem(self.build(), self.loss, **extra)

    def spec(self):
        """The planner's view, with what FLOPs need: tokens, embeddings, expert shares."""
        from dataclasses import replace

        from evenzero.spec import ModuleSpecOptions, from_module

        ep = self.config.ep_size if self.kind == "seed" else 1
        spec = from_module(self.build(), options=ModuleSpecOptions(expert_parallel_size=ep),
                           name=self.kind).with_tokens(self.tokens)
        if self.kind == "seed":  # top-1 routing: an expert sees ep_size / num_experts of the tokens
            share = self.config.ep_size / self.config.num_experts
            spec = replace(spec, params=tuple(
                replace(p, token_share=share) if p.group != "dense" else p for p in spec.params))
        return spec

    def measured_profile(self):
        """Median per-parameter backward compute of a few backwards that reduce nothing."""
        import torch
        import torch.distributed as dist

        from evenzero.cost.compute import median_profile, profile_from_arrivals

        model = self.build()
        events: list[tuple[str, float]] = []
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda _p, n=name: events.append((n, time.perf_counter())))
        profiles = []
        for step in range(PROFILE_BACKWARDS + 1):
            x, y = self.batch(step)
            dist.barrier()
            t0 = time.perf_counter()
            loss = self.loss(model(x.to(self.ctx.device)), y.to(self.ctx.device))
            t1 = time.perf_counter()
            events.clear()
            loss.backward()
            t2 = time.perf_counter()
            model.zero_grad(set_to_none=True)
            if step:  # the first one pays allocations
                profiles.append(profile_from_arrivals(list(events), t1, t2, forward_s=t1 - t0,
                                                      source="measured gradient arrivals"))
        box = [median_profile(profiles)]
        torch.distributed.broadcast_object_list(box, src=0)  # rank 0's, on every rank
        return box[0]


def run(cases: list[str], steps: int, warmup: int, scale: str) -> list[dict]:
    out = []
    for case in cases:
        kind, _, world = case.partition(":")
        print(f"case {case} ...", flush=True)
        payload = {"model": kind, "steps": steps, "warmup": warmup, "scale": scale}
        out.append(launch(case_worker, payload, LaunchOptions(int(world), "gloo", timeout_s=3600)))
    return out


def markdown(reports: list[dict], command: str) -> str:
    lines = ["```bash", command, "```", "",
             "| case | W | bucket (buckets) | system | measured ms | predicted ms (FLOPs) | error "
             "| predicted ms (measured compute) | error |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in reports:
        for row in r["rows"]:
            m = row["measured_ms"]
            f, c = row["predicted_flops_ms"], row["predicted_measured_compute_ms"]
            lines.append(f"| {r['case']} ({r['numel']:,} params, {r['tokens']} tokens) | "
                         f"{r['world_size']} | {r['bucket_numel']:,} ({r['buckets']}) | "
                         f"{row['system']} | {m:.1f} | {f:.1f} | {(f - m) / m:+.0%} | {c:.1f} | "
                         f"{(c - m) / m:+.0%} |")
    worst = max((abs(row["predicted_flops_ms"] - row["measured_ms"]) / row["measured_ms"]
                 for r in reports for row in r["rows"]), default=float("nan"))
    lines += ["", f"Largest |error| of the FLOPs prediction: {worst:.0%} (goal: 25%)."]
    for r in reports:
        c = r["measured_compute"]
        lines.append(f"- {r['case']} W={r['world_size']}: backward compute measured "
                     f"{c['backward_ms']:.1f} ms vs FLOPs {c['flops_backward_ms']:.1f} ms; forward "
                     f"{c['forward_ms']:.1f} vs {c['flops_forward_ms']:.1f} ms. {r['choice_note']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES),
                   help="model:world_size, model one of seed, gpt (default: %(default)s)")
    p.add_argument("--steps", type=int, default=6, help="measured steps per system")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per system")
    p.add_argument("--scale", choices=sorted(CALIBRATION), default="full",
                   help="full: the benchmark; tiny: small models, a quick end-to-end check")
    p.add_argument("--json", type=Path, help="write every figure here")
    args = p.parse_args(argv)
    for case in args.cases:
        kind, sep, world = case.partition(":")
        if kind not in ("seed", "gpt") or not sep or not world.isdigit() or int(world) < 2:
            p.error(f"--cases: {case!r} is not seed:W or gpt:W with W >= 2")
        if kind == "seed" and int(world) % 4:
            p.error(f"--cases: {case!r}: the seed model needs a multiple of 4 ranks")
    reports = run(args.cases, args.steps, args.warmup, args.scale)
    command = "python benchmarks/predict_vs_measured.py " + " ".join(argv or sys.argv[1:])
    sys.stdout.write(markdown(reports, command.strip()))
    if args.json:
        args.json.write_text(json.dumps(reports, indent=1))
        print(f"wrote {args.json}")
    medians = [statistics.median(row["step_ms"]) for r in reports for row in r["rows"]]
    return 0 if all(m == m for m in medians) else 1


if __name__ == "__main__":
    sys.exit(main())
