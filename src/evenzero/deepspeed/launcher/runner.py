"""The `deepspeed` launcher command (deepspeed/launcher/runner.py@0.19.8) on torchrun.

    deepspeed --num_gpus 2 train.py --deepspeed ...   (under `evenzero run`)

becomes one torchrun agent on this node with one worker per selected device slot:

    python -m torch.distributed.run --nnodes 1 --node-rank 0 --nproc-per-node N \\
        --master-addr 127.0.0.1 --master-port P  rank_exec.py SPEC train.py --deepspeed ...

and each worker runs what DeepSpeed's per-node launcher (deepspeed/launcher/launch.py)
runs: `python -u train.py --local_rank=R ...` (`--module`: `-m`, `--no_python`: the
program itself, `--no_local_rank`: without the argument), with DeepSpeed's environment
(`RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `MASTER_*`, `LOCAL_SIZE`, `CROSS_RANK`,
`CROSS_SIZE`, `CUDA_VISIBLE_DEVICES` = the slots) and, with `--bind_cores_to_rank`, each
rank bound to its share of the cores with `OMP_NUM_THREADS` set to it.

Flags, as DeepSpeed reads them: `--num_gpus`/`--num_accelerators`, `--num_nodes 1`,
`-i/--include` and `-e/--exclude` (host `localhost` only), `--master_port`,
`--master_addr` (ignored on one node, as DeepSpeed does), `--module`, `--no_python`,
`--no_local_rank`, `--bind_cores_to_rank`, `--bind_core_list`, `--log_level`, `-q`.
Refused by name, since they describe a multi-node launch or a DeepSpeed tool this
launcher does not run: a hostfile (`-H`, or `/job/hostfile` present), `--num_nodes` > 1,
`--node_rank`, `--no_ssh`, `--force_multi`, `--launcher`, `--launcher_args`,
`--ssh_port`, `--no_ssh_check`, `--venv_script`, `--autotuning`, `--save_pid`,
`--enable_each_rank_log`. For several nodes run `evenzero run torchrun --nnodes ...` on
each node.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

DLTS_HOSTFILE = "/job/hostfile"
DEEPSPEED_ENVIRONMENT_NAME = os.getenv("DS_ENV_FILE", ".deepspeed_env")
DEEPSPEED_ENVIRONMENT_PATHS = [os.path.expanduser("~"), "."]
TORCH_DISTRIBUTED_DEFAULT_PORT = 29500
PDSH_LAUNCHER = "pdsh"
RANK_EXEC = Path(__file__).with_name("rank_exec.py")


class LauncherError(ValueError):
    """A `deepspeed` launcher flag or value that cannot be honoured here."""


# Flag -> why it is refused; each is checked against DeepSpeed's default below.
MULTI_NODE = ("describes a multi-node launch, which the deepspeed launcher here does not do; "
              "run `evenzero run torchrun --nnodes N --node-rank R --master-addr HOST ...` on "
              "each node")
REFUSED_FLAGS = {
    "node_rank": ("--node_rank", -1, MULTI_NODE),
    "no_ssh": ("--no_ssh", False, MULTI_NODE),
    "force_multi": ("--force_multi", False, MULTI_NODE),
    "launcher": ("--launcher", PDSH_LAUNCHER, MULTI_NODE),
    "launcher_args": ("--launcher_args", "", MULTI_NODE),
    "ssh_port": ("--ssh_port", None, MULTI_NODE),
    "no_ssh_check": ("--no_ssh_check", False, MULTI_NODE),
    "venv_script": ("--venv_script", None, MULTI_NODE),
    "autotuning": ("--autotuning", "", "DeepSpeed's autotuner is not run"),
    "save_pid": ("--save_pid", False, "torchrun's agent is the launcher process here; its pid "
                                      "is the one `evenzero run` waits on"),
    "enable_each_rank_log": ("--enable_each_rank_log", "None",
                             "per-rank log files are torchrun's: use `evenzero run torchrun "
                             "--log-dir DIR --redirects 3 ...`"),
}


def parse_args(args: list[str] | None = None) -> argparse.Namespace:
    """DeepSpeed 0.19.8's launcher flags, names and defaults as there."""
    p = argparse.ArgumentParser(prog="deepspeed", description="DeepSpeed's launcher on torchrun "
                                "(evenzero stands in for DeepSpeed)")
    p.add_argument("-H", "--hostfile", type=str, default=DLTS_HOSTFILE)
    p.add_argument("-i", "--include", type=str, default="")
    p.add_argument("-e", "--exclude", type=str, default="")
    p.add_argument("--num_nodes", type=int, default=-1)
    p.add_argument("--num_gpus", "--num_accelerators", type=int, default=-1)
    p.add_argument("--master_port", default=TORCH_DISTRIBUTED_DEFAULT_PORT, type=int)
    p.add_argument("--master_addr", default="", type=str)
    p.add_argument("--node_rank", default=-1, type=int)
    p.add_argument("--launcher", default=PDSH_LAUNCHER, type=str)
    p.add_argument("--launcher_args", default="", type=str)
    p.add_argument("--module", action="store_true")
    p.add_argument("--no_python", action="store_true")
    p.add_argument("--no_local_rank", action="store_true")
    p.add_argument("--no_ssh", action="store_true")
    p.add_argument("--no_ssh_check", action="store_true")
    p.add_argument("--force_multi", action="store_true")
    p.add_argument("--save_pid", action="store_true")
    p.add_argument("--enable_each_rank_log", default="None", type=str)
    p.add_argument("--autotuning", default="", choices=["tune", "run"], type=str)
    p.add_argument("user_script", type=str)
    p.add_argument("user_args", nargs=argparse.REMAINDER)
    p.add_argument("--bind_cores_to_rank", action="store_true")
    p.add_argument("--bind_core_list", type=str, default=None)
    p.add_argument("--ssh_port", type=int, default=None)
    p.add_argument("--venv_script", type=str, default=None)
    p.add_argument("--log_level", type=str, default="info",
                   choices=["debug", "info", "warning", "error", "critical"])
    p.add_argument("-q", "--quiet", action="store_true")
    return p.parse_args(args=args)


