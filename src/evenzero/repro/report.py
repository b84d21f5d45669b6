"""Tables and the plot for `evenzero repro`, from its JSON-ready report."""

from __future__ import annotations

import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from evenzero.cost import bytes_sent_per_rank
from evenzero.planview import human_bytes
from evenzero.repro.systems import BY_NAME, LOSS_CHECK_STEPS, LOSS_RTOL, is_exact, trains
from evenzero.repro.verdict import (
    CONFIDENCE,
    INCONCLUSIVE,
    MET,
    REFERENCE,
    Verdict,
    step_ratios,
    verdicts,
)

FULL_BENCHMARK = ('BENCHMARKS.md, "Seed case side by side" (this command, run twice back to '
                  'back) and "Defaults against DDP and FSDP2" '
                  '(`python benchmarks/defaults.py --cases seed`)')
"""Where the longer runs of this comparison are, with their commands."""
PHASE_LABELS = {"forward": "forward", "backward": "backward", "step": "step+zero_grad"}
RATIO_LABEL = "evenzero / this"
"""The one ratio the output shows, in the time table and in the verdicts: the median over
the steps both ran of evenzero's step time over the other system's in the same step."""


def print_report(report: dict[str, Any], console: Console | None = None) -> bool:
    """Print every table; True when the exact systems' losses agree."""
    # Wide tables: at 80 columns rich folds every cell; a narrow terminal wraps instead.
    console = console or Console(width=max(Console().width, 130))
    systems = report["systems"]
    config = report["config"]
    console.print(f"[bold]Seed model[/bold] ({report['numel_per_rank']:,} params per rank) on "
                  f"{report['world_size']} ranks, {report['backend']}; "
                  f"{config['steps']} measured steps, {config['warmup']} warm-up"
                  + (f", up to {config['max_steps']} while a verdict is open"
                     if config.get("max_steps", 0) > config["steps"] else ""))
    for s in report.get("skipped", []):
        # The reason holds an install hint with [brackets]: print it as text, not markup.
        console.print(f"[yellow]skipped {escape(s['name'])}[/yellow]: {escape(s['reason'])}")
    console.print(systems_table(systems))
    line = bucket_line(report)
    if line:
        console.print(line, highlight=False)
    console.print(collectives_table(systems))
    console.print(f"  {collectives_legend(systems, report['numel_per_rank'])} Captured in one "
                  f"more, untimed step per system. DDP's C++ reducer calls the process group "
                  f"directly, so for that step DDP reduces through the stock allreduce_hook (the "
                  f"same buckets); its timed steps use the reducer itself.", highlight=False)
    seed = next((s for s in systems if s["name"] == "deepspeed-0.6-schedule"), None)
    if seed is not None:
        console.print(seed_table(seed, report["numel_per_rank"]))
        console.print("  The report lists 13 rows and no gate: its DeepSpeed re-cast the gate weight "
                      "to fp32 in forward, which orphaned ZeRO's hook, so the gate's gradient was "
                      "never reduced. evenzero's runtime hooks every parameter and checks that each "
                      "gradient arrived, so the same schedule has a 14th row for the gate.")
    console.print(time_table(systems))
    console.print(f"  {RATIO_LABEL}: the median, over the steps both ran, of evenzero's whole "
                  f"step over this system's in the same step (under 1: evenzero is faster); the "
                  f"verdicts below use the same ratio. steps: measured steps (the systems whose "
                  f"verdict was still open ran more).", highlight=False)
    console.print(loss_table(systems))
    ok, lines = loss_agreement(systems)
    for line in lines:
        console.print(line)
    for line in target_lines(systems, report["world_size"]):
        console.print(line, highlight=False)
    return ok


def titled(title: str, caption: str | None = None) -> Table:
    """A table at least as wide as its title and caption, so that neither wraps
    mid-phrase (rich wraps both to the table's width)."""
    return Table(title=title, caption=caption,
                 min_width=max(len(title), len(caption or "")) + 4)


def condensed(values: list[int]) -> str:
    """'3 x 252,250, 1,000' for runs of equal values, in order."""
    out: list[str] = []
    i = 0
    while i < len(values):
        j = i
        while j < len(values) and values[j] == values[i]:
            j += 1
        out.append(f"{j - i} x {values[i]:,}" if j - i > 1 else f"{values[i]:,}")
        i = j
    return ", ".join(out)


def systems_table(systems: list[dict]) -> Table:
    t = titled("The systems, each training its own copy of the model on the same batches")
    t.add_column("system")
    t.add_column("what it is")
    for s in systems:
        entry = BY_NAME.get(s["name"])
        t.add_row(escape(s["name"]), escape(entry.describe if entry else "-"))
    return t


