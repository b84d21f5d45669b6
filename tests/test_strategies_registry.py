"""The strategy registry: one record per strategy, read by the CLI list, the memory
model and the runtime (which imports no planner of its own)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from evenzero.cost.memory import estimate_memory
from evenzero.model_presets import preset
from evenzero.strategies import (
    GENERIC_MEMORY,
    REGISTRY,
    STRATEGIES,
    STRATEGY_NAMES,
    executable_plan,
    plan,
    strategy_names,
)
from evenzero.strategies.common import PlanOptions

SRC = Path(__file__).resolve().parents[1] / "src" / "evenzero"


def test_names_come_from_the_registry():
    assert STRATEGY_NAMES == tuple(s.name for s in REGISTRY if s.compared)
    assert strategy_names() == tuple(s.name for s in REGISTRY)
    assert len(set(strategy_names())) == len(REGISTRY)
    assert "deepspeed-reduce-mode" in strategy_names() and "deepspeed-reduce-mode" not in STRATEGY_NAMES


@pytest.mark.parametrize("name", [s.name for s in REGISTRY])
def test_each_record_plans_its_strategy_and_describes_its_memory(name):
    record = STRATEGIES[name]
    p = record.plan(preset("seed-moe"), 8)
    assert p.strategy == name and p.sharded == record.sharded
    assert plan(preset("seed-moe"), 8, name) == p
    memory = estimate_memory(p)
    assert memory.basis.startswith(record.memory.grads_at_rest.value)
    assert ("sharded master" in memory.basis) == record.sharded


def test_an_unregistered_planner_gets_the_generic_memory_model():
    import dataclasses

    p = dataclasses.replace(plan(preset("seed-moe"), 8, "evenzero"), strategy="custom")
    memory = estimate_memory(p)
    assert memory.basis.startswith(GENERIC_MEMORY.grads_at_rest.value)
    assert "no memory model for 'custom'" in memory.basis


def test_memory_model_reads_record_fields_not_names():
    source = (SRC / "cost" / "memory.py").read_text()
    for name in strategy_names():
        assert f'"{name}"' not in source, name


def test_the_runtime_imports_no_planner_module():
    planners = {f"evenzero.strategies.{s}" for s in
                ("evenzero", "deepspeed", "deepspeed_layout", "megatron", "fsdp2", "ddp",
                 "common", "registry", "executable")}
    for path in sorted((SRC / "runtime").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                assert node.module not in planners, f"{path.name} imports {node.module}"
            if isinstance(node, ast.Import):
                assert not {a.name for a in node.names} & planners, path.name


def test_executable_plans_have_single_group_buckets():
    for name in ("evenzero", "deepspeed-0.6", "deepspeed"):
        p = executable_plan(preset("seed-moe"), 8, name, PlanOptions())
        groups = {g.name for g in p.groups}
        assert all(b.group in groups for b in p.buckets), name
        if name == "evenzero":
            assert p == plan(preset("seed-moe"), 8, name)
    custom = executable_plan(preset("seed-moe"), 8, STRATEGIES["deepspeed-0.6"].planner,
                             PlanOptions())
    assert custom == executable_plan(preset("seed-moe"), 8, "deepspeed-0.6", PlanOptions())
