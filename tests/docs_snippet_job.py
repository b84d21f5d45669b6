"""Run every Python block of README.md and docs/*.md that is not opted out, as written.

    torchrun --standalone --nproc-per-node 2 tests/docs_snippet_job.py ROOT WORKDIR

Each block runs after `doc_snippets.PRELUDE` in a fresh namespace and its own directory
under WORKDIR (the same on every rank, so relative checkpoint paths meet). A block that
does not initialise torch.distributed itself gets a gloo group. After each block its
group is destroyed, and the next one rendezvous on a fresh store: rank 0 picks a free
port, sent over the old group (re-initialising on the same store can meet the previous
group's keys). Rank 0 prints `ok PATH:LINE` per block; the first failure prints its
traceback (with the Markdown file's line numbers) and ends the job.
"""

from __future__ import annotations

import gc
import os
import socket
import sys
import traceback
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from doc_snippets import PRELUDE, snippets


def main() -> None:
    root, work = Path(sys.argv[1]), Path(sys.argv[2])
    rank = int(os.environ["RANK"])
    for k, snippet in enumerate(s for s in snippets(root) if s.skip_id is None):
        where = work / f"block{k}"
        where.mkdir(parents=True, exist_ok=True)
        os.chdir(where)
        if "init_process_group" not in snippet.code:
            dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        namespace: dict = {"__name__": "__snippet__"}
        try:
            exec(compile(PRELUDE, "<prelude: tests/doc_snippets.py>", "exec"), namespace)
            # Padded so that a traceback names the Markdown file's own line.
            code = "\n" * (snippet.line - 1) + snippet.code
            exec(compile(code, str(root / snippet.path), "exec"), namespace)
        except BaseException:  # noqa: BLE001 - report which block, then end the whole job
            print(f"FAIL {snippet.where} on rank {rank}\n{traceback.format_exc()}",
                  file=sys.stderr, flush=True)
            os._exit(1)
        namespace.clear()
        gc.collect()
        if dist.is_initialized():
            fresh_store_for_next_block()
        if rank == 0:
            print(f"ok {snippet.where}", flush=True)


def fresh_store_for_next_block() -> None:
    port = [_free_port() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(port, src=0)
    dist.barrier()
    dist.destroy_process_group()
    # Rank 0 hosts the next store itself (env://), on the port every rank now knows.
    os.environ.update(MASTER_PORT=str(port[0]), TORCHELASTIC_USE_AGENT_STORE="False")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