def bucket_line(report: dict[str, Any]) -> str | None:
    """Which bucket size evenzero ran, and why (its plan's note)."""
    bucket = report.get("bucket")
    if not bucket:
        return None
    size = f"{bucket['numel']:,} elements" if bucket["numel"] else "one bucket per group"
    if bucket["requested"] == "auto":
        what = (f"evenzero's bucket size: the library's default, \"auto\", which ran "
                f"{size} ({bucket['buckets']} buckets)")
        if report["config"]["warmup"] < 2:  # refined at the end of the second backward
            what += (" (refined in a measured step, whose time includes it; --warmup 2 or "
                     "more keeps it out)")
    else:
        what = (f"evenzero's bucket size: {bucket['requested']:,} elements, fixed by "
                f"--bucket-numel ({bucket['buckets']} buckets)")
    return f"{what}. Its plan's note: {escape(bucket['note'])}"


def collectives_legend(systems: list[dict], numel_per_rank: int) -> str:
    """How to read the collectives table, with each system's padding."""
    text = ("ops: count and collective / ranks in its group (reduce_scatter/8: a reduce-scatter "
            "over 8 ranks). roots: each reduce's destination rank, in issue order. elements: "
            "the sum of the messages")
    padded = [(s["name"], sum(c["numel"] for c in s["backward_collectives"]) - numel_per_rank)
              for s in systems]
    padded = [(name, extra) for name, extra in padded if extra > 0]
    if padded:
        text += ("; " + ", ".join(f"{escape(name)}'s include {extra:,} elements of padding"
                                  for name, extra in padded)
                 + f" beyond the model's {numel_per_rank:,} (each bucket is padded so that it "
                   f"splits into equal, aligned shards)")
    return text + "."


def collectives_table(systems: list[dict]) -> Table:
    t = titled("Backward collectives each system issued (captured at run time)")
    for col in ("system", "calls", "ops", "message sizes (elements)", "roots", "elements"):
        t.add_column(col, justify="right" if col in ("calls", "elements") else "left")
    for s in systems:
        calls = s["backward_collectives"]
        ops = Counter(f"{c['op']}/{c['group_size']}" for c in calls)
        roots = [c["root"] for c in calls if c["root"] is not None]
        t.add_row(escape(s["name"]), str(len(calls)),
                  ", ".join(f"{n} {op}" for op, n in ops.items()) or "-",
                  condensed([c["numel"] for c in calls]) or "-",
                  " ".join(map(str, roots)) or "-",
                  f"{sum(c['numel'] for c in calls):,}")
    return t


def seed_rows(system: dict) -> list[tuple[int, int, int, str]]:
    """(dst, bucket offset, numel, group) of each reduce, in issue order."""
    return [(c["root"], c["offset"], c["numel"], c["group"])
            for c in system["backward_collectives"] if c["op"] == "reduce"]


def seed_table(system: dict, numel_per_rank: int) -> Table:
    rows = seed_rows(system)
    total = sum(r[2] for r in rows)
    t = titled("Seed table: DeepSpeed 0.6's reduces in evenzero's runtime, by destination",
               f"{len(rows)} reduces, {total:,} of {numel_per_rank:,} elements")
    for col in ("#", "(dst, offset, numel)", "group", "issued"):
        t.add_column(col)
    order = sorted(range(len(rows)), key=lambda i: (rows[i][0], rows[i][1]))
    gate_offset = max((r[1] for r in rows), default=0)
    for k, i in enumerate(order, 1):
        dst, off, n, group = rows[i]
        mark = "  <- gate (missing in the report)" if off == gate_offset and group == "dense" else ""
        t.add_row(str(k), f"({dst},{off},{n}){mark}", group, f"#{i + 1}")
    return t


def time_table(systems: list[dict]) -> Table:
    t = titled("Step time by phase, ms: slowest rank, median over the measured steps",
               "whole step = forward + backward + step on each rank, slowest rank per step; "
               "ddp is DDP's C++ reducer")
    cols = ["system", "steps", *PHASE_LABELS.values(), "whole step", "min-max", RATIO_LABEL]
    for col in cols:
        t.add_column(col, justify="left" if col == "system" else "right")
    ref = next((s for s in systems if s["name"] == REFERENCE), None)
    for s in systems:
        ms = s["step_ms"]
        phases = s.get("median_phase_ms", {})
        t.add_row(escape(s["name"]), str(len(ms)),
                  *(f"{phases[p]:.1f}" if p in phases else "-" for p in PHASE_LABELS),
                  f"{s['median_step_ms']:.1f}", f"{min(ms):.0f}-{max(ms):.0f}",
                  _ratio_cell(ref, s))
    return t


