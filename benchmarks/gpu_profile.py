"""Where evenzero's single-GPU step spends its time, and how often the host waits.

The companion of `gpu_single.py`: the same 370M GPT at world size 1 with bf16 parameters,
fp32 master shards and fused AdamW, profiled with torch.profiler over a few steps after
warm-up. Prints the top operators by device time and by host time, and the host-device
synchronisations per step (each one drains the CUDA queue, so the host cannot launch
ahead: the cause of the 1.32x regression in BENCHMARKS.md "Single-GPU engine overhead").

    python benchmarks/gpu_profile.py                      # on the GPU machine, ~1 minute
    python benchmarks/gpu_profile.py --device cpu --tiny  # logic smoke test
Writes gpu_profile.txt into $OUT when that is set (else --out PATH).
"""

from __future__ import annotations

import argparse
import io
import os
import socket
import sys
from collections import Counter
from contextlib import redirect_stdout
from pathlib import Path

try:
    import evenzero  # noqa: F401
except ImportError:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

from evenzero.repro.gptmodel import GPT, GPT_SIZES, gpt_batch, gpt_loss
from evenzero.runtime.optimizer import ZeroOptimizer

SYNC_EVENTS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize",
               "cudaMemcpy", "aten::item", "aten::_local_scalar_dense", "aten::equal",
               "aten::nonzero")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--steps", type=int, default=3, help="profiled steps")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("error: no CUDA device; use --device cpu --tiny")
        return 2
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda:0" if args.device == "cuda" else "cpu")
    if device.type == "cuda":
        torch.cuda.set_device(0)
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=device)
    else:
        dist.init_process_group("gloo", rank=0, world_size=1)
    config = GPT_SIZES["tiny" if args.tiny else "gpu-350m"]
    torch.manual_seed(0)
    model = GPT(config).to(device, torch.bfloat16)
    opt = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-4, weight_decay=0.01,
                        **({"fused": True} if device.type == "cuda" else {}))
    batch = [t.to(device) for t in gpt_batch(config, 0, 0, 1)]

    def one_step() -> None:
        gpt_loss(model(batch[0]), batch[1]).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(3):
        one_step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    if device.type == "cuda":
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            one_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
    counts = Counter(e.name for e in prof.events())
    out = io.StringIO()
    with redirect_stdout(out):
        print(f"{config.numel():,} params on {device}; {args.steps} profiled steps; "
              f"plan notes: {opt.plan.notes[-2:]}")
        print("host-device waits per step:")
        for name in SYNC_EVENTS:
            hits = sum(c for n, c in counts.items() if n.startswith(name))
            print(f"  {name:28s} {hits / args.steps:8.1f}")
        sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
        print(prof.key_averages().table(sort_by=sort, row_limit=25, max_name_column_width=60))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25,
                                        max_name_column_width=60))
    text = out.getvalue()
    print(text)
    dest = args.out or (Path(os.environ["OUT"]) / "gpu_profile.txt" if os.environ.get("OUT") else None)
    if dest:
        dest.write_text(text)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
