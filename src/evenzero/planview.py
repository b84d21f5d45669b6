"""Plans for people: a comparison table (rich or Markdown) and a schedule plot.

The plot draws each strategy's backward collectives in issue order, one bar per call,
height = message size on a log scale, colour = destination rank of a reduce. DeepSpeed's
problem is then a glance: many bars of wildly different heights in many colours, where
evenzero has a few equal bars of one kind.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rich import box
from rich.console import Console
from rich.markup import escape
from rich.measure import Measurement
from rich.table import Table

from evenzero.plan import BACKWARD, Plan
from evenzero.plan_report import PlanSummary

OP_SHORT = {"reduce": "reduce", "reduce_scatter": "RS", "all_reduce": "AR", "all_gather": "AG"}
MAX_BARS = 2000
"""Above this many calls in a panel, the plot draws lines instead of bar patches."""
MIN_COLUMNS = 3
"""A table never drops below strategy, backward calls and message sizes."""


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 10 else f"{s:.1f} s"


def short_bytes(n: float) -> str:
    """A one-letter binary unit, one decimal below 100: 3.9K, 985K, 15.3M, 1.6G."""
    for unit in ("B", "K", "M", "G", "T", "P"):
        if abs(n) < 999.5 or unit == "P":
            return f"{n:.0f}{unit}" if unit == "B" or abs(n) >= 99.95 else f"{n:.1f}{unit}"
        n /= 1024
    raise AssertionError("unreachable")


def short_seconds(s: float) -> str:
    ms = s * 1e3
    if ms < 9.995:
        return f"{ms:.2f}ms"
    return f"{ms:.0f}ms" if ms < 999.5 else f"{s:.2f}s" if s < 9.995 else f"{s:.1f}s"


@dataclass(frozen=True)
class Column:
    """One column of the comparison table, in a full and a compact form."""

    header: str
    """Header of the full table and of Markdown."""
    short: str
    """Header of the compact table (may break over two lines)."""
    priority: int
    """Narrow terminals drop the highest numbers first."""
    full: Callable[[PlanSummary], str]
    compact: Callable[[PlanSummary], str]


def _calls(s: PlanSummary, sep: str = " + ", space: str = " ") -> str:
    return sep.join(f"{n}{space}{OP_SHORT[op]}" for op, n in s.backward_ops) or "0"


COLUMNS = (
    Column("strategy", "strategy", 0, lambda s: s.strategy, lambda s: s.strategy),
    Column("backward calls", "backward\ncalls", 1, _calls, lambda s: _calls(s, "+")),
    Column("msg min / median / max", "message\nmin/med/max", 2,
           lambda s: " / ".join(human_bytes(x) for x in s.message_bytes),
           lambda s: "/".join(short_bytes(x) for x in s.message_bytes)),
    Column("bytes/rank/step", "bytes/rank\n/step", 6,
           lambda s: human_bytes(s.cost.bytes_per_rank),
           lambda s: short_bytes(s.cost.bytes_per_rank)),
    Column("padding", "padding", 8, lambda s: f"{s.padding:,} ({s.padding_fraction:.2%})",
           lambda s: f"{s.padding_fraction:.2%}"),
    Column("backward comm", "backward\ncomm", 3,
           lambda s: human_seconds(s.cost.backward_seconds),
           lambda s: short_seconds(s.cost.backward_seconds)),
    Column("step comm", "step\ncomm", 5, lambda s: human_seconds(s.cost.step_seconds),
           lambda s: short_seconds(s.cost.step_seconds)),
    Column("grad mem/rank", "grad mem\n/rank", 4,
           lambda s: f"{human_bytes(s.cost.memory.grad_bytes)} + "
                     f"{human_bytes(s.cost.memory.inflight_bytes)}"
                     + (f" + {human_bytes(s.cost.memory.residual_bytes)} residual"
                        if s.cost.memory.residual_bytes else ""),
           lambda s: f"{short_bytes(s.cost.memory.grad_bytes)}+"
                     f"{short_bytes(s.cost.memory.inflight_bytes)}"
                     + (f"+{short_bytes(s.cost.memory.residual_bytes)}"
                        if s.cost.memory.residual_bytes else "")),
    Column("optim mem/rank", "optim\nmem/rank", 7,
           lambda s: human_bytes(s.cost.memory.optimizer_bytes),
           lambda s: short_bytes(s.cost.memory.optimizer_bytes)),
)
CAPTION = "grad mem = at rest + in flight; times are predictions, serial on one stream"


def table_rows(summaries: Sequence[PlanSummary]) -> list[tuple[str, ...]]:
    """Every column in full, for Markdown and the wide table."""
    return [tuple(c.full(s) for c in COLUMNS) for s in summaries]


def rich_table(title: str, summaries: Sequence[PlanSummary],
               columns: Sequence[Column] = COLUMNS, compact: bool = False) -> Table:
    """The comparison table with `columns`, full or compact."""
    caption = CAPTION
    if compact:
        caption += "; K/M/G = KiB/MiB/GiB"
    hidden = [c.header for c in COLUMNS if c not in columns]
    if hidden:
        caption += (f"; left out at this width: {', '.join(hidden)} (widen the terminal, or "
                    f"use --markdown or --json)")
    table = Table(title=escape(title), title_justify="left", caption=caption,
                  caption_justify="left", box=box.SIMPLE_HEAD if compact else box.HEAVY_HEAD,
                  pad_edge=not compact)
    for col in columns:
        table.add_column(col.short if compact else col.header, no_wrap=True,
                         justify="left" if col.priority == 0 else "right")
    for s in summaries:
        table.add_row(*(escape(col.compact(s) if compact else col.full(s)) for col in columns))
    return table


def fitted_table(title: str, summaries: Sequence[PlanSummary], width: int) -> Table:
    """The richest table no wider than `width`: as many columns as fit (dropping the
    highest priority numbers first), in full cells if they fit, else compact ones."""
    console = Console(width=max(width, 1), file=io.StringIO())
    ranked = sorted(COLUMNS, key=lambda c: c.priority)
    table = rich_table(title, summaries)
    for keep in range(len(COLUMNS), MIN_COLUMNS - 1, -1):
        for compact in (False, True):
            kept = {c.header for c in ranked[:keep]}
            table = rich_table(title, summaries, [c for c in COLUMNS if c.header in kept],
                               compact)
            natural = Measurement.get(console, console.options.update_width(10**6), table)
            if natural.maximum <= width:
                return table
    return table  # narrower than three columns: rich folds what it must


def table_width(stream=None) -> int | None:
    """Width to lay the table out for: the terminal's (or $COLUMNS); None lets rich ask.
    Piped output has no width, so it gets room for the full table."""
    stream = stream or sys.stdout
    if os.environ.get("COLUMNS") or stream.isatty():
        return None
    return 200


def print_table(title: str, summaries: Sequence[PlanSummary], console: Console | None = None) -> None:
    console = console or Console(width=table_width())
    console.print(fitted_table(title, summaries, console.width))
    for s in summaries:
        for note in s.notes:
            console.print(f"[dim]{escape(s.strategy)}: {escape(note)}[/dim]", highlight=False)


def markdown_table(title: str, summaries: Sequence[PlanSummary]) -> str:
    lines = [f"**{title}**", "", "| " + " | ".join(c.header for c in COLUMNS) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(COLUMNS))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(summaries)]
    return "\n".join(lines) + "\n"


def image_formats() -> set[str]:
    """File extensions (no dot) the plot can be saved as."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib.backend_bases import FigureCanvasBase

    return set(FigureCanvasBase.get_supported_filetypes())


