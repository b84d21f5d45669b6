"""Dense GPT (59M params) on CPU gloo: evenzero vs DDP vs FSDP2 (ZeRO-2) vs DeepSpeed ZeRO-2.

The same as `evenzero bench`; see `evenzero.repro.bench` for what is measured and how.

    python benchmarks/gpt_dense.py [--world-size 4] [--steps 6] [--systems ...] [--json FILE]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

try:
    import evenzero  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from evenzero.repro import bench

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    bench.add_arguments(parser)
    sys.exit(bench.main(parser.parse_args()))
