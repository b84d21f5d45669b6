"""`evenzero repro`: the DeepSpeed #3151 seed case, trained for real, side by side.

One local job of W ranks builds the seed model (fc1, fc2, a 16-expert top-1 MoE at
expert-parallel size 4) and trains it with, interleaved step by step (the systems come
from `evenzero.repro.systems`, the table `evenzero bench` uses too):

1. `evenzero`: evenzero ZeRO-2, one equal reduce-scatter per bucket;
2. `deepspeed-0.6-schedule`: DeepSpeed 0.6's reduce schedule executed by evenzero's
   runtime (the 13 uneven reduces of the report, plus the gate's, which our hooks keep);
3. `ddp`: torch DDP (its C++ reducer) on the dense params, expert grads all-reduced over
   the EDP group;
4. `deepspeed` and `deepspeed-reduce-mode`: real DeepSpeed ZeRO-2, default config and
   `use_multi_rank_bucket_allreduce: false`, when DeepSpeed is importable;

and on request `floor` (`--systems ...,floor`): no communication, AdamW on this rank's
shard only. The data is a fixed teacher the model can fit (`seedmodel.seed_batch`), so
the losses fall, and equal losses across systems are the evidence of a correct step.

It prints what each system is, the backward collectives each issued (captured in one
more, untimed step), the seed table, each system's forward, backward and step times, the
losses (1-3 must agree to 1e-5 relative over the first `LOSS_CHECK_STEPS` steps) and the
verdicts against DDP and DeepSpeed (`evenzero.repro.verdict`): met, missed, or
inconclusive when the run's noise crosses the target. A verdict still open after `steps`
measured steps is measured further, evenzero and that system only, doubling the steps up
to `max_steps`. evenzero runs the library's default bucket size ("auto") unless
`--bucket-numel` fixes one; the report says which size it ran and why.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from evenzero.repro.localrun import add_launch_arguments, parse_launch_arguments
from evenzero.repro.seedmodel import SeedModelConfig
from evenzero.repro.systems import system_names

SYSTEMS = system_names(experts=True)
"""What `--systems` accepts: every system that runs the seed model's expert-parallel MoE."""
DEFAULT_SYSTEMS = ("evenzero", "deepspeed-0.6-schedule", "ddp", "deepspeed",
                   "deepspeed-reduce-mode")
DEFAULT_BUCKET_NUMEL = None
"""The library's default, "auto", as a user gets it: chosen at construction, refined at the
end of the second backward (inside the two warm-up steps). `--bucket-numel N` fixes a size
instead (BENCHMARKS.md has the runs at 2**20)."""
DEFAULT_MAX_STEPS = 32
"""Measured steps at most for evenzero and a system whose verdict is still open."""