def _ratio_cell(ref: dict | None, system: dict) -> str:
    if ref is None:
        return "-"
    ratios = step_ratios(ref["step_ms"], system["step_ms"])
    return f"{statistics.median(ratios):.2f}" if ratios else "-"


def common_steps(systems: list[dict]) -> int:
    """Steps every training system ran (warm-up included): the later ones ran for the
    systems whose verdict stayed open only."""
    trained = [s for s in systems if trains(s["name"])]
    return min((len(s["losses"]) for s in trained), default=0)


def loss_table(systems: list[dict]) -> Table:
    trained = [s for s in systems if trains(s["name"])]
    left_out = [s["name"] for s in systems if not trains(s["name"])]
    steps = common_steps(systems)
    longer = [s["name"] for s in trained if len(s["losses"]) > steps]
    notes = []
    if left_out:
        notes.append(f"not shown: {', '.join(left_out)} (does not update the model's weights)")
    if longer:
        notes.append(f"the later steps of {', '.join(longer)} are in --json")
    t = titled("Loss per step (mean over ranks; warm-up steps included)",
               "; ".join(notes) or None)
    t.add_column("step", justify="right")
    for s in trained:
        t.add_column(escape(s["name"]), justify="right")
    for i in range(steps):
        t.add_row(str(i), *(f"{s['losses'][i]:.7f}" for s in trained))
    return t


def max_rel_diff(a: list[float], b: list[float]) -> float:
    return max((abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b, strict=False)),
               default=0.0)


def loss_agreement(systems: list[dict]) -> tuple[bool, list[str]]:
    by_name = {s["name"]: s for s in systems}
    ref = by_name.get(REFERENCE)
    if ref is None:
        return True, ["losses: evenzero not run, nothing to compare against"]
    ok, lines = True, []
    first, last = ref["losses"][0], ref["losses"][-1]
    lines.append(f"evenzero's loss went from {first:.4f} to {last:.4f} over "
                 f"{len(ref['losses'])} steps ({'falling: it trains' if last < first else 'not falling'})")
    for s in systems:
        if s["name"] == REFERENCE or not trains(s["name"]):
            continue
        checked = min(len(s["losses"]), len(ref["losses"]), LOSS_CHECK_STEPS)
        diff = max_rel_diff(s["losses"][:checked], ref["losses"][:checked])
        first_diff = max_rel_diff(s["losses"][:1], ref["losses"][:1])
        if is_exact(s["name"]):
            passed = diff <= LOSS_RTOL
            ok &= passed
            verdict = "[green]PASS[/green]" if passed else "[red]FAIL[/red]"
            lines.append(f"losses {escape(s['name'])} vs evenzero: max relative difference {diff:.2e} "
                         f"over the first {checked} steps (limit {LOSS_RTOL:.0e}) {verdict}")
        else:
            entry = BY_NAME.get(s["name"])
            why = ("DeepSpeed's own MoE layer, gate set to match ours" if entry is None
                   or entry.kind == "deepspeed" else f"not the same math: {entry.describe}")
            lines.append(f"losses {escape(s['name'])} vs evenzero: first step {first_diff:.2e}, "
                         f"first {checked} steps {diff:.2e} ({escape(why)}; informational)")
    return ok, lines


PEER_LABELS = {"ddp": "DDP's C++ reducer", "deepspeed": "real DeepSpeed ZeRO-2, default config"}


def target_lines(systems: list[dict], world_size: int) -> list[str]:
    """Per target: its verdict with the ratio and its interval; then how to read them and
    where the longer runs are."""
    found = verdicts({s["name"]: s["step_ms"] for s in systems})
    lines = [verdict_line(v) for v in found]
    if lines:
        most = max(len(s["step_ms"]) for s in systems)
        lines.append(
            f"How to read: in every step the systems ran back to back on the same batch; "
            f"{RATIO_LABEL} is evenzero's step time over the other's in that step, and its "
            f"median over the steps is the number above. 'met' needs the whole "
            f"{CONFIDENCE:.0%} confidence interval of that median at or under the target, "
            f"'missed' all of it above; otherwise this run's noise cannot tell. An open "
            f"verdict was measured further (evenzero and that system only, here up to {most} "
            f"steps; --max-steps). One run on {world_size} ranks sharing this machine's cores; "
            f"the longer runs: {escape(FULL_BENCHMARK)}.")
    return lines


