"""A run saved by real DeepSpeed 0.19.8, resumed with `import evenzero.deepspeed as
deepspeed` and `engine.load_checkpoint(dir)`, continues as DeepSpeed continues.

The script is tests/ds_train_script.py (`save_and_continue`, `resume`): DeepSpeed trains
at 2 gloo ranks (AdamW, WarmupDecayLR, clipping, a global batch of 16 in micro-batches of
4, so 2 accumulation steps at 2 ranks), saves with a client state after 2 epochs, and a
fresh DeepSpeed engine loads that checkpoint and trains 2 more epochs: the reference.
The same script under evenzero.deepspeed loads the same directory and trains the same
epochs, at 2 ranks, at 4 (1 accumulation step) and, marked slow, at 1 (4 steps);
DeepSpeed itself refuses to load a ZeRO checkpoint at another data-parallel size, so
those are compared with DeepSpeed's 2. Cases: ZeRO-2, ZeRO-1, fp16 ZeRO-2 with dynamic
loss scaling (DeepSpeed's CPU fp16 check patched, `deepspeed_ckpt_job.deepspeed_rank`)
and, marked slow, bf16. Counters, client state, the path returned, scheduler, LR sequence
and the fp16 loss scaler (scale, iteration counters, hysteresis) must be DeepSpeed's
exactly; losses (global mean per optimizer step), gradient norms and final weights to a
tolerance. Resumes load `./<case>` from the checkpoint root as the working directory, so
the returned path keeps the caller's spelling as DeepSpeed's does.

DeepSpeed trains once per session (`deepspeed_runs`) and each world size resumes once
(`_resumed`), each job running only the (case, load) pairs the session selected.
`python tests/test_deepspeed_checkpoint_from_deepspeed.py [CASE...]` prints the measured
differences of every pair.
"""

from __future__ import annotations

import math
import os
import sys

import pytest

from deepspeed_fixtures import needs_deepspeed
from dist_helpers import run_distributed

pytestmark = needs_deepspeed

TOLERANCE = {1: (1e-4, 1e-4, 1e-4), 2: (1e-5, 1e-5, 1e-5), 4: (1e-4, 1e-4, 1e-4)}
"""(loss, relative gradient norm, weight) tolerances per evenzero world size (fp32)."""
HALF_TOLERANCE = {"fp16": (1e-4, 1e-4, 5e-4), "bf16": (1e-3, 4e-3, 4e-3)}
"""16-bit runs at any world size: DeepSpeed accumulates and reduces the 16-bit gradients
in 16 bits, evenzero in fp32, so weights and norms differ by about one 16-bit rounding
step (relative 2**-11 in fp16, 2**-8 = 3.9e-3 in bf16)."""
CASES = ("resume_zero2", "resume_zero1", "resume_fp16", "resume_bf16")
LOADS = {"full": {}, "weights_only": {"load_optimizer_states": False},
         "module_only": {"load_module_only": True}}
"""`engine.load_checkpoint` options: everything; weights, counters and scheduler with the
fresh optimizer (DeepSpeed rebuilds the fp32 masters from the weights); weights only."""
WORLDS = (2, 4, 1)


def _compared(case: str, load: str, world: int) -> bool:
    """fp16 with a fresh loss scale (weights_only, module_only) walks the scale down to
    where the gradients overflow, and that edge moves with the accumulation steps (the loss
    is divided by them before it is scaled): DeepSpeed itself would skip other steps at 4
    ranks than at 2. A full load carries the scale over, so it stays comparable."""
    return not ("fp16" in case and load != "full" and world != 2)


def _slow(case: str, load: str, world: int) -> bool:
    """The default run keeps two jobs (DeepSpeed at 2, evenzero at 2): every load at 2
    ranks, for ZeRO-2, ZeRO-1, fp16. Another world size (1 and 4 ranks) runs in the slow
    set; tests/test_checkpoint_deepspeed.py loads DeepSpeed checkpoints at 4 ranks by default."""
    return case == "resume_bf16" or world != 2


PARAMS = [pytest.param(c, ld, w, marks=[pytest.mark.slow] if _slow(c, ld, w) else [])
          for c in CASES for ld in LOADS for w in WORLDS if _compared(c, ld, w)]
