"""`evenzero plan`: the collective schedule of a model under each strategy, before a job runs.

    evenzero plan MODEL --world-size W [--ep-size E] [--strategy S ... | all]
                  [--bucket-numel B|auto] [--round-robin] [--json] [--markdown] [--plot FILE.png]
                  [--cost PRESET|FILE.json] [--alpha-us A] [--busbw-gbs B]
                  [--cost-param KEY=V ...]
                  [--timeline] [--timeline-plot FILE.png] [--tokens N]

Pure planning: never imports torch. The table fits the terminal (less important columns
are left out on narrow ones and named below it); --markdown and --json are complete.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

from evenzero.commands import (
    MAX_LOCAL_RANKS,
    UsageError,
    finite_float,
    int_in,
    output_path,
    write_failed,
)
from evenzero.cost import CostModel, CostModelError, predict
from evenzero.cost.presets import PRESETS as COST_PRESETS
from evenzero.cost.presets import default_cost_preset, load_cost_model
from evenzero.model_presets import PRESETS, preset
from evenzero.plan import PlanError
from evenzero.plan_report import plans_record, summarize
from evenzero.spec import MAX_NUMEL, GroupSpec, ModelSpec
from evenzero.spec_json import from_json
from evenzero.strategies import STRATEGY_NAMES, PlanOptions, plan, strategy_names
from evenzero.strategies.common import MAX_WORLD_SIZE
from evenzero.strategies.wholetensor import muon_split
from evenzero.wire import DEFAULT_BLOCK, MODES


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", metavar="MODEL",
                   help=f"a preset ({', '.join(PRESETS)}) or a JSON model file")
    p.add_argument("--world-size", type=int_in(1, MAX_WORLD_SIZE, "DeepSpeed's plans list "
                                               "calls per rank"),
                   required=True, metavar="W",
                   help=f"data-parallel ranks to plan for, 1 to {MAX_WORLD_SIZE:,}")
    p.add_argument("--ep-size", type=int_in(1, MAX_WORLD_SIZE), metavar="E",
                   help="expert_parallel_size for the model's expert groups")
    p.add_argument("--strategy", action="extend", nargs="+", metavar="S",
                   help=f"one or more of {', '.join(STRATEGY_NAMES)}, or all (the default)")
    p.add_argument("--bucket-numel", type=bucket_numel_arg, metavar="B|auto",
                   help="bucket size in elements (default: each strategy's own; evenzero's is "
                        "auto, the size with the shortest predicted step)")
    p.add_argument("--round-robin", action="store_true",
                   help="DeepSpeed round_robin_gradients")
    p.add_argument("--grad-compression", choices=MODES, default=None,
                   help="evenzero's gradient reduce-scatter sends bf16, or int8 with one fp32 "
                        "scale per block, summed in fp32 (default: exact values); the other "
                        "strategies' bytes are shown beside it")
    p.add_argument("--compression-block", type=int, default=DEFAULT_BLOCK, metavar="N",
                   help=f"int8: elements per scale, a power of two (default {DEFAULT_BLOCK})")
    p.add_argument("--error-feedback", action="store_true",
                   help="with --grad-compression: plan the per-rank fp32 residual (memory) "
                        "and its compute")
    p.add_argument("--optimizer", choices=("adamw", "muon"), default="adamw",
                   help="muon: torch.optim.Muon on the hidden matrices and AdamW on the rest "
                        "(embeddings, head, norms, biases), each in a group of its own, as "
                        "ZeroOptimizer runs them; evenzero lays the matrices out "
                        "matrix-aligned and its notes give the padding and the "
                        "Newton-Schulz balance")
    p.add_argument("--offload", action="store_true",
                   help="also say whether evenzero with offload_optimizer='cpu' fits where "
                        "plain ZeRO does not, and what it costs per step")
    p.add_argument("--device-memory-gib", type=finite_float(0.0, inclusive=False), default=80.0,
                   metavar="G", help="with --offload: device memory per rank (default 80)")
    p.add_argument("--json", action="store_true", help="print the plans as JSON")
    p.add_argument("--plot", metavar="FILE.png",
                   help="plot backward message sizes per call (.png added if no extension)")
    p.add_argument("--markdown", action="store_true", help="print the table as Markdown")
    p.add_argument("--timeline", action="store_true",
                   help="predict each strategy's step: forward, backward with overlap, exposed "
                        "communication, step time")
    p.add_argument("--timeline-plot", metavar="FILE.png",
                   help="draw the step timelines as a Gantt chart (compute and comm lanes)")
    p.add_argument("--tokens", type=int_in(1, MAX_NUMEL), metavar="N",
                   help="tokens per micro-batch on one rank, for compute estimates "
                        "(default: the model's)")
    p.add_argument("--cost", metavar="PRESET|FILE.json",
                   help=f"cost model: {', '.join(COST_PRESETS)}, or a file from "
                        f"`evenzero calibrate --json` (default h100-nvlink-8 for W <= 8, "
                        f"else h100-ndr-ib)")
    p.add_argument("--alpha-us", type=finite_float(0.0), metavar="A",
                   help="charge every collective a flat A microseconds of latency")
    p.add_argument("--busbw-gbs", type=finite_float(0.0, inclusive=False), metavar="B",
                   help="bus bandwidth of every collective, GB/s")
    p.add_argument("--cost-param", action="append", metavar="KEY=V",
                   help="override one cost parameter (repeatable). KEY is OP.FIELD for every "
                        "variant of a collective (reduce.alpha_us=160), OP.VARIANT.FIELD for "
                        "one variant (all_reduce.tree.busbw_gbs=300), or a field of the "
                        "whole model (reference_ranks=64)")


def main(args: argparse.Namespace) -> int:
    plot = _plot_path("--plot", args.plot) if args.plot is not None else None
    gantt = (_plot_path("--timeline-plot", args.timeline_plot)
             if args.timeline_plot is not None else None)
    spec = load_model(args.model)
    if args.ep_size is not None:
        spec = with_ep_size(spec, args.ep_size)
    if args.tokens is not None:
        spec = spec.with_tokens(args.tokens)  # validated by ModelSpec
    names = strategies_from(args.strategy)
    model, why = cost_model_from(args)
    whole: tuple[str, ...] = ()
    if args.optimizer == "muon":
        spec, whole = muon_split(spec)
        if not whole:
            raise PlanError(f"--optimizer muon: model {spec.name!r} has no hidden matrix "
                            f"(2-D, not an embedding or head) for Muon to step")
    options = PlanOptions(bucket_numel=args.bucket_numel, round_robin=args.round_robin,
                          cost_model=model, grad_compression=args.grad_compression,
                          compression_block=args.compression_block,
                          error_feedback=args.error_feedback, whole_tensor=whole)
    warning = model.extrapolation_warning(args.world_size)
    if warning:
        warning = f"{warning}; {calibrate_hint(args.world_size)}"
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
    timelines = (step_timelines(spec, model, [p for p, _ in results])
                 if args.timeline or gantt else None)
    if plot is not None:
        from evenzero.planview import plot_schedules

        try:
            plot_schedules(results, plot, title)
        except OSError as e:
            raise write_failed("--plot", plot, e) from None
    if gantt is not None:
        from evenzero.timelineview import plot_timelines

        try:
            plot_timelines(timelines, gantt, title)
        except OSError as e:
            raise write_failed("--timeline-plot", gantt, e) from None
    if args.json:
        doc = plans_record(args.world_size, results)
        if timelines is not None:
            from evenzero.timelineview import timeline_record

            for record, t in zip(doc["plans"], timelines, strict=True):
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
    if args.offload:
        for line in offload_lines(spec, args.world_size, options, model, args.device_memory_gib):
            print(line)
    for path in (plot, gantt):
        if path is not None:
            print(f"wrote {path}")
    return 0


def offload_lines(spec: ModelSpec, world_size: int, options: PlanOptions, model: CostModel,
                  device_gib: float) -> list[str]:
    """`--offload`: evenzero's plan with and without `offload_optimizer="cpu"`."""
    from evenzero.plan_report import offload_verdict

    plain = plan(spec, world_size, "evenzero", options)
    offloaded = plan(spec, world_size, "evenzero",
                     dataclasses.replace(options, offload_optimizer="cpu"))
    steps: list[float | None] = [None, None]
    if model.compute is not None:
        steps = [t.total_s for t in step_timelines(spec, model, [plain, offloaded])]
    lines = offload_verdict(plain, offloaded, device_gib, *steps).lines()
    dev = model.compute
    if dev is not None:
        link = (f"{dev.host_link_gbs:g} GB/s" if dev.host_link_gbs is not None
                else "none (the device is the host)")
        step = (f"{dev.host_step_ns_per_element:g} ns/element" if dev.host_step_ns_per_element
                is not None else "the device's own optimizer figures")
        lines.append(f"  host link {link}, host step {step} ({dev.name}; `evenzero calibrate` "
                     f"measures both on a GPU)")
    return lines


