"""The `evenzero` command: plan, calibrate, repro, bench.

    evenzero plan MODEL --world-size W [--ep-size E] [--strategy S ... | all]
                  [--bucket-numel B|auto] [--round-robin] [--json] [--plot FILE.png]
                  [--cost PRESET|FILE.json] [--alpha-us A] [--busbw-gbs B]
                  [--cost-param OP.FIELD=V ...] [--markdown]
                  [--timeline] [--timeline-plot FILE.png] [--tokens N]
    evenzero calibrate --world-size W [--sizes N ...] [--repeats R] [--json FILE]
    evenzero repro ...    (evenzero.repro)
    evenzero bench ...    (evenzero.repro.bench)

`plan` never imports torch: it is pure planning. Bad input ends in one line on stderr
that names the problem, and exit status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from evenzero.cost import CostModel, CostModelError, predict
from evenzero.cost.presets import PRESETS as COST_PRESETS
from evenzero.cost.presets import default_cost_preset, load_cost_model
from evenzero.model_presets import PRESETS, preset
from evenzero.plan import PlanError
from evenzero.plan_report import plans_record, summarize
from evenzero.spec import GroupSpec, ModelSpec, SpecError, from_json
from evenzero.strategies import STRATEGY_NAMES, PlanOptions, plan, strategy_names

LAZY_COMMANDS = {
    "repro": ("evenzero.repro", "run the seed case side by side: evenzero, DeepSpeed, DDP"),
    "bench": ("evenzero.repro.bench", "run the benchmarks"),
}
"""Subcommands whose module (and torch) is imported only when they run."""


class UsageError(Exception):
    """A command-line mistake; main() prints it on one line and returns 2."""


class CommandError(Exception):
    """A command that cannot run here (e.g. calibration failed); printed like UsageError."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump: the message names the fix
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


# --------------------------------------------------------------------------- plan


def load_model(name_or_path: str) -> ModelSpec:
    """A preset by name, else a JSON model file."""
    if name_or_path in PRESETS:
        return preset(name_or_path)
    if name_or_path.endswith(".json") or os.path.exists(name_or_path):
        return from_json(name_or_path)
    return preset(name_or_path)  # raises: unknown preset, names the choices


def with_ep_size(spec: ModelSpec, ep_size: int) -> ModelSpec:
    """`spec` with expert_parallel_size = `ep_size` on every expert group (E > 1)."""
    if isinstance(ep_size, bool) or ep_size < 1:
        raise PlanError(f"--ep-size must be a positive integer, got {ep_size}")
    if not any(g.expert_parallel_size > 1 for g in spec.groups):
        raise PlanError(f"--ep-size: model {spec.name!r} has no expert group "
                        f"(none with expert_parallel_size > 1); drop --ep-size")
    groups = tuple(GroupSpec(g.name, ep_size) if g.expert_parallel_size > 1 else g
                   for g in spec.groups)
    return dataclasses.replace(spec, groups=groups)


def strategies_from(requested: Sequence[str] | None) -> list[str]:
    if not requested:
        return list(STRATEGY_NAMES)
    out: list[str] = []
    for name in requested:
        names = STRATEGY_NAMES if name == "all" else (name,)
        for n in names:
            if n not in strategy_names():
                raise PlanError(f"unknown strategy {n!r}; choose from "
                                f"{', '.join(strategy_names())} or all")
            if n not in out:
                out.append(n)
    return out


def cost_model_from(args: argparse.Namespace) -> tuple[CostModel, str]:
    """(model, how it was chosen) from --cost and the override flags."""
    if args.cost:
        model, why = load_cost_model(args.cost), ""
    else:
        name = default_cost_preset(args.world_size)
        model, why = COST_PRESETS[name], f"default for W {'<=' if args.world_size <= 8 else '>'} 8"
    if args.alpha_us is not None or args.busbw_gbs is not None:
        model = model.replace(alpha_us=args.alpha_us, busbw_gbs=args.busbw_gbs)
        why = ", ".join(x for x in (why, "overridden") if x)
    assignments = {}
    for item in args.cost_param or ():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise CostModelError(f"--cost-param {item!r}: expected OP.FIELD=VALUE, "
                                 f"e.g. reduce.alpha_us=160")
        assignments[key.strip()] = value.strip()
    if assignments:
        model = model.with_params(assignments)
        why = ", ".join(x for x in (why, "overridden") if x)
    return model, why