Pairs = tuple[tuple[str, str], ...]


def _deepspeed_job(rank: int, world: int, pairs: Pairs, root: str) -> dict:
    import ds_train_script as script
    from deepspeed_ckpt_job import deepspeed_rank

    deepspeed = deepspeed_rank(rank, world, fp16=True)
    os.chdir(root)
    out: dict = {}
    for case, load in pairs:
        if case not in out:
            out[case] = {"saved": script.save_and_continue(deepspeed, case, f"./{case}")}
        out[case][load] = script.resume(deepspeed, case, f"./{case}", **LOADS[load])
    return out


def _evenzero_job(rank: int, world: int, pairs: Pairs, root: str) -> dict:
    os.environ["LOCAL_RANK"] = str(rank)
    import ds_train_script as script

    deepspeed = script.load_deepspeed("evenzero")
    os.chdir(root)
    out: dict = {}
    for case, load in pairs:
        out.setdefault(case, {})[load] = script.resume(deepspeed, case, f"./{case}",
                                                       **LOADS[load])
    return out


@pytest.fixture(scope="session")
def selected(request) -> set[tuple[str, str, int]]:
    """The (case, load, world) this session runs (after -m / -k deselection)."""
    return {(item.callspec.params["case"], item.callspec.params["load"],
             item.callspec.params["world"]) for item in request.session.items
            if getattr(item, "originalname", None) == TEST_NAME}


@pytest.fixture(scope="session")
def deepspeed_runs(tmp_path_factory, selected) -> tuple[str, dict]:
    """(checkpoint root, per case: DeepSpeed's run that saved and its resume per load)."""
    root = str(tmp_path_factory.mktemp("ds_script_ckpt"))
    pairs = tuple(sorted({(c, ld) for c, ld, _ in selected}))
    runs = run_distributed(_deepspeed_job, 2, (pairs, root), timeout=600)
    return root, runs[0]


_RESUMED: dict[tuple[str, int], list[dict]] = {}


def _resumed(root: str, world: int, selected: set) -> list[dict]:
    """The selected pairs resumed by evenzero.deepspeed at `world` ranks, one job each."""
    if (root, world) not in _RESUMED:
        pairs = tuple(sorted((c, ld) for c, ld, w in selected if w == world))
        _RESUMED[root, world] = run_distributed(_evenzero_job, world, (pairs, root),
                                                timeout=600)
    return _RESUMED[root, world]


def compare(reference: dict, got: dict, case: str, world: int) -> dict:
    """Figures of one resume against DeepSpeed's; AssertionError past the tolerances."""
    half = next((h for h in HALF_TOLERANCE if h in case), None)
    tolerances = HALF_TOLERANCE[half] if half else TOLERANCE[world]
    ref, out = reference["after"], got["after"]
    for key in ("global_steps", "global_samples", "skipped_steps", "lr", "scheduler",
                "scaler", "client"):
        assert got["loaded"][key] == reference["loaded"][key], (
            f"{case}: loaded {key}: deepspeed {reference['loaded'][key]} "
            f"evenzero {got['loaded'][key]}")
    assert got["loaded"]["path"] == reference["loaded"]["path"], (
        f"{case}: load_checkpoint returned {got['loaded']['path']!r}, DeepSpeed "
        f"{reference['loaded']['path']!r}")
    assert out["lrs"] == ref["lrs"], f"{case}: LR sequences differ: {ref['lrs']} {out['lrs']}"
    assert out["scalers"] == ref["scalers"], f"{case}: loss scaler: {ref['scalers']} " \
                                             f"{out['scalers']}"
    assert (got["global_steps"], got["skipped_steps"]) == (
        reference["global_steps"], reference["skipped_steps"])
    finite = [(a, b) for a, b in zip(ref["grad_norms"], out["grad_norms"], strict=True)
              if math.isfinite(a) or math.isfinite(b)]
    fig = {
        "steps": len(ref["losses"]),
        "max_loss_diff": max(abs(a - b) for a, b in zip(ref["losses"], out["losses"],
                                                        strict=True)),
        "max_rel_norm_diff": max(abs(a - b) / max(1.0, abs(a)) for a, b in finite),
        "max_param_diff": max(abs(x - y) for n in reference["params"]
                              for x, y in zip(reference["params"][n], got["params"][n],
                                              strict=True)),
        "lrs_identical": out["lrs"] == ref["lrs"],
        "skipped_after_load": got["skipped_steps"] - got["loaded"]["skipped_steps"],
    }
    assert set(reference["params"]) == set(got["params"])
    for key, tol in zip(("max_loss_diff", "max_rel_norm_diff", "max_param_diff"), tolerances,
                        strict=True):
        assert fig[key] <= tol, f"{case} at {world} ranks: {key} {fig}"
    return fig


