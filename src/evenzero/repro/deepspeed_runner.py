"""Real DeepSpeed ZeRO-2 as a side-by-side system (optional: `pip install deepspeed`).

On a CPU job the ranks run with `DS_ACCELERATOR=cpu` and `deepspeed.init_distributed(
dist_backend="gloo")` reuses the process group that is already up. fp32 throughout (no
fp16/bf16 section: ZeRO-2 accepts it, and it keeps losses comparable with evenzero's).
The client optimizer is torch's AdamW (DeepSpeed's FusedAdam needs compiled ops), which
ZeRO accepts with `zero_allow_untested_optimizer`.

MoE: DeepSpeed only treats a layer as MoE if it is its own `deepspeed.moe.layer.MoE`
(the engine then builds its expert-data-parallel groups and ZeRO partitions expert
params over them), so the seed model gets a twin built from DeepSpeed's MoE and loaded
with exactly the same weights. Its TopKGate is configured to behave like evenzero's:
top-1, no noise, no random token selection, no capacity limit (`drop_tokens=False`),
and the auxiliary loss is not added. What remains different is the dispatch layout
(DeepSpeed pads every expert to a common capacity and combines with einsum), so the
losses agree up to float rounding, not bit for bit.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from evenzero.moe import Expert
from evenzero.plan import BACKWARD, STEP, Collective
from evenzero.repro.capture import CaptureOptions, CollectiveCapture
from evenzero.repro.seedmodel import SeedModelConfig, seed_weights
from evenzero.repro.sidebyside import Batch, LossFn

DEEPSPEED_VERSION = "0.19.8"
"""The DeepSpeed the `deepspeed` extra pins and CI runs (pyproject.toml, .ci/run)."""
DEEPSPEED_INSTALL = (f"install it without compiled ops: DS_BUILD_OPS=0 pip install "
                     f"\"deepspeed=={DEEPSPEED_VERSION}\"")
"""The hint shown when DeepSpeed is missing; plain text, so rich must not parse it."""


def deepspeed_unavailable() -> str | None:
    """None when DeepSpeed can be imported, else the reason (shown to the user)."""
    try:
        import deepspeed  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means "skip it and say why"
        return f"{type(e).__name__}: {e}".splitlines()[0]
    return None


class DeepSpeedSeedModel(nn.Module):
    """The seed model with `deepspeed.moe.layer.MoE` in place of evenzero's MoE."""

    def __init__(self, config: SeedModelConfig, ep_rank: int) -> None:
        from deepspeed.moe.layer import MoE

        super().__init__()
        d = config.dim
        self.fc1 = nn.Linear(d, d)
        self.fc2 = nn.Linear(d, d)
        self.moe = MoE(d, Expert(d, d), num_experts=config.num_experts,
                       ep_size=config.ep_size, k=1, capacity_factor=1.0, min_capacity=0,
                       noisy_gate_policy=None, drop_tokens=False, use_rts=False)
        self.ep_rank = ep_rank
        names = dict(self.named_parameters())
        with torch.no_grad():
            for name, value in seed_weights(config, ep_rank).items():
                names[_deepspeed_name(name)].copy_(value)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _aux_loss, _counts = self.moe(x)
        return self.fc2(F.relu(self.fc1(h)))


def _deepspeed_name(evenzero_name: str) -> str:
    if evenzero_name.startswith("moe.gate."):
        return evenzero_name.replace("moe.gate.", "moe.deepspeed_moe.gate.", 1)
    if evenzero_name.startswith("moe.experts."):
        return evenzero_name.replace("moe.experts.", "moe.deepspeed_moe.experts.deepspeed_experts.", 1)
    return evenzero_name


def deepspeed_config(micro_batch: int, *, multi_rank_allreduce: bool,
                     reduce_bucket_size: int | None = None, dtype: str = "float32") -> dict:
    zero: dict[str, Any] = {"stage": 2, "use_multi_rank_bucket_allreduce": multi_rank_allreduce}
    if reduce_bucket_size is not None:
        zero["reduce_bucket_size"] = reduce_bucket_size
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if dtype == "bfloat16":
        config["bf16"] = {"enabled": True}
    return config


class DeepSpeedSystem:
    """A DeepSpeed engine with ZeRO stage 2, captured with `CollectiveCapture`."""

    def __init__(self, name: str, model: nn.Module, loss_fn: LossFn, *, micro_batch: int,
                 multi_rank_allreduce: bool = True, lr: float = 1e-3, weight_decay: float = 0.01,
                 reduce_bucket_size: int | None = None, dtype: str = "float32",
                 capture: CaptureOptions | None = None) -> None:
        import deepspeed
        from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

        _quiet_deepspeed()
        deepspeed.init_distributed(dist_backend=torch.distributed.get_backend(),
                                   verbose=False)
        self.name = name
        self.loss_fn = loss_fn
        groups = split_params_into_different_moe_groups_for_optimizer(
            {"params": [p for p in model.parameters() if p.requires_grad], "name": "parameters"})
        optimizer = torch.optim.AdamW(groups, lr=lr, weight_decay=weight_decay)
        config = deepspeed_config(micro_batch, multi_rank_allreduce=multi_rank_allreduce,
                                  reduce_bucket_size=reduce_bucket_size, dtype=dtype)
        self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
        self.capture = CollectiveCapture(capture or CaptureOptions())
        self._capturing = False
        self._last: list[Collective] = []

    def loss(self, batch: Batch) -> torch.Tensor:
        x, y = batch
        return self.loss_fn(self.engine(x), y)

    def backward(self, loss: torch.Tensor) -> None:
        with self.capture.active(BACKWARD) if self._capturing else nullcontext():
            self.engine.backward(loss)

    def step(self) -> None:
        """`engine.step()` steps and clears the gradients."""
        with self.capture.active(STEP) if self._capturing else nullcontext():
            self.engine.step()
        if self._capturing:
            self._last, self._capturing = self.capture.take(), False

    def capture_next_step(self) -> None:
        self._capturing = True

    def collectives(self) -> list[Collective]:
        return list(self._last)


def check_expert_layout(world_size: int, ep_size: int) -> None:
    """DeepSpeed must have built the same EDP groups as evenzero ({r % E + k*E})."""
    from deepspeed.utils import groups

    name = f"ep_size_{ep_size}"
    got = torch.distributed.get_process_group_ranks(groups._get_expert_data_parallel_group(name))
    rank = torch.distributed.get_rank()
    want = list(range(rank % ep_size, world_size, ep_size))
    if sorted(got) != want:
        raise RuntimeError(f"DeepSpeed built expert-data-parallel ranks {sorted(got)} for rank {rank}, "
                           f"evenzero uses {want}; the models would not match")


def _quiet_deepspeed() -> None:
    from deepspeed.utils import logger

    logger.setLevel(logging.WARNING)