def verdict_line(v: Verdict) -> str:
    what = PEER_LABELS.get(v.peer, v.peer)
    if v.low == v.low:  # not nan
        interval = f"{CONFIDENCE:.0%} interval {v.low:.2f}-{v.high:.2f}"
    else:
        interval = f"too few steps for a {CONFIDENCE:.0%} interval (8 or more)"
    word = {MET: "[green]met[/green]", INCONCLUSIVE: "[yellow]inconclusive: the spread "
            "crosses the target[/yellow]"}.get(v.word, "[red]missed[/red]")
    return (f"target evenzero <= {v.target:.1f} x {v.peer} ({what}): {v.median:.2f} x, the "
            f"median of {v.steps} per-step ratios of forward+backward+step (slowest rank), "
            f"{interval}: {word}")


OP_MARKERS = {"reduce_scatter": "o", "reduce": "v", "all_reduce": "s", "all_gather": "^"}
OP_LABELS = {"reduce_scatter": "reduce-scatter: sends (n-1)/n x size",
             "reduce": "reduce: sends 1 x size",
             "all_reduce": "all-reduce: sends 2(n-1)/n x size",
             "all_gather": "all-gather: sends (n-1)/n x size"}


def sent_bytes(system: dict) -> float:
    """Bytes one rank sends in the system's backward collectives (ring algorithms)."""
    return sum(bytes_sent_per_rank(c["op"], c["group_size"], c["numel"] * c.get("itemsize", 4))
               for c in system["backward_collectives"])


def system_label(system: dict) -> str:
    calls = system["backward_collectives"]
    ops = Counter(c["op"] for c in calls)
    kinds = ", ".join(f"{n} {op.replace('_', '-')}" for op, n in ops.items())
    return f"{system['name']}: {kinds or 'no calls'}, {human_bytes(sent_bytes(system))}"


def plot(report: dict[str, Any], path: Path) -> None:
    """Two panels: message size per backward call, and median step time per system."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    systems = report["systems"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    # Colour = system, marker = collective type: fewer calls is not better when each call
    # is an all-reduce that sends twice what a reduce-scatter of the same size sends.
    for k, s in enumerate(systems):
        calls = s["backward_collectives"]
        # Dodge the systems a little so that equal schedules do not hide each other.
        shift = 0.08 * (k - (len(systems) - 1) / 2)
        x = [i + 1 + shift for i in range(len(calls))]
        colour = f"C{k % 10}"
        left.plot(x, [c["numel"] for c in calls], color=colour, linestyle="-", linewidth=1)
        for op, marker in OP_MARKERS.items():
            mine = [(i, c["numel"]) for i, c in zip(x, calls, strict=True) if c["op"] == op]
            if mine:
                left.scatter(*zip(*mine, strict=True), marker=marker, color=colour, s=36,
                             zorder=3, edgecolors="black", linewidths=0.4)
    left.set_yscale("log")
    left.set_xlabel("backward collective, in issue order")
    left.set_ylabel("message size (elements)")
    left.set_title(f"Backward messages, seed model, {report['world_size']} ranks")
    system_handles = [Line2D([], [], color=f"C{k % 10}", label=system_label(s))
                      for k, s in enumerate(systems)]
    used = {c["op"] for s in systems for c in s["backward_collectives"]}
    op_handles = [Line2D([], [], color="0.4", marker=m, linestyle="", markeredgecolor="black",
                         label=OP_LABELS[op]) for op, m in OP_MARKERS.items() if op in used]
    first = left.legend(handles=system_handles, fontsize=8, loc="upper left",
                        bbox_to_anchor=(0.0, -0.14), frameon=False,
                        title="system: backward calls, bytes each rank sends", title_fontsize=8)
    left.add_artist(first)
    left.legend(handles=op_handles, fontsize=8, loc="upper right", bbox_to_anchor=(1.0, -0.14),
                frameon=False, title="marker = collective", title_fontsize=8)
    left.grid(True, which="both", alpha=0.3)
    names = [s["name"] for s in systems]
    med = [s["median_step_ms"] for s in systems]
    lo = [m - min(s["step_ms"]) for m, s in zip(med, systems, strict=True)]
    hi = [max(s["step_ms"]) - m for m, s in zip(med, systems, strict=True)]
    bars = right.bar(range(len(names)), med, yerr=[lo, hi], capsize=4,
                     color=["C0" if n == REFERENCE else "C7" for n in names])
    right.bar_label(bars, labels=[f"{m:.0f}" for m in med], padding=2, fontsize=8)
    right.set_xticks(range(len(names)), names, rotation=20, ha="right", fontsize=8)
    right.set_ylabel("forward+backward+step, ms (median, min-max)")
    right.set_title(f"Step time ({report['backend']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")  # the legends sit below the axes
    plt.close(fig)
