"""The differential fuzzer (tests/fuzz): a fixed-seed sample in the default run, a longer
one marked slow, the cases it found kept as regressions, and proof it can fail."""

from __future__ import annotations

import dataclasses

import pytest

from fuzz.case import (
    Backward,
    Block,
    Case,
    EngineDraw,
    ModelDraw,
    Step,
    coverage_sample,
    draw_case,
    features,
    from_dict,
    to_dict,
)
from fuzz.pool import run_cases
from fuzz.runner import FAULT_DOUBLE_FIRST_BACKWARD
from fuzz.shrink import candidates, script, shrink, size

# Cases the fuzzer found that failed before their fix (kept exactly as they failed).
REGRESSIONS = {
    # An empty parameter used in forward: "has a gradient but ZeroOptimizer does not manage
    # it" (runtime/checks.py).
    "empty_parameter": Case(
        seed=1, model=ModelDraw(4, (Block("linear", 4), Block("zero", 0)), 1, "fp32"),
        steps=(Step(micro=((Backward(),), (Backward(),)), no_sync=True),),
        engine=EngineDraw(stage=2, bucket_numel=10**7)),
    # A mixed-dtype model grouped by dtype (as evenzero's own error advises) with an empty
    # parameter in a group: refused as "not a trainable parameter" (runtime/groups.py).
    "empty_parameter_in_param_groups": Case(
        seed=41, model=ModelDraw(3, (Block("linear", 3, fp32=True), Block("zero", 0)), 2, "mixed"),
        steps=(Step(micro=((Backward(),),)),), engine=EngineDraw(stage=1, bucket_numel=16)),
    # zero_grad(set_to_none=False), then a new optimizer (state_dict or checkpoint reload)
    # and the block frozen: torch steps it on its zero gradient, evenzero's close() had set
    # p.grad = None so the new optimizer skipped it (runtime/shardedgrad.py).
    "frozen_after_reload_keeps_zero_grad": Case(
        seed=246, model=ModelDraw(4, (Block("linear", 4), Block("conv", 2)), 1, "fp32"),
        steps=(Step(micro=((Backward(),),), set_to_none=False),
               Step(micro=((Backward(),),), freeze=(1,), reload="state_dict")),
        engine=EngineDraw(stage=2, bucket_numel=16), optimizer="sgd_momentum", find_unused=True),
}
# Chosen from these seeds to cover every feature `features()` names (all 42 of them).
SAMPLES = {2: (range(1000, 1400), 6), 3: (range(2000, 2400), 5)}


def _assert_all_ok(cases, results) -> None:
    bad = [(c.seed, r["status"], r["detail"]) for c, r in zip(cases, results, strict=True)
           if r["status"] != "ok"]
    assert not bad, bad


@pytest.mark.parametrize("world", [2, 3])
def test_fixed_seed_sample_and_regressions_match_ddp(world):
    planted = dataclasses.replace(draw_case(7), notes=(FAULT_DOUBLE_FIRST_BACKWARD,))
    seeds, n = SAMPLES[world]
    cases = [*REGRESSIONS.values(), *coverage_sample(seeds, n)]
    results = run_cases([*cases, planted], world)
    _assert_all_ok(cases, results[:-1])
    # The same comparison catches a planted double-counted backward.
    assert results[-1]["status"] == "mismatch", results[-1]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_longer_sample_matches_ddp(world):
    cases = [draw_case(s) for s in range(5000, 5200)]
    _assert_all_ok(cases, run_cases(cases, world))


def test_cases_are_drawn_from_the_seed_and_round_trip():
    assert draw_case(123) == draw_case(123) != draw_case(124)
    for s in range(200):
        case = draw_case(s)
        assert from_dict(to_dict(case)) == case
    seen = {f for s in range(300) for f in features(draw_case(s))}
    wanted = {"block:moe", "block:shared", "block:zero", "params:1d", "params:3d", "dtype:bf16",
              "dtype:mixed", "accum:no_sync", "accum:plain", "backwards>1", "unused:one_rank",
              "unused:all_ranks", "freeze", "unfreeze", "clip", "zero_grad:keep", "p.data_write",
              "reload:state_dict", "reload:checkpoint", "bucket:tiny", "bucket:one", "bucket:auto",
              "reduce_dtype:bf16", "impl:fused", "overlap_param_gather", "stage1", "stage2",
              "size:>=10k"}
    assert wanted <= seen, wanted - seen
    for seeds, n in SAMPLES.values():
        assert {f for c in coverage_sample(seeds, n) for f in features(c)} == seen


def test_shrinking_keeps_the_failure_and_reaches_a_small_case():
    def bad(c: Case) -> bool:  # stands in for a run: "fails" with a zero block and clipping
        return (any(b.kind == "zero" for b in c.model.blocks)
                and any(s.clip is not None for s in c.steps))

    shrunk = 0
    for s in range(150):
        case = draw_case(s)
        if not bad(case):
            continue
        small = shrink(case, lambda cs: next((i for i, c in enumerate(cs) if bad(c)), None))
        assert bad(small) and size(small) <= size(case)
        assert len(small.steps) == 1 and [b.kind for b in small.model.blocks] == ["zero"], small
        assert not any(bad(c) for c in list(candidates(small))[:40]), small  # a local minimum
        shrunk += 1
    assert shrunk > 10
    text = script(small, 2, "mismatch: ...")
    compile(text, "repro.py", "exec")
    assert "run_cases([from_dict(CASE)], world=2)" in text


@pytest.mark.slow
def test_a_planted_fault_shrinks_to_a_runnable_script(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    from fuzz.pool import first_failing

    case = dataclasses.replace(draw_case(7), notes=(FAULT_DOUBLE_FIRST_BACKWARD,))
    small = shrink(case, lambda cs: first_failing(cs, 2, lambda r: r["status"] == "mismatch"))
    assert size(small) < size(case) and len(small.steps) == 1, small
    repro = tmp_path / "repro.py"
    repro.write_text(script(small, 2, "a planted fault"))
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, str(repro)], cwd=root, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 1 and done.stdout.startswith("mismatch"), done.stdout + done.stderr
