"""A small nanoGPT-style decoder for the benchmarks (dense, untied head, pre-LayerNorm).

Untied so that every parameter has exactly one gradient hook; `blocks()` lists the
transformer blocks, the unit FSDP2 shards by.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    """Shape of the decoder and of its batches."""

    vocab: int = 8192
    """Vocabulary size (embedding rows and head columns)."""
    seq: int = 64
    """Tokens per sequence."""
    dim: int = 512
    """Model width."""
    layers: int = 16
    """Transformer blocks."""
    heads: int = 8
    """Attention heads; must divide dim."""
    batch_per_rank: int = 1
    """Sequences per rank per step."""
    seed: int = 1234
    """Seed of the weights and of the data stream."""

    def numel(self) -> int:
        d = self.dim
        block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (8 * d * d + 5 * d)
        return self.vocab * d + self.seq * d + self.layers * block + 2 * d + d * self.vocab


# The benchmark sizes. "bench-50m" is the CPU comparison (>= 50M params); "gpu-350m" is
# the single-GPU engine-overhead check (>= 300M params); "tiny" is for smoke tests.
GPT_SIZES = {
    "tiny": GPTConfig(vocab=256, seq=16, dim=64, layers=2, heads=4),
    "bench-50m": GPTConfig(vocab=8192, seq=64, dim=512, layers=16, heads=8),
    "gpu-350m": GPTConfig(vocab=32768, seq=1024, dim=1024, layers=24, heads=16, batch_per_rank=8),
}


class CausalSelfAttention(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.qkv = nn.Linear(c.dim, 3 * c.dim)
        self.proj = nn.Linear(c.dim, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class MLP(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.fc = nn.Linear(c.dim, 4 * c.dim)
        self.proj = nn.Linear(4 * c.dim, c.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(c.dim)
        self.attn = CausalSelfAttention(c)
        self.ln2 = nn.LayerNorm(c.dim)
        self.mlp = MLP(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, c: GPTConfig) -> None:
        super().__init__()
        self.config = c
        self.tok = nn.Embedding(c.vocab, c.dim)
        self.pos = nn.Embedding(c.seq, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.ln_f = nn.LayerNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        self._init(c)

    def _init(self, c: GPTConfig) -> None:
        # GPT-2's init from a private generator: every rank and every system gets the
        # same weights without touching the global RNG.
        gen = torch.Generator().manual_seed(c.seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if p.dim() == 1:
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    std = 0.02 / math.sqrt(2 * c.layers) if name.endswith("proj.weight") else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def blocks(model: GPT) -> list[nn.Module]:
    return list(model.blocks)


def gpt_batch(c: GPTConfig, step: int, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank `rank`'s sequences of step `step`'s global batch (inputs, next-token targets)."""
    gen = torch.Generator().manual_seed(c.seed * 1_000_003 + step)
    tokens = torch.randint(0, c.vocab, (c.batch_per_rank * world_size, c.seq + 1), generator=gen)
    mine = tokens[rank * c.batch_per_rank:(rank + 1) * c.batch_per_rank]
    return mine[:, :-1], mine[:, 1:]


def gpt_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))
