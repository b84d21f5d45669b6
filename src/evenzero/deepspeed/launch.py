"""Process-group set-up the way DeepSpeed scripts expect it.

Three launchers set the environment torch.distributed reads (`RANK`, `WORLD_SIZE`,
`LOCAL_RANK`, `MASTER_ADDR`, `MASTER_PORT`):

* torchrun, and DeepSpeed's own launcher (`deepspeed train.py`, which also passes
  `--local_rank=N` to the script: deepspeed/launcher/launch.py@0.19.8);
* mpirun (OpenMPI), which sets `OMPI_COMM_WORLD_{RANK,SIZE,LOCAL_RANK,LOCAL_SIZE}`
  instead. DeepSpeed asks mpi4py (deepspeed/comm/comm.py@0.19.8:913-950); here the
  OpenMPI variables are read directly, and mpi4py is used only when they are absent
  and it is installed. The rendezvous address comes from `MASTER_ADDR` (pass it with
  `mpirun -x MASTER_ADDR=host`), or is 127.0.0.1 when every rank is on one node;
* nothing at all: one process, as `python train.py` (DeepSpeed would need mpi4py).

A job whose launcher evenzero cannot read (Slurm `srun` without torchrun, MPICH/PMI) is
refused rather than started as several unrelated single-process runs.
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from evenzero.deepspeed.log import logger
from evenzero.rendezvous import init_process_group

DEFAULT_PORT = 29500  # deepspeed/constants.py@0.19.8:12
REQUIRED_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")
# Launchers that start several processes without torch's variables.
FOREIGN_LAUNCHERS = (("PMI_SIZE", "MPICH/Intel MPI (PMI)"), ("PMIX_SIZE", "PMIx"),
                     ("SLURM_NTASKS", "Slurm srun"), ("MV2_COMM_WORLD_SIZE", "MVAPICH2"))


class LaunchError(RuntimeError):
    """The environment does not say which rank this process is."""


def default_timeout() -> timedelta:
    """DeepSpeed's process-group timeout: `DEEPSPEED_TIMEOUT` minutes, default 10
    (deepspeed/constants.py@0.19.8:19)."""
    return timedelta(minutes=int(os.getenv("DEEPSPEED_TIMEOUT", default=10)))


def use_cpu() -> bool:
    """CPU unless CUDA is there and `DS_ACCELERATOR` does not say otherwise. Any other
    accelerator DeepSpeed knows (xpu, npu, hpu, mps, ...) is refused by name."""
    accel = os.environ.get("DS_ACCELERATOR", "").lower()
    if accel not in ("", "cpu", "cuda"):
        raise LaunchError(f"DS_ACCELERATOR={os.environ['DS_ACCELERATOR']}: evenzero.deepspeed "
                          f"runs on cpu or cuda only; unset it or set it to one of those")
    return accel == "cpu" or (accel != "cuda" and not torch.cuda.is_available())


def default_backend() -> str:
    return "gloo" if use_cpu() else "nccl"


def fill_env_from_launcher(distributed_port: int = DEFAULT_PORT) -> str:
    """Make torch's variables present; returns which launcher they came from."""
    if all(v in os.environ for v in REQUIRED_ENV):
        return "env"
    if "OMPI_COMM_WORLD_RANK" in os.environ:
        _from_openmpi(distributed_port)
        return "openmpi"
    if _from_mpi4py(distributed_port):
        return "mpi4py"
    partial = [v for v in REQUIRED_ENV if v in os.environ]
    for var, name in FOREIGN_LAUNCHERS:
        if int(os.environ.get(var, "1") or 1) > 1:
            raise LaunchError(f"started by {name} ({var}={os.environ[var]}) without torch's "
                              f"rank variables; launch with torchrun, deepspeed or OpenMPI's "
                              f"mpirun, or set {', '.join(REQUIRED_ENV)}")
    if partial and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        missing = [v for v in REQUIRED_ENV if v not in os.environ]
        raise LaunchError(f"the environment sets {', '.join(partial)} but not "
                          f"{', '.join(missing)}; launch with torchrun or deepspeed")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(distributed_port))
    logger.info("no launcher environment found; running as one process")
    return "single"


def _from_openmpi(port: int) -> None:
    env = os.environ
    rank, size = env["OMPI_COMM_WORLD_RANK"], env["OMPI_COMM_WORLD_SIZE"]
    local = env.get("OMPI_COMM_WORLD_LOCAL_RANK", "0")
    local_size = env.get("OMPI_COMM_WORLD_LOCAL_SIZE", size)
    if "MASTER_ADDR" not in env:
        if int(local_size) != int(size):
            raise LaunchError(f"mpirun across nodes ({size} ranks, {local_size} on this node) "
                              f"needs the rendezvous host: pass -x MASTER_ADDR=<rank 0's host> "
                              f"(and optionally -x MASTER_PORT)")
        env["MASTER_ADDR"] = "127.0.0.1"
    for var, value in (("RANK", rank), ("WORLD_SIZE", size), ("LOCAL_RANK", local)):
        if var in env and env[var] != value:
            raise LaunchError(f"{var}={env[var]} but OMPI_COMM_WORLD says {value}; not sure "
                              f"which launcher to believe")
        env[var] = value
    env.setdefault("MASTER_PORT", str(port))


