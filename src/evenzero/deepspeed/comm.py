"""`deepspeed.comm`: the part of DeepSpeed's communication API training scripts call,
as thin aliases of torch.distributed (deepspeed/comm/comm.py@0.19.8 wraps the same
calls). `get_local_rank` reads the launcher's variable, as DeepSpeed does."""

from __future__ import annotations

import os

import torch.distributed as _dist
from torch.distributed import (  # noqa: F401 - re-exported
    ReduceOp,
    all_gather,
    all_gather_into_tensor,
    all_gather_object,
    all_reduce,
    all_to_all,
    all_to_all_single,
    barrier,
    broadcast,
    broadcast_object_list,
    destroy_process_group,
    gather,
    get_backend,
    get_global_rank,
    get_process_group_ranks,
    irecv,
    is_available,
    is_initialized,
    isend,
    monitored_barrier,
    new_group,
    recv,
    reduce,
    reduce_scatter,
    reduce_scatter_tensor,
    scatter,
    send,
)

from evenzero.deepspeed.launch import init_distributed  # noqa: F401 - re-exported


def reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None, async_op=False,
                      prof=False, debug=None):
    """DeepSpeed's reduce-scatter of a flat tensor into `output_tensor`
    (deepspeed/comm/comm.py@0.19.8:283): `reduce_scatter_tensor`. `prof` and `debug` are
    DeepSpeed's comms-logging arguments, which change nothing here."""
    return reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


def get_rank(group=None) -> int:
    return _dist.get_rank(group) if _dist.is_initialized() else 0


def get_world_size(group=None) -> int:
    return _dist.get_world_size(group) if _dist.is_initialized() else 1


def get_local_rank() -> int:
    """The launcher's local rank (deepspeed/comm/comm.py@0.19.8 `get_local_rank`)."""
    return int(os.environ.get("LOCAL_RANK", os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", 0)))


def get_world_group():
    return _dist.group.WORLD


def get_all_ranks_from_group(group=None) -> list[int]:
    return _dist.get_process_group_ranks(group or _dist.group.WORLD)


def log_summary(show_straggler: bool = False) -> None:
    """No-op: DeepSpeed's comms logger is not run (`ZeroOptimizer.trace` lists the
    collectives of a step)."""
    del show_straggler