@dataclass(frozen=True)
class ReproConfig:
    """Everything one `evenzero repro` run needs; travels to every rank."""

    world_size: int = 8
    """Local ranks."""
    steps: int = 8
    """Measured steps per system before the first look at the verdicts."""
    max_steps: int = DEFAULT_MAX_STEPS
    """Measured steps at most, for evenzero and the systems whose verdict is still open."""
    warmup: int = 2
    """Untimed steps per system before the measured ones."""
    model: SeedModelConfig = field(default_factory=SeedModelConfig)
    """Seed model shape (the report's at the defaults)."""
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    """Which systems to train, by name."""
    bucket_numel: int | None = DEFAULT_BUCKET_NUMEL
    """evenzero bucket size in elements; None = the runtime's default."""
    lr: float = 1e-3
    weight_decay: float = 0.01
    backend: str = "auto"
    """gloo, nccl, or auto (NCCL when >= world_size GPUs are visible)."""
    timeout_s: float = 1200.0
    """Wall-clock limit for the whole job."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from evenzero.commands import finite_float, int_in
    from evenzero.repro.localrun import MAX_STEPS

    add_launch_arguments(parser, world_size=8, steps=8, systems=SYSTEMS,
                         default_systems=DEFAULT_SYSTEMS, bucket_numel=0)
    parser.add_argument("--max-steps", type=int_in(1, MAX_STEPS), default=DEFAULT_MAX_STEPS,
                        help=f"while a verdict is inconclusive, measure evenzero and that "
                             f"system further, doubling the steps up to this many "
                             f"(default {DEFAULT_MAX_STEPS}; at most --steps: never)")
    parser.add_argument("--json", help="write collectives, times and losses here")
    parser.add_argument("--plot", help="write message sizes and step times as a PNG "
                                       "(.png added if no extension)")
    # Small shapes for tests and quick looks; the defaults are the report's model.
    parser.add_argument("--dim", type=int_in(1, 16384), default=1000, help=argparse.SUPPRESS)
    parser.add_argument("--experts", type=int_in(1, 1024), default=16, help=argparse.SUPPRESS)
    parser.add_argument("--ep-size", type=int_in(1, 1024), default=4, help=argparse.SUPPRESS)
    parser.add_argument("--tokens", type=int_in(1, 65536), default=32, help=argparse.SUPPRESS)
    parser.add_argument("--timeout", type=finite_float(0.0, inclusive=False), default=1200.0,
                        help=argparse.SUPPRESS)


def config_from_args(args: argparse.Namespace) -> ReproConfig:
    systems = parse_launch_arguments(args, SYSTEMS)
    model = SeedModelConfig(dim=args.dim, num_experts=args.experts, ep_size=args.ep_size,
                            tokens_per_rank=args.tokens)
    model.check(args.world_size)
    return ReproConfig(world_size=args.world_size, steps=args.steps,
                       max_steps=max(args.steps, args.max_steps), warmup=args.warmup,
                       model=model, systems=systems, bucket_numel=args.bucket_numel or None,
                       backend=args.backend, timeout_s=args.timeout)


def main(args: argparse.Namespace) -> int:
    """Run the job and print the report; errors are raised for `evenzero.cli` to print."""
    from evenzero.commands import CommandError, UsageError, output_path, write_failed
    from evenzero.repro import report as reproreport
    from evenzero.repro.localrun import LaunchError

    try:
        config = config_from_args(args)
    except ValueError as e:
        raise UsageError(str(e)) from None
    # Checked before the run: a bad path must not cost a minute of training.
    json_path = output_path("--json", args.json) if args.json else None
    plot_path = output_path("--plot", args.plot, default_suffix=".png") if args.plot else None
    try:
        report = run(config, progress=True)
    except LaunchError as e:
        raise CommandError(str(e)) from None
    ok = reproreport.print_report(report)
    for flag, path, write in (
            ("--json", json_path, lambda p: p.write_text(json.dumps(report, indent=1))),
            ("--plot", plot_path, lambda p: reproreport.plot(report, p))):
        if path is None:
            continue
        try:
            write(path)
        except OSError as e:
            raise write_failed(flag, path, e) from None
        print(f"wrote {path}")
    return 0 if ok else 1


def run(config: ReproConfig, progress: bool = False) -> dict[str, Any]:
    """Run the side-by-side job; returns the JSON-ready report."""
    from evenzero.repro.localrun import LaunchOptions, launch

    options = LaunchOptions(config.world_size, config.backend, config.timeout_s)
    if not progress:
        return launch(repro_worker, config, options)
    from evenzero.repro.progress import JobProgress

    with JobProgress(config.world_size) as shown:
        return launch(repro_worker, config, options, shown)


def repro_worker(ctx, config: ReproConfig) -> dict[str, Any]:
    """Runs on every rank; rank 0's return value is the report."""
    import torch.distributed as dist

    from evenzero.moe import expert_parallel_groups
    from evenzero.plan_report import collective_record as record
    from evenzero.repro.capture import CaptureOptions
    from evenzero.repro.deepspeed_runner import check_expert_layout
    from evenzero.repro.progress import Continued, Planned, Status, StepDone
    from evenzero.repro.seedmodel import SeedModel, seed_batch, seed_loss
    from evenzero.repro.sidebyside import InterleaveOptions, capture_collectives, run_interleaved
    from evenzero.repro.systems import Workload, build_systems
    from evenzero.repro.verdict import REFERENCE, next_steps

    m = config.model
    groups = expert_parallel_groups(m.ep_size)
    world = frozenset(range(ctx.world_size))
    capture = CaptureOptions(
        group_labels={world: "dense",
                      frozenset(dist.get_process_group_ranks(groups.edp_group)): m.expert_group_name},
        exclude_all_to_all_ranks=frozenset(dist.get_process_group_ranks(groups.ep_group)))

    def deepspeed_model():
        from evenzero.repro.deepspeed_runner import DeepSpeedSeedModel

        return DeepSpeedSeedModel(m, groups.ep_rank).to(ctx.device)

    work = Workload(lambda: SeedModel(m, groups).to(ctx.device), seed_loss, m.tokens_per_rank,
                    lr=config.lr, weight_decay=config.weight_decay,
                    bucket_numel=config.bucket_numel,
                    expert_groups={m.expert_group_name: groups.edp_group},
                    deepspeed_model=deepspeed_model,
                    after_deepspeed=lambda: check_expert_layout(ctx.world_size, m.ep_size),
                    capture=capture)
    systems, skipped = build_systems(ctx, config.systems, work)
    ctx.emit(Planned(tuple(s.name for s in systems), config.steps, config.warmup))

    def batch(step: int):
        return seed_batch(m, step, ctx.rank, ctx.world_size)

    def step_done(name: str, step: int) -> None:
        ctx.emit(StepDone(name, step))

    results = run_interleaved(systems, batch,
                              InterleaveOptions(config.steps, config.warmup, ctx.device),
                              on_step=step_done)
    by_name = {r.name: r for r in results}
    # Every rank holds the same reduced times, so every rank takes the same decisions.
    while True:
        names, more = next_steps({r.name: r.step_ms for r in results}, config.max_steps)
        if not names:
            break
        done = config.warmup + len(by_name[REFERENCE].step_ms)
        ctx.emit(Continued(tuple(names), done, more, continue_reason(results, more)))
        for extra in run_interleaved([s for s in systems if s.name in names], batch,
                                     InterleaveOptions(more, 0, ctx.device, first_step=done),
                                     on_step=step_done):
            by_name[extra.name].extend(extra)
    ctx.emit(Status("capturing each system's collectives in one more, untimed step"))
    done = config.warmup + len(by_name[REFERENCE].step_ms) if REFERENCE in by_name else 0
    captured = capture_collectives(systems, batch(max(done, config.warmup + config.steps)),
                                   ctx.device)
    # What evenzero's runtime planned, to check that it issued exactly that.
    planned = {s.name: [record(c) for c in s.optimizer.plan.backward()]
               for s in systems if hasattr(s, "optimizer") and hasattr(s.optimizer, "plan")}
    return {
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "config": dataclasses.asdict(config),
        "numel_per_rank": m.numel_per_rank(),
        "systems": [system_record(r, captured[r.name], record)
                    | ({"planned_backward": planned[r.name]} if r.name in planned else {})
                    for r in results],
        "skipped": skipped,
        "bucket": bucket_record(systems, config),
    }


