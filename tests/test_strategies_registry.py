"""The strategy registry: one record per strategy, read by the CLI list and the runtime
(which imports no planner of its own); everything else about a strategy is in its plans."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from evenzero.cost.memory import GENERIC_MEMORY, estimate_memory
from evenzero.model_presets import preset
from evenzero.strategies import (
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
def test_each_record_plans_its_strategy_and_the_plan_describes_itself(name):
    record = STRATEGIES[name]
    p = record.plan(preset("seed-moe"), 8)
    assert p.strategy == name
    assert plan(preset("seed-moe"), 8, name) == p
    assert p.memory is not None and p.step_work is not None
    memory = estimate_memory(p)
    assert memory.basis.startswith(p.memory.grads_at_rest.value)
    assert "generic" not in memory.basis
    assert ("sharded" in memory.basis) == p.sharded


def test_a_plan_without_a_memory_model_gets_the_generic_one():
    import dataclasses

    p = dataclasses.replace(plan(preset("seed-moe"), 8, "evenzero"), strategy="custom",
                            memory=None)
    memory = estimate_memory(p)
    assert memory.basis.startswith(GENERIC_MEMORY.grads_at_rest.value)
    assert "planner of 'custom' set no memory model" in memory.basis


PLANNER_READERS = ["plan.py", "spec.py", "spec_json.py", "model_presets.py", "plan_report.py",
                   "planview.py", "timelineview.py", "calibration.py", "commands/plan.py",
                   "commands/calibrate.py"]


def _name_comparisons(path: Path) -> list[str]:
    """`x == "ddp"`, `x in ("evenzero", ...)`: a branch on a strategy name."""
    names = set(strategy_names())
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.Compare):
            continue
        sides = [node.left, *node.comparators]
        sides += [e for c in node.comparators if isinstance(c, (ast.Tuple, ast.List, ast.Set))
                  for e in c.elts]
        if any(isinstance(c, ast.Constant) and c.value in names for c in sides):
            found.append(f"{path.relative_to(SRC)}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_nothing_in_the_planner_switches_on_strategy_names():
    """What differs between strategies is a field of their plans (`Execution`,
    `MemoryModel`, `StepWork`, `sharded`) or of their registry record, never a branch on
    a name: a new strategy is its planner and its record."""
    files = sorted((SRC / "cost").glob("*.py")) + sorted((SRC / "strategies").glob("*.py"))
    files += [SRC / f for f in PLANNER_READERS]
    found = [hit for path in files for hit in _name_comparisons(path)]
    assert not found, "branch on a strategy name; put the fact in the plan or the record:\n" + \
        "\n".join(found)


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
