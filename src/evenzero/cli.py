"""The `evenzero` command: one subcommand per entry of COMMANDS (`evenzero --help` lists them).

    evenzero plan MODEL --world-size W ...   the collective schedule under each strategy
    evenzero calibrate --world-size W ...    measure alpha and bandwidth per collective
    evenzero repro ...                       the seed case trained side by side
    evenzero bench ...                       a dense GPT trained side by side
    evenzero convert-deepspeed DS_DIR OUT    a DeepSpeed ZeRO-1/2 checkpoint as an evenzero one
    evenzero run COMMAND...                  a launch command with deepspeed = evenzero.deepspeed

`evenzero COMMAND --help` lists a command's options. Exit status: 0 done; 1 the command
ran and failed (a rank died, results disagree); 2 bad input, with one line on stderr
that names the problem; 70 an internal error, a bug in evenzero, also one line (set
EVENZERO_DEBUG=1 for its traceback); 130 interrupted.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass

from evenzero.commands import CommandError, UsageError


@dataclass(frozen=True)
class Command:
    """A subcommand: its module (imported only when it runs) and its one-line help."""

    module: str
    """Module with `add_arguments(parser)` and `main(args) -> int`."""
    help: str


COMMANDS: dict[str, Command] = {
    "plan": Command("evenzero.commands.plan",
                    "show the collective schedule of a model under each strategy"),
    "calibrate": Command("evenzero.commands.calibrate",
                         "measure alpha and bus bandwidth per collective"),
    "repro": Command("evenzero.repro",
                     "run the seed case side by side: evenzero, DeepSpeed, DDP"),
    "bench": Command("evenzero.repro.bench", "run the benchmarks"),
    "convert-deepspeed": Command("evenzero.commands.convert_deepspeed",
                                 "write an evenzero checkpoint from a DeepSpeed ZeRO-1/2 one"),
    "run": Command("evenzero.commands.run",
                   "run a launch command with `import deepspeed` as evenzero.deepspeed"),
}
"""Every subcommand by name. A new one is a module with the two functions and a line here."""

EXIT_FAILED, EXIT_USAGE, EXIT_BUG, EXIT_INTERRUPTED = 1, 2, 70, 130
DEBUG_ENV = "EVENZERO_DEBUG"
MAX_MESSAGE = 2000
"""Longest error line printed; a message quoting a huge input is cut."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, no usage dump: the message names the fix
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


def input_errors() -> tuple[type[Exception], ...]:
    """Exceptions that mean bad input (exit 2). Imported here, not at module level, so
    that `evenzero repro` does not load the planner's modules before it needs them."""
    from evenzero.cost import CostModelError
    from evenzero.plan import PlanError
    from evenzero.spec import SpecError

    return (UsageError, SpecError, PlanError, CostModelError)


def help_text() -> str:
    """The top-level help: its first line names every subcommand, from COMMANDS."""
    rest = (__doc__ or "").split("\n", 1)[1]
    return f"The `evenzero` command: {', '.join(COMMANDS)}.\n{rest}"


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: only for `evenzero --help` and unknown commands."""
    parser = _Parser(prog="evenzero", description=help_text(),
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser,
                                metavar="COMMAND")
    for name, command in COMMANDS.items():
        sub.add_parser(name, help=command.help, add_help=False)
    return parser


def run_command(name: str, argv: Sequence[str]) -> int:
    """Import the command's module now, let it add its own arguments, and run it."""
    command = COMMANDS[name]
    try:
        module = importlib.import_module(command.module)
    except ModuleNotFoundError as e:
        if e.name != command.module:
            raise
        raise UsageError(f"evenzero {name}: {command.module} is not part of this installation; "
                         f"reinstall evenzero from a full checkout (pip install -e .)") from None
    parser = _Parser(prog=f"evenzero {name}", description=module.__doc__ or command.help,
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    module.add_arguments(parser)
    return int(module.main(parser.parse_args(list(argv))) or 0)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if argv and argv[0] in COMMANDS:
            return run_command(argv[0], argv[1:])
        build_parser().parse_args(argv)  # --help exits; anything else is an error
        raise UsageError("evenzero: expected a command (see evenzero --help)")
    except CommandError as e:
        return _fail(f"error: {e}", EXIT_FAILED)
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_INTERRUPTED)
    except BrokenPipeError:  # `evenzero plan ... | head`: the reader left, nothing to say
        _silence_stdout()
        return EXIT_FAILED
    except MemoryError:
        return _fail("error: out of memory; use a smaller model, world size or fewer "
                     "strategies", EXIT_FAILED)
    except Exception as e:  # noqa: BLE001 - sorted below: input errors, or a bug named as one
        if isinstance(e, input_errors()):
            return _fail(f"error: {e}", EXIT_USAGE)
        if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
            raise
        return _fail(f"internal error: {type(e).__name__}: {e}. This is a bug in evenzero; "
                     f"please report it with the command line (set {DEBUG_ENV}=1 to see the "
                     f"traceback)", EXIT_BUG)


def one_line(text: str) -> str:
    """`text` on one printable line: control characters and unpaired surrogates escaped,
    cut to MAX_MESSAGE characters."""
    out = "".join(c if c.isprintable() or c == " " else
                  c.encode("unicode_escape", "backslashreplace").decode("ascii")
                  for c in text[:MAX_MESSAGE + 1])
    return out if len(out) <= MAX_MESSAGE else out[:MAX_MESSAGE - 3] + "..."


def _fail(message: str, status: int) -> int:
    try:
        sys.stdout.flush()
    except (OSError, ValueError):
        pass
    print(f"evenzero: {one_line(message)}", file=sys.stderr)
    return status


def _silence_stdout() -> None:
    # Python flushes stdout again at exit; point it at /dev/null so that flush is quiet.
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


if __name__ == "__main__":
    sys.exit(main())
