"""Matrix-aligned Muon layouts: padding and Newton-Schulz balance per rank, as `evenzero
plan --optimizer muon` plans them (BENCHMARKS.md, "Muon"). Planner only, no processes.

    PYTHONPATH=src python3 benchmarks/muon_plan.py [--worlds 8 64 128]
"""

from __future__ import annotations

import argparse
import re
import time

from evenzero.commands.plan import load_model
from evenzero.strategies import PlanOptions, plan
from evenzero.strategies.wholetensor import muon_split

MODELS = ("seed-moe", "benchmarks/models/llama-20m.json", "gpt2-xl")


def row(name: str, world: int) -> str:
    spec, whole = muon_split(load_model(name))
    total = sum(p.numel for p in spec.params)
    t0 = time.perf_counter()
    p = plan(spec, world, "evenzero", PlanOptions(whole_tensor=whole))
    seconds = time.perf_counter() - t0
    aligned = [n for n in p.notes if "matrix-aligned" in n]
    ratios = [re.search(r"max/mean ([0-9.]+)", n).group(1) for n in aligned]
    groups = [n.split(":")[0].removeprefix("group ") for n in aligned]
    grown = any("grown" in n for n in p.notes)
    return (f"| {spec.name} | {world} | {p.padding():,} | {100 * p.padding() / total:.2f}% | "
            f"{', '.join(f'{g} {r}' for g, r in zip(groups, ratios, strict=True))} | "
            f"{len(p.buckets)} | {'yes' if grown else 'no'} | {seconds:.1f} s |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--worlds", type=int, nargs="+", default=[8, 64, 128])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    args = ap.parse_args()
    print("| model | ranks | padding (elements) | of the model | NS max/mean per rank "
          "(group) | buckets | bucket grown | planning |")
    print("|---|---:|---:|---:|---|---:|---|---:|")
    for name in args.models:
        for world in args.worlds:
            print(row(name, world), flush=True)


if __name__ == "__main__":
    main()