def bucket_numel_arg(text: str) -> int | str:
    """--bucket-numel: a number of elements or "auto"."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected a number of elements or auto, got {text!r}") from None


def _png(flag: str, value: str | None) -> Path | None:
    path = Path(value) if value else None
    if path is not None and not path.parent.exists():
        raise PlanError(f"{flag} {path}: directory {path.parent} does not exist")
    return path


def run_plan(args: argparse.Namespace) -> int:
    spec = load_model(args.model)
    if args.ep_size is not None:
        spec = with_ep_size(spec, args.ep_size)
    if args.tokens is not None:
        spec = spec.with_tokens(args.tokens)  # validated by ModelSpec
    names = strategies_from(args.strategy)
    model, why = cost_model_from(args)
    options = PlanOptions(bucket_numel=args.bucket_numel, round_robin=args.round_robin,
                          cost_model=model)
    plot, gantt = _png("--plot", args.plot), _png("--timeline-plot", args.timeline_plot)
    warning = model.extrapolation_warning(args.world_size)
    results = []
    for name in names:
        p = plan(spec, args.world_size, name, options)
        if warning:
            p = dataclasses.replace(p, notes=p.notes + (f"warning: {warning}",))
        results.append((p, summarize(p, predict(p, model, options.fixed_bucket_numel))))
    title = (f"{spec.name} on {args.world_size} ranks, cost model {model.name}"
             + (f" ({why})" if why else "")
             + (f", fitted at {'/'.join(map(str, model.fitted_ranks))} ranks: extrapolated"
                if warning else ""))
    timelines = step_timelines(spec, model, [p for p, _ in results]) \
        if args.timeline or gantt else None
    for path, draw in ((plot, "plot_schedules"), (gantt, "plot_timelines")):
        if path is None:
            continue
        try:
            if draw == "plot_schedules":
                from evenzero.planview import plot_schedules

                plot_schedules(results, path, title)
            else:
                from evenzero.timelineview import plot_timelines

                plot_timelines(timelines, path, title)
        except ValueError as e:  # matplotlib: unknown image format
            raise PlanError(f"{path}: {e}") from None
    if args.json:
        doc = plans_record(args.world_size, results)
        for record, t in zip(doc["plans"], timelines or (), strict=False):
            from evenzero.timelineview import timeline_record

            record["timeline"] = timeline_record(t)
        json.dump(doc, sys.stdout)
        sys.stdout.write("\n")
        return 0
    from evenzero.planview import markdown_table, print_table

    summaries = [s for _, s in results]
    if args.markdown:
        sys.stdout.write(markdown_table(title, summaries))
    else:
        print_table(title, summaries)
    if timelines is not None:
        from evenzero.timelineview import markdown_timeline, print_timeline

        notes = [f"compute: {timelines[0].compute_source}"]
        notes += [f"warning: {warning}"] if warning else []
        ttitle = f"step timeline: {title}"
        if args.markdown:
            sys.stdout.write("\n" + markdown_timeline(ttitle, timelines, notes))
        else:
            print_timeline(ttitle, timelines, notes)
    for path in (plot, gantt):
        if path is not None:
            print(f"wrote {path}")
    return 0


def step_timelines(spec: ModelSpec, model: CostModel, plans) -> list:
    """Each plan's predicted step, compute from the spec's FLOPs on the model's device."""
    from evenzero.cost.compute import estimate_profile
    from evenzero.cost.timeline import device_for, simulate

    profile = estimate_profile(spec, device_for(model))
    return [simulate(p, model, profile) for p in plans]


# --------------------------------------------------------------------------- calibrate


def run_calibrate(args: argparse.Namespace) -> int:
    from evenzero.cost import calibrate

    sizes = args.sizes or calibrate.DEFAULT_SIZES
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise UsageError(f"--json {args.json}: directory {Path(args.json).parent} does not "
                         f"exist; create it first")
    try:
        calibrate.check_sweep(sizes, args.repeats)
    except calibrate.CalibrationError as e:
        raise CommandError(str(e)) from None
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        if args.world_size is not None and args.world_size != int(os.environ["WORLD_SIZE"]):
            raise CostModelError(f"--world-size {args.world_size} disagrees with WORLD_SIZE="
                                 f"{os.environ['WORLD_SIZE']} from the launcher; drop --world-size")
        result = calibrate.run_from_env(sizes, args.repeats)
        if result is None:  # only rank 0 reports
            return 0
    else:
        if args.world_size is None:
            raise UsageError("evenzero calibrate: --world-size W is required outside torchrun")
        try:
            result = calibrate.run_local(args.world_size, sizes, args.repeats)
        except calibrate.CalibrationError as e:
            raise CommandError(str(e)) from None
        except Exception as e:  # a worker failed: show its last line, not a spawn traceback
            last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise CommandError(f"a calibration rank failed: {last}") from None
    model, samples = result
    _print_calibration(model, samples)
    if args.json:
        Path(args.json).write_text(json.dumps(model.to_json(), indent=2) + "\n")
        print(f"wrote {args.json}; use it with: evenzero plan MODEL --world-size W "
              f"--cost {args.json}")
    return 0


