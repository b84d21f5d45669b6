"""`evenzero plan --timeline / --timeline-plot / --tokens / --bucket-numel auto`."""

from __future__ import annotations

import json

from evenzero import cli
from evenzero.strategies import STRATEGY_NAMES


def rows(out: str) -> dict[str, list[str]]:
    """Table rows after the "step timeline" title, by strategy."""
    table = out[out.index("step timeline"):]
    return {cells[0]: cells[1:] for line in table.splitlines() if line.startswith("│")
            for cells in [[c.strip() for c in line.strip("│").split("│")]]}


def test_timeline_table_for_every_strategy(capsys):
    assert cli.main(["plan", "seed-moe", "--world-size", "8", "--cost", "gloo-local",
                     "--timeline"]) == 0
    out = capsys.readouterr().out
    table = rows(out)
    assert set(table) == set(STRATEGY_NAMES)
    step = {name: float(cells[-1].split()[0]) for name, cells in table.items()}
    assert step["evenzero"] < step["deepspeed-0.6"]  # as the repro measures
    assert "compute: FLOPs estimate, 32 tokens per micro-batch, on cpu-local" in out
    assert "bucket_numel auto:" in out


def test_timeline_markdown_json_and_tokens(capsys):
    argv = ["plan", "gpt2-xl", "--world-size", "64", "--strategy", "evenzero", "ddp", "--timeline"]
    assert cli.main([*argv, "--markdown"]) == 0
    md = capsys.readouterr().out
    assert "**step timeline: gpt2-xl on 64 ranks" in md and "| evenzero |" in md
    assert cli.main([*argv, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    t = doc["plans"][0]["timeline"]
    assert t["step_s"] >= t["backward_s"] > 0 and "1,024 tokens" in t["compute"]
    assert cli.main([*argv, "--json", "--tokens", "8192"]) == 0
    more = json.loads(capsys.readouterr().out)["plans"][0]["timeline"]
    assert more["backward_s"] > t["backward_s"] and "8,192 tokens" in more["compute"]


def test_timeline_plot_writes_a_png(tmp_path, capsys):
    out = tmp_path / "gantt.png"
    assert cli.main(["plan", "seed-moe", "--world-size", "8", "--timeline-plot", str(out),
                     "--strategy", "evenzero", "deepspeed-0.6", "fsdp2"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert f"wrote {out}" in capsys.readouterr().out


def test_preset_fitted_at_8_ranks_warns_at_16(capsys):
    assert cli.main(["plan", "seed-moe", "--world-size", "16", "--cost", "gloo-local",
                     "--strategy", "evenzero", "--timeline"]) == 0
    out = capsys.readouterr().out
    assert "cost model gloo-local, fitted at 8 ranks: extrapolated" in out
    assert "warning: cost model gloo-local was fitted at 8 ranks, not 16" in out
    doc = json.loads(_json(capsys, "seed-moe", "--world-size", "16", "--cost", "gloo-local"))
    notes = doc["plans"][0]["summary"]["notes"]
    assert any(n.startswith("warning: cost model gloo-local") for n in notes)
    at_8 = _json(capsys, "seed-moe", "--world-size", "8", "--cost", "gloo-local")
    assert "extrapolated" not in at_8


def test_bucket_numel_auto_and_bad_values(capsys):
    auto = json.loads(_json(capsys, "seed-moe", "--world-size", "8", "--bucket-numel", "auto"))
    default = json.loads(_json(capsys, "seed-moe", "--world-size", "8"))
    assert auto == default
    for argv, needle in ((["--bucket-numel", "big"], "expected a number of elements or auto"),
                         (["--tokens", "0"], "--tokens: 0 is below the minimum of 1"),
                         (["--timeline-plot", "/no/such/dir/g.png"], "does not exist")):
        assert cli.main(["plan", "seed-moe", "--world-size", "8", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and needle in err, err


def _json(capsys, *argv) -> str:
    assert cli.main(["plan", *argv, "--json"]) == 0
    return capsys.readouterr().out