def local_slots(args: argparse.Namespace, device_count: int) -> list[int]:
    """The device slots of this node to run on (DeepSpeed's resource pool, include and
    exclude filters, and --num_gpus), refusing anything that leaves this node."""
    for attr, (flag, default, why) in REFUSED_FLAGS.items():
        if getattr(args, attr) != default:
            raise LauncherError(f"deepspeed {flag}: {why}")
    if os.path.isfile(args.hostfile):
        raise LauncherError(f"deepspeed hostfile {args.hostfile}: a hostfile {MULTI_NODE}; "
                            f"remove it (or point -H elsewhere) for a single-node run")
    if args.num_nodes > 1:
        raise LauncherError(f"deepspeed --num_nodes {args.num_nodes}: {MULTI_NODE}")
    if (args.num_nodes >= 0 or args.num_gpus >= 0) and (args.include or args.exclude):
        raise LauncherError("Cannot specify num_nodes/gpus with include/exclude")
    if args.include and args.exclude:
        raise LauncherError("include_str and exclude_str are mutually exclusive.")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    include = args.include
    if visible and not (args.include or args.exclude or args.num_nodes > 1
                        or args.num_gpus > 0):
        # DeepSpeed turns a visible-device list into --include (runner.py@0.19.8 main).
        include = f"localhost:{visible}"
    if device_count == 0:
        raise LauncherError("Unable to proceed, no GPU resources available")
    slots = list(range(device_count))
    if include:
        slots = _filter(include, slots, keep=True)
    elif args.exclude:
        slots = _filter(args.exclude, slots, keep=False)
    if args.num_gpus > 0:
        slots = list(range(args.num_gpus))
    if not slots:
        raise LauncherError("no device slots left to run on after --include/--exclude")
    return slots


