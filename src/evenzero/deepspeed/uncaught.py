"""A refusal that ends a job under `evenzero run`: one message, not a traceback per process.

When a job asks for something evenzero.deepspeed refuses (a config key, a call, a module),
every rank raises the same error. Left to Python and the launcher, each rank prints its
traceback (torch prefixes every line with `[rankN]:`) and the launcher adds its own for the
failed ranks (torchrun's `ChildFailedError`, Accelerate's `CalledProcessError`): some 70
lines around one sentence. Under `evenzero run` instead:

* every Python process of the job (ranks and launchers alike) runs `excepthook` for its
  uncaught exceptions: this file is the stand-in directory's `sitecustomize`
  (`evenzero.deepspeed.standin` copies it there), which installs the hook at start-up,
  before torch wraps it with its rank prefix. So it imports nothing but the standard
  library until an exception arrives, and then evenzero only where evenzero.deepspeed is
  loaded already: a launcher pays nothing for it;
* a process whose uncaught exception is a refusal (`is_refusal`, or one in its chain of
  causes) writes the message to the job's record directory and exits with status 1,
  printing nothing;
* a process whose uncaught exception comes after a refusal was recorded (a launcher
  reporting the failed ranks, a rank whose peer left) exits with status 1 quietly too:
  its error is a consequence of the refusal;
* `evenzero run` prints each distinct message once, with the ranks that raised it, when
  the command ends (`summary`). Ranks that raised different refusals are listed apart.

A refusal that the script catches never reaches the hook, so a script's fallbacks (`try:
import deepspeed.ops.aio except ImportError: ...`) work as without evenzero. The exit
status stays non-zero, so the launcher still stops the other ranks at once (torchrun) and
restarts the job if it was asked to. `EVENZERO_DEBUG=1` leaves every traceback as it is.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

RECORDS = "refused"
"""Subdirectory of the stand-in directory (`standin.STANDIN_ENV`) holding one record per
process that ended with a refusal, and one empty marker per process silenced after it."""
DEBUG_ENV = "EVENZERO_DEBUG"
"""Set to anything but "" or "0": every traceback is printed as usual."""
STANDIN_ENV = "EVENZERO_DEEPSPEED_STANDIN"
"""The job's stand-in directory (the same name as `standin.STANDIN_ENV`, which imports
this module)."""

ExceptHook = Callable[..., object]


@dataclass(frozen=True)
class Refusal:
    """What one process recorded."""

    message: str
    """The refusal's message: it names the key or call and the fix."""
    rank: int | None
    """The process's `RANK` (None: a process outside the ranks, or a single process)."""


def is_refusal(error: BaseException) -> bool:
    """Raised by evenzero.deepspeed for a key, call, module or launch it does not support
    (never for a bug or a failure at run time). False in a process that never loaded
    evenzero.deepspeed: nothing there can have raised one."""
    if "evenzero.deepspeed" not in sys.modules:
        return False
    from evenzero.deepspeed.config_keys import DeepSpeedConfigError
    from evenzero.deepspeed.launch import LaunchError
    from evenzero.deepspeed.refusals import RefusedModuleError, UnsupportedError

    return isinstance(error, (DeepSpeedConfigError, UnsupportedError, RefusedModuleError,
                              LaunchError))


def refusal_in(error: BaseException) -> BaseException | None:
    """`error` if it is a refusal, else the first refusal among its causes and contexts
    (a framework that re-raises it wrapped), else None."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if is_refusal(current):
            return current
        current = current.__cause__ or current.__context__
    return None


def excepthook(kind: type[BaseException], value: BaseException, tb, previous: ExceptHook) -> None:
    """`sys.excepthook` in a job under `evenzero run`; `previous` is the hook it replaced."""
    directory = os.environ.get(STANDIN_ENV)
    if not directory or _debug() or not isinstance(value, Exception):
        previous(kind, value, tb)
        return
    refused = refusal_in(value)
    try:
        if refused is not None:
            _write(Path(directory), "refusal", {"message": str(refused), "rank": _rank()})
            return
        if recorded(Path(directory)):
            _write(Path(directory), "hidden", {})
            return
    except OSError:
        pass  # the record directory is gone (evenzero run ended): print as usual
    previous(kind, value, tb)


def install() -> None:
    """Make `excepthook` this process's hook, in front of the current one; once."""
    if getattr(sys.excepthook, "evenzero_uncaught", False):
        return

    def hook(kind, value, tb, previous=sys.excepthook):
        excepthook(kind, value, tb, previous)

    hook.evenzero_uncaught = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def recorded(directory: Path) -> bool:
    """Whether some process of the job has recorded a refusal."""
    records = directory / RECORDS
    return records.is_dir() and any(p.name.startswith("refusal-") for p in records.iterdir())


