"""`evenzero plan` / `calibrate` / lazy subcommands, end to end through main()."""

from __future__ import annotations

import json
import subprocess
import sys
import types

import pytest

from evenzero import cli
from evenzero.strategies import STRATEGY_NAMES

# DeepSpeed #3151 as reported: (destination, bucket offset, numel) of the 13 reduces.
SEED_CASE_REDUCES = [
    (0, 1002000, 252250), (0, 6006000, 4004000), (1, 1254250, 252250), (1, 2002000, 4004000),
    (2, 1506500, 252250), (3, 1000, 8000), (3, 1001000, 1000), (3, 1758750, 243250),
    (4, 9000, 252250), (5, 261250, 252250), (6, 513500, 252250), (7, 0, 1000),
    (7, 765750, 235250)]


def run_json(capsys, *argv) -> dict:
    assert cli.main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def fails(capsys, *argv) -> str:
    """Run main(argv), expect exit status 2 and exactly one line on stderr; return it."""
    assert cli.main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("evenzero: error: "), err
    return err


def test_default_table_compares_all_six_strategies(capsys):
    # One 32M-element bucket per group: evenzero's two reduce-scatters.
    assert cli.main(["plan", "seed-moe-gate-lost", "--world-size", "8",
                     "--bucket-numel", "33554432"]) == 0
    out = capsys.readouterr().out
    assert "seed-moe-gate-lost on 8 ranks, cost model h100-nvlink-8 (default for W <= 8)" in out
    rows = {line.split()[1]: line for line in out.splitlines() if line.startswith("│")}
    assert set(rows) == set(STRATEGY_NAMES)
    assert "13 reduce" in rows["deepspeed-0.6"] and "2 RS" in rows["evenzero"]
    assert "2 AR" in rows["deepspeed"]


def test_json_has_the_documented_shape(capsys):
    doc = run_json(capsys, "seed-moe", "--world-size", "8", "--bucket-numel", "33554432")
    assert set(doc) == {"world_size", "plans"} and doc["world_size"] == 8
    assert [p["strategy"] for p in doc["plans"]] == list(STRATEGY_NAMES)
    for p in doc["plans"]:
        assert {"strategy", "buckets", "collectives", "summary"} <= set(p)
        for b in p["buckets"]:
            assert {"group", "index", "numel", "params"} <= set(b)
            assert sum(s["numel"] for s in b["params"]) <= b["numel"]
            assert all(set(s) == {"name", "offset", "numel"} for s in b["params"])
        for c in p["collectives"]:
            assert {"phase", "op", "group", "group_size", "root", "bucket", "offset",
                    "numel"} <= set(c)
            assert c["phase"] in ("backward", "step")
            assert c["op"] in ("reduce", "reduce_scatter", "all_reduce", "all_gather")
            assert (c["root"] is None) == (c["op"] != "reduce")
    ez = doc["plans"][0]
    backward = [c for c in ez["collectives"] if c["phase"] == "backward"]
    assert [(c["op"], c["group"], c["group_size"]) for c in backward] == [
        ("reduce_scatter", "experts", 2), ("reduce_scatter", "dense", 8)]
    assert ez["summary"]["backward_collectives"] == 2
    assert ez["summary"]["memory_per_rank"]["grad_bytes"] == 4 * (252_256 + 4_004_000)


def test_deepspeed_06_reproduces_the_reported_reduces(capsys):
    doc = run_json(capsys, "seed-moe-gate-lost", "--world-size", "8", "--strategy",
                   "deepspeed-0.6")
    (ds,) = doc["plans"]
    got = sorted((c["root"], c["offset"], c["numel"]) for c in ds["collectives"]
                 if c["phase"] == "backward")
    assert got == SEED_CASE_REDUCES


def test_strategy_flag_repeats_takes_several_and_all(capsys):
    doc = run_json(capsys, "seed-moe", "--world-size", "8", "--strategy", "ddp",
                   "--strategy", "deepspeed-0.6", "evenzero", "ddp")
    assert [p["strategy"] for p in doc["plans"]] == ["ddp", "deepspeed-0.6", "evenzero"]
    doc = run_json(capsys, "seed-moe", "--world-size", "8", "--strategy", "all")
    assert len(doc["plans"]) == 6


def test_ep_size_and_bucket_numel_reach_the_planner(capsys):
    doc = run_json(capsys, "seed-moe", "--world-size", "8", "--ep-size", "8",
                   "--strategy", "evenzero", "--bucket-numel", "1000000")
    (ez,) = doc["plans"]
    sizes = {c["group"]: c["group_size"] for c in ez["collectives"] if c["phase"] == "backward"}
    assert sizes == {"dense": 8, "experts": 1}
    assert all(b["numel"] <= 1_000_000 + 8 * 32 or len(b["params"]) == 1 for b in ez["buckets"])
    assert len(ez["buckets"]) > 2


