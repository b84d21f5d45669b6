"""Every Python block of README.md and docs/*.md runs as written on 2 CPU ranks (issue 21).

How blocks are found, what the prelude supplies and how a block opts out:
`tests/doc_snippets.py`. An opted-out block is listed here by its ID, with the reason.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from doc_snippets import parse, snippets

ROOT = Path(__file__).resolve().parents[1]
JOB = Path(__file__).with_name("docs_snippet_job.py")

SKIPPED = {
    "load-deepspeed": "needs a checkpoint written by DeepSpeed itself "
                      "(tests/test_checkpoint_deepspeed.py loads real ones)",
    "deepspeed-vs-evenzero": "two versions of one step side by side, not one program",
    "lightning-gpu": "Lightning launches its own 8 GPU processes; the same Trainer and Fabric "
                     "calls run on CPU ranks in tests/test_lightning_strategy.py and "
                     "tests/test_lightning_fabric.py",
}
"""Blocks that cannot run on 2 CPU ranks as written, by the ID of their marker."""


def test_every_python_block_runs_or_is_listed_here():
    found = snippets(ROOT)
    assert sum(s.path == "README.md" for s in found) >= 4, [s.where for s in found]
    skipped = {s.skip_id: s for s in found if s.skip_id is not None}
    assert set(skipped) == set(SKIPPED), (
        "a block opted out with <!-- snippet: skip ID: reason --> must be listed in SKIPPED, "
        "and a listed ID must still mark a block", sorted(skipped), sorted(SKIPPED))


def test_python_blocks_run_on_two_cpu_ranks(tmp_path):
    runnable = [s for s in snippets(ROOT) if s.skip_id is None]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(JOB.parent),
                                                       os.environ.get("PYTHONPATH")]))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", "--monitor-interval", "0.1", str(JOB), str(ROOT), str(tmp_path)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=420)
    failed = [line for line in done.stderr.splitlines() if line.startswith("FAIL ")]
    assert done.returncode == 0, "\n".join(failed) + "\n" + done.stderr[-4000:]
    ran = [line.removeprefix("ok ") for line in done.stdout.splitlines() if line.startswith("ok ")]
    assert ran == [s.where for s in runnable], done.stdout


def test_markers_are_checked():
    text = "<!-- snippet: skip demo: no GPU here -->\n```python\nx = 1\n```\n```bash\nls\n```\n"
    first, = parse(text, "x.md")
    assert (first.skip_id, first.skip_reason, first.line, first.code) == (
        "demo", "no GPU here", 3, "x = 1\n")
    # Indented fences (inside a list) and longer fences are blocks too.
    listed, = parse("1. step\n\n   ````py\n   y = 2\n   ````\n", "x.md")
    assert listed.code == "y = 2\n" and listed.skip_id is None
    for bad in ("<!-- snippet: skp demo: typo -->\n```python\nx\n```\n",
                "<!-- snippet: skip demo: before bash -->\n```bash\nls\n```\n",
                "<!-- snippet: skip demo: stray -->\n\ntext\n",
                "```python\nnever closed\n"):
        with pytest.raises(ValueError):
            parse(bad, "x.md")