def step_timelines(spec: ModelSpec, model: CostModel, plans) -> list:
    """Each plan's predicted step, compute from the spec's FLOPs on the model's device."""
    from evenzero.cost.compute import estimate_profile
    from evenzero.cost.timeline import device_for, simulate

    profile = estimate_profile(spec, device_for(model))
    return [simulate(p, model, profile) for p in plans]


def bucket_numel_arg(text: str) -> int | str:
    """--bucket-numel: a number of elements or "auto"."""
    if text == "auto":
        return text
    try:
        return int_in(1, MAX_NUMEL, "2**63 - 1, torch's numel")(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e}; expected a number of elements or auto") from None


def _plot_path(flag: str, raw: str) -> Path:
    """The file --plot will write, checked before planning: matplotlib adds .png to a
    name without an extension, so we add it ourselves and report what was written."""
    path = output_path(flag, raw, default_suffix=".png")
    from evenzero.planview import image_formats

    formats = image_formats()
    if path.suffix[1:].lower() not in formats:
        raise UsageError(f"{flag} {path}: unknown image format {path.suffix!r}; use one of "
                         f"{', '.join('.' + f for f in sorted(formats))}")
    return path


def calibrate_hint(world_size: int) -> str:
    """The command that measures a cost model for `world_size` ranks, one that runs:
    `evenzero calibrate` spawns at most MAX_LOCAL_RANKS local processes."""
    if world_size <= MAX_LOCAL_RANKS:
        return (f"for numbers measured at this size run `evenzero calibrate --world-size "
                f"{world_size} --json FILE`")
    return (f"`evenzero calibrate` spawns at most {MAX_LOCAL_RANKS} local ranks: measure "
            f"{world_size} ranks under your launcher (`torchrun ... -m evenzero.cli calibrate "
            f"--json FILE` on every node), or calibrate the largest local size "
            f"(`evenzero calibrate --world-size {MAX_LOCAL_RANKS} --json FILE`) and the "
            f"model is extrapolated from it to {world_size}")


def load_model(name_or_path: str) -> ModelSpec:
    """A preset by name, else a JSON model file."""
    if name_or_path in PRESETS:
        return preset(name_or_path)
    if name_or_path and (name_or_path.endswith(".json") or Path(name_or_path).exists()):
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
            raise CostModelError(f"--cost-param {item!r}: expected KEY=V, e.g. "
                                 f"reduce.alpha_us=160 (see evenzero plan --help)")
        assignments[key.strip()] = _finite(item, value.strip())
    if assignments:
        model = model.with_params(assignments)
        why = ", ".join(x for x in (why, "overridden") if x)
    return model, why


def _finite(item: str, value: str) -> str:
    """Refuse nan, inf and overflowing numbers here: the cost model would price with them."""
    if len(value) > 40:
        raise CostModelError(f"--cost-param {item[:40]!r}...: value too long")
    try:
        number = float(value)
    except ValueError:
        return value  # not a number: a scaling name, or an error the cost model names
    if not math.isfinite(number):
        raise CostModelError(f"--cost-param {item!r}: {value!r} is not a finite number")
    return value