def continue_reason(results, more: int) -> str:
    """Why the job measures `more` steps: the open verdicts, with their intervals."""
    from evenzero.repro.verdict import CONFIDENCE, verdicts

    open_ones = [v for v in verdicts({r.name: r.step_ms for r in results}) if not v.decided]
    what = "; ".join(f"{v.peer}: {CONFIDENCE:.0%} interval {v.low:.2f}-{v.high:.2f} crosses "
                     f"{v.target:g}" if v.low == v.low else  # nan: too few steps
                     f"{v.peer}: too few steps for a {CONFIDENCE:.0%} interval"
                     for v in open_ones)
    return f"verdict open after {open_ones[0].steps} steps ({what}): {more} more steps"


def bucket_record(systems, config: ReproConfig) -> dict[str, Any] | None:
    """The bucket size evenzero ran (after any refinement) and its plan's note on why."""
    system = next((s for s in systems if s.name == "evenzero"), None)
    if system is None:
        return None
    plan = system.optimizer.plan
    return {"requested": "auto" if config.bucket_numel is None else config.bucket_numel,
            "numel": plan.bucket_numel, "note": plan.notes[-1] if plan.notes else "",
            "buckets": len(plan.buckets)}


def system_record(result, collectives, record) -> dict[str, Any]:
    """One system's part of a report: times (whole step and phases), losses, collectives."""
    from evenzero.plan import BACKWARD, STEP
    from evenzero.repro.sidebyside import PHASES

    return {"name": result.name,
            "backward_collectives": [record(c) for c in collectives if c.phase == BACKWARD],
            "step_collectives": [record(c) for c in collectives if c.phase == STEP],
            "median_step_ms": result.median_step_ms,
            "step_ms": result.step_ms,
            "phase_ms": result.phase_ms,
            "median_phase_ms": {p: result.median_phase_ms(p) for p in PHASES},
            "losses": result.losses}
