"""The Python blocks of README.md and docs/*.md, as `tests/test_docs_snippets.py` runs them.

Every fenced block whose info string is `python` (or `py`, `python3`) is a snippet. Each
runs on its own, as written, on 2 CPU ranks under torchrun (`docs_snippet_job.py`), in a
fresh namespace and a fresh working directory, after `PRELUDE`: the names a reader
supplies (`build_model()`, `data`, `model`, ...). A block that does not call
`init_process_group` itself gets a gloo process group from the runner.

A block that cannot run there opts out with a comment on the line above its fence:

    <!-- snippet: skip ID: why it cannot run on 2 CPU ranks -->

ID (lowercase letters, digits, dashes) must also be listed in `SKIPPED` in the test, so a
block is never left out silently. Any other `<!-- snippet: ... -->` comment is an error.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

PYTHON = frozenset({"python", "py", "python3"})
MARKER = re.compile(r"^\s*<!--\s*snippet:(?P<body>.*?)-->\s*$")
SKIP = re.compile(r"^\s*skip\s+(?P<id>[a-z0-9][a-z0-9-]*)\s*:\s*(?P<reason>\S.*?)\s*$")
FENCE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})(?P<info>.*)$")

PRELUDE = '''\
import json, os
import torch, torch.distributed as dist
from torch import nn
import evenzero


def build_model():
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


_gen = torch.Generator().manual_seed(int(os.environ.get("RANK", "0")))
data = [torch.randn(4, 16, generator=_gen) for _ in range(4)]   # this rank's batches
batch, micro_batch_1, micro_batch_2 = data[0], data[1], data[2]
total_steps = len(data)
# The DeepSpeed drop-in's blocks: a model, a dataset of (input, target), a loss, a config.
model = build_model()
dataset = torch.utils.data.TensorDataset(torch.randn(32, 16, generator=_gen),
                                         torch.randn(32, 8, generator=_gen))
criterion = nn.MSELoss()
args = None
with open(f"ds_config.json.{os.getpid()}", "w") as _f:
    json.dump({"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
               "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, _f)
os.replace(f"ds_config.json.{os.getpid()}", "ds_config.json")
'''
"""What a reader brings to every block."""


@dataclass(frozen=True)
class Snippet:
    path: str
    """The Markdown file, relative to the repository root."""
    line: int
    """1-based line of the block's first line of code."""
    code: str
    skip_id: str | None = None
    skip_reason: str | None = None

    @property
    def where(self) -> str:
        return f"{self.path}:{self.line}"


def documents(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def snippets(root: Path) -> list[Snippet]:
    out: list[Snippet] = []
    for path in documents(root):
        out += parse(path.read_text(encoding="utf-8"), str(path.relative_to(root)))
    return out


def parse(text: str, path: str) -> list[Snippet]:
    """The Python blocks of one Markdown text; a malformed or stray marker raises ValueError."""
    lines = text.splitlines()
    out: list[Snippet] = []
    pending: tuple[int, str] | None = None  # (line, marker body) waiting for its fence
    i = 0
    while i < len(lines):
        line = lines[i]
        marker = MARKER.match(line)
        opening = FENCE.match(line)
        if marker:
            if pending is not None:
                raise ValueError(f"{path}:{pending[0] + 1}: snippet marker not followed by a "
                                 f"python block")
            pending = (i, marker["body"])
            i += 1
            continue
        if opening is None:
            if line.strip() and pending is not None:
                raise ValueError(f"{path}:{pending[0] + 1}: snippet marker not followed by a "
                                 f"python block")
            i += 1
            continue
        indent, fence = len(opening["indent"]), opening["fence"]
        language = (opening["info"].strip().split() or [""])[0].lower()
        body, j = [], i + 1
        while j < len(lines):
            close = FENCE.match(lines[j])
            if (close and close["fence"][0] == fence[0] and len(close["fence"]) >= len(fence)
                    and not close["info"].strip()):
                break
            body.append(lines[j][indent:] if lines[j][:indent].strip() == "" else lines[j])
            j += 1
        else:
            raise ValueError(f"{path}:{i + 1}: code block never closed")
        if language in PYTHON:
            skip_id = reason = None
            if pending is not None:
                skip = SKIP.match(pending[1])
                if skip is None:
                    raise ValueError(f"{path}:{pending[0] + 1}: expected <!-- snippet: skip ID: "
                                     f"reason -->, got {pending[1].strip()!r}")
                skip_id, reason = skip["id"], skip["reason"]
            out.append(Snippet(path, i + 2, "\n".join(body) + "\n", skip_id, reason))
        elif pending is not None:
            raise ValueError(f"{path}:{pending[0] + 1}: snippet marker before a "
                             f"{language or 'plain'} block; only python blocks are run")
        pending = None
        i = j + 1
    if pending is not None:
        raise ValueError(f"{path}:{pending[0] + 1}: snippet marker not followed by a python block")
    return out
