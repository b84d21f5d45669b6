"""The plan table fits the terminal; the plot copes with plans of many calls."""

from __future__ import annotations

import io
import re

import pytest
from rich.console import Console

from evenzero import cli
from evenzero.cost import predict
from evenzero.cost.presets import PRESETS
from evenzero.model_presets import preset
from evenzero.plan_report import summarize
from evenzero.planview import COLUMNS, MAX_BARS, plot_schedules, print_table
from evenzero.strategies import STRATEGY_NAMES, plan


def results(name: str, world_size: int, strategies=STRATEGY_NAMES):
    spec = preset(name)
    cost = PRESETS["h100-ndr-ib"]
    return [(p, summarize(p, predict(p, cost))) for p in
            (plan(spec, world_size, s) for s in strategies)]


def rendered(name: str, world_size: int, width: int) -> list[str]:
    buffer = io.StringIO()
    print_table(f"{name} on {world_size} ranks", [s for _, s in results(name, world_size)],
                Console(width=width, file=buffer, color_system=None))
    return buffer.getvalue().splitlines()


def rows(lines: list[str]) -> dict[str, str]:
    """strategy -> its table row; every strategy must have exactly one."""
    out: dict[str, str] = {}
    for line in lines:
        words = line.replace("│", " ").split()
        if words and words[0] in STRATEGY_NAMES and not re.match(r"^\S+:", line):
            assert words[0] not in out, f"{words[0]} folded over two lines"
            out[words[0]] = line
    return out


@pytest.mark.parametrize("name, world_size", [("seed-moe-gate-lost", 8), ("llama-70b", 1024)])
def test_table_fits_80_columns_and_keeps_what_matters(name, world_size):
    lines = rendered(name, world_size, 80)
    assert max(len(line) for line in lines) <= 80
    table = rows(lines)
    assert set(table) == set(STRATEGY_NAMES)
    text = "\n".join(lines)
    for header in ("backward", "calls", "min/med/max", "comm"):
        assert header in text
    assert "left out at this width:" in text and "--markdown" in text
    if name == "seed-moe-gate-lost":
        assert "13 reduce" in table["deepspeed-0.6"] and "3.9K/985K/15.3M" in table["deepspeed-0.6"]
        assert re.search(r"\b\d+ RS\b", table["evenzero"])


def test_table_at_200_columns_has_every_column_in_full():
    lines = rendered("seed-moe-gate-lost", 8, 200)
    assert max(len(line) for line in lines) <= 200
    header = next(line for line in lines if "strategy" in line)
    assert all(c.header in header for c in COLUMNS)
    assert "left out" not in "\n".join(lines)
    assert "3.9 KiB / 985.4 KiB / 15.3 MiB" in rows(lines)["deepspeed-0.6"]


def test_cli_table_follows_columns(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    assert cli.main(["plan", "gpt2-xl", "--world-size", "128"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert max(len(line) for line in lines) <= 80 and set(rows(lines)) == set(STRATEGY_NAMES)
    monkeypatch.delenv("COLUMNS")  # piped, no COLUMNS: room for the full table
    assert cli.main(["plan", "gpt2-xl", "--world-size", "128", "--strategy", "evenzero"]) == 0
    out = capsys.readouterr().out
    assert all(c.header in out for c in COLUMNS), out


def test_plot_of_a_plan_with_many_calls_draws_lines(tmp_path, monkeypatch):
    # deepspeed-0.6 on llama-7b over 4096 ranks issues thousands of reduces. A bar patch
    # per call took 69 s and 1.5 GB at 131,072 ranks; one line collection takes seconds.
    from matplotlib.axes import Axes

    drawn: dict[str, list[int]] = {"bar": [], "vlines": []}
    for name in drawn:
        original = getattr(Axes, name)

        def counting(self, x, *args, _original=original, _name=name, **kwargs):
            drawn[_name].append(len(x))
            return _original(self, x, *args, **kwargs)

        monkeypatch.setattr(Axes, name, counting)
    many = results("llama-7b", 4096, ("deepspeed-0.6", "evenzero"))
    assert many[0][1].backward_calls > MAX_BARS
    out = plot_schedules(many, tmp_path / "many.png", "many")
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert drawn["vlines"] == [many[0][1].backward_calls]
    assert drawn["bar"] == [many[1][1].backward_calls]
