"""python -m tests.fuzz --cases 1000 [--seed S] [--world 2 3] [--out DIR] [--no-shrink]

Draws `--cases` cases (seeds S .. S+cases-1), runs each under DDP and evenzero at every
world size given, prints the tally, the features covered and the closest call per compared
quantity (largest difference / allowed difference; below 1 passes), and shrinks every case
that did not pass to a runnable script in `--out` (default: fuzz-failures/).
Run from the repository root with evenzero importable (pip install -e . or PYTHONPATH=src).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

from .case import Case, draw_case, features
from .pool import first_failing, run_cases
from .shrink import script, shrink, size


def _same_failure(status: str, detail: str):
    """Whether a candidate fails the way the original did (same status; for an error,
    the same exception type; for a mismatch, any mismatch)."""
    kind = detail.split(":", 1)[0] if status == "error" else ""

    def same(result: dict) -> bool:
        if result["status"] != status:
            return False
        return status != "error" or result["detail"].split(":", 1)[0] == kind
    return same


def search(cases: list[Case], world: int, batch: int, log) -> list[dict]:
    results: list[dict] = []
    for start in range(0, len(cases), batch):
        chunk = cases[start:start + batch]
        t = time.monotonic()
        got = run_cases(chunk, world)
        for c, r in zip(chunk, got, strict=True):
            if r["status"] != "ok":
                log(f"world {world} seed {c.seed}: {r['status']}: {r['detail'][:300]}")
        results += got
        bad = sum(r["status"] != "ok" for r in results)
        log(f"world {world}: {len(results)}/{len(cases)} cases ({time.monotonic() - t:.0f} s for "
            f"the last {len(chunk)}), {bad} not ok")
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=100)
    ap.add_argument("--seed", type=int, default=0, help="first case seed")
    ap.add_argument("--world", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--batch", type=int, default=100, help="cases per spawn of the ranks")
    ap.add_argument("--out", default="fuzz-failures", help="where shrunk repro scripts go")
    ap.add_argument("--no-shrink", action="store_true")
    ap.add_argument("--json", help="also write the summary as JSON here")
    args = ap.parse_args(argv)

    def log(msg: str) -> None:
        print(msg, file=sys.stderr, flush=True)

    cases = [draw_case(args.seed + i) for i in range(args.cases)]
    coverage = collections.Counter(f for c in cases for f in features(c))
    summary: dict = {"cases": args.cases, "seeds": [args.seed, args.seed + args.cases - 1],
                     "features": dict(sorted(coverage.items())), "worlds": {}}
    failures = []
    for world in args.world:
        t = time.monotonic()
        results = search(cases, world, args.batch, log)
        tally = collections.Counter(r["status"] for r in results)
        closest: dict[str, tuple[float, int]] = {}
        for c, r in zip(cases, results, strict=True):
            for k, v in (r.get("worst") or {}).items():
                key = f"{c.precision} {k}"
                if v > closest.get(key, (-1.0, 0))[0]:
                    closest[key] = (round(v, 3), c.seed)
            if r["status"] != "ok":
                failures.append((world, c, r))
        summary["worlds"][world] = {"tally": dict(tally), "seconds": round(time.monotonic() - t),
                                    "closest_call": dict(sorted(closest.items()))}
    print(f"{args.cases} cases, seeds {args.seed}..{args.seed + args.cases - 1}")
    print("features: " + ", ".join(f"{k} {v}" for k, v in summary["features"].items()))
    for world, w in summary["worlds"].items():
        print(f"world {world} ({w['seconds']} s): " + ", ".join(f"{k} {v}" for k, v in w["tally"].items()))
        print("  closest call (difference / allowed): " + ", ".join(
            f"{k} {v} (seed {s})" for k, (v, s) in w["closest_call"].items()))
    out = Path(args.out)
    for world, case, r in failures:
        print(f"\nworld {world} seed {case.seed}: {r['status']}: {r['detail'][:400]}")
        if args.no_shrink:
            continue
        same = _same_failure(r["status"], r["detail"])

        def first(cands: list[Case], world=world, same=same) -> int | None:
            return first_failing(cands, world, same)

        small = shrink(case, first, log=log)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"repro_w{world}_seed{case.seed}.py"
        detail = run_cases([small], world)[0]["detail"]
        path.write_text(script(small, world, f"{r['status']}: {detail}"))
        print(f"  shrunk (size {size(case)} -> {size(small)}): {path}")
    if args.json:
        Path(args.json).write_text(json.dumps({**summary, "failures": [
            {"world": w, "seed": c.seed, "status": r["status"], "detail": r["detail"]}
            for w, c, r in failures]}, indent=1))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
