"""`evenzero convert-deepspeed DS_DIR OUT_DIR`: a DeepSpeed ZeRO-1/2 checkpoint as an
evenzero checkpoint, on one process, without DeepSpeed or torch.distributed.

    evenzero convert-deepspeed ds_ckpt/ ez_ckpt/ [--tag global_step40] [--optimizer AdamW]

The arguments and the output; the conversion is
`evenzero.checkpoint.deepspeed.offline.convert_deepspeed`.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from evenzero.checkpoint.deepspeed.offline import SUMMARY_FILE, convert_deepspeed
from evenzero.checkpoint.format import CheckpointError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("source", metavar="DS_DIR",
                        help="DeepSpeed save_dir (with 'latest') or a tag directory")
    parser.add_argument("out", metavar="OUT_DIR", help="where to write the evenzero checkpoint")
    parser.add_argument("--tag", help="checkpoint tag to convert (default: the one in 'latest')")
    parser.add_argument("--optimizer", metavar="NAME",
                        help="torch.optim class the run continues with (default: AdamW or "
                             "Adam, as DeepSpeed ran)")


def main(args: argparse.Namespace) -> int:
    try:
        path = convert_deepspeed(args.source, args.out, args.tag, optimizer=args.optimizer)
    except (CheckpointError, OSError) as e:
        print(f"evenzero convert-deepspeed: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} and {Path(args.out) / SUMMARY_FILE}")
    return 0