def test_round_robin_changes_deepspeed(capsys):
    plain = run_json(capsys, "seed-moe", "--world-size", "8", "--strategy", "deepspeed-0.6")
    rr = run_json(capsys, "seed-moe", "--world-size", "8", "--strategy", "deepspeed-0.6",
                  "--round-robin")
    assert plain["plans"][0]["collectives"] != rr["plans"][0]["collectives"]


def test_cost_flags_change_predictions(capsys, tmp_path):
    base = run_json(capsys, "gpt2-xl", "--world-size", "128", "--strategy", "evenzero")
    s = base["plans"][0]["summary"]
    assert s["cost_model"] == "h100-ndr-ib"
    a100 = run_json(capsys, "gpt2-xl", "--world-size", "128", "--strategy", "evenzero",
                    "--cost", "a100-hdr-ib")["plans"][0]["summary"]
    assert a100["predicted_backward_s"] > s["predicted_backward_s"]
    flat = run_json(capsys, "gpt2-xl", "--world-size", "128", "--strategy", "evenzero",
                    "--alpha-us", "0", "--busbw-gbs", "1")["plans"][0]["summary"]
    assert flat["predicted_backward_s"] == pytest.approx(s["backward_bytes_per_rank"] / 1e9)
    path = tmp_path / "c.json"
    from evenzero.cost.presets import PRESETS

    path.write_text(json.dumps(PRESETS["a100-hdr-ib"].with_params({"reduce_scatter.alpha_us": 0})
                               .to_json()))
    mine = run_json(capsys, "gpt2-xl", "--world-size", "128", "--strategy", "evenzero",
                    "--cost", str(path), "--cost-param", "reduce_scatter.busbw_gbs=180")
    assert mine["plans"][0]["summary"]["predicted_backward_s"] < a100["predicted_backward_s"]


