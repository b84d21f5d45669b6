"""Models and the single-process reference for the Muon tests (not a test module)."""

from __future__ import annotations

import copy

import torch
from torch import nn

MUON = {"lr": 0.02, "momentum": 0.95, "weight_decay": 0.1}
ADAMW = {"lr": 3e-3, "weight_decay": 0.01, "foreach": False}
"""AdamW's single-tensor loop in both runs: Muon's bf16 Newton-Schulz turns a last-bit
difference anywhere into a visible one, so both runs do the same arithmetic."""


class TinyLlama(nn.Module):
    """A Llama-shaped stack: embedding, RMSNorm, attention-like and gated-MLP matrices,
    an untied head (enough of each kind for torch's Muon recipe)."""

    def __init__(self, vocab: int = 64, d: int = 32, layers: int = 2, ff: int = 48) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            b = nn.Module()
            b.attn_norm = nn.RMSNorm(d)
            b.q, b.k, b.v, b.o = (nn.Linear(d, d, bias=False) for _ in range(4))
            b.mlp_norm = nn.RMSNorm(d)
            b.gate, b.up = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
            b.down = nn.Linear(ff, d, bias=True)
            self.blocks.append(b)
        self.norm = nn.RMSNorm(d)
        self.lm_head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            h = b.attn_norm(x)
            att = torch.softmax(b.q(h) @ b.k(h).transpose(-1, -2) / h.shape[-1] ** 0.5, -1)
            x = x + b.o(att @ b.v(h))
            h = b.mlp_norm(x)
            x = x + b.down(nn.functional.silu(b.gate(h)) * b.up(h))
        return self.lm_head(self.norm(x))


def llama_loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def llama_batch(step: int, n: int, vocab: int = 64, seq: int = 9) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (n, seq), generator=g)


def muon_groups(model: nn.Module, muon=None, adamw=None) -> list[dict]:
    """torch's recipe: Muon for the hidden matrices, AdamW (its own "optimizer" key) for
    embeddings, head, norms and biases."""
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2
              and not n.startswith(("embed", "lm_head"))]
    rest = [p for n, p in model.named_parameters() if not any(p is h for h in hidden)]
    return [{"params": hidden, **(muon or {})},
            {"params": rest, "optimizer": torch.optim.AdamW, **(adamw or ADAMW)}]


class Reference:
    """Single-process torch.optim.Muon + torch.optim.AdamW on the global batch, whose
    gradient is the ranks' gradients summed in rank order and scaled by 1/world, as the
    reduce-scatter computes it."""

    def __init__(self, model: nn.Module, muon=None, adamw=None) -> None:
        self.model = copy.deepcopy(model)
        groups = muon_groups(self.model, muon, adamw)
        self.muon = torch.optim.Muon(groups[0]["params"], **{**MUON, **(muon or {})})
        self.adamw = torch.optim.AdamW(groups[1]["params"], **(adamw or ADAMW))

    def step(self, parts: list[torch.Tensor], loss_fn=llama_loss) -> None:
        params = list(self.model.parameters())
        total = [torch.zeros_like(p) for p in params]
        for part in parts:
            grads = torch.autograd.grad(loss_fn(self.model, part), params, allow_unused=True)
            for t, g in zip(total, grads, strict=True):
                if g is not None:
                    t.add_(g)
        for p, t in zip(params, total, strict=True):
            p.grad = t * (1.0 / len(parts))
        self.muon.step()
        self.adamw.step()
        self.muon.zero_grad()
        self.adamw.zero_grad()
