"""Dense Llama-style model (~20M parameters) on CPU gloo: evenzero defaults vs DDP and FSDP2.

A Llama-style decoder (RMSNorm, rotary attention without biases, SwiGLU MLP, untied
head; at the defaults vocab 8192, 8 layers x 384, MLP 1024: 20,453,760 parameters)
trained at 4 local gloo ranks by

* `evenzero`: `ZeroOptimizer(model, torch.optim.AdamW, lr=..., weight_decay=...)`, no
  tuning arguments (bucket size "auto", refined at run time);
* `ddp`: torch DDP with its own C++ reducer (no comm hook), torch AdamW;
* `fsdp2`: `fully_shard(block, reshard_after_forward=False)` per block, then the root
  (ZeRO-2 style), torch AdamW;

interleaved step by step on the same batches; forward+backward+step of the slowest rank
(FSDP2 gathers in forward), median, and each phase's median (forward, backward, step with
zero_grad). Issue 9's targets: evenzero <= 1.0x DDP and
<= 0.85x FSDP2. Run it on an otherwise idle machine.

    python benchmarks/llama_dense.py [--world-size 4] [--steps 8] [--warmup 3]
        [--seq 128] [--systems evenzero,ddp,fsdp2] [--tiny] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

try:
    import evenzero  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
import torch.nn.functional as F
from torch import nn

from evenzero.repro.localrun import LaunchOptions, launch

SYSTEMS = ("evenzero", "ddp", "fsdp2")
COMPRESSED = ("evenzero-bf16", "evenzero-int8", "evenzero-int8-ef", "ddp-bf16-hook")
"""Further systems `--systems` may name (`evenzero.repro.systems`: grad_compression and
DDP's bf16_compress_hook)."""


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 8192
    seq: int = 128
    dim: int = 384
    layers: int = 8
    heads: int = 6
    hidden: int = 1024
    """SwiGLU width."""
    batch_per_rank: int = 1
    seed: int = 1234

    def numel(self) -> int:
        d = self.dim
        block = 4 * d * d + 3 * d * self.hidden + 2 * d
        return 2 * self.vocab * d + self.layers * block + d


TINY = LlamaConfig(vocab=256, seq=16, dim=64, layers=2, heads=4, hidden=128)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    a, b = x[..., ::2], x[..., 1::2]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.heads = c.heads
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(c.dim, c.dim, bias=False)
                                              for _ in range(4))

    def forward(self, x, cos, sin):
        b, t, d = x.shape
        q, k, v = (w(x).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(rotary(q, cos, sin), rotary(k, cos, sin), v,
                                           is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w3 = nn.Linear(c.dim, c.hidden, bias=False)
        self.w2 = nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(c.dim), Attention(c)
        self.mlp_norm, self.mlp = RMSNorm(c.dim), SwiGLU(c)

    def forward(self, x, cos, sin):
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class Llama(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.tok = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        half = c.dim // c.heads // 2
        freqs = 1.0 / (10000 ** (torch.arange(half) / half))
        angles = torch.outer(torch.arange(c.seq), freqs)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)
        gen = torch.Generator().manual_seed(c.seed)
        with torch.no_grad():  # the same weights on every rank and in every system
            for name, p in self.named_parameters():
                if p.dim() > 1:
                    std = 0.02 / math.sqrt(2 * c.layers) if name.endswith(("wo.weight", "w2.weight")) else 0.02
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, idx):
        x = self.tok(idx)
        t = idx.shape[1]
        for block in self.blocks:
            x = block(x, self.cos[:t], self.sin[:t])
        return self.head(self.norm(x))


def loss_fn(logits, targets):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


def batch(c: LlamaConfig, step: int, rank: int, world_size: int):
    gen = torch.Generator().manual_seed(c.seed * 1_000_003 + step)
    tokens = torch.randint(0, c.vocab, (c.batch_per_rank * world_size, c.seq + 1), generator=gen)
    mine = tokens[rank * c.batch_per_rank:(rank + 1) * c.batch_per_rank]
    return mine[:, :-1], mine[:, 1:]


def llama_worker(ctx, payload: dict) -> dict:
    from evenzero.repro.baselines import DDPSystem, FSDP2System
    from evenzero.repro.sidebyside import (
        PHASES,
        EvenzeroSystem,
        InterleaveOptions,
        run_interleaved,
    )
    from evenzero.repro.systems import BY_NAME

    c = LlamaConfig(**payload["config"])
    systems = []
    for name in payload["systems"]:
        model = Llama(c).to(ctx.device)
        if name == "evenzero":  # EvenzeroSystem passes lr, weight_decay, stage, strategy only
            systems.append(EvenzeroSystem("evenzero", model, loss_fn))
        elif name.startswith("evenzero-"):
            systems.append(EvenzeroSystem(name, model, loss_fn,
                                          extra=dict(BY_NAME[name].settings)))
        elif name.startswith("ddp"):
            systems.append(DDPSystem(model, loss_fn, name=name,
                                     comm_hook=BY_NAME[name].comm_hook))
        else:
            systems.append(FSDP2System(model, loss_fn, lambda m: list(m.blocks)))
    results = run_interleaved(systems, lambda step: batch(c, step, ctx.rank, ctx.world_size),
                              InterleaveOptions(payload["steps"], payload["warmup"], ctx.device),
                              on_step=lambda name, step: ctx.emit((name, step)))
    notes = []
    for s in systems:
        if s.name == "evenzero":
            notes = list(s.optimizer.plan.notes)
    return {"world_size": ctx.world_size, "numel": c.numel(), "config": asdict(c),
            "evenzero_plan_notes": notes,
            "systems": {r.name: {"median_ms": r.median_step_ms, "step_ms": r.step_ms,
                                 "phase_ms": {p: r.median_phase_ms(p) for p in PHASES},
                                 "losses": r.losses} for r in results}}


def run(world_size: int, config: LlamaConfig, systems: tuple[str, ...], steps: int,
        warmup: int) -> dict:
    payload = {"config": asdict(config), "systems": list(systems), "steps": steps,
               "warmup": warmup}
    return launch(llama_worker, payload, LaunchOptions(world_size, "gloo", timeout_s=3600))


def summary(report: dict) -> list[str]:
    s = report["systems"]
    lines = [f"Llama-style {report['numel']:,} params, {report['world_size']} gloo ranks: "
             f"forward+backward+step, slowest rank, median"]
    for name, r in s.items():
        phases = "  ".join(f"{p} {ms:7.1f}" for p, ms in r["phase_ms"].items())
        lines.append(f"  {name:9s} {r['median_ms']:9.1f} ms  (min {min(r['step_ms']):.1f}, "
                     f"max {max(r['step_ms']):.1f});  {phases} ms")
    if "evenzero" in s:
        ez = s["evenzero"]["median_ms"]
        ref = s["evenzero"]["losses"]
        worst = max(abs(a - b) / abs(b) for r in s.values() for a, b in zip(r["losses"], ref, strict=True))
        lines.append(f"  losses agree with evenzero's to {worst:.1e} relative")
        for peer, goal in (("ddp", 1.0), ("fsdp2", 0.85)):
            if peer in s:
                lines.append(f"  evenzero / {peer} = {ez / s[peer]['median_ms']:.2f}x "
                             f"(target <= {goal}x)")
        lines += [f"  plan note: {n}" for n in report["evenzero_plan_notes"]]
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3,
                   help="untimed steps (evenzero measures and re-plans in its first two)")
    p.add_argument("--seq", type=int, default=LlamaConfig.seq)
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--tiny", action="store_true", help="a tiny model: checks the script works")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    systems = tuple(s for s in args.systems.split(",") if s)
    if not systems or any(s not in SYSTEMS + COMPRESSED for s in systems):
        p.error(f"--systems: choose from {', '.join(SYSTEMS + COMPRESSED)}")
    config = TINY if args.tiny else LlamaConfig(seq=args.seq)
    report = run(args.world_size, config, systems, args.steps, args.warmup)
    print("\n".join(summary(report)))
    print(f"command: python {' '.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