def test_plot_writes_a_png(tmp_path, capsys):
    out = tmp_path / "schedule.png"
    assert cli.main(["plan", "seed-moe-gate-lost", "--world-size", "8", "--plot", str(out),
                     "--strategy", "evenzero", "deepspeed-0.6"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert f"wrote {out}" in capsys.readouterr().out


def test_markdown_table(capsys):
    assert cli.main(["plan", "seed-moe", "--world-size", "8", "--markdown", "--bucket-numel",
                     "33554432", "--strategy", "evenzero", "deepspeed"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].startswith("| strategy | backward calls |")
    assert lines[4].startswith("| evenzero | 2 RS |") and lines[5].startswith("| deepspeed | 2 AR |")


# --------------------------------------------------------------------------- bad input


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_bad_input_is_one_line_and_exit_2(capsys, tmp_path):
    assert "unknown preset 'gpt5'; choose one of seed-moe" in fails(
        capsys, "plan", "gpt5", "--world-size", "8")
    assert "params[0] (w).shape: expected a list of non-negative integers" in fails(
        capsys, "plan", write(tmp_path, "bad.json", '{"params": [{"name": "w", "shape": [-1]}]}'),
        "--world-size", "8")
    assert "not valid JSON at line 1" in fails(
        capsys, "plan", write(tmp_path, "broken.json", '{"params": ['), "--world-size", "8")
    model = '{"params": [{"name": "a", "shape": [4]}, {"name": "b", "shape": [4]}], "arrival": %s}'
    assert "arrival: duplicate name 'a'" in fails(
        capsys, "plan", write(tmp_path, "dup.json", model % '["a", "a"]'), "--world-size", "2")
    assert "arrival: unknown parameter name 'c'" in fails(
        capsys, "plan", write(tmp_path, "unk.json", model % '["c"]'), "--world-size", "2")
    assert "world size 6 is not divisible by expert_parallel_size 4" in fails(
        capsys, "plan", "seed-moe", "--world-size", "6")
    assert "world size 8 is not divisible by expert_parallel_size 3" in fails(
        capsys, "plan", "seed-moe", "--world-size", "8", "--ep-size", "3")
    for bad in ("0", "-5"):
        assert f"argument --bucket-numel: {bad} is below the minimum of 1" in fails(
            capsys, "plan", "seed-moe", "--world-size", "8", "--bucket-numel", bad)
    assert "argument --world-size: 0 is below the minimum of 1" in fails(
        capsys, "plan", "seed-moe", "--world-size", "0")
    assert "unknown strategy 'zero3'" in fails(
        capsys, "plan", "seed-moe", "--world-size", "8", "--strategy", "zero3")
    assert "argument --ep-size: 0 is below the minimum of 1" in fails(
        capsys, "plan", "seed-moe", "--world-size", "8", "--ep-size", "0")
    assert "has no expert group" in fails(capsys, "plan", "gpt2-xl", "--world-size", "8",
                                          "--ep-size", "2")
    assert "unknown cost preset 'tpu-v5'" in fails(
        capsys, "plan", "seed-moe", "--world-size", "8", "--cost", "tpu-v5")
    assert "expected KEY=V, e.g. reduce.alpha_us=160" in fails(
        capsys, "plan", "seed-moe", "--world-size", "8", "--cost-param", "reduce.alpha_us")
    assert "does not exist" in fails(capsys, "plan", "seed-moe", "--world-size", "8",
                                     "--plot", str(tmp_path / "no" / "such" / "dir.png"))
    assert "the following arguments are required: --world-size" in fails(capsys, "plan", "seed-moe")
    assert "argument --world-size: 'eight' is not an integer" in fails(
        capsys, "plan", "seed-moe", "--world-size", "eight")


# --------------------------------------------------------------------------- speed, imports


def test_70b_on_1024_ranks_plans_fast_without_torch():
    code = (
        "import sys, io, time, contextlib\n"
        "from evenzero.cli import main\n"
        "from evenzero.strategies import STRATEGY_NAMES\n"
        "for s in STRATEGY_NAMES:\n"
        "    t = time.perf_counter()\n"
        "    with contextlib.redirect_stdout(io.StringIO()):\n"
        "        rc = main(['plan', 'llama-70b', '--world-size', '1024', '--json', '--strategy', s])\n"
        "    print(s, rc, time.perf_counter() - t)\n"
        "print('torch' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=120).stdout.split("\n")
    *rows, torch_loaded, _ = out
    assert torch_loaded == "False"
    assert [r.split()[0] for r in rows] == list(STRATEGY_NAMES)
    for row in rows:
        name, rc, seconds = row.split()
        assert rc == "0" and float(seconds) < 2.0, row


# --------------------------------------------------------------------------- lazy subcommands


def test_lazy_subcommand_missing_module_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.setitem(cli.COMMANDS, "bench", cli.Command("evenzero._no_such_bench", "x"))
    assert "is not part of this installation" in fails(capsys, "bench", "--quick")


def test_lazy_subcommand_dispatches_with_its_own_arguments(capsys, monkeypatch):
    seen = {}
    fake = types.ModuleType("evenzero._fake_repro")
    fake.add_arguments = lambda p: p.add_argument("--world-size", type=int, default=8)
    fake.main = lambda args: seen.setdefault("ws", args.world_size) and 0
    monkeypatch.setitem(sys.modules, "evenzero._fake_repro", fake)
    monkeypatch.setitem(cli.COMMANDS, "repro", cli.Command("evenzero._fake_repro", "x"))
    assert cli.main(["repro", "--world-size", "4"]) == 0 and seen == {"ws": 4}
    assert "unrecognized arguments: --bogus" in fails(capsys, "repro", "--bogus")


def test_calibrate_saves_a_cost_model_plan_can_use(tmp_path, capsys):
    path = tmp_path / "gloo2.json"
    assert cli.main(["calibrate", "--world-size", "2", "--sizes", "1024", "262144", "4194304",
                     "--repeats", "3", "--json", str(path)]) == 0
    out = capsys.readouterr().out
    assert "gloo-local-2" in out and f"wrote {path}" in out
    saved = json.loads(path.read_text())
    assert saved["reference_ranks"] == 2
    doc = run_json(capsys, "gpt2-xl", "--world-size", "2", "--strategy", "evenzero",
                   "--cost", str(path))
    assert doc["plans"][0]["summary"]["cost_model"] == "gloo-local-2"
    assert "--world-size W is required" in fails(capsys, "calibrate")


def test_strategies_planned_on_request_are_accepted(capsys):
    doc = run_json(capsys, "seed-moe", "--world-size", "8", "--strategy", "deepspeed-reduce-mode")
    calls = [c for c in doc["plans"][0]["collectives"] if c["phase"] == "backward"]
    # One reduce per distinct (destination, process group): 8 dense roots + 2 expert roots.
    assert [c["op"] for c in calls] == ["reduce"] * 10
    assert [c["root"] for c in calls[:8]] == [7, 3, 4, 5, 6, 0, 1, 2]


def test_invalid_cost_fields_are_a_clear_error(capsys):
    assert "gpus_per_node must be a positive integer" in fails(
        capsys, "plan", "seed-moe", "--world-size", "8", "--cost-param", "gpus_per_node=0")


def test_calibrate_json_into_missing_directory_fails_before_measuring(capsys, tmp_path):
    err = fails(capsys, "calibrate", "--world-size", "2", "--json", str(tmp_path / "no" / "c.json"))
    assert "does not exist" in err
