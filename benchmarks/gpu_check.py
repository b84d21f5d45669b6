"""CUDA/NCCL correctness check of the runtime (world size 1; one GPU is all a session gets).

Trains a small MLP for a few steps with `ZeroOptimizer` (stages 1 and 2, fp32, native
NCCL reduce-scatter, CUDA streams) and with plain `torch.optim.AdamW` from the same
initial weights and data, and checks the parameters agree. Then the same in bf16 params
with fp32 master shards against plain AdamW on fp32 masters cast to bf16. Prints one line
per case and exits non-zero on a mismatch.

    python benchmarks/gpu_check.py          # needs a CUDA device
    python benchmarks/gpu_check.py --cpu    # the same logic on gloo
"""

from __future__ import annotations

import copy
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
import torch.distributed as dist
from torch import nn

import evenzero


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(),
                         nn.Linear(256, 8))


def train_reference(model: nn.Module, batches, master_dtype=None) -> nn.Module:
    if master_dtype is None:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
        for x, y in batches:
            nn.functional.mse_loss(model(x.to(model[0].weight.dtype)).float(), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad()
        return model
    masters = [p.detach().to(master_dtype).clone().requires_grad_() for p in model.parameters()]
    opt = torch.optim.AdamW(masters, lr=1e-2, weight_decay=0.01)
    for x, y in batches:
        nn.functional.mse_loss(model(x.to(model[0].weight.dtype)).float(), y).backward()
        for m, p in zip(masters, model.parameters(), strict=True):
            m.grad = p.grad.to(master_dtype)
            p.grad = None
        torch.nn.utils.clip_grad_norm_(masters, 1.0)
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for m, p in zip(masters, model.parameters(), strict=True):
                p.copy_(m)
    return model


def train_evenzero(model: nn.Module, batches, **kw) -> nn.Module:
    opt = evenzero.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, weight_decay=0.01,
                                 bucket_numel=20_000, **kw)
    for x, y in batches:
        nn.functional.mse_loss(model(x.to(model[0].weight.dtype)).float(), y).backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    opt.wait_for_params()  # parameters are read directly below
    algos = sorted({c.algorithm for c in opt.trace if c.phase == "backward"})
    print(f"    plan: {len(opt.plan.backward())} backward collectives; algorithm {algos}")
    return model


def main(argv: list[str]) -> int:
    cpu = "--cpu" in argv  # a smoke test of this script's logic on gloo
    if not cpu and not torch.cuda.is_available():
        print("no CUDA device (use --cpu for a gloo smoke test)")
        return 2
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29555")
    dev = torch.device("cpu" if cpu else "cuda:0")
    if cpu:
        dist.init_process_group("gloo", rank=0, world_size=1)
    else:
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=dev)
    torch.manual_seed(1)
    batches = [(torch.randn(32, 64, device=dev), torch.randn(32, 8, device=dev)) for _ in range(6)]
    failures = 0
    cases = [("fp32 stage 2", torch.float32, {"stage": 2}, 1e-5),
             ("fp32 stage 1", torch.float32, {"stage": 1}, 1e-5),
             ("fp32 stage 2, gather overlapped with forward", torch.float32,
              {"stage": 2, "overlap_param_gather": True}, 1e-5),
             ("bf16 params, fp32 masters, stage 2", torch.bfloat16, {"stage": 2}, 1e-2)]
    for name, dtype, kw, tol in cases:
        base = make_model().to(dev, dtype)
        ref = train_reference(copy.deepcopy(base), batches,
                              None if dtype == torch.float32 else torch.float32)
        ours = train_evenzero(copy.deepcopy(base), batches, **kw)
        worst = max(((a.float() - b.float()).abs().max() / (b.float().abs().max() + 1e-12)).item()
                    for a, b in zip(ours.parameters(), ref.parameters(), strict=True))
        ok = worst <= tol
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} {name}: max relative difference {worst:.2e} (tol {tol})")
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
