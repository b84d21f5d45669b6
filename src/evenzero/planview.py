"""Plans for people: a comparison table (rich or Markdown) and a schedule plot.

The plot draws each strategy's backward collectives in issue order, one bar per call,
height = message size on a log scale, colour = destination rank of a reduce. DeepSpeed's
problem is then a glance: many bars of wildly different heights in many colours, where
evenzero has a few equal bars of one kind.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.table import Table

from evenzero.plan import BACKWARD, Plan
from evenzero.plan_report import PlanSummary

OP_SHORT = {"reduce": "reduce", "reduce_scatter": "RS", "all_reduce": "AR", "all_gather": "AG"}
COLUMNS = ("strategy", "backward calls", "msg min / median / max", "bytes/rank/step",
           "padding", "backward comm", "step comm", "grad mem/rank", "optim mem/rank")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def human_seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 10 else f"{s:.1f} s"


def table_rows(summaries: Sequence[PlanSummary]) -> list[tuple[str, ...]]:
    rows = []
    for s in summaries:
        m = s.cost.memory
        calls = " + ".join(f"{n} {OP_SHORT[op]}" for op, n in s.backward_ops) or "0"
        lo, mid, hi = s.message_bytes
        rows.append((
            s.strategy, calls,
            " / ".join(human_bytes(x) for x in (lo, mid, hi)),
            human_bytes(s.cost.bytes_per_rank),
            f"{s.padding:,} ({s.padding_fraction:.2%})",
            human_seconds(s.cost.backward_seconds),
            human_seconds(s.cost.step_seconds),
            f"{human_bytes(m.grad_bytes)} + {human_bytes(m.inflight_bytes)}",
            human_bytes(m.optimizer_bytes),
        ))
    return rows


def rich_table(title: str, summaries: Sequence[PlanSummary]) -> Table:
    table = Table(title=title, title_justify="left",
                  caption="grad mem = at rest + in flight; times are predictions, serial "
                          "on one stream", caption_justify="left")
    for i, col in enumerate(COLUMNS):
        table.add_column(col, justify="left" if i == 0 else "right", overflow="fold")
    for row in table_rows(summaries):
        table.add_row(*row)
    return table


def print_table(title: str, summaries: Sequence[PlanSummary], console: Console | None = None) -> None:
    # Piped output has no width; give the table room instead of folding every cell.
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    console.print(rich_table(title, summaries))
    for s in summaries:
        for note in s.notes:
            console.print(f"[dim]{s.strategy}: {note}[/dim]", highlight=False)


def markdown_table(title: str, summaries: Sequence[PlanSummary]) -> str:
    lines = [f"**{title}**", "", "| " + " | ".join(COLUMNS) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(COLUMNS))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(summaries)]
    return "\n".join(lines) + "\n"


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
        bars = ax.bar(range(len(calls)), [max(1, c.nbytes) for c in calls], color=colours,
                      width=0.8, edgecolor="black", linewidth=0.3 if len(calls) < 60 else 0)
        for bar, c in zip(bars, calls, strict=True):
            if c.group in expert:
                bar.set_hatch("//")
        ax.set_yscale("log")
        ax.set_ylim(*ylim)
        ax.set_xlim(-0.6, max(len(calls), 1) - 0.4)
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


__all__ = ["human_bytes", "markdown_table", "plot_schedules", "print_table", "rich_table",
           "table_rows"]
