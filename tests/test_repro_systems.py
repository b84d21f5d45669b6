"""The one table of side-by-side systems, the DDP it times (its C++ reducer), the floor,
and the verdict lines that say what was compared, how noisy it was and where to look next."""

from __future__ import annotations

import argparse
import io
from pathlib import Path

import pytest
from rich.console import Console

from dist_helpers import run_distributed
from evenzero import repro
from evenzero.repro import bench
from evenzero.repro.report import FULL_BENCHMARK, RATIO_LABEL, target_lines, time_table
from evenzero.repro.systems import BY_NAME, SYSTEMS, is_exact, system_names, trains


def test_repro_and_bench_take_their_systems_from_one_table():
    names = [e.name for e in SYSTEMS]
    assert bench.SYSTEMS == system_names() == tuple(names)
    assert repro.SYSTEMS == tuple(n for n in names if BY_NAME[n].experts)
    assert "fsdp2" in bench.SYSTEMS and "fsdp2" not in repro.SYSTEMS  # no MoE in FSDP2 here
    assert set(repro.DEFAULT_SYSTEMS) <= set(repro.SYSTEMS)
    assert set(bench.DEFAULT_SYSTEMS) <= set(bench.SYSTEMS)
    assert is_exact("ddp") and not is_exact("deepspeed") and not trains("floor")
    for module, extra in ((repro, ["--world-size", "8"]), (bench, [])):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        config = module.config_from_args(parser.parse_args(["--systems", "evenzero,floor", *extra]))
        assert config.systems == ("evenzero", "floor")
    parser = argparse.ArgumentParser()
    repro.add_arguments(parser)
    with pytest.raises(ValueError, match="fsdp2"):
        repro.config_from_args(parser.parse_args(["--systems", "fsdp2"]))


def _ddp_native_then_hooked(rank: int, world_size: int) -> dict:
    import torch
    from torch import nn

    from evenzero.repro.baselines import DDPSystem, FloorSystem

    torch.manual_seed(0)
    ddp = DDPSystem(nn.Linear(8, 4), lambda out, y: (out - y).pow(2).mean())
    batch = (torch.randn(3, 8), torch.randn(3, 4))
    for _ in range(2):  # timed steps: DDP's own reducer, nothing captured
        ddp.backward(ddp.loss(batch))
        ddp.step()
    native = (list(ddp.ddp._comm_hooks), ddp.collectives())
    ddp.capture_next_step()
    ddp.backward(ddp.loss(batch))
    ddp.step()
    floor = FloorSystem(nn.Linear(8, 4), lambda out, y: (out - y).pow(2).mean())
    floor.backward(floor.loss(batch))
    before = torch.get_rng_state()
    floor.step()
    return {"native_hooks": len(native[0]), "native_calls": len(native[1]),
            "hooked": len(ddp.ddp._comm_hooks),
            "captured": [(c.phase, c.op, c.numel) for c in ddp.collectives()],
            "floor_numel": floor.shard.numel(),
            "floor_grads_cleared": all(p.grad is None for p in floor.model.parameters()),
            "rng_kept": torch.equal(before, torch.get_rng_state())}


def test_ddp_times_its_cpp_reducer_and_is_hooked_only_to_be_captured():
    out = run_distributed(_ddp_native_then_hooked, 2, timeout=120)[0]
    assert out["native_hooks"] == 0 and out["native_calls"] == 0
    assert out["hooked"] == 1 and out["captured"] == [("backward", "all_reduce", 36)]
    # The floor steps 1/W of the elements, reduces nothing, clears the model's gradients.
    assert out["floor_numel"] == 18 and out["floor_grads_cleared"] and out["rng_kept"]


