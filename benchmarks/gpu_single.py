"""Single-GPU engine overhead: evenzero vs plain PyTorch vs DDP (vs DeepSpeed if present).

World size 1, NCCL, bf16, a 370M-parameter GPT-style decoder (seq 1024, batch 8). With
one rank there is nothing to communicate, so what separates the systems is the engine:
hooks, bucket copies, the flat-shard optimizer step and the parameter copy-back. Target:
evenzero's step <= 1.05 x plain PyTorch with the same master-weight arrangement.

Systems (all AdamW, lr 1e-4, weight decay 0.01, interleaved step by step):
  torch-amp   fp32 params + torch.autocast(bf16) + fused AdamW (fp32 master weights)
  torch-bf16  bf16 params + fused AdamW, no master weights (a lower bound, not like-for-like)
  ddp         torch-amp inside DistributedDataParallel
  evenzero    bf16 params, ZeroOptimizer stage 2: fp32 master shards, fused AdamW
  deepspeed   DeepSpeed ZeRO-2 with bf16, only if `import deepspeed` works here

Run:  python benchmarks/gpu_single.py                 (H200: well under 4 minutes)
      python benchmarks/gpu_single.py --device cpu --tiny   (logic smoke test, seconds)
Prints a table; writes gpu_single.json into $OUT when that is set (else --json PATH).
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import socket
import sys
import time
from pathlib import Path

try:
    import evenzero  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
import torch.distributed as dist
from torch import nn

from evenzero.repro.gptmodel import GPT, GPT_SIZES, gpt_batch, gpt_loss
from evenzero.repro.sidebyside import EvenzeroSystem, InterleaveOptions, run_interleaved

SYSTEMS = ("torch-amp", "torch-bf16", "ddp", "evenzero", "deepspeed")
TARGET = 1.05
LR, WEIGHT_DECAY = 1e-4, 0.01


class Autocast(nn.Module):
    """Runs the wrapped model under torch.autocast (bf16 compute, fp32 params)."""

    def __init__(self, inner: nn.Module, device_type: str) -> None:
        super().__init__()
        self.inner = inner
        self.device_type = device_type

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast(self.device_type, dtype=torch.bfloat16):
            return self.inner(x)


class PlainSystem:
    """A model and a torch optimizer, nothing else: the baseline for engine overhead."""

    def __init__(self, name: str, model: nn.Module, fused: bool) -> None:
        self.name = name
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY,
                                           fused=fused)

    def loss(self, batch):
        x, y = batch
        return gpt_loss(self.model(x), y)

    def backward(self, loss) -> None:
        loss.backward()

    def step(self) -> None:
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def capture_next_step(self) -> None:
        """Nothing to capture: one process, no collectives."""

    def collectives(self):
        return []


def build(name: str, base: GPT, device: str):
    """System `name` around its own copy of `base` (one CPU init, copied: 370M randn is slow)."""
    fused = device.startswith("cuda")
    dev_type = "cuda" if fused else "cpu"
    config = base.config
    if name == "torch-amp":
        return PlainSystem(name, Autocast(copy.deepcopy(base), dev_type).to(device), fused)
    if name == "torch-bf16":
        return PlainSystem(name, copy.deepcopy(base).to(device, torch.bfloat16), fused)
    if name == "ddp":
        from evenzero.repro.baselines import DDPSystem

        return DDPSystem(Autocast(copy.deepcopy(base), dev_type).to(device), gpt_loss, lr=LR,
                         weight_decay=WEIGHT_DECAY, fused_adamw=fused)
    if name == "evenzero":
        return EvenzeroSystem(name, copy.deepcopy(base).to(device, torch.bfloat16), gpt_loss,
                              lr=LR, weight_decay=WEIGHT_DECAY,
                              extra={"fused": True} if fused else None)
    if name == "deepspeed":
        from evenzero.repro.deepspeed_runner import DeepSpeedSystem, deepspeed_unavailable

        reason = deepspeed_unavailable()
        if reason:
            raise RuntimeError(f"not importable ({reason})")
        return DeepSpeedSystem(name, copy.deepcopy(base).to(device), gpt_loss, lr=LR,
                               weight_decay=WEIGHT_DECAY, micro_batch=config.batch_per_rank,
                               dtype="bfloat16")
    raise ValueError(f"unknown system {name!r}; choose from {', '.join(SYSTEMS)}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true", help="tiny model (smoke test of the logic)")
    p.add_argument("--steps", type=int, default=20, help="measured steps per system")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per system")
    p.add_argument("--systems", default=",".join(SYSTEMS))
    p.add_argument("--json", type=Path, help="output file (default $OUT/gpu_single.json)")
    args = p.parse_args(argv)
    names = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [n for n in names if n not in SYSTEMS]
    if unknown or not names:
        print(f"error: --systems: unknown {unknown}; choose from {', '.join(SYSTEMS)}")
        return 2
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device visible; use --device cpu --tiny for a smoke test")
        return 2
    config = GPT_SIZES["tiny" if args.tiny else "gpu-350m"]
    device = "cuda:0" if args.device == "cuda" else "cpu"
    _init_single_rank(args.device)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    started = time.perf_counter()
    systems, skipped = [], {}
    base = GPT(config)
    for name in names:
        try:
            systems.append(build(name, base, device))
        except Exception as e:  # noqa: BLE001 - an optional system that fails to build is skipped, loudly
            if name != "deepspeed":
                raise
            skipped[name] = f"{type(e).__name__}: {e}".splitlines()[0][:200]
    del base
    results = run_interleaved(systems, lambda step: gpt_batch(config, step, 0, 1),
                              InterleaveOptions(args.steps, args.warmup, device))
    report = _report(results, skipped, config, device, time.perf_counter() - started)
    _print(report)
    out = args.json or (Path(os.environ["OUT"]) / "gpu_single.json" if os.environ.get("OUT") else None)
    if out:
        out.write_text(json.dumps(report, indent=1))
        print(f"wrote {out}")
    dist.destroy_process_group()
    return 0


def _init_single_rank(device: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    backend = "nccl" if device == "cuda" else "gloo"
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if device == "cuda" else "cpu")
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0",
                 "LOCAL_RANK": "0", "WORLD_SIZE": "1"}.items():
        os.environ[k] = v
    if device == "cuda":
        torch.cuda.set_device(0)
    dist.init_process_group(backend, rank=0, world_size=1)


def _report(results, skipped, config, device, wall_s) -> dict:
    name = torch.cuda.get_device_name(0) if device.startswith("cuda") else "cpu"
    by = {r.name: r for r in results}
    ref = by.get("torch-amp")
    rows = []
    for r in results:
        rows.append({"name": r.name, "median_step_ms": r.median_step_ms, "step_ms": r.step_ms,
                     "losses": r.losses,
                     "x_torch_amp": r.median_step_ms / ref.median_step_ms if ref else None})
    ez = by.get("evenzero")
    verdict = None
    if ez and ref:
        verdict = {"target": TARGET, "ratio": ez.median_step_ms / ref.median_step_ms,
                   "met": ez.median_step_ms / ref.median_step_ms <= TARGET}
    return {"device": name, "torch": torch.__version__, "params": config.numel(),
            "config": config.__dict__, "systems": rows, "skipped": skipped,
            "evenzero_vs_torch_amp": verdict, "wall_s": wall_s}


def _print(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"{report['device']}: GPT {report['params']:,} params, world size 1, "
                    f"forward+backward+step")
    for col in ("system", "median ms", "min ms", "max ms", "x torch-amp", "first loss", "last loss"):
        t.add_column(col, justify="left" if col == "system" else "right")
    for s in report["systems"]:
        ratio = s["x_torch_amp"]
        t.add_row(s["name"], f"{s['median_step_ms']:.1f}", f"{min(s['step_ms']):.1f}",
                  f"{max(s['step_ms']):.1f}", "-" if ratio is None else f"{ratio:.3f}",
                  f"{s['losses'][0]:.4f}", f"{s['losses'][-1]:.4f}")
    console = Console(width=120)
    console.print(t)
    for name, reason in report["skipped"].items():
        console.print(f"skipped {name}: {reason}")
    v = report["evenzero_vs_torch_amp"]
    if v:
        console.print(f"evenzero / torch-amp = {v['ratio']:.3f} (target <= {v['target']}): "
                      f"{'met' if v['met'] else 'MISSED'}")
    console.print(f"wall time {report['wall_s']:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
