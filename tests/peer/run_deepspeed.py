"""Run DeepSpeed's vendored ZeRO-1/2 unit tests (tests/peer/deepspeed) on CPU under evenzero's
stand-in (`evenzero run`) and, as the control, under the installed DeepSpeed; print each
test's outcome under both and the counts.

    PYTHONPATH=src python3 tests/peer/run_deepspeed.py                 # both, the full set
    PYTHONPATH=src python3 tests/peer/run_deepspeed.py --under standin unit/checkpoint
    PYTHONPATH=src python3 tests/peer/run_deepspeed.py --json out.json -k "TestZeroToFP32"

Positional arguments are test paths or ids relative to tests/peer/deepspeed (default: the
files in `DEFAULT_PATHS`). Exit status 0 when the stand-in passes every applicable test that
the control passes (only `--under both` compares), else 1.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
VENDORED = HERE / "deepspeed"
REPO = HERE.parent.parent

# test_zero_user_backward.py is vendored only because test_zero_coalesce_grad_reduction.py
# imports its helpers; its 134 ZeRO-1/2 ids (user-driven backward, activation checkpointing)
# are outside the selection and would double the run.
DEFAULT_PATHS = (
    "unit/v1/zero/test_zero.py",
    "unit/v1/zero/test_zero_coalesce_grad_reduction.py",
    "unit/checkpoint",
    "unit/runtime/half_precision",
    "unit/v1/half_precision",
    "unit/v1/moe/test_moe.py",
    "unit/runtime/zero/test_zero_tensor_fragment.py",
    "unit/runtime/zero/test_ignore_unused_parameters.py",
)

UNDER = ("standin", "deepspeed")


@dataclass(frozen=True)
class Outcome:
    status: str  # passed, failed, error, skipped
    message: str


def run_pytest(under: str, paths: list[str], extra: list[str], timeout_s: int,
               workdir: Path) -> tuple[dict[str, Outcome], dict[str, str], int]:
    """Run the vendored tests; returns ({id: outcome}, {deselected id: reason}, rc).

    DeepSpeed's harness ends the whole pytest session when one test outlives its timeout
    ("Test hanged, exiting"); that test is recorded as `hanged` and the run goes on with
    the ids after it."""
    outcomes: dict[str, Outcome] = {}
    dropped: dict[str, str] = {}
    selected_file = workdir / f"{under}-selected.json"
    args, rc, attempt = list(paths), 0, 0
    while True:
        got, dropped_now, rc, log = _pytest_once(under, args, extra, timeout_s, workdir,
                                                 f"{under}-{attempt}")
        outcomes.update(got)
        dropped.update(dropped_now)
        # An id this side does not collect (a module it skips whole) makes pytest run none.
        absent = [line.split(str(VENDORED) + "/", 1)[1] for line in log.splitlines()
                  if line.startswith("ERROR: found no collectors for ")]
        if absent and not got:
            for i in absent:
                outcomes[i] = Outcome("uncollected", "this side does not collect the id")
            args = [a for a in args if a not in absent]
            if not args:
                return outcomes, dropped, rc
            attempt += 1
            continue
        if not selected_file.exists():
            return outcomes, dropped, rc
        selected = json.loads(selected_file.read_text())
        missing = [i for i in selected if i not in outcomes]
        if not missing or "Test hanged" not in log:
            return outcomes, dropped, rc
        outcomes[missing[0]] = Outcome("hanged", f"outlived DS_UNITTEST_TIMEOUT={timeout_s}s")
        args, attempt = missing[1:], attempt + 1
        if not args:
            return outcomes, dropped, rc


def _pytest_once(under: str, args: list[str], extra: list[str], timeout_s: int, workdir: Path,
                 name: str) -> tuple[dict[str, Outcome], dict[str, str], int, str]:
    junit = workdir / f"{name}.xml"
    deselected = workdir / f"{name}-deselected.json"
    env = dict(os.environ)
    env.update({"DS_ACCELERATOR": "cpu",
                # DistributedTest skips when the accelerator has fewer devices than ranks;
                # the CPU accelerator counts LOCAL_SIZE as its devices (both implementations).
                "LOCAL_SIZE": "4",
                "DS_UNITTEST_TIMEOUT": str(timeout_s),
                "ZERO12_DESELECTED": str(deselected),
                "PYTHONPATH": os.pathsep.join([str(VENDORED)] + [p for p in [env.get(
                    "PYTHONPATH", "")] if p])})
    selected = workdir / f"{under}-selected.json"
    if not selected.exists():
        env["ZERO12_SELECTED"] = str(selected)
    pytest = [sys.executable, "-m", "pytest", "-p", "zero12_select", "-p", "no:cacheprovider",
              "--color=no", "-q", f"--junitxml={junit}", *args, *extra]
    if under == "standin":
        src = str(REPO / "src")
        env["PYTHONPATH"] = os.pathsep.join([src, env["PYTHONPATH"]])
        command = [sys.executable, "-c", "import sys; from evenzero.cli import main; "
                   "sys.exit(main())", "run", *pytest]
    else:
        command = pytest
    log_path = workdir / f"{name}.log"
    with open(log_path, "w") as log:
        # Streamed, so a long run can be watched; SIGINT restored, so that interrupting
        # pytest (which then still writes its report) works from a background job too.
        proc = subprocess.run(command, cwd=VENDORED, env=env, stdout=log,
                              stderr=subprocess.STDOUT, text=True,
                              preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    stdout = log_path.read_text()
    outcomes = parse_junit(junit) if junit.exists() else {}
    dropped = json.loads(deselected.read_text()) if deselected.exists() else {}
    return outcomes, dropped, proc.returncode, stdout


def sample_ids(paths: list[str], extra: list[str]) -> list[str]:
    """The last applicable id of each test function under `paths` (collected under the
    installed DeepSpeed, or the stand-in where it is absent: both collect the same ids)."""
    with tempfile.TemporaryDirectory() as tmp:
        selected = Path(tmp) / "selected.json"
        env = dict(os.environ, DS_ACCELERATOR="cpu", ZERO12_SELECTED=str(selected),
                   PYTHONPATH=os.pathsep.join([str(VENDORED), str(REPO / "src")]))
        subprocess.run([sys.executable, "-m", "pytest", "-p", "zero12_select", "-p",
                        "no:cacheprovider", "--collect-only", "-q", *paths, *extra],
                       cwd=VENDORED, env=env, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        ids = json.loads(selected.read_text())
    first: dict[str, str] = {}
    for i in ids:
        first[i.split("[")[0]] = i  # the last: usually stage 2, the widest parameters
    return list(first.values())


def parse_junit(path: Path) -> dict[str, Outcome]:
    """{pytest id: outcome} from a JUnit XML report of the vendored run."""
    outcomes: dict[str, Outcome] = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        classname = case.get("classname", "")
        name = case.get("name", "")
        status, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            node = case.find(tag)
            if node is not None:
                status = {"failure": "failed"}.get(tag, tag)
                message = (node.get("message") or "").strip().splitlines()[0:1]
                message = message[0][:300] if message else ""
                break
        outcomes[junit_id(classname, name)] = Outcome(status, message)
    return outcomes


def junit_id(classname: str, name: str) -> str:
    """pytest's node id from JUnit's dotted classname (`unit.v1.zero.test_zero.TestX`)."""
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        candidate = VENDORED.joinpath(*parts[:i]).with_suffix(".py")
        if candidate.exists():
            return "::".join(["/".join(parts[:i]) + ".py", *parts[i:], name])
    return "::".join([classname, name])


REFUSED_FEATURES = ("ZeRO stage 3", "ZeRO-3", "offload", "Offload", "pipeline parallelism",
                    "NVMe")
"""The features evenzero refuses by name (issue 28: ZeRO-3, NVMe/offload, pipeline)."""


def refused_by_name(outcome: Outcome) -> bool:
    """A stand-in failure that is evenzero's refusal of a feature it refuses by name."""
    return (outcome.status in ("failed", "error") and "evenzero" in outcome.message
            and any(w in outcome.message for w in REFUSED_FEATURES))