def refusals(directory: Path) -> list[Refusal]:
    """Every refusal recorded in the job, oldest first."""
    records = directory / RECORDS
    if not records.is_dir():
        return []
    out = []
    for path in sorted(records.glob("refusal-*.json"), key=lambda p: (p.stat().st_mtime_ns, p.name)):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # a process killed while writing: the others recorded the same
        out.append(Refusal(str(data.get("message", "")), data.get("rank")))
    return out


def hidden(directory: Path) -> int:
    """How many processes ended quietly after a refusal."""
    records = directory / RECORDS
    return len(list(records.glob("hidden-*.json"))) if records.is_dir() else 0


def summary(directory: Path, status: int) -> list[str]:
    """What `evenzero run` prints when the command ended with `status`: each distinct
    refusal once, with the ranks that raised it; nothing when there was none."""
    found = refusals(directory)
    if not found:
        return []
    by_message: dict[str, set[int | None]] = {}
    for r in found:
        by_message.setdefault(r.message, set()).add(r.rank)
    lines = [f"evenzero run: refused{_where(ranks)}: {message}"
             for message, ranks in by_message.items()]
    if len(by_message) > 1:
        lines.append("evenzero run: the ranks were refused for different reasons: their "
                     "configs or code paths differ")
    quiet = len(found) + hidden(directory)
    tracebacks = ("its traceback is" if quiet == 1 else
                  f"the tracebacks of its {quiet} processes (ranks and launcher) are")
    lines.append(f"evenzero run: the job ended with exit status {status}; {tracebacks} not "
                 f"shown ({DEBUG_ENV}=1 shows them)")
    return lines


def _where(ranks: set[int | None]) -> str:
    known = sorted(r for r in ranks if r is not None)
    if not known:
        return ""
    return f" on rank {known[0]}" if len(known) == 1 else f" on ranks {_spans(known)}"


def _spans(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out = []
    start = prev = ranks[0]
    for r in ranks[1:] + [None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        out.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(out)


def _write(directory: Path, kind: str, data: dict) -> None:
    records = directory / RECORDS
    records.mkdir(exist_ok=True)
    # Written aside and renamed, so that a reader never sees half a record.
    final = records / f"{kind}-{os.getpid()}.json"
    staging = records / f".{final.name}.tmp"
    staging.write_text(json.dumps(data))
    os.replace(staging, final)


def _rank() -> int | None:
    try:
        return int(os.environ["RANK"])
    except (KeyError, ValueError):
        return None


def _debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


def _next_sitecustomize() -> None:
    """Run the `sitecustomize` this copy shadows (a distribution's or an environment's),
    as Python would have without the stand-in."""
    import importlib.machinery
    import importlib.util

    def standin(entry: str) -> bool:  # this copy's directory, or an outer job's
        directory = os.path.abspath(entry or os.curdir)
        return (os.path.isdir(os.path.join(directory, RECORDS))
                and os.path.isfile(os.path.join(directory, "sitecustomize.py"))
                and os.path.isdir(os.path.join(directory, "deepspeed")))

    path = [entry for entry in sys.path if not standin(entry)]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if __name__ == "sitecustomize":  # this file, copied into a job's stand-in directory
    install()
    _next_sitecustomize()


__all__ = ["Refusal", "excepthook", "hidden", "install", "is_refusal", "recorded",
           "refusal_in", "refusals", "summary"]
