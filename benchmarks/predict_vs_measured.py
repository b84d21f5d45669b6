"""Predicted vs measured step time, per phase: the planner's timeline after calibration.

For each case (model, world size), one local gloo job:

1. calibrates a cost model on its own ranks (`evenzero.calibration.measure`: the
   collectives the runtime issues, at the world's and the expert groups' sizes; the
   compute of a rank while every rank computes; the step's own work: AdamW per torch
   implementation, the gradient norms, per-tensor and per-parameter host time), as
   `evenzero calibrate` does;
2. picks evenzero's bucket size with it, as the planner's default does at plan time
   (`evenzero.strategies.choose_bucket`, compute from the model's FLOPs);
3. times each parameter's backward compute with gradient-hook timestamps in backwards
   that communicate nothing (a plain copy of the model; every rank at once);
4. trains `ZeroOptimizer` with that bucket size and DDP (its C++ reducer, torch AdamW)
   side by side, interleaved step by step, timing forward, backward and step (+
   zero_grad) on every rank: each phase's slowest rank, median over steps;
5. predicts both systems' phases with the timeline, from the plans the runs executed,
   once with compute from FLOPs and once with the measured compute.

The cases are the seed case at 8 ranks, the dense GPT of `benchmarks/gpt_dense.py`
(`bench-50m`, 59M parameters) at 2, 4 and 8 ranks and the Llama-style model of
`benchmarks/llama_dense.py` (20M parameters) at 4. The goal is |error| <= 25% on the
whole step for the FLOPs prediction; the phase columns say where a miss comes from.
Run it on an otherwise idle machine; prints Markdown tables.

    python benchmarks/predict_vs_measured.py [--cases seed:8 gpt:2 gpt:4 gpt:8 llama:4]
        [--steps 6] [--warmup 3] [--scale full|tiny] [--evenzero-step plan|main] [--json FILE]

`--evenzero-step main` predicts evenzero's step as the runtime ran it before issue 17's
step work (fp64 norm, torch's default AdamW on each group's flat shard, masters copied
in and out every step) instead of what its plan says; for a runtime that predates that
work. `--scale tiny` (small models, short sweeps) checks the pipeline in a minute.
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

DEFAULT_CASES = ("seed:8", "gpt:2", "gpt:4", "gpt:8", "llama:4")
KINDS = ("seed", "gpt", "llama")
CALIBRATION = {"full": ((2**10, 2**14, 2**16, 2**18, 2**20, 2**22), 5),
               "tiny": ((2**10, 2**16, 2**20), 3)}
"""(sizes, repeats) of the collective sweep per scale."""
PROFILE_BACKWARDS = 3
"""Backwards timed for the measured compute profile (median per parameter)."""
PHASES = ("forward", "backward", "step", "total")


def case_worker(ctx, payload: dict) -> dict:
    import dataclasses

    import torch.distributed as dist

    from evenzero.calibration import measure
    from evenzero.cost.compute import estimate_profile
    from evenzero.cost.timeline import simulate
    from evenzero.repro.sidebyside import EvenzeroSystem, InterleaveOptions, run_interleaved
    from evenzero.strategies import PlanOptions, choose_bucket, plan

    sizes, repeats = CALIBRATION[payload["scale"]]
    cost = measure(sizes=sizes, repeats=repeats, name=f"calibrated-w{ctx.world_size}")
    model = _Case(payload["model"], payload["scale"], ctx)
    spec = model.spec()
    choice = choose_bucket(spec, ctx.world_size, PlanOptions(cost_model=cost))
    measured = model.measured_profile()
    evenzero = EvenzeroSystem("evenzero", model.build(), model.loss, bucket_numel=choice.numel,
                              expert_groups=model.expert_groups())
    # Issue 27: each compression mode is one more system, with the same bucket size, in the
    # same interleaved steps; its own executed plan carries the compressed collectives.
    compressed = [EvenzeroSystem(f"evenzero-{mode}", model.build(), model.loss,
                                 bucket_numel=choice.numel, expert_groups=model.expert_groups(),
                                 extra=settings)
                  for mode, settings in COMPRESSION_MODES.items()
                  if mode in payload.get("compression", ())]
    ddp = model.ddp()
    dist.barrier()
    results = run_interleaved(
        [evenzero, *compressed, ddp], model.batch,
        InterleaveOptions(payload["steps"], payload["warmup"], ctx.device),
        on_step=lambda name, step: ctx.emit((name, step)))
    phases = {r.name: {**{ph: statistics.median(r.phase_ms[ph]) for ph in PHASES[:-1]},
                       "total": statistics.median(r.step_ms)} for r in results}
    executed = evenzero.optimizer.plan  # re-planned on the measured arrival order
    if payload["evenzero_step"] == "main":
        executed = main_step(executed)
    spec = spec.with_arrival(executed.arrival, "measured")
    flops = estimate_profile(spec, cost.compute)
    ddp_plan = plan(spec, ctx.world_size, "ddp", PlanOptions())
    rows = []
    planned = [("evenzero", executed)]
    for system in compressed:
        p = system.optimizer.plan
        planned.append((system.name, main_step(p) if payload["evenzero_step"] == "main" else p))
    for name, p in (*planned, ("ddp", ddp_plan)):
        by_flops, by_time = simulate(p, cost, flops), simulate(p, cost, measured)
        rows.append({"system": name, "measured_ms": phases[name],
                     "predicted_flops_ms": _phases_ms(by_flops),
                     "predicted_measured_compute_ms": _phases_ms(by_time),
                     "predicted_step_parts_ms": _step_parts_ms(by_flops),
                     "backward_calls": len(p.backward()),
                     "step_work": dataclasses.asdict(p.step_work) if p.step_work else None})
    return {"case": payload["model"], "world_size": ctx.world_size, "numel": spec.numel,
            "params": len(spec.params), "tokens": spec.tokens, "bucket_numel": choice.numel,
            "buckets": len(executed.buckets), "choice_note": choice.note,
            "evenzero_step": payload["evenzero_step"], "cost_model": cost.to_json(),
            "measured_compute": {"backward_ms": measured.backward_s * 1e3,
                                 "forward_ms": measured.forward_s * 1e3,
                                 "flops_backward_ms": flops.backward_s * 1e3,
                                 "flops_forward_ms": flops.forward_s * 1e3},
            "rows": rows}


COMPRESSION_MODES = {
    "bf16": {"grad_compression": "bf16"},
    "int8": {"grad_compression": "int8"},
    "int8-ef": {"grad_compression": "int8", "grad_compression_error_feedback": True},
}


def main_step(executed):
    """`executed` with the step main's runtime ran before issue 17: an fp64 copy for the
    norm, torch's default AdamW on one flat shard per group, every master copied in and
    out (`--evenzero-step main`)."""
    from dataclasses import replace

    from evenzero.spec import DTYPE_BYTES

    work = executed.step_work
    copies = sum(2 * executed.shard_numel(g.name) * (4 + DTYPE_BYTES[g.dtype])
                 for g in executed.groups)
    return replace(executed, step_work=replace(work, optimizer_impl=None, norm="fp64",
                                               copy_bytes=copies))


def _phases_ms(t) -> dict[str, float]:
    return {"forward": t.forward_end_s * 1e3, "backward": t.backward_s * 1e3,
            "step": t.step_phase_s * 1e3, "total": t.total_s * 1e3}


def _step_parts_ms(t) -> dict[str, float]:
    """Compute-lane time after backward, by kind (waits are the step's collectives)."""
    out: dict[str, float] = {}
    for s in t.segments:
        if s.lane == "compute" and s.start >= t.backward_end_s - 1e-12:
            out[s.kind] = out.get(s.kind, 0.0) + (s.end - s.start) * 1e3
    return out


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
        elif kind == "llama":
            import llama_dense

            self.config = llama_dense.LlamaConfig() if scale == "full" else llama_dense.TINY
        else:
            raise ValueError(f"unknown case {kind!r}; use one of {', '.join(KINDS)}")

    def build(self):
        if self.kind == "seed":
            from evenzero.repro.seedmodel import SeedModel

            return SeedModel(self.config, self.groups).to(self.ctx.device)
        if self.kind == "llama":
            import llama_dense

            return llama_dense.Llama(self.config).to(self.ctx.device)
        from evenzero.repro.gptmodel import GPT

        return GPT(self.config).to(self.ctx.device)

    def loss(self, output, target):
        if self.kind == "llama":
            import llama_dense

            return llama_dense.loss_fn(output, target)
        from evenzero.repro.gptmodel import gpt_loss
        from evenzero.repro.seedmodel import seed_loss

        return (seed_loss if self.kind == "seed" else gpt_loss)(output, target)

    def batch(self, step: int):
        if self.kind == "seed":
            from evenzero.repro.seedmodel import seed_batch

            return seed_batch(self.config, step, self.ctx.rank, self.ctx.world_size)
        if self.kind == "llama":
            import llama_dense

            return llama_dense.batch(self.config, step, self.ctx.rank, self.ctx.world_size)
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


def run(cases: list[str], steps: int, warmup: int, scale: str, evenzero_step: str,
        json_path: Path | None = None, compression: tuple[str, ...] = ()) -> list[dict]:
    """Every case in turn; with `json_path`, the reports so far are written after each
    case, so a case that fails (a rank killed for memory, say) loses only itself."""
    out = []
    for case in cases:
        kind, _, world = case.partition(":")
        print(f"case {case} ...", flush=True)
        payload = {"model": kind, "steps": steps, "warmup": warmup, "scale": scale,
                   "evenzero_step": evenzero_step, "compression": list(compression)}
        out.append(launch(case_worker, payload, LaunchOptions(int(world), "gloo", timeout_s=3600)))
        if json_path is not None:
            json_path.write_text(json.dumps(out, indent=1))
    return out


def _error(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.0%}" if measured > 0 else "-"


def markdown(reports: list[dict], command: str) -> str:
    lines = ["```bash", command, "```", "",
             "Whole step (forward + backward + step + zero_grad), slowest rank, median:", "",
             "| case | W | bucket (buckets) | system | measured ms | predicted ms (FLOPs) | error "
             "| predicted ms (measured compute) | error |",
             "|---|---:|---:|---|---:|---:|---:|---:|---:|"]
    for r in reports:
        for row in r["rows"]:
            m = row["measured_ms"]["total"]
            f = row["predicted_flops_ms"]["total"]
            c = row["predicted_measured_compute_ms"]["total"]
            lines.append(f"| {r['case']} ({r['numel']:,} params, {r['tokens']} tokens) | "
                         f"{r['world_size']} | {r['bucket_numel']:,} ({r['buckets']}) | "
                         f"{row['system']} | {m:.1f} | {f:.1f} | {_error(f, m)} | {c:.1f} | "
                         f"{_error(c, m)} |")
    worst = max((abs(row["predicted_flops_ms"]["total"] - row["measured_ms"]["total"])
                 / row["measured_ms"]["total"] for r in reports for row in r["rows"]),
                default=float("nan"))
    lines += ["", f"Largest |error| of the FLOPs prediction: {worst:.0%} (goal: 25%).", "",
              "Per phase, ms: measured / predicted from FLOPs / predicted from measured compute "
              "(each phase's slowest rank, median; the phases of one step need not sum to its "
              "whole):", "",
              "| case | W | system | forward | backward | step | predicted step parts (FLOPs) |",
              "|---|---:|---|---:|---:|---:|---|"]
    for r in reports:
        for row in r["rows"]:
            cells = [f"{row['measured_ms'][p]:.1f} / {row['predicted_flops_ms'][p]:.1f} / "
                     f"{row['predicted_measured_compute_ms'][p]:.1f}"
                     for p in ("forward", "backward", "step")]
            parts = ", ".join(f"{k} {v:.1f}" for k, v in row["predicted_step_parts_ms"].items()
                              if v >= 0.05)
            lines.append(f"| {r['case']} | {r['world_size']} | {row['system']} | "
                         + " | ".join(cells) + f" | {parts} |")
    lines.append("")
    for r in reports:
        c = r["measured_compute"]
        lines.append(f"- {r['case']} W={r['world_size']}: backward compute measured "
                     f"{c['backward_ms']:.1f} ms vs FLOPs {c['flops_backward_ms']:.1f} ms; forward "
                     f"{c['forward_ms']:.1f} vs {c['flops_forward_ms']:.1f} ms. {r['choice_note']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", nargs="+", default=list(DEFAULT_CASES),
                   help=f"model:world_size, model one of {', '.join(KINDS)} "
                        f"(default: %(default)s)")
    p.add_argument("--steps", type=int, default=6, help="measured steps per system")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per system")
    p.add_argument("--scale", choices=sorted(CALIBRATION), default="full",
                   help="full: the benchmark; tiny: small models, a quick end-to-end check")
    p.add_argument("--evenzero-step", choices=("plan", "main"), default="plan",
                   help="plan: predict evenzero's step as its plan says; main: as the runtime "
                        "ran it before issue 17's step work")
    p.add_argument("--compression", nargs="*", choices=sorted(COMPRESSION_MODES), default=[],
                   help="also train and predict evenzero with these grad_compression modes "
                        "(issue 27), interleaved with the others")
    p.add_argument("--json", type=Path, help="write every figure here (after each case)")
    p.add_argument("--from-json", type=Path, nargs="+", metavar="FILE",
                   help="print the tables of reports written by --json, running nothing")
    args = p.parse_args(argv)
    if args.from_json:
        reports = [r for f in args.from_json for r in json.loads(f.read_text())]
        sys.stdout.write(markdown(reports, "python benchmarks/predict_vs_measured.py "
                                  + " ".join(argv if argv is not None else sys.argv[1:])))
        return 0
    for case in args.cases:
        kind, sep, world = case.partition(":")
        if kind not in KINDS or not sep or not world.isdigit() or int(world) < 2:
            p.error(f"--cases: {case!r} is not MODEL:W with MODEL one of {', '.join(KINDS)} "
                    f"and W >= 2")
        if kind == "seed" and int(world) % 4:
            p.error(f"--cases: {case!r}: the seed model needs a multiple of 4 ranks")
    reports = run(args.cases, args.steps, args.warmup, args.scale, args.evenzero_step, args.json,
                  tuple(args.compression))
    command = "python benchmarks/predict_vs_measured.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    sys.stdout.write(markdown(reports, command.strip()))
    if args.json:
        print(f"wrote {args.json}")
    totals = [row["measured_ms"]["total"] for r in reports for row in r["rows"]]
    return 0 if all(t == t for t in totals) else 1


if __name__ == "__main__":
    sys.exit(main())
