"""The `optimizer` that `initialize` returns: DeepSpeed hands scripts its ZeRO wrapper
(`DeepSpeedZeroOptimizer`), whose `param_groups` are the torch optimizer's and whose
`loss_scale`/`cur_scale` is the fp16 scale. This is that view over a `ZeroOptimizer`;
the engine's `step()` does the stepping, as in DeepSpeed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from evenzero.deepspeed.config import NCCL_START_ALIGNMENT_FACTOR
from evenzero.deepspeed.loss_scaler import DeepSpeedLossScaler
from evenzero.deepspeed.utils import tensor_fragment
from evenzero.runtime.shardedgrad import ShardedGrad


class EngineOptimizer:
    """`engine.optimizer`: param groups, state and loss scale of the sharded optimizer."""

    def __init__(self, zero: Any, scaler: DeepSpeedLossScaler) -> None:
        self.zero = zero
        """The `evenzero.ZeroOptimizer` doing the work (plan, trace, memory_report, ...)."""
        self.loss_scaler = scaler
        self.client: torch.optim.Optimizer | None = None
        """The optimizer object the script passed to `initialize`, if any."""
        self.overflow = False
        """Whether the last boundary step found non-finite gradients (and was skipped)."""
        tensor_fragment.register(zero)
        self.nccl_start_alignment_factor = NCCL_START_ALIGNMENT_FACTOR
        """DeepSpeed's ZeRO-1/2 attribute (partition starts aligned to 2 fp16 elements)."""

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer (DeepSpeed's `basic_optimizer`): the client's optimizer
        object when one was passed (it shares the `ZeroOptimizer`'s `param_groups`), else
        the `ZeroOptimizer`. Its state is sharded over the ranks (`ZeroOptimizer.state_dict`)."""
        return self.client if self.client is not None else self.zero

    @property
    def single_partition_of_fp32_groups(self) -> list[torch.Tensor]:
        """This rank's fp32 master partition of each group, flat (DeepSpeed's ZeRO-1/2
        attribute; copies, as reading them must not change them)."""
        return [self.zero.master_shard(g) for g in self.zero.groups]

    @property
    def param_groups(self) -> list[dict]:
        return self.zero.param_groups

    @property
    def state(self) -> Any:
        return self.zero.state

    @property
    def defaults(self) -> dict:
        return self.zero.defaults

    @property
    def loss_scale(self) -> float:
        return self.loss_scaler.cur_scale

    @property
    def cur_scale(self) -> float:
        return self.loss_scaler.cur_scale

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.loss_scaler.dynamic

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the parameters' local gradients only, as DeepSpeed's ZeRO optimizer does
        (deepspeed/runtime/zero/stage_1_and_2.py@0.19.8:2613): gradients already reduced
        into this rank's shards in this accumulation window are kept, so a script calling
        `optimizer.zero_grad()` after every micro-step accumulates as under DeepSpeed."""
        drop_local_grads(self.zero.params.values(), set_to_none)

    def step(self, closure=None) -> None:
        raise RuntimeError("call engine.step() (it steps this optimizer at accumulation "
                           "boundaries, clips and applies the loss scale), not optimizer.step()")

    def backward(self, loss: torch.Tensor, retain_graph: bool = False) -> None:
        raise RuntimeError("call engine.backward(loss), not optimizer.backward(loss)")

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer state, as DeepSpeed's ZeRO optimizer returns
        its partition (deepspeed/runtime/zero/stage_1_and_2.py@0.19.8:3358): the
        `ZeroOptimizer`'s per-rank state dict (masters, optimizer state, step, loss scale).
        It loads back at the same world size (`load_state_dict`); to change the world size
        use `engine.save_checkpoint` / `load_checkpoint`. Lightning saves it on every
        checkpoint."""
        return self.zero.state_dict()

    def load_state_dict(self, state: dict) -> None:
        """What `state_dict()` returned on this rank, at the same world size (a collective,
        as in DeepSpeed, which also requires the same data-parallel size)."""
        self.zero.load_state_dict(state)

    def __repr__(self) -> str:
        return f"EngineOptimizer({type(self.optimizer).__name__}, stage={self.zero.config.stage})"


def drop_local_grads(params: Iterable[torch.nn.Parameter], set_to_none: bool = True) -> None:
    """Clear the local `.grad` of `params`, keeping gradients already reduced into this
    rank's shards (`p.grad` is their `ShardedGrad` placeholder), as DeepSpeed keeps its
    reduced partitions."""
    for p in params:
        if isinstance(p.grad, ShardedGrad):
            continue
        if set_to_none:
            p.grad = None
        elif p.grad is not None:
            p.grad.detach_()
            p.grad.zero_()
