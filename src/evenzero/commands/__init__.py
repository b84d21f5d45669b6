"""What every `evenzero` subcommand shares: its error types and its argument checks.

A subcommand is a module with two functions, registered by name in `evenzero.cli.COMMANDS`:

    def add_arguments(parser: argparse.ArgumentParser) -> None: ...
    def main(args: argparse.Namespace) -> int: ...

`evenzero.cli.main` imports the module only when its command runs (so `evenzero plan`
never imports torch), and turns the errors below into one line on stderr:
`UsageError` and the library's input errors (SpecError, PlanError, CostModelError) exit
2, `CommandError` exits 1. The argument types here reject bad numbers and paths while
parsing, with a message that names the flag and the allowed range, before any work runs.
"""

from __future__ import annotations

import argparse
import math
import os
import stat
from pathlib import Path

MAX_DIGITS = 30
"""Longest integer accepted on the command line (int() of a 5,000-digit string raises)."""
MAX_LOCAL_RANKS = 64
"""Most local ranks a command spawns (`repro`, `bench`, `calibrate`): each is a process
with its own torch (~300 MB). Larger worlds run under a launcher (torchrun)."""


class UsageError(Exception):
    """A command-line mistake; printed on one line, exit status 2."""


class CommandError(Exception):
    """A command that ran and failed (a rank died, calibration failed); exit status 1."""


def int_in(low: int, high: int | None = None, why: str = "") -> type:
    """An argparse type: an integer in [low, high]; `why` explains the upper bound."""

    def parse(text: str) -> int:
        digits = text.strip().lstrip("+-").replace("_", "")
        if len(digits) > MAX_DIGITS:
            raise argparse.ArgumentTypeError(f"{_cut(text)} is not an integer of at most "
                                             f"{MAX_DIGITS} digits")
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_cut(text)} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is below the minimum of {low}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"{value:,} is over the limit of {high:,}"
                                             + (f" ({why})" if why else ""))
        return value

    parse.__name__ = "integer"  # argparse names the type in its own messages
    return parse


def finite_float(low: float, *, inclusive: bool = True) -> type:
    """An argparse type: a finite number >= low (> low unless `inclusive`)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_cut(text)} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{_cut(text)} is not a finite number")
        if value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(
                f"{value:g} must be {'at least' if inclusive else 'greater than'} {low:g}")
        return value

    parse.__name__ = "number"
    return parse


def _cut(text: str) -> str:
    return repr(text) if len(text) <= 24 else repr(text[:20]) + "..."


def output_path(flag: str, path: str | Path, default_suffix: str = "") -> Path:
    """Where `flag` will write: checked now, so that a long run never ends in a bad path.

    A missing directory is refused rather than created (a typo would leave stray
    directories behind, as `curl -o` and matplotlib do too); the message says how to
    create it. With `default_suffix`, a name without one gets it: the path returned is the
    path that will be written, so it is also the one to report.
    """
    given = Path(path)
    if not given.name or str(path) in ("", "."):
        raise UsageError(f"{flag}: expected a file name, got {str(path)!r}")
    try:
        if given.is_dir():  # before the suffix: `--plot out/` means a directory
            raise UsageError(f"{flag} {given}: is a directory; give a file name inside it")
        path = (given.with_name(given.name + default_suffix)
                if default_suffix and not given.suffix else given)
        parent = path.parent
        if path.is_dir():
            raise UsageError(f"{flag} {path}: is a directory; give a file name inside it")
        if not parent.exists():
            raise UsageError(f"{flag} {path}: directory {parent} does not exist; create it "
                             f"first (mkdir -p {parent})")
        if not parent.is_dir():
            raise UsageError(f"{flag} {path}: {parent} is not a directory")
        for candidate in {given, path}:
            if candidate.exists() and not stat.S_ISREG(candidate.stat().st_mode):
                raise UsageError(f"{flag} {candidate}: exists and is not a regular file")
    except OSError as e:  # a symlink loop, a name too long, ...
        raise UsageError(f"{flag} {path}: {e.strerror or type(e).__name__}") from None
    if not os.access(parent, os.W_OK):
        raise UsageError(f"{flag} {path}: directory {parent} is not writable")
    return path


def write_failed(flag: str, path: Path, error: OSError) -> CommandError:
    """The error to raise when writing `flag`'s file fails after the checks passed."""
    return CommandError(f"{flag} {path}: could not write ({error.strerror or error})")


__all__ = ["MAX_LOCAL_RANKS", "CommandError", "UsageError", "finite_float", "int_in",
           "output_path", "write_failed"]
