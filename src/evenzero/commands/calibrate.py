"""`evenzero calibrate`: measure alpha and bus bandwidth per collective on this machine.

    evenzero calibrate --world-size W [--sizes N ...] [--repeats R] [--json FILE]

Spawns W local gloo ranks, or under torchrun measures the launcher's world. The fitted
cost model feeds `evenzero plan --cost FILE`.
"""

from __future__ import annotations

import argparse
import json
import logging
import os

from evenzero.commands import (
    MAX_LOCAL_RANKS,
    CommandError,
    UsageError,
    int_in,
    output_path,
    write_failed,
)
from evenzero.commands.heartbeat import Heartbeat
from evenzero.cost.model import CostModel
from evenzero.plan import OPTIMIZER_IMPLS

MAX_SIZE = 2**28
"""Largest message swept, in fp32 elements (1 GiB per buffer per rank)."""
MAX_REPEATS = 1000


def add_arguments(c: argparse.ArgumentParser) -> None:
    c.add_argument("--world-size", type=int_in(2, MAX_LOCAL_RANKS, "local processes"),
                   metavar="W",
                   help=f"local gloo ranks to spawn (2 to {MAX_LOCAL_RANKS}); under torchrun "
                        f"omit it or match WORLD_SIZE")
    c.add_argument("--sizes", type=int_in(1, MAX_SIZE, "1 GiB of fp32 per buffer"), nargs="+",
                   metavar="N", help="message sizes to sweep, in elements (fp32)")
    c.add_argument("--repeats", type=int_in(1, MAX_REPEATS), default=5,
                   help="calls timed per size (fastest kept)")
    c.add_argument("--json", metavar="FILE", help="save the fitted cost model here")


def main(args: argparse.Namespace) -> int:
    from evenzero import calibration as calibrate

    sizes = args.sizes or calibrate.DEFAULT_SIZES
    json_path = output_path("--json", args.json) if args.json else None
    try:
        calibrate.check_sweep(sizes, args.repeats)
    except calibrate.CalibrationError as e:
        raise UsageError(str(e)) from None
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        launched = _launcher_world_size()
        if args.world_size is not None and args.world_size != launched:
            raise UsageError(f"--world-size {args.world_size} disagrees with WORLD_SIZE="
                             f"{launched} from the launcher; drop --world-size")
        if os.environ["RANK"] == "0":
            with Heartbeat(f"calibrating {launched} ranks: "
                           f"{_what(launched, sizes, args.repeats)}"):
                result = calibrate.run_from_env(sizes, args.repeats)
        else:
            result = calibrate.run_from_env(sizes, args.repeats)
        if result is None:  # only rank 0 reports
            return 0
    else:
        if args.world_size is None:
            raise UsageError("evenzero calibrate: --world-size W is required outside torchrun")
        # torch logs "Terminating process ..." for the ranks it stops after one failed;
        # the failure itself is reported below, in one line.
        logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
        try:
            with Heartbeat(f"calibrating {args.world_size} local gloo ranks (each starts "
                           f"its own torch): {_what(args.world_size, sizes, args.repeats)}"):
                result = calibrate.run_local(args.world_size, sizes, args.repeats)
        except calibrate.CalibrationError as e:
            raise CommandError(str(e)) from None
        except Exception as e:  # a worker failed: show its last line, not a spawn traceback
            last = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
            raise CommandError(f"a calibration rank failed: {last}") from None
    model, samples = result
    _print_calibration(model, samples)
    if json_path is not None:
        try:
            json_path.write_text(json.dumps(model.to_json(), indent=2) + "\n")
        except OSError as e:
            raise write_failed("--json", json_path, e) from None
        print(f"wrote {json_path}; use it with: evenzero plan MODEL --world-size W "
              f"--cost {json_path}")
    return 0


def _what(world_size: int, sizes, repeats: int) -> str:
    """The measurement in one line, so that a wait of a minute says what it waits for."""
    from evenzero.calibration import default_group_sizes
    from evenzero.cost import OPS

    groups = default_group_sizes(world_size)
    return (f"measuring {len(OPS)} collectives x {len(sizes)} sizes x {repeats} calls on "
            f"group size(s) {', '.join(map(str, groups))}, then this host's compute "
            f"(matmul, copy, AdamW step)")


def _launcher_world_size() -> int:
    raw = os.environ["WORLD_SIZE"]
    try:
        return int_in(1)(raw)
    except argparse.ArgumentTypeError as e:
        raise UsageError(f"WORLD_SIZE={raw[:20]!r} from the environment: {e}") from None


def _print_calibration(model: CostModel, samples) -> None:
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from evenzero.planview import human_bytes

    table = Table(title=escape(f"{model.name}: {model.description}"), title_justify="left")
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
                      f"GB/s copy; beside a collective compute runs at "
                      f"{1 / (1 + c.comm_slowdown):.0%} of its speed alone, and a collective "
                      f"beside compute at {1 / (1 + c.collective_slowdown):.0%}",
                      highlight=False)
        impls = ", ".join(f"{impl} {c.optimizer_bytes(impl):.0f}" for impl in OPTIMIZER_IMPLS)
        console.print(f"step per rank: AdamW {impls} B/element (default {c.default_optimizer_impl}); "
                      f"norm fp32 {c.norm_fp32_bytes_per_element:.1f}, fp64 "
                      f"{c.norm_fp64_bytes_per_element:.1f} B/element; "
                      f"{c.tensor_overhead_us:.0f} us per tensor of a single-tensor step, "
                      f"{c.param_overhead_us:.1f} us per parameter visit", highlight=False)
