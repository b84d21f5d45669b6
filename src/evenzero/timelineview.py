"""Step timelines for people: a comparison table and a Gantt chart, one lane per stream.

The table answers "how long is a step, and how much of the communication is left
exposed" per strategy; the chart shows why: the compute lane (forward, backward in
arrival order, copies into buckets, waits, the step's own work) above the comm lane (each
collective where it ran), so a reduction hidden behind backward, a bucket waiting
behind an incomplete one or a flush after backward can be seen at a glance.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from evenzero.cost.timeline import COMM, COMPUTE, Timeline
from evenzero.planview import human_seconds

COLUMNS = ("strategy", "forward", "backward", "exposed comm", "comm (hidden)", "after backward",
           "step time")
CAPTION = ("predicted: backward runs until its last reduction is done; exposed comm = step "
           "time - compute alone; after backward = step collectives + the step's own work "
           "(bookkeeping, norm, master copies, optimizer)")
COMPUTE_COLOURS = {"forward": "#9ecae1", "backward": "#3182bd", "copy": "#fd8d3c",
                   "wait": "#fcbba1", "bookkeeping": "#bcbddc", "norm": "#74c476",
                   "optimizer": "#31a354", "newton-schulz": "#006d2c", "host link": "#e6550d"}
COMM_COLOURS = {"reduce_scatter": "#636363", "reduce": "#756bb1", "all_reduce": "#bdbdbd",
                "all_gather": "#969696"}


def _ms(s: float) -> str:
    return human_seconds(s) if s >= 1e-3 else f"{s * 1e6:.0f} us"


def timeline_rows(timelines: Sequence[Timeline]) -> list[tuple[str, ...]]:
    return [(t.strategy, _ms(t.forward_end_s), _ms(t.backward_s), _ms(t.exposed_comm_s),
             f"{_ms(t.comm_s)} ({t.hidden_comm_s / t.comm_s:.0%})" if t.comm_s else "0",
             _ms(t.step_phase_s), _ms(t.total_s)) for t in timelines]


def print_timeline(title: str, timelines: Sequence[Timeline], notes: Sequence[str] = (),
                   console: Console | None = None) -> None:
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    table = Table(title=title, title_justify="left", caption=CAPTION, caption_justify="left")
    for i, col in enumerate(COLUMNS):
        table.add_column(col, justify="left" if i == 0 else "right")
    for row in timeline_rows(timelines):
        table.add_row(*row)
    console.print(table)
    for note in notes:
        console.print(f"[dim]{note}[/dim]", highlight=False)


def markdown_timeline(title: str, timelines: Sequence[Timeline], notes: Sequence[str] = ()) -> str:
    lines = [f"**{title}**", "", "| " + " | ".join(COLUMNS) + " |",
             "|" + "|".join("---" if i == 0 else "---:" for i in range(len(COLUMNS))) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in timeline_rows(timelines)]
    return "\n".join(lines + [""] + [f"- {n}" for n in notes]) + "\n"


def timeline_record(t: Timeline) -> dict[str, Any]:
    """The JSON record of one timeline (totals; the segments are for the plot)."""
    return {"cost_model": t.cost_model, "compute": t.compute_source,
            "forward_s": t.forward_end_s, "backward_s": t.backward_s,
            "exposed_comm_s": t.exposed_comm_s, "comm_s": t.comm_s,
            "after_backward_s": t.step_phase_s, "step_s": t.total_s}


def plot_timelines(timelines: Sequence[Timeline], path: str | Path, title: str = "") -> Path:
    """One panel per strategy, two lanes each (compute above comm), one time axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    path = Path(path)
    fig, axes = plt.subplots(len(timelines), 1, figsize=(12, 1.5 * len(timelines) + 1.0),
                             squeeze=False, sharex=True)
    scale = 1e3  # ms
    for ax, t in zip(axes[:, 0], timelines, strict=True):
        for lane, y, colours in ((COMPUTE, 1, COMPUTE_COLOURS), (COMM, 0, COMM_COLOURS)):
            by_kind: dict[str, list[tuple[float, float]]] = {}
            for s in t.segments:
                if s.lane == lane and s.end > s.start:
                    by_kind.setdefault(s.kind, []).append((s.start * scale, (s.end - s.start) * scale))
            for kind, bars in by_kind.items():
                ax.broken_barh(bars, (y - 0.4, 0.8), facecolors=colours.get(kind, "0.3"),
                               edgecolor="black", linewidth=0.2 if len(bars) < 200 else 0)
        ax.axvline(t.backward_end_s * scale, color="black", linewidth=0.6, linestyle=":")
        ax.set_yticks([0, 1], ["comm", "compute"])
        ax.set_ylim(-0.6, 1.6)
        ax.set_title(f"{t.strategy}: step {_ms(t.total_s)}, exposed comm {_ms(t.exposed_comm_s)}",
                     loc="left", fontsize=9)
    handles = [Patch(facecolor=c, edgecolor="black", label=k) for k, c in COMPUTE_COLOURS.items()]
    handles += [Patch(facecolor=c, edgecolor="black", label=k) for k, c in COMM_COLOURS.items()
                if any(s.kind == k for t in timelines for s in t.segments)]
    axes[0, 0].legend(handles=handles, fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0),
                      frameon=False)
    axes[-1, 0].set_xlabel("ms since the step began (dotted: backward's last reduction done)")
    if title:
        fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


__all__ = ["markdown_timeline", "plot_timelines", "print_timeline", "timeline_record",
           "timeline_rows"]
