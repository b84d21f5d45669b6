"""How big an int8 block (`grad_compression_block`) should be: error, bytes and codec time.

No processes: the codec of `runtime/compression.py` on 4 ranks' gradients, the all-to-all
done by hand. Gradients: a backward of the seed MoE's dense layers and of the ~20M
Llama-style model (`benchmarks/llama_dense.py`) on 4 different batches. For each block:
the relative L2 error of the reduced (summed) gradient, the bytes per element on the
wire, and the seconds to encode all 4 ranks' buckets and decode every chunk (median of 5).

    python benchmarks/compression_block.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import evenzero  # noqa: F401
except ImportError:
    sys.path.insert(0, str(HERE.parent / "src"))

BLOCKS = (32, 64, 128, 256, 512, 1024, 4096)
WORLD = 4


class _Arena:
    def __init__(self, numel: int) -> None:
        self.arena, self.used = torch.empty(numel), 0

    def take(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        out = self.arena[self.used:self.used + numel]
        self.used += numel
        return out


def gradients(which: str) -> list[torch.Tensor]:
    """One flat gradient per rank (4 batches), padded to whole blocks of every size."""
    if which == "llama":
        import llama_dense

        c = llama_dense.LlamaConfig()
        torch.manual_seed(c.seed)
        model = llama_dense.Llama(c)
        batch, loss_fn = (lambda r: llama_dense.batch(c, 0, r, WORLD)), llama_dense.loss_fn
    else:
        from evenzero.repro.seedmodel import seed_batch, seed_loss

        cfg_dim = 1000
        model = torch.nn.Sequential(torch.nn.Linear(cfg_dim, cfg_dim), torch.nn.GELU(),
                                    torch.nn.Linear(cfg_dim, cfg_dim))
        from evenzero.repro.seedmodel import SeedModelConfig

        m = SeedModelConfig()
        batch, loss_fn = (lambda r: seed_batch(m, 0, r, WORLD)), seed_loss
    out = []
    for r in range(WORLD):
        model.zero_grad()
        x, y = batch(r)
        loss_fn(model(x), y).backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        whole = WORLD * max(BLOCKS)
        out.append(torch.nn.functional.pad(flat, (0, -flat.numel() % whole)))
    return out


def measure(grads: list[torch.Tensor], block: int) -> tuple[float, float, float]:
    from evenzero.runtime.compression import CompressedReduceScatter
    from evenzero.wire import wire_bytes

    n = grads[0].numel()
    rs = CompressedReduceScatter("int8", block)
    exact = sum(grads)
    times, err = [], 0.0
    for _ in range(5):
        bufs = [rs.allocate(_Arena(rs.pool_numel(n, 4)), g) for g in grads]
        t0 = time.perf_counter()
        for b, g in zip(bufs, grads, strict=True):
            rs.encode(b, g, WORLD)
        t1 = time.perf_counter()
        for k, b in enumerate(bufs):
            b.recv.view(WORLD, -1).copy_(torch.stack([s.send.view(WORLD, -1)[k] for s in bufs]))
        t2 = time.perf_counter()
        got = torch.cat([rs.chunk(b, WORLD, torch.float32) for b in bufs])
        t3 = time.perf_counter()
        times.append((t1 - t0) + (t3 - t2))
        err = float((got - exact).norm() / exact.norm())
    return err, wire_bytes("int8", n, 4, block) / n, statistics.median(times)


def main() -> int:
    torch.set_num_threads(1)
    for which in ("seed", "llama"):
        grads = gradients(which)
        print(f"\n{which}: {grads[0].numel():,} elements per rank, {WORLD} ranks, one thread")
        print("| block | rel. error of the sum | bytes/element | fp32 / int8 bytes | "
              "encode + decode s |")
        print("|---:|---:|---:|---:|---:|")
        for block in BLOCKS:
            err, per, sec = measure(grads, block)
            print(f"| {block} | {err:.4f} | {per:.4f} | {4 / per:.2f}x | {sec:.3f} |")
    print("command: python benchmarks/compression_block.py")
    return 0


if __name__ == "__main__":
    sys.exit(main())
