"""The network a `ModelDraw` describes, built identically for DDP and for evenzero."""

from __future__ import annotations

import torch
from torch import nn

from .case import Block, ModelDraw, out_width


class Scale(nn.Module):
    """A 1-D parameter multiplying the features. (Read in its own forward: with
    overlap_param_gather evenzero refuses, by name, a parameter read by a parent's forward.)"""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(width))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * self.weight - h


class Zero(nn.Module):
    """A zero-size parameter (its gradient is an empty tensor)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(0))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h * 0 + self.weight.sum()


class FuzzNet(nn.Module):
    def __init__(self, draw: ModelDraw, expert_groups=None) -> None:
        super().__init__()
        from evenzero.moe import MoE

        self.draw = draw
        self.blocks = nn.ModuleList()
        width = draw.in_width
        for b in draw.blocks:
            if b.kind == "linear":
                m: nn.Module = nn.Linear(width, b.width, bias=b.bias)
            elif b.kind == "conv":
                m = nn.Conv1d(1, b.width, 3, padding=1, bias=b.bias)
            elif b.kind == "scale":
                m = Scale(width)
            elif b.kind == "zero":
                m = Zero()
            elif b.kind == "moe":
                m = MoE(width, b.experts, expert_groups, ffn_dim=b.width)
            else:  # "shared" runs blocks[b.shares] and has no parameters of its own
                m = nn.Identity()
            self.blocks.append(m)
            width = out_width(b, width)
        self.head = nn.Linear(width, draw.out_width)
        low = torch.bfloat16
        if draw.dtype != "fp32":
            for b, m in zip(draw.blocks, self.blocks, strict=True):
                if not b.fp32:
                    m.to(low)
            self.head.to(low)
        self.act_dtype = torch.float32 if draw.dtype == "fp32" else low

    def block_dtype(self, i: int) -> torch.dtype:
        b: Block = self.draw.blocks[i]
        if b.kind == "shared":
            return self.block_dtype(b.shares)
        if self.draw.dtype == "fp32" or b.fp32:
            return torch.float32
        return torch.bfloat16

    def forward(self, x: torch.Tensor, skip: frozenset[int] = frozenset()) -> torch.Tensor:
        x = x.to(self.act_dtype)
        for i, (b, m) in enumerate(zip(self.draw.blocks, self.blocks, strict=True)):
            if i in skip:
                continue
            h = x.to(self.block_dtype(i))
            if b.kind == "linear":
                y = torch.tanh(m(h))
            elif b.kind == "conv":
                y = m(h.unsqueeze(1)).mean(1)
            elif b.kind == "shared":
                y = torch.tanh(self.blocks[b.shares](h))
            else:
                y = m(h)
            y = y.to(self.act_dtype)
            x = x + y if y.shape == x.shape else y
        return self.head(x)


def block_params(net: FuzzNet, i: int) -> list[nn.Parameter]:
    """The parameters block `i` owns (a "shared" block owns none)."""
    return list(net.blocks[i].parameters())