def _from_mpi4py(port: int) -> bool:
    """DeepSpeed's `mpi_discovery`, used only when mpi4py is installed and MPI runs us."""
    try:
        from mpi4py import MPI
    except ImportError:
        return False
    comm = MPI.COMM_WORLD
    if comm.Get_size() == 1:
        return False
    import socket

    rank = comm.Get_rank()
    addr = socket.gethostbyname(socket.gethostname()) if rank == 0 else None
    addr = os.environ.get("MASTER_ADDR") or comm.bcast(addr, root=0)
    name = MPI.Get_processor_name()
    local = sum(n == name for n in comm.allgather(name)[:rank])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(comm.Get_size()), LOCAL_RANK=str(local),
                      MASTER_ADDR=addr, MASTER_PORT=os.environ.get("MASTER_PORT", str(port)))
    return True


def init_distributed(dist_backend: str | None = None, auto_mpi_discovery: bool = True,
                     distributed_port: int = DEFAULT_PORT, verbose: bool = True,
                     timeout: timedelta | None = None, init_method: str | None = None,
                     dist_init_required: bool | None = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """`deepspeed.init_distributed`: keep a process group that is already up, otherwise
    find the ranks from the launcher and initialise torch.distributed."""
    del config  # DeepSpeed's comms-logger settings; nothing to configure here
    if dist.is_available() and dist.is_initialized():
        return
    if dist_init_required is False:
        raise LaunchError("Distributed backend is not initialized. Please set "
                          "dist_init_required to True or initialize before calling "
                          "deepspeed.initialize()")
    if auto_mpi_discovery and init_method is None:
        source = fill_env_from_launcher(distributed_port)
        if verbose and os.environ["RANK"] == "0":
            logger.info("ranks from %s: rank %s of %s, local rank %s",
                        source, os.environ["RANK"], os.environ["WORLD_SIZE"],
                        os.environ["LOCAL_RANK"])
    backend = dist_backend or default_backend()
    if not use_cpu() and "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    # evenzero's drop-in: safe when torchrun restarts the job (evenzero/rendezvous.py).
    init_process_group(backend, init_method=init_method, timeout=timeout or default_timeout(),
                       rank=rank, world_size=world_size)


def local_rank_from_env() -> int:
    """`LOCAL_RANK`, reconciled with OpenMPI's (deepspeed/runtime/engine.py@0.19.8:1953-1969)."""
    ompi = os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK")
    if ompi is not None:
        local = os.environ.get("LOCAL_RANK", ompi)
        if local != ompi:
            raise LaunchError(f"LOCAL_RANK ({local}) != OMPI_COMM_WORLD_LOCAL_RANK ({ompi}), not "
                              f"sure how to proceed as we're seeing conflicting local rank info.")
        os.environ["LOCAL_RANK"] = local
    if "LOCAL_RANK" not in os.environ:
        if dist.is_initialized() and dist.get_world_size() == 1:
            os.environ["LOCAL_RANK"] = "0"
        else:
            raise LaunchError("evenzero.deepspeed needs the LOCAL_RANK environment variable; it "
                              "is set by torchrun, deepspeed and init_distributed(). With a "
                              "different launcher, set LOCAL_RANK before initialize()")
    return int(os.environ["LOCAL_RANK"])


def reconcile_args_local_rank(args, local_rank: int) -> None:
    """`--local_rank` from the command line must match the environment; then it is set to
    it (-1, argparse's usual default, becomes the real local rank), as DeepSpeed does."""
    if args is None or not hasattr(args, "local_rank"):
        return
    given = args.local_rank
    if given is not None:
        if isinstance(given, bool) or not isinstance(given, int):
            raise LaunchError(f"args.local_rank of {given} is an unknown type {type(given)}")
        if given >= 0 and given != local_rank:
            raise LaunchError(f"Mismatch in local rank setting, args.local_rank={given} but "
                              f"env['LOCAL_RANK']={local_rank}.")
    args.local_rank = local_rank


@dataclass(frozen=True)
class Placement:
    """Where this process runs."""

    local_rank: int
    global_rank: int
    world_size: int
    device: torch.device


def placement(args=None) -> Placement:
    local = local_rank_from_env()
    reconcile_args_local_rank(args, local)
    if use_cpu():
        device = torch.device("cpu")
    else:
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    return Placement(local, dist.get_rank(), dist.get_world_size(), device)


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """`deepspeed.add_config_arguments` (deepspeed/__init__.py@0.19.8:613): `--deepspeed`,
    `--deepspeed_config` and the deprecated `--deepscale`, `--deepscale_config`. Like
    DeepSpeed it does not add `--local_rank`; scripts add that themselves."""
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on the engine)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code)")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated DeepSpeed json configuration file.")
    return parser
