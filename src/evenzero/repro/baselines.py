"""PyTorch baselines for side-by-side runs: DDP (MoE-aware) and FSDP2 in ZeRO-2 mode.

DDP and MoE: DDP all-reduces every gradient over the whole world, which is wrong for
expert parameters (each expert exists only on its expert-data-parallel ranks). So DDP is
told to ignore the expert params, and `ExpertGradReducer` all-reduces their gradients
over the EDP group as one flat message, launched asynchronously the moment the last
expert gradient arrives (overlapping the rest of backward, as a DDP bucket would), and
divides by the WORLD size: every expert gradient already sums the contributions of all
E ranks of its expert-parallel group (all_to_all's backward brings them back), so the
EDP sum covers all W ranks' losses, and the mean over W ranks is what DDP computes for
the dense params. This is what DeepSpeed >= 0.15.4 divides by too.

Both baselines are captured with `CollectiveCapture`; DDP runs with the stock
`allreduce_hook` (DDP's own algorithm expressed in Python) so its calls are visible.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from evenzero.plan import BACKWARD, STEP, Collective
from evenzero.repro.capture import CaptureOptions, CollectiveCapture
from evenzero.repro.sidebyside import Batch, LossFn
from evenzero.spec import is_expert


class ExpertGradReducer:
    """All-reduce expert gradients over their EDP group, overlapped with backward."""

    def __init__(self, params: Sequence[nn.Parameter], group: Any, world_size: int) -> None:
        self.params = [p for p in params if p.requires_grad]
        self.group = group
        self.world_size = world_size
        self._arrived = 0
        self._work: Any = None
        self._flat: torch.Tensor | None = None
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in self.params]

    def _on_grad(self, _param: nn.Parameter) -> None:
        self._arrived += 1
        if self._arrived == len(self.params):
            self._flat = torch.cat([p.grad.reshape(-1) for p in self.params])
            self._work = dist.all_reduce(self._flat, group=self.group, async_op=True)

    def finish(self) -> None:
        """Wait for the reduction and write the averaged gradients back; call after backward."""
        if not self.params:
            return
        if self._work is None:
            missing = [i for i, p in enumerate(self.params) if p.grad is None]
            raise RuntimeError(f"{len(missing)} expert parameter(s) produced no gradient this step; "
                               f"every expert must be used (or give it a zero loss term)")
        self._work.wait()
        flat = self._flat.div_(self.world_size)
        offset = 0
        for p in self.params:
            n = p.numel()
            p.grad.copy_(flat[offset:offset + n].view_as(p.grad))
            offset += n
        self._arrived, self._work, self._flat = 0, None, None

    def remove(self) -> None:
        for h in self._handles:
            h.remove()


class CapturedBaseline:
    """A plain-PyTorch system whose collectives are captured by wrapping torch.distributed:
    `forward` runs the (wrapped) model, the optimizer steps inside the capture's step phase."""

    def __init__(self, name: str, loss_fn: LossFn, forward: nn.Module,
                 optimizer: torch.optim.Optimizer, capture: CaptureOptions | None) -> None:
        self.name, self.loss_fn, self.forward, self.optimizer = name, loss_fn, forward, optimizer
        self.capture = CollectiveCapture(capture or CaptureOptions())
        self._last: list[Collective] = []

    def loss(self, batch: Batch) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(self.forward(x), y)

    def finish_backward(self) -> None:
        """Work after `loss.backward()` that belongs to the backward phase."""

    def backward_and_step(self, loss: torch.Tensor) -> None:
        with self.capture.active(BACKWARD):
            loss.backward()
            self.finish_backward()
            with self.capture.phase_as(STEP):
                self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._last = self.capture.take()

    def collectives(self) -> list[Collective]:
        return list(self._last)


class DDPSystem(CapturedBaseline):
    """torch DDP over the dense params, `ExpertGradReducer` for the expert params.

    `comm_hook=True` (default) reduces through the stock Python `allreduce_hook` so the
    collectives are captured; False leaves DDP's C++ reducer alone (nothing captured),
    the baseline for host-overhead comparisons."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, *, lr: float = 1e-3,
                 weight_decay: float = 0.01, expert_group: Any = None,
                 capture: CaptureOptions | None = None, name: str = "ddp",
                 fused_adamw: bool | None = None, comm_hook: bool = True) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel as DDP

        expert = [(n, p) for n, p in model.named_parameters() if is_expert(p)]
        if expert and expert_group is None:
            raise ValueError("model has expert params (allreduce=False) but no expert_group was given; "
                             "pass the expert-data-parallel process group")
        DDP._set_params_and_buffers_to_ignore_for_model(model, [n for n, _ in expert])
        device = next(model.parameters()).device
        ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        if comm_hook:  # False: DDP's own C++ all-reduce, fastest but not captured
            ddp.register_comm_hook(None, allreduce_hook)
        self.experts = ExpertGradReducer([p for _, p in expert], expert_group, dist.get_world_size())
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                                      fused=fused_adamw)
        super().__init__(name, loss_fn, ddp, optimizer, capture)

    def finish_backward(self) -> None:
        self.experts.finish()


class FSDP2System(CapturedBaseline):
    """PyTorch FSDP2 in ZeRO-2 mode: `fully_shard(block, reshard_after_forward=False)` per
    block, then the root; params stay gathered between forward and backward."""

    def __init__(self, model: nn.Module, loss_fn: LossFn,
                 blocks: Callable[[nn.Module], Sequence[nn.Module]], *, lr: float = 1e-3,
                 weight_decay: float = 0.01, capture: CaptureOptions | None = None,
                 name: str = "fsdp2") -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        device = next(model.parameters()).device
        mesh = init_device_mesh(device.type, (dist.get_world_size(),))
        for block in blocks(model):
            fully_shard(block, mesh=mesh, reshard_after_forward=False)
        fully_shard(model, mesh=mesh, reshard_after_forward=False)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
        super().__init__(name, loss_fn, model, optimizer, capture)
