"""PyTorch baselines for side-by-side runs: DDP (MoE-aware), FSDP2 in ZeRO-2 mode, and the
comm-free floor.

DDP and MoE: DDP all-reduces every gradient over the whole world, which is wrong for
expert parameters (each expert exists only on its expert-data-parallel ranks). So DDP is
told to ignore the expert params, and `ExpertGradReducer` all-reduces their gradients
over the EDP group as one flat message, launched asynchronously the moment the last
expert gradient arrives (overlapping the rest of backward, as a DDP bucket would), and
divides by the WORLD size: every expert gradient already sums the contributions of all
E ranks of its expert-parallel group (all_to_all's backward brings them back), so the
EDP sum covers all W ranks' losses, and the mean over W ranks is what DDP computes for
the dense params. This is what DeepSpeed >= 0.15.4 divides by too.

DDP runs its own C++ reducer, the DDP users run. Its calls are invisible to
`CollectiveCapture` (the reducer calls the process group directly), so for the one
untimed step whose collectives are shown, `capture_next_step` registers the stock
`allreduce_hook` (DDP's own algorithm expressed in Python, on the same buckets) first.

`FloorSystem` is the comm-free floor of the benchmarks: forward, backward, and an AdamW
step over this rank's 1/N share of the elements, nothing reduced, nothing gathered.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
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
    """A plain-PyTorch system whose collectives can be captured by wrapping torch.distributed:
    `forward` runs the (wrapped) model, the optimizer steps in the capture's step phase."""

    def __init__(self, name: str, loss_fn: LossFn, forward: nn.Module,
                 optimizer: torch.optim.Optimizer, capture: CaptureOptions | None) -> None:
        self.name, self.loss_fn, self.forward, self.optimizer = name, loss_fn, forward, optimizer
        self.capture = CollectiveCapture(capture or CaptureOptions())
        self._capturing = False
        self._last: list[Collective] = []

    def loss(self, batch: Batch) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(self.forward(x), y)

    def finish_backward(self) -> None:
        """Work after `loss.backward()` that belongs to the backward phase."""

    def backward(self, loss: torch.Tensor) -> None:
        with self.capture.active(BACKWARD) if self._capturing else nullcontext():
            loss.backward()
            self.finish_backward()

    def step(self) -> None:
        with self.capture.active(STEP) if self._capturing else nullcontext():
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self._capturing:
            self._last, self._capturing = self.capture.take(), False

    def capture_next_step(self) -> None:
        self._capturing = True

    def collectives(self) -> list[Collective]:
        return list(self._last)


class DDPSystem(CapturedBaseline):
    """torch DDP (its C++ reducer) over the dense params, `ExpertGradReducer` for the
    expert params. `capture_next_step` switches DDP to the stock Python `allreduce_hook`
    for good (torch allows one registration), so capture after the timed steps."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, *, lr: float = 1e-3,
                 weight_decay: float = 0.01, expert_group: Any = None,
                 capture: CaptureOptions | None = None, name: str = "ddp",
                 fused_adamw: bool | None = None, comm_hook: str | None = None) -> None:
        from torch.nn.parallel import DistributedDataParallel as DDP

        expert = [(n, p) for n, p in model.named_parameters() if is_expert(p)]
        if expert and expert_group is None:
            raise ValueError("model has expert params (allreduce=False) but no expert_group was given; "
                             "pass the expert-data-parallel process group")
        DDP._set_params_and_buffers_to_ignore_for_model(model, [n for n, _ in expert])
        device = next(model.parameters()).device
        self.ddp = DDP(model, device_ids=[device.index] if device.type == "cuda" else None)
        self.experts = ExpertGradReducer([p for _, p in expert], expert_group, dist.get_world_size())
        self._hooked = False
        if comm_hook == "bf16":  # torch's bf16_compress_hook: bf16 on the wire, summed in bf16
            self.ddp.register_comm_hook(None, bf16_hook_any_backend)
            self._hooked = True  # torch allows one registration: no capture through it
        elif comm_hook is not None:
            raise ValueError(f"unknown DDP comm hook {comm_hook!r}; 'bf16' or None")
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay,
                                      fused=fused_adamw)
        super().__init__(name, loss_fn, self.ddp, optimizer, capture)

    def finish_backward(self) -> None:
        self.experts.finish()

    def capture_next_step(self) -> None:
        if not self._hooked:
            from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

            self.ddp.register_comm_hook(None, allreduce_hook)
            self._hooked = True
        super().capture_next_step()


def bf16_hook_any_backend(process_group, bucket):  # DDP checks the annotations: none
    """torch's `bf16_compress_hook` (torch/distributed/algorithms/ddp_comm_hooks/
    default_hooks.py@v2.13.0) without the check for CUDA and NCCL 2.10 that DDP makes by
    the hook's name and that refuses gloo: the bucket divided by the world size in bf16,
    all-reduced in bf16, copied back. gloo all-reduces bf16, so the DDP users' habit can
    be measured on CPU ranks."""
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(world)
    fut = dist.all_reduce(compressed, group=group, async_op=True).get_future()

    def decompress(fut: Any) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return fut.then(decompress)


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


class FloorSystem:
    """The comm-free floor: what a data-parallel step costs with no communication at all.

    Forward and backward of the model as it is (an MoE layer's token all_to_all stays:
    it is the model's, not the optimizer's), no gradient reduction, no parameter
    gather, and an AdamW step over this rank's shard only: 1/W of the dense elements and
    1/(its EDP group's size) of the expert elements, in one preallocated flat tensor (the
    gradients are not reduced into it, so the model's own weights do not train and its
    losses are not comparable). What evenzero's step costs beyond this is its
    communication and bookkeeping."""

    def __init__(self, model: nn.Module, loss_fn: LossFn, *, lr: float = 1e-3,
                 weight_decay: float = 0.01, expert_group_size: int = 1,
                 name: str = "floor") -> None:
        self.name, self.model, self.loss_fn = name, model, loss_fn
        world = dist.get_world_size()
        dense = sum(p.numel() for p in model.parameters() if p.requires_grad and not is_expert(p))
        expert = sum(p.numel() for p in model.parameters() if p.requires_grad and is_expert(p))
        numel = -(-dense // world) + -(-expert // max(1, expert_group_size))
        device = next(model.parameters()).device
        gen = torch.Generator().manual_seed(0)  # never the user's generator
        self.shard = nn.Parameter(torch.zeros(numel, device=device))
        self.shard.grad = (torch.randn(numel, generator=gen) * 1e-3).to(device)
        self.optimizer = torch.optim.AdamW([self.shard], lr=lr, weight_decay=weight_decay)

    def loss(self, batch: Batch) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(self.model(x), y)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.model.zero_grad(set_to_none=True)

    def capture_next_step(self) -> None:
        """Nothing to capture: the floor reduces nothing."""

    def collectives(self) -> list[Collective]:
        return []