def _filter(spec: str, slots: list[int], keep: bool) -> list[int]:
    """DeepSpeed's NODE_SPEC[@NODE_SPEC ...] filter, for the one host `localhost`."""
    chosen: list[int] = []
    for node in spec.split("@"):
        host, _, listed = node.partition(":")
        if host != "localhost":
            raise LauncherError(f"deepspeed --include/--exclude {spec!r}: host {host!r} is not "
                                f"this node ('localhost'); {MULTI_NODE}")
        wanted = [int(x) for x in listed.split(",")] if listed else list(slots)
        for s in wanted:
            if s not in slots:
                raise LauncherError(f"No slot '{s}' specified on host '{host}'")
        chosen += wanted
    chosen = sorted(set(chosen))
    return chosen if keep else [s for s in slots if s not in chosen]


def parse_range_list(text: str) -> list[int]:
    """'0,2-4,6' -> [0, 2, 3, 4, 6]; ranges ascending, not overlapping (DeepSpeed's
    `parse_range_list`, deepspeed/utils/numa.py@0.19.8)."""
    out: list[int] = []
    last = -1
    for part in text.split(","):
        lo, sep, hi = part.partition("-")
        try:
            rng = range(int(lo), int(hi) + 1) if sep else range(int(lo), int(lo) + 1)
        except ValueError:
            raise LauncherError(f"Bad range: '{part}', range must be either a number or two "
                                f"number separated by dash") from None
        if sep and int(lo) > int(hi):
            raise LauncherError(f"Bad range: '{part}', range end must larger than or equal to "
                                f"start")
        if rng[0] <= last:
            raise LauncherError(f"Bad range: '{text}', sub ranges must not overlap with each "
                                f"other and should be in ascend order")
        last = rng[-1]
        out.extend(rng)
    return out


def physical_cores() -> int:
    """DeepSpeed binds to cores 0..P-1, P = psutil's physical core count."""
    try:
        import psutil

        count = psutil.cpu_count(logical=False)
        if count:
            return int(count)
    except ImportError:
        pass
    return os.cpu_count() or 1


def rank_spec(args: argparse.Namespace, nproc: int) -> dict:
    """What each rank's `rank_exec.py` needs to start the user's program."""
    if args.no_python and args.module:
        raise LauncherError("Don't use both the '--no_python' flag and the '--module' flag at "
                            "the same time.")
    bind = None
    if args.bind_cores_to_rank:
        if "KMP_AFFINITY" in os.environ:
            raise LauncherError("Environment variable KMP_AFFINITY conflicts with numactl "
                                "because it interfere with how many CPU cores numactl can set. "
                                "Unset KMP_AFFINITY before launching deepspeed.")
        cores = (parse_range_list(args.bind_core_list) if args.bind_core_list is not None
                 else list(range(physical_cores())))
        if len(cores) // nproc < 1:
            raise LauncherError("At least one core needs to be assigned to each rank")
        bind = cores
    return {"mode": "no_python" if args.no_python else ("module" if args.module else "python"),
            "local_rank_arg": not args.no_local_rank, "bind_cores": bind,
            "omp_num_threads": os.environ.get("OMP_NUM_THREADS")}


def torchrun_command(argv: list[str] | None = None) -> tuple[list[str], dict[str, str]]:
    """(torchrun's command line, environment additions) for a `deepspeed ...` command."""
    from evenzero.deepspeed.accelerator import get_accelerator

    args = parse_args(argv)
    slots = local_slots(args, get_accelerator().device_count())
    spec = rank_spec(args, len(slots))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--node-rank", "0",
           "--nproc-per-node", str(len(slots)), "--master-addr", "127.0.0.1",
           "--master-port", str(args.master_port), str(RANK_EXEC), json.dumps(spec),
           args.user_script, *args.user_args]
    env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, slots))}
    return cmd, env


def main(args: list[str] | None = None) -> int:
    """The `deepspeed` command: run the job under torchrun, return its exit status."""
    try:
        cmd, extra = torchrun_command(args)
    except LauncherError as e:
        print(f"deepspeed (evenzero): error: {e}", file=sys.stderr)
        return 2
    proc = subprocess.Popen(cmd, env={**os.environ, **extra})
    try:
        return proc.wait()
    except KeyboardInterrupt:
        proc.terminate()
        return proc.wait()


if __name__ == "__main__":
    sys.exit(main())