def plot_schedules(plans: Sequence[tuple[Plan, PlanSummary]], path: str | Path,
                   title: str = "") -> Path:
    """One panel per strategy: backward message size per call, coloured by root."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch
    from matplotlib.ticker import MaxNLocator

    path = Path(path)
    fig, axes = plt.subplots(len(plans), 1, figsize=(11, 2.3 * len(plans) + 0.8), squeeze=False)
    largest_group = max((g.size for p, _ in plans for g in p.groups), default=1)
    # Distinct colours for up to 10 roots, none of them grey (grey marks rootless ops).
    palette = [plt.get_cmap("tab10")(i) for i in (0, 1, 2, 3, 4, 5, 6, 8, 9)] + ["#000080"]
    ramp = plt.get_cmap("turbo")

    def root_colour(root: int, group_size: int):
        return palette[root % 10] if largest_group <= 10 else ramp(root / max(1, group_size - 1))

    non_rooted = {"reduce_scatter": "0.4", "all_reduce": "0.75", "all_gather": "0.55"}
    sizes = [c.nbytes for p, _ in plans for c in p.collectives if c.phase == BACKWARD]
    # One y-range for every panel, so that bar heights compare across strategies.
    ylim = (max(1, min(sizes, default=1)) / 2, max(sizes, default=2) * 2)
    for ax, (plan, summary) in zip(axes[:, 0], plans, strict=True):
        calls = [c for c in plan.collectives if c.phase == BACKWARD]
        expert = {g.name for g in plan.groups if g.expert_parallel_size > 1}
        colours = [root_colour(c.root, c.group_size) if c.root is not None
                   else non_rooted.get(c.op, "0.3") for c in calls]
        heights = [max(1, c.nbytes) for c in calls]
        ax.set_yscale("log")
        if len(calls) <= MAX_BARS:
            bars = ax.bar(range(len(calls)), heights, color=colours, width=0.8,
                          edgecolor="black", linewidth=0.3 if len(calls) < 60 else 0)
            for bar, c in zip(bars, calls, strict=True):
                if c.group in expert:
                    bar.set_hatch("//")
        else:  # one line per call in a single collection: bars would take minutes and GBs
            ax.vlines(range(len(calls)), ylim[0], heights, colors=colours, linewidth=0.5)
        ax.set_ylim(*ylim)
        ax.set_xlim(-0.6, max(len(calls), 1) - 0.4)
        if len(calls) <= 10:
            ax.set_xticks(range(len(calls)))
        else:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_ylabel("bytes")
        ax.set_title(f"{plan.strategy}: {summary.backward_calls} backward calls, "
                     f"{human_seconds(summary.cost.backward_seconds)} predicted "
                     f"({summary.cost.cost_model})", loc="left", fontsize=10)
        ax.grid(axis="y", which="major", alpha=0.3)
        handles = [Patch(facecolor=non_rooted[op], edgecolor="black", label=f"{op} (all ranks)")
                   for op in non_rooted if any(c.op == op for c in calls)]
        roots = sorted({c.root for c in calls if c.root is not None})
        if roots and largest_group <= 10:
            handles += [Patch(facecolor=root_colour(r, 1), label=f"reduce -> rank {r}")
                        for r in roots]
        elif roots:
            handles.append(Patch(facecolor=ramp(0.5), label=f"reduce, colour = root "
                                 f"(0..{largest_group - 1})"))
        if any(c.group in expert for c in calls):
            handles.append(Patch(facecolor="white", edgecolor="black", hatch="//",
                                 label="expert group"))
        if handles:
            ax.legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                      frameon=False)
    axes[-1, 0].set_xlabel("backward collective, in issue order")
    if title:
        fig.suptitle(title, fontsize=11, x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["COLUMNS", "fitted_table", "human_bytes", "image_formats", "markdown_table",
           "plot_schedules", "print_table", "rich_table", "table_rows"]