def fake(name: str, step_ms: list[float]) -> dict:
    return {"name": name, "step_ms": step_ms, "median_step_ms": sorted(step_ms)[len(step_ms) // 2],
            "losses": [1.0]}


def test_verdict_says_what_was_compared_its_noise_and_where_the_full_benchmark_is():
    ez = fake("evenzero", [84, 95, 88, 86, 91, 89, 93, 87])
    ddp = fake("ddp", [100] * 8)
    lines = target_lines([ez, ddp], 8)
    assert lines[0] == ("target evenzero <= 0.9 x ddp (DDP's C++ reducer): 0.89 x, the median of "
                        "8 per-step ratios of forward+backward+step (slowest rank), 99% interval "
                        "0.84-0.95: [yellow]inconclusive: the spread crosses the target[/yellow]")
    assert "One run on 8 ranks" in lines[-1] and FULL_BENCHMARK in lines[-1]
    assert "'met' needs the whole 99% confidence interval" in lines[-1]
    assert "BENCHMARKS.md" in FULL_BENCHMARK and "benchmarks/defaults.py" in FULL_BENCHMARK
    headings = [line for line in (Path(__file__).resolve().parents[1] / "BENCHMARKS.md")
                .read_text().splitlines() if line.startswith("## ")]
    for named in FULL_BENCHMARK.split('"')[1::2]:  # the sections it sends readers to exist
        assert any(h.startswith(f"## {named}") for h in headings), named
    clear = target_lines([fake("evenzero", [80, 81, 82] * 3), ddp | {"step_ms": [100] * 9}], 8)
    assert clear[0].endswith("99% interval 0.80-0.82: [green]met[/green]")
    missed = target_lines([fake("evenzero", [95] * 8), ddp], 8)
    assert missed[0].endswith(": [red]missed[/red]")
    few = target_lines([fake("evenzero", [80] * 3), fake("ddp", [100] * 3)], 8)
    assert "too few steps for a 99% interval (8 or more): [yellow]inconclusive" in few[0]
    buffer = io.StringIO()
    Console(file=buffer, width=400).print(clear[0])
    assert buffer.getvalue().rstrip().endswith(": met")


def test_the_time_table_shows_the_verdicts_ratio_not_a_ratio_of_medians():
    """Issue 29: the table said 1.01 (ratio of medians) where the verdict said 0.95."""
    ddp = fake("ddp", [100, 100, 100, 400, 100]) | {"median_phase_ms": {}}
    lopsided = fake("evenzero", [90, 90, 300, 300, 300]) | {"median_phase_ms": {}}
    buffer = io.StringIO()
    Console(file=buffer, width=200).print(time_table([lopsided, ddp]))
    assert RATIO_LABEL in buffer.getvalue()
    row = next(line for line in buffer.getvalue().splitlines() if line.startswith("│ ddp"))
    # Per step: 0.9, 0.9, 3.0, 0.75, 3.0 -> median 0.90; the medians' ratio is 300/100 = 3.00.
    assert row.rstrip("│ ").endswith("0.90"), row


def test_table_titles_and_captions_do_not_wrap():
    from evenzero.repro.report import print_report

    def system(name: str, calls: list[dict]) -> dict:
        return {"name": name, "backward_collectives": calls, "step_collectives": [],
                "median_step_ms": 10.0, "step_ms": [10.0, 11.0], "losses": [1.0, 0.9, 0.8],
                "median_phase_ms": {"forward": 1.0, "backward": 4.0, "step": 5.0}}

    reduce = {"op": "reduce", "group": "dense", "group_size": 8, "root": 3, "offset": 0,
              "numel": 1000, "itemsize": 4}
    report = {"world_size": 8, "backend": "gloo", "numel_per_rank": 2000,
              "config": {"steps": 2, "warmup": 1}, "skipped": [],
              "systems": [system("evenzero", []), system("deepspeed-0.6-schedule",
                                                         [reduce, reduce | {"offset": 1000}]),
                          system("floor", [])]}
    buffer = io.StringIO()
    print_report(report, Console(file=buffer, width=130, color_system=None))
    out = buffer.getvalue()
    for whole in ("Seed table: DeepSpeed 0.6's reduces in evenzero's runtime, by destination",
                  "2 reduces, 2,000 of 2,000 elements",
                  "Step time by phase, ms: slowest rank, median over the measured steps",
                  "whole step = forward + backward + step on each rank, slowest rank per step; "
                  "ddp is DDP's C++ reducer",
                  "not shown: floor (does not update the model's weights)"):
        assert whole in out, whole
