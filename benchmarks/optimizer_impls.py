"""torch.optim's implementations (single-tensor, foreach, fused) stepping one flat shard.

What `evenzero.runtime.innerstep.FASTEST_ON_CPU` is read from: each elementwise optimizer
evenzero accepts, one parameter of N elements with a gradient, `opt.step()` timed; the
implementations of one optimizer are interleaved step by step and the median of
`--steps` steps is printed, in milliseconds, one process, one thread.

    python benchmarks/optimizer_impls.py [--sizes 1000000 4000000 10000000] [--steps 7]
                                         [--device cpu] [--dtype float32]
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import time

import torch

C = torch.optim
CASES = [(C.AdamW, {"lr": 1e-3, "weight_decay": 0.01}), (C.Adam, {"lr": 1e-3}),
         (C.SGD, {"lr": 0.1, "momentum": 0.9}), (C.SGD, {"lr": 0.1}), (C.Adagrad, {"lr": 0.1}),
         (C.RMSprop, {"lr": 1e-3}), (C.NAdam, {"lr": 1e-3}), (C.RAdam, {"lr": 1e-3}),
         (C.Adamax, {"lr": 1e-3}), (C.Adadelta, {}), (C.Rprop, {}), (C.ASGD, {})]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def bench(cls, kw: dict, numel: int, steps: int, device: torch.device,
          dtype: torch.dtype) -> dict[str, float]:
    impls = {"single_tensor": {"foreach": False}, "foreach": {"foreach": True}}
    if "fused" in inspect.signature(cls.__init__).parameters:
        impls["fused"] = {"fused": True}
    gen = torch.Generator(device=device).manual_seed(0)
    opts = {}
    for name, extra in impls.items():
        p = torch.nn.Parameter(torch.randn(numel, generator=gen, device=device, dtype=dtype))
        p.grad = torch.randn(numel, generator=gen, device=device, dtype=dtype) * 1e-2
        opt = cls([p], **kw, **extra)
        opt.step()  # state allocated, first-call costs paid
        opt.step()
        opts[name] = opt
    times: dict[str, list[float]] = {k: [] for k in opts}
    for _ in range(steps):
        for name, opt in opts.items():
            _sync(device)
            t0 = time.perf_counter()
            opt.step()
            _sync(device)
            times[name].append(time.perf_counter() - t0)
    return {k: 1e3 * statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", type=int, nargs="+", default=[1_000_000, 4_000_000, 10_000_000])
    p.add_argument("--steps", type=int, default=7)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "float64", "bfloat16"))
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    print(f"torch {torch.__version__}, {device}, {dtype}, median of {args.steps} steps, ms")
    for numel in args.sizes:
        for cls, kw in CASES:
            med = bench(cls, kw, numel, args.steps, device, dtype)
            cells = "  ".join(f"{k} {v:8.2f}" for k, v in med.items())
            print(f"{numel:>10,} {cls.__name__:8s} {str(kw):38s} {cells}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
