"""`evenzero run COMMAND...`: run a launch command with `import deepspeed` resolving to
evenzero.deepspeed, unchanged otherwise.

    evenzero run python train.py --deepspeed ds.json
    evenzero run torchrun --nproc-per-node 8 train.py --deepspeed ds.json
    evenzero run accelerate launch --config_file deepspeed_zero2.yaml train.py
    evenzero run deepspeed --num_gpus 8 train.py --deepspeed --deepspeed_config ds.json

The command and every process it starts see a `deepspeed` package (version 0.19.8 to
`importlib.metadata`) whose modules are evenzero.deepspeed's, whether or not DeepSpeed is
installed; a real installation is never imported. DeepSpeed's own launcher form,
`deepspeed [flags] script ...`, becomes one torchrun launch on this node with DeepSpeed's
per-rank arguments and environment; flags with no meaning here are refused by name
(`evenzero.deepspeed.launcher.runner`). One line on stderr says, at start, that evenzero
stands in for DeepSpeed. The exit status is the command's.

What evenzero.deepspeed refuses ends the job with one message, printed once by `evenzero
run` when the command ends, naming the key or call and the fix, and a non-zero exit
status; the ranks' tracebacks and the launcher's report of the failed ranks are not shown
(EVENZERO_DEBUG=1 shows them). A script that catches the error keeps its fallback. Refused:
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from evenzero.commands import UsageError
from evenzero.deepspeed.refusals import refused_features

NOTICE = ("evenzero run: `import deepspeed` is evenzero.deepspeed in this job (it stands in "
          "for DeepSpeed {version}: ZeRO stages 1-2; `evenzero run --help` lists what it "
          "refuses)")
LAUNCHERS = ("deepspeed", "ds")


def _refused_text() -> str:
    """The help's list of refusals, from the tables that refuse them."""
    lines = []
    for where, items in refused_features().items():
        lines.append(f"  {where}:")
        for item in items:
            lines += textwrap.wrap(item, 88, initial_indent="    ", subsequent_indent="      ",
                                   break_on_hyphens=False)
    lines.append('  "auto" values (HF\'s placeholders): filled in only by HF Trainer and '
                 "Accelerate;")
    lines.append("    a script that calls deepspeed.initialize itself must give values")
    return "\n".join(lines) + "\n"


__doc__ = (__doc__ or "") + _refused_text()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("command", nargs=argparse.REMAINDER, metavar="COMMAND",
                        help="the launch command and its arguments")


def main(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise UsageError("evenzero run: expected a command, e.g. `evenzero run torchrun "
                         "--nproc-per-node 2 train.py` (see evenzero run --help)")
    return run(command)


def run(command: list[str]) -> int:
    """Run `command` under the stand-in; returns its exit status."""
    from evenzero.deepspeed.standin import VERSION, child_environment, write_standin
    from evenzero.deepspeed.uncaught import summary

    directory = Path(tempfile.mkdtemp(prefix="evenzero-deepspeed-"))
    try:
        write_standin(directory)
        env = child_environment(directory, os.environ)
        if Path(command[0]).name in LAUNCHERS:
            from evenzero.deepspeed.launcher.runner import LauncherError, torchrun_command

            try:
                command, extra = torchrun_command(command[1:])
            except LauncherError as e:
                raise UsageError(f"evenzero run {Path(command[0]).name}: {e}") from None
            env.update(extra)
        elif shutil.which(command[0], path=env["PATH"]) is None:
            raise UsageError(f"evenzero run: command not found: {command[0]}")
        print(NOTICE.format(version=VERSION), file=sys.stderr, flush=True)
        status = _wait(subprocess.Popen(command, env=env))
        for line in summary(directory, status):
            print(line, file=sys.stderr, flush=True)
        return status
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def _wait(proc: subprocess.Popen) -> int:
    """Wait for the command, passing SIGTERM on (Ctrl-C reaches it through the terminal's
    process group already)."""
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: proc.send_signal(signum))
    try:
        while True:
            try:
                code = proc.wait()
                break
            except KeyboardInterrupt:
                continue  # the command got the SIGINT too; wait for it to stop
    finally:
        signal.signal(signal.SIGTERM, previous)
    return code if code >= 0 else 128 - code