def _check_reference(runs: dict, case: str, load: str) -> None:
    """DeepSpeed's own resume is what the options say: a full load continues as if never
    interrupted; the steps compared are clipped (and, for fp16, move the scale), so they
    test something."""
    saved, resumed = runs[case]["saved"], runs[case][load]
    assert resumed["loaded"]["client"]["epoch"] == 2
    assert resumed["loaded"]["client"]["data"] == [0, 1, 2]
    assert min(resumed["after"]["grad_norms"]) > 0.3  # every finite step was clipped
    assert resumed["after"]["lrs"][0] != resumed["after"]["lrs"][-1]
    if load != "full":
        # A fresh optimizer (and for module_only a fresh schedule) trains differently.
        assert resumed["after"]["losses"] != saved["after"]["losses"]
        steps = resumed["loaded"]["global_steps"]
        assert steps == (0 if load == "module_only" else 6), steps
        return
    assert resumed["after"] == saved["after"], case
    assert resumed["loaded"]["global_steps"] == len(saved["before"]["losses"]) == 6
    if "fp16" in case:
        loaded = resumed["loaded"]["scaler"]
        scales = [s["cur_scale"] for s in resumed["after"]["scalers"]]
        # Saved with the hysteresis spent, after overflows; the first step after the load
        # overflows (OVERFLOW_AT) and halves the scale at once, which then grows back.
        assert loaded["cur_hysteresis"] == 1 and resumed["loaded"]["skipped_steps"] > 0
        assert scales[0] == loaded["cur_scale"] / 2 and scales[-1] > loaded["cur_scale"], scales
        assert resumed["skipped_steps"] == resumed["loaded"]["skipped_steps"] + 1


TEST_NAME = "test_resume_deepspeed_checkpoint_like_deepspeed"


@pytest.mark.parametrize("case,load,world", PARAMS)
def test_resume_deepspeed_checkpoint_like_deepspeed(case, load, world, deepspeed_runs, selected):
    root, runs = deepspeed_runs
    _check_reference(runs, case, load)
    results = _resumed(root, world, selected)
    for r in results[1:]:
        assert r[case][load]["after"]["losses"] == results[0][case][load]["after"]["losses"]
    compare(runs[case][load], results[0][case][load], f"{case} ({load})", world)


if __name__ == "__main__":
    import tempfile

    root = tempfile.mkdtemp(prefix="ds_script_ckpt")
    cases = tuple(sys.argv[1:]) or CASES
    every = [(c, ld, w) for c in cases for ld in LOADS for w in WORLDS if _compared(c, ld, w)]
    runs = run_distributed(_deepspeed_job, 2, (tuple(sorted({(c, ld) for c, ld, _ in every})),
                                                root), timeout=1200)[0]
    print(f"{'case':14} {'load':12} {'ranks':>5} {'steps':>5} {'max |loss diff|':>16} "
          f"{'max rel |norm diff|':>20} {'max |param diff|':>17} LRs identical")
    for world in WORLDS:
        pairs = tuple((c, ld) for c, ld, w in every if w == world)
        resumed = run_distributed(_evenzero_job, world, (pairs, root), timeout=1200)[0]
        for case, load in pairs:
            _check_reference(runs, case, load)
            f = compare(runs[case][load], resumed[case][load], f"{case} ({load})", world)
            print(f"{case:14} {load:12} {world:>5} {f['steps']:>5} "
                  f"{f['max_loss_diff']:>16.3g} {f['max_rel_norm_diff']:>20.3g} "
                  f"{f['max_param_diff']:>17.3g} {str(f['lrs_identical']):>13}")
