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

from evenzero.checkpoint.deepspeed import is_deepspeed_checkpoint
from evenzero.checkpoint.deepspeed.offline import SUMMARY_FILE, convert_deepspeed
from evenzero.checkpoint.deepspeed.reader import LATEST
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
    problem = source_problem(Path(args.source), args.tag)
    if problem is not None:
        print(f"evenzero convert-deepspeed: error: {problem}", file=sys.stderr)
        return 2
    try:
        path = convert_deepspeed(args.source, args.out, args.tag, optimizer=args.optimizer)
    except (CheckpointError, OSError) as e:
        print(f"evenzero convert-deepspeed: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {path} and {Path(args.out) / SUMMARY_FILE}")
    return 0


def source_problem(source: Path, tag: str | None) -> str | None:
    """What is wrong with DS_DIR in command-line terms, before the library reads it, or
    None: a path that does not exist, and a save_dir without `latest` and no --tag."""
    try:
        if not source.exists():
            return (f"DS_DIR {source}: does not exist; give the directory DeepSpeed's "
                    f"save_checkpoint wrote (it holds 'latest' and one directory per tag)")
        if not source.is_dir():
            return f"DS_DIR {source}: is not a directory"
        if tag is not None or (source / LATEST).is_file() or is_deepspeed_checkpoint(source):
            return None
        tags = sorted(p.name for p in source.iterdir() if p.is_dir())
    except OSError as e:
        return f"DS_DIR {source}: {e.strerror or type(e).__name__}"
    found = (f"directories here: {', '.join(tags[:8])}{', ...' if len(tags) > 8 else ''}"
             if tags else "it holds no directories; is it DeepSpeed's save_dir?")
    return (f"DS_DIR {source}: no '{LATEST}' file naming the checkpoint tag; pass --tag TAG "
            f"({found})")