def summarise(results: dict[str, dict[str, Outcome]], dropped: dict[str, str]) -> dict:
    """The counts and per-test table; `results[under][id]`."""
    ids = sorted(set().union(*[set(r) for r in results.values()]))
    counts = {under: {} for under in results}
    for under, table in results.items():
        for outcome in table.values():
            counts[under][outcome.status] = counts[under].get(outcome.status, 0) + 1
    summary = {"ids": len(ids), "deselected (refused by name)": len(dropped), "counts": counts}
    if set(results) == set(UNDER):
        control = {i for i in ids if results["deepspeed"].get(i, Outcome("missing", "")).status
                   == "passed"}
        standin = results["standin"]
        refused = sorted(i for i in control if refused_by_name(standin.get(i, Outcome("", ""))))
        applicable = control - set(refused)
        passed = sorted(i for i in applicable if standin.get(i) and standin[i].status == "passed")
        summary.update({
            "control passes": len(control),
            "refused by name under the stand-in": refused,
            "applicable (control passes, not refused)": len(applicable),
            "stand-in passes of those": len(passed),
            "ratio": round(len(passed) / len(applicable), 4) if applicable else None,
            "stand-in fails where the control passes": sorted(applicable - set(passed)),
        })
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="*", help="tests or ids under tests/peer/deepspeed")
    parser.add_argument("--under", choices=("both", *UNDER), default="both")
    parser.add_argument("-k", dest="keyword", help="pytest -k expression")
    parser.add_argument("--timeout", type=int, default=600,
                        help="seconds before DistributedTest calls a test hung (DeepSpeed's "
                             "DS_UNITTEST_TIMEOUT)")
    parser.add_argument("--json", help="write the per-test outcomes and counts here")
    parser.add_argument("--logs", help="keep pytest's logs and reports in this directory")
    parser.add_argument("--sample", action="store_true",
                        help="only the last applicable id of each test function")
    args = parser.parse_args(argv)
    paths = args.paths or list(DEFAULT_PATHS)
    extra = ["-k", args.keyword] if args.keyword else []
    if args.sample:
        paths, extra = sample_ids(paths, extra), []
    unders = UNDER if args.under == "both" else (args.under,)
    results: dict[str, dict[str, Outcome]] = {}
    dropped: dict[str, str] = {}
    with tempfile.TemporaryDirectory(prefix="evenzero-peer-") as tmp:
        if args.logs:
            Path(args.logs).mkdir(parents=True, exist_ok=True)
            tmp = args.logs
        for under in unders:
            outcomes, dropped, rc = run_pytest(under, paths, extra, args.timeout, Path(tmp))
            if not outcomes:
                log = (Path(tmp) / f"{under}-0.log").read_text()
                print(f"{under}: no test ran (pytest exit {rc}); the end of its output:\n"
                      f"{log[-3000:]}", file=sys.stderr)
                return 2
            results[under] = outcomes
    ids = sorted(set().union(*[set(r) for r in results.values()]))
    width = max(len(i) for i in ids)
    print(f"{'test':<{width}}  " + "  ".join(f"{u:<9}" for u in unders))
    for i in ids:
        cells = [results[u].get(i, Outcome("-", "")) for u in unders]
        line = f"{i:<{width}}  " + "  ".join(f"{c.status:<9}" for c in cells)
        why = next((c.message for c in cells if c.status in ("failed", "error")), "")
        print(line + (f"  {why[:160]}" if why else ""))
    summary = summarise(results, dropped)
    for key, value in summary.items():
        if isinstance(value, list):
            print(f"{key}: {len(value)}")
            for item in value:
                print(f"  {item}")
        else:
            print(f"{key}: {value}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "summary": summary, "deselected": dropped,
            "outcomes": {u: {i: [o.status, o.message] for i, o in r.items()}
                         for u, r in results.items()}}, indent=1))
    if "ratio" in summary:
        return 0 if not summary["stand-in fails where the control passes"] else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
