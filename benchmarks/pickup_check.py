"""The bf16 pick-up of writes to parameters, before and after the cheap check: the full
element-by-element pick-up (4 temporaries of the shard's size) against
`paramwrites.pick_up` on a step without writes (one bitwise pass through a fixed scratch).
Single process, one thread; best of `--repeats`.

    python benchmarks/pickup_check.py [--numel 4000000] [--repeats 20]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

try:
    import evenzero  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch

from evenzero.runtime.paramwrites import CHECK_NUMEL, pick_up


def full_pick_up(master: torch.Tensor, owned: torch.Tensor) -> None:
    """The pick-up before the cheap check (runtime/paramwrites.py before 092dfc0)."""
    written = owned != master.to(owned.dtype)
    master.copy_(torch.where(written, owned.to(master.dtype), master))


def best_ms(work, repeats: int) -> float:
    work()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--numel", type=int, default=4_000_000)
    p.add_argument("--repeats", type=int, default=20)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    master = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    owned = master.to(torch.bfloat16)  # what the last gather left: nothing written
    scratch = torch.empty(min(CHECK_NUMEL, args.numel), dtype=torch.bfloat16)
    print(f"full pick-up                 {best_ms(lambda: full_pick_up(master, owned), args.repeats):8.2f} ms")
    print(f"cheap check (nothing written) {best_ms(lambda: pick_up(master, owned, scratch), args.repeats):8.2f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
