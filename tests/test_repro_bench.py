"""The benchmark harnesses at tiny sizes: `evenzero bench` and benchmarks/gpu_single.py."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from evenzero.repro import bench

ROOT = Path(__file__).resolve().parents[1]


def test_bench_dense_systems_agree_and_report(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "bench.json"
    args = parser.parse_args(["--world-size", "2", "--model", "tiny", "--steps", "2",
                              "--warmup", "1", "--systems", "evenzero,ddp,fsdp2",
                              "--json", str(out)])
    assert bench.main(args) == 0
    report = json.loads(out.read_text())
    by = {s["name"]: s for s in report["systems"]}
    assert set(by) == {"evenzero", "ddp", "fsdp2"}
    for name in ("ddp", "fsdp2"):
        assert by[name]["losses"] == [
            pytest.approx(x, rel=1e-5) for x in by["evenzero"]["losses"]]
    assert all(c["op"] == "reduce_scatter" for c in by["evenzero"]["backward_collectives"])
    assert all(c["op"] == "all_reduce" for c in by["ddp"]["backward_collectives"])
    # FSDP2 reduce-scatters once per fully_shard group: 2 blocks + the root.
    fsdp = by["fsdp2"]["backward_collectives"]
    assert [c["op"] for c in fsdp] == ["reduce_scatter"] * 3


def test_gpu_single_smoke_on_cpu_writes_its_table_and_json(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_single.py"), "--device", "cpu", "--tiny",
         "--steps", "2", "--warmup", "1", "--systems", "torch-amp,torch-bf16,ddp,evenzero"],
        capture_output=True, text=True, timeout=240, env={**_env(), "OUT": str(tmp_path)})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "evenzero / torch-amp" in proc.stdout
    report = json.loads((tmp_path / "gpu_single.json").read_text())
    names = [s["name"] for s in report["systems"]]
    assert names == ["torch-amp", "torch-bf16", "ddp", "evenzero"]
    assert report["evenzero_vs_torch_amp"]["ratio"] > 0
    amp = report["systems"][0]["losses"]
    ez = report["systems"][3]["losses"]
    assert ez[0] == pytest.approx(amp[0], rel=2e-2)  # bf16 params vs autocast


def test_gpu_single_refuses_cuda_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible")
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_single.py")],
                          capture_output=True, text=True, timeout=120, env=_env())
    assert proc.returncode == 2
    assert "no CUDA device visible; use --device cpu --tiny" in proc.stdout


def _env() -> dict[str, str]:
    import os

    return {k: v for k, v in os.environ.items() if k != "OUT"}
