"""`evenzero bench`: a dense GPT-style model trained side by side by every system.

evenzero, the DeepSpeed-0.6 schedule in evenzero's runtime, torch DDP (its C++ reducer),
PyTorch FSDP2 in ZeRO-2 mode (`reshard_after_forward=False`), real DeepSpeed ZeRO-2 and
the comm-free floor (the systems of `evenzero.repro.systems`, the table `evenzero repro`
uses too), interleaved step by step on the same batches. Every step is timed in its
phases, forward, backward and step: FSDP2 gathers parameters in forward, evenzero and
DeepSpeed in their step, so no phase alone compares them; the whole step does.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from evenzero.repro.gptmodel import GPT_SIZES, GPTConfig
from evenzero.repro.localrun import add_launch_arguments, parse_launch_arguments
from evenzero.repro.systems import system_names

SYSTEMS = system_names()
"""What `--systems` accepts: every system of the table (the GPT has no MoE)."""
DEFAULT_SYSTEMS = ("evenzero", "ddp", "fsdp2", "deepspeed")
DEFAULT_BUCKET_NUMEL = 2**22
"""4M elements (16 MiB): 15 buckets for the 59M model, so reductions overlap backward, as
DDP's 25 MB buckets do: the fixed size this benchmark has always compared at.
`--bucket-numel 0` runs the runtime's default instead ("auto": chosen from the timeline
at construction, refined from the first backwards; `benchmarks/defaults.py`)."""


@dataclass(frozen=True)
class BenchConfig:
    """One side-by-side benchmark run."""

    world_size: int = 4
    """Local ranks. 4 by default: five copies of a 59M model on 8 ranks need > 24 GiB."""
    steps: int = 6
    """Measured steps per system."""
    warmup: int = 2
    """Untimed steps per system."""
    model: GPTConfig = field(default_factory=lambda: GPT_SIZES["bench-50m"])
    """Decoder shape."""
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    bucket_numel: int | None = DEFAULT_BUCKET_NUMEL
    """evenzero bucket size in elements; None = the runtime's default."""
    backend: str = "auto"
    timeout_s: float = 1800.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_launch_arguments(parser, world_size=4, steps=6, systems=SYSTEMS,
                         default_systems=DEFAULT_SYSTEMS, bucket_numel=DEFAULT_BUCKET_NUMEL)
    parser.add_argument("--model", default="bench-50m", choices=sorted(GPT_SIZES),
                        help="decoder size (default bench-50m, 59M params)")
    parser.add_argument("--json", help="write the results here")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    systems = parse_launch_arguments(args, SYSTEMS)
    return BenchConfig(args.world_size, args.steps, args.warmup, GPT_SIZES[args.model], systems,
                       args.bucket_numel or None, args.backend)


def main(args: argparse.Namespace) -> int:
    """Run the benchmark and print it; errors are raised for `evenzero.cli` to print."""
    from evenzero.commands import CommandError, UsageError, output_path, write_failed
    from evenzero.repro.localrun import LaunchError, LaunchOptions, launch
    from evenzero.repro.progress import JobProgress

    try:
        config = config_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    json_path = output_path("--json", args.json) if args.json else None
    try:
        with JobProgress(config.world_size) as shown:
            report = launch(bench_worker, config,
                            LaunchOptions(config.world_size, config.backend, config.timeout_s),
                            shown)
    except LaunchError as e:
        raise CommandError(str(e)) from None
    print_bench(report)
    if json_path is not None:
        try:
            json_path.write_text(json.dumps(report, indent=1))
        except OSError as e:
            raise write_failed("--json", json_path, e) from None
        print(f"wrote {json_path}")
    return 0


def bench_worker(ctx, config: BenchConfig) -> dict[str, Any]:
    from evenzero.plan_report import collective_record as record
    from evenzero.repro import system_record
    from evenzero.repro.gptmodel import GPT, blocks, gpt_batch, gpt_loss
    from evenzero.repro.progress import Planned, Status, StepDone
    from evenzero.repro.sidebyside import InterleaveOptions, capture_collectives, run_interleaved
    from evenzero.repro.systems import Workload, build_systems

    work = Workload(lambda: GPT(config.model).to(ctx.device), gpt_loss,
                    config.model.batch_per_rank, bucket_numel=config.bucket_numel, blocks=blocks)
    systems, skipped = build_systems(ctx, config.systems, work)
    ctx.emit(Planned(tuple(s.name for s in systems), config.steps, config.warmup))

    def batch(step: int):
        return gpt_batch(config.model, step, ctx.rank, ctx.world_size)

    results = run_interleaved(systems, batch,
                              InterleaveOptions(config.steps, config.warmup, ctx.device),
                              on_step=lambda name, step: ctx.emit(StepDone(name, step)))
    ctx.emit(Status("capturing each system's collectives in one more, untimed step"))
    captured = capture_collectives(systems, batch(config.warmup + config.steps), ctx.device)
    return {
        "world_size": ctx.world_size, "backend": ctx.backend, "config": dataclasses.asdict(config),
        "numel": config.model.numel(),
        "systems": [system_record(r, captured[r.name], record) for r in results],
        "skipped": skipped,
    }


def print_bench(report: dict[str, Any]) -> None:
    from rich.console import Console

    from evenzero.repro.report import PHASE_LABELS, condensed, max_rel_diff, titled
    from evenzero.repro.systems import trains

    console = Console(width=max(Console().width, 130))
    systems = report["systems"]
    ref = next((s for s in systems if s["name"] == "evenzero"), None)
    t = titled(f"GPT {report['numel']:,} params, {report['world_size']} ranks "
               f"({report['backend']}): ms per phase, slowest rank, median",
               "whole step = forward + backward + step on each rank, slowest rank per step; "
               "ddp is DDP's C++ reducer; collectives from one more, untimed step")
    cols = ("system", *PHASE_LABELS.values(), "whole step", "min-max", "x evenzero",
            "backward calls", "message sizes", "loss diff vs evenzero")
    for col in cols:
        t.add_column(col, justify="left" if col in ("system", "message sizes") else "right")
    for s in systems:
        calls = s["backward_collectives"]
        ratio = s["median_step_ms"] / ref["median_step_ms"] if ref else float("nan")
        diff = (f"{max_rel_diff(s['losses'], ref['losses']):.1e}" if ref and trains(s["name"])
                else "-")
        phases = s.get("median_phase_ms", {})
        t.add_row(s["name"], *(f"{phases[p]:.0f}" if p in phases else "-" for p in PHASE_LABELS),
                  f"{s['median_step_ms']:.0f}", f"{min(s['step_ms']):.0f}-{max(s['step_ms']):.0f}",
                  f"{ratio:.2f}", str(len(calls)),
                  _clipped(condensed([c["numel"] for c in calls]), 60) or "-", diff)
    console.print(t)
    for s in report.get("skipped", []):
        console.print(f"skipped {s['name']}: {s['reason']}", markup=False)


def _clipped(text: str, width: int) -> str:
    if len(text) <= width:
        return text
    return text[:text.rfind(", ", 0, width)] + ", ..."
