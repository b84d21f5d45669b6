"""The model of DeepSpeed issue #3151 (deepspeedai/DeepSpeed#3151), built for real.

fc1, fc2 = Linear(dim, dim), registered first; then an expert-parallel top-1 MoE layer
(gate Linear(dim, E, bias=False), E experts of fc1/fc2, expert parallel size 4, tokens
moved with all_to_all). Forward x -> moe -> relu(fc1) -> fc2, loss = MSE to a target.
At dim 1000, 16 experts and 8 ranks it has the report's 10,026,000 parameters per rank.

Every rank seeds the same way and draws its slice of one global batch, so a system that
reduces gradients correctly produces the same losses as any other. The targets come from a
fixed teacher the model can fit (`seed_batch`), so the losses fall as it trains: equal,
falling losses are the evidence that every system steps correctly.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class SeedModelConfig:
    """Shape of the seed model and of its data."""

    dim: int = 1000
    """Width of fc1, fc2, the gate input and every expert layer."""
    num_experts: int = 16
    """Experts in the MoE layer, across the expert-parallel group."""
    ep_size: int = 4
    """Expert-parallel size; each rank holds num_experts / ep_size experts."""
    tokens_per_rank: int = 32
    """Rows of the global batch each rank trains on per step."""
    seed: int = 1234
    """Seed of the weights and of the data stream."""

    def check(self, world_size: int) -> None:
        if world_size % self.ep_size:
            raise ValueError(f"world size {world_size} is not a multiple of the expert-parallel "
                             f"size {self.ep_size}; use a world size of {self.ep_size}, "
                             f"{2 * self.ep_size}, ...")
        if self.num_experts % self.ep_size:
            raise ValueError(f"{self.num_experts} experts cannot be split over expert-parallel "
                             f"size {self.ep_size}; make num_experts a multiple of it")

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep_size

    @property
    def expert_group_name(self) -> str:
        # DeepSpeed's naming; evenzero's MoE and DeepSpeed's optimizer groups both key on it.
        return f"ep_size_{self.ep_size}"

    def numel_per_rank(self) -> int:
        d = self.dim
        dense = 2 * (d * d + d) + self.num_experts * d
        return dense + self.local_experts * 2 * (d * d + d)


class SeedModel(nn.Module):
    """fc1, fc2 and an evenzero `MoE`, registered in that order (the order of the report)."""

    def __init__(self, config: SeedModelConfig, groups) -> None:
        from evenzero.moe import MoE

        super().__init__()
        self.config = config
        self.fc1 = nn.Linear(config.dim, config.dim)
        self.fc2 = nn.Linear(config.dim, config.dim)
        self.moe = MoE(config.dim, config.num_experts, groups, ffn_dim=config.dim)
        init_seed_weights(self, config, groups.ep_rank)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.moe(x)
        if isinstance(h, tuple):
            h = h[0]
        return self.fc2(F.relu(self.fc1(h)))


def seed_weights(config: SeedModelConfig, ep_rank: int) -> dict[str, torch.Tensor]:
    """The seed model's weights for one rank, by evenzero parameter name.

    Each expert is drawn from its own generator keyed by its global index, so the 16
    experts differ, the two replicas of an expert (its expert-data-parallel pair) agree,
    and a DeepSpeed twin can be given exactly the same numbers.
    """
    d, out = config.dim, {}
    gen = torch.Generator().manual_seed(config.seed)
    for name in ("fc1", "fc2"):
        out[f"{name}.weight"], out[f"{name}.bias"] = _linear(gen, d, d)
    out["moe.gate.wg.weight"] = _linear(gen, d, config.num_experts, bias=False)[0]
    for i in range(config.local_experts):
        e = ep_rank * config.local_experts + i
        gen_e = torch.Generator().manual_seed(config.seed + 1 + e)
        for name in ("fc1", "fc2"):
            w, b = _linear(gen_e, d, d)
            out[f"moe.experts.{i}.{name}.weight"] = w
            out[f"moe.experts.{i}.{name}.bias"] = b
    return out


def init_seed_weights(model: nn.Module, config: SeedModelConfig, ep_rank: int) -> None:
    weights = seed_weights(config, ep_rank)
    params = dict(model.named_parameters())
    missing = sorted(set(weights) - set(params))
    if missing:
        raise RuntimeError(f"seed model has no parameter(s) {missing}; evenzero.moe.MoE must "
                           f"expose gate.wg and experts.<i>.fc1/fc2")
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value)


def _linear(gen: torch.Generator, n_in: int, n_out: int,
            bias: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    # nn.Linear's default init (kaiming-uniform with a=sqrt(5) reduces to U(-1/sqrt(in), ..)).
    bound = 1.0 / math.sqrt(n_in)
    w = (torch.rand(n_out, n_in, generator=gen) * 2 - 1) * bound
    b = (torch.rand(n_out, generator=gen) * 2 - 1) * bound if bias else None
    return w, b


TEACHER_OFFSET = 0.5
"""Scale of the teacher's constant part c (per output feature)."""
TEACHER_SCALE = 0.1
"""Scale of the teacher's linear part x T (T has unit-variance columns)."""


def seed_batch(config: SeedModelConfig, step: int, rank: int,
               world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s rows of step `step`'s global batch: inputs x ~ N(0, 1) and the fixed
    teacher's targets y = c + 0.1 x T (c, T drawn once from the seed). The model fits c
    within a few steps and T slowly, so at lr 1e-3 the loss falls from about 0.26 to
    about 0.06 over the repro's 10 steps (dim 1000, one process, measured)."""
    offset, mapping = _teacher(config.dim, config.seed)
    gen = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    rows = config.tokens_per_rank * world_size
    x = torch.randn(rows, config.dim, generator=gen)
    lo = rank * config.tokens_per_rank
    mine = x[lo:lo + config.tokens_per_rank]
    return mine, offset + TEACHER_SCALE * (mine @ mapping)


@functools.lru_cache(maxsize=4)
def _teacher(dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed + 7_777_777)
    offset = torch.randn(dim, generator=gen) * TEACHER_OFFSET
    mapping = torch.randn(dim, dim, generator=gen) / math.sqrt(dim)
    return offset, mapping


def seed_loss(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(output, target)