def _print_calibration(model: CostModel, samples) -> None:
    from rich.console import Console
    from rich.table import Table

    from evenzero.planview import human_bytes

    table = Table(title=f"{model.name}: {model.description}", title_justify="left")
    for col in ("op", "ranks", "bytes", "measured", "fitted", "alpha (us)", "busbw (GB/s)"):
        table.add_column(col, justify="right")
    for s in samples:
        v, fitted = model.choose(s.op, s.group_size, s.nbytes)
        table.add_row(f"{s.op} ({v.name})" if v.name != "measured" else s.op, str(s.group_size),
                      human_bytes(s.nbytes), f"{s.seconds * 1e3:.3f} ms", f"{fitted * 1e3:.3f} ms",
                      f"{model.alpha_us(v, s.group_size):.1f}", f"{v.busbw_gbs:.3f}")
    console = Console(width=120)
    console.print(table)
    if model.compute is not None:
        c = model.compute
        console.print(f"compute per rank: {c.tflops * 1e3:.1f} GFLOP/s matmul, {c.memory_gbs:.1f} "
                      f"GB/s copy, optimizer {c.optimizer_bytes_per_element:.0f} B/element, "
                      f"{c.comm_slowdown:.2f}x slower beside a collective", highlight=False)


# --------------------------------------------------------------------------- repro, bench


def run_lazy(command: str, argv: Sequence[str]) -> int:
    """Import the command's module now, let it add its own arguments, and run it."""
    module_name, help_text = LAZY_COMMANDS[command]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name != module_name:
            raise
        raise UsageError(f"evenzero {command}: {module_name} is not part of this installation; "
                         f"reinstall evenzero from a full checkout (pip install -e .)") from None
    parser = _Parser(prog=f"evenzero {command}", description=module.__doc__ or help_text,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    return int(module.main(parser.parse_args(list(argv))) or 0)


# --------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="evenzero", description=__doc__,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    p = sub.add_parser("plan", help="show the collective schedule of a model under each strategy")
    p.add_argument("model", metavar="MODEL",
                   help=f"a preset ({', '.join(PRESETS)}) or a JSON model file")
    p.add_argument("--world-size", type=int, required=True, metavar="W",
                   help="data-parallel ranks to plan for")
    p.add_argument("--ep-size", type=int, metavar="E",
                   help="expert_parallel_size for the model's expert groups")
    p.add_argument("--strategy", action="extend", nargs="+", metavar="S",
                   help=f"one or more of {', '.join(STRATEGY_NAMES)}, or all (the default)")
    p.add_argument("--bucket-numel", type=bucket_numel_arg, metavar="B|auto",
                   help="bucket size in elements (default: each strategy's own; evenzero's is "
                        "auto, the size with the shortest predicted step)")
    p.add_argument("--round-robin", action="store_true",
                   help="DeepSpeed round_robin_gradients")
    p.add_argument("--json", action="store_true", help="print the plans as JSON")
    p.add_argument("--plot", metavar="FILE.png", help="plot backward message sizes per call")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--timeline", action="store_true",
                   help="predict each strategy's step: forward, backward with overlap, exposed "
                        "communication, step time")
    p.add_argument("--timeline-plot", metavar="FILE.png",
                   help="draw the step timelines as a Gantt chart (compute and comm lanes)")
    p.add_argument("--tokens", type=int, metavar="N",
                   help="tokens per micro-batch on one rank, for compute estimates "
                        "(default: the model's)")
    p.add_argument("--cost", metavar="PRESET|FILE.json",
                   help=f"cost model: {', '.join(COST_PRESETS)}, or a file from "
                        f"`evenzero calibrate --json` (default h100-nvlink-8 for W <= 8, "
                        f"else h100-ndr-ib)")
    p.add_argument("--alpha-us", type=float, metavar="A",
                   help="charge every collective a flat A microseconds of latency")
    p.add_argument("--busbw-gbs", type=float, metavar="B",
                   help="bus bandwidth of every collective, GB/s")
    p.add_argument("--cost-param", action="append", metavar="KEY=V",
                   help="override one cost parameter, e.g. reduce.alpha_us=160, "
                        "all_reduce.tree.busbw_gbs=300, reference_ranks=64 (repeatable)")
    p.set_defaults(run=run_plan)

    c = sub.add_parser("calibrate", help="measure alpha and bus bandwidth per collective")
    c.add_argument("--world-size", type=int, metavar="W",
                   help="local gloo ranks to spawn; under torchrun omit it or match WORLD_SIZE")
    c.add_argument("--sizes", type=int, nargs="+", metavar="N",
                   help="message sizes to sweep, in elements (fp32)")
    c.add_argument("--repeats", type=int, default=5, help="calls timed per size (fastest kept)")
    c.add_argument("--json", metavar="FILE", help="save the fitted cost model here")
    c.set_defaults(run=run_calibrate)

    for name, (_, help_text) in LAZY_COMMANDS.items():
        sub.add_parser(name, help=help_text, add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in LAZY_COMMANDS:
            return run_lazy(argv[0], argv[1:])
        args = build_parser().parse_args(argv)
        return args.run(args)
    except (UsageError, CommandError, SpecError, PlanError, CostModelError) as e:
        print(f"evenzero: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
