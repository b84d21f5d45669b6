"""Small models and a reference trainer shared by the runtime tests (workers import them).

Also checks, single-process, that the models are what the other tests assume.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import nullcontext

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    def __init__(self, d: int = 8, h: int = 16, o: int = 4) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, h)
        self.head = nn.Linear(h, o)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class Branchy(MLP):
    """An MLP with an extra layer used only when asked to."""

    def __init__(self) -> None:
        super().__init__()
        self.extra = nn.Linear(4, 4)

    def forward(self, x, use_extra: bool = False):
        y = super().forward(x)
        return self.extra(y) if use_extra else y


class Quirky(nn.Module):
    """Tied embedding/head, a frozen layer, an unused layer; forward order != registration."""

    def __init__(self, vocab: int = 11, d: int = 6) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.frozen = nn.Linear(d, d)
        self.frozen.requires_grad_(False)
        self.mid = nn.Linear(d, d)
        self.unused = nn.Linear(d, 3)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.frozen(self.emb(tokens)))
        return self.head(torch.relu(self.mid(h)))


def mlp_loss(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.mse_loss(model(x), y)


def mlp_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(size, 8, generator=g), torch.randn(size, 4, generator=g)


def quirky_loss(model: nn.Module, batch) -> torch.Tensor:
    tokens, targets = batch
    logits = model(tokens)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def quirky_batch(step: int, size: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(200 + step)
    return torch.randint(0, 11, (size, 5), generator=g), torch.randint(0, 11, (size, 5), generator=g)


def part(t: torch.Tensor, index: int, count: int) -> torch.Tensor:
    n = t.shape[0] // count
    return t[index * n:(index + 1) * n]


def train_pair(rank: int, world: int, make_model: Callable[[], nn.Module], loss_fn, make_batch,
               opt_cls, opt_kw: dict, engine_kw: dict, steps: int = 3, micro: int = 1,
               use_no_sync: bool = True, clip: float | None = None, per_rank: int = 4):
    """Train a ZeroOptimizer model on this rank's slices and a single-process reference
    on the whole global batch; returns (model, reference, opt, [(norm, ref_norm)])."""
    from evenzero import ZeroOptimizer

    torch.manual_seed(0)
    model = make_model()
    ref = copy.deepcopy(model)
    opt = ZeroOptimizer(model, opt_cls, **opt_kw, **engine_kw)
    ref_opt = opt_cls([p for p in ref.parameters() if p.requires_grad], **opt_kw)
    norms = []
    for step in range(steps):
        batch = make_batch(step, per_rank * world * micro)
        mine = tuple(part(t, rank, world) for t in batch)
        for m in range(micro):
            quiet = opt.no_sync() if use_no_sync and m < micro - 1 else nullcontext()
            with quiet:
                (loss_fn(model, tuple(part(t, m, micro) for t in mine)) / micro).backward()
        norm = opt.clip_grad_norm_(clip) if clip is not None else None
        opt.step()
        opt.zero_grad()
        loss_fn(ref, batch).backward()
        if clip is not None:
            norms.append((float(norm), float(torch.nn.utils.clip_grad_norm_(
                [p for p in ref.parameters() if p.requires_grad], clip))))
        ref_opt.step()
        ref_opt.zero_grad()
    # The last step's parameter gathers overlap the next forward, and there is none:
    # reading the parameters directly needs the documented wait.
    opt.wait_for_params()
    return model, ref, opt, norms


def assert_same_params(model: nn.Module, ref: nn.Module, rtol: float = 1e-5, atol: float = 1e-6) -> None:
    ref_params = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), ref_params[name].detach(), rtol=rtol, atol=atol,
                                   msg=lambda m, name=name: f"{name}: {m}")


# --------------------------------------------------------------------------- model checks


def test_quirky_model_has_tied_frozen_and_unused_params_and_a_non_reverse_arrival():
    model = Quirky()
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    assert names == ["emb.weight", "mid.weight", "mid.bias", "unused.weight", "unused.bias"]
    order = []
    for n, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(lambda _p, n=n: order.append(n))
    quirky_loss(model, quirky_batch(0, 4)).backward()
    assert "unused.weight" not in order and order[-1] == "emb.weight"
    assert order != list(reversed(names))  # so the first backward re-plans the layout


def test_moe_reference_matches_per_token_computation():
    from evenzero.moe import MoE

    torch.manual_seed(3)
    moe = MoE(6, 4, None, ffn_dim=5)
    x = torch.randn(13, 6)
    out = moe(x)
    probs = torch.softmax(moe.gate.wg(x), dim=-1)
    for t in range(x.shape[0]):
        e = int(probs[t].argmax())
        expected = probs[t, e] * moe.experts[e](x[t:t + 1])[0]
        torch.testing.assert_close(out[t], expected)
    out.sum().backward()
    # Every expert runs (on zero tokens if none are routed), so every parameter has a grad.
    assert all(p.grad is not None for p in moe.parameters())
