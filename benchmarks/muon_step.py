"""Muon step time side by side on CPU gloo ranks: evenzero (ZeroOptimizer with torch.optim.Muon
+ AdamW), DDP + torch.optim.Muon + AdamW, and real DeepSpeed 0.19.8's ZeRO-2 Muon
(`"optimizer": {"type": "Muon"}`), on the same Llama-shaped model and batches, in one job
(BENCHMARKS.md, "Muon").

    PYTHONPATH=src python3 benchmarks/muon_step.py --world 4 --steps 12

Each system trains `--steps` steps (the first 2 are warm-up), the systems taking turns
step by step in the same processes; the figure is the median step (forward, backward,
step) over the rest, and the ratios are to evenzero's. Losses of
the first steps are printed too, and the size of each system's first update of the Muon
matrices against evenzero's: evenzero, DDP and DeepSpeed without ZeRO (stage 0) should
agree; DeepSpeed's ZeRO-2 Muon updates differ (docs/muon.md). Its step time is not a
comparison of interest (nothing sharded).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn


class Llama(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, ff: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList()
        for _ in range(layers):
            b = nn.Module()
            b.attn_norm, b.mlp_norm = nn.RMSNorm(d), nn.RMSNorm(d)
            b.q, b.k, b.v, b.o = (nn.Linear(d, d, bias=False) for _ in range(4))
            b.gate, b.up = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
            b.down = nn.Linear(ff, d, bias=False)
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


def loss_of(model, ids):
    logits = model(ids[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))


def split(model):
    hidden = [p for n, p in model.named_parameters()
              if p.ndim == 2 and not n.startswith(("embed", "lm_head"))]
    rest = [p for p in model.parameters() if not any(p is h for h in hidden)]
    return hidden, rest


LR, ADAM_LR, WD = 0.02, 3e-3, 0.01


def build(system: str, args):
    """(forward module, backward, step, zero_grad, the Muon matrices) of one system."""
    torch.manual_seed(0)
    model = Llama(args.vocab, args.d, args.layers, args.ff)
    hidden, rest = split(model)
    if system == "evenzero":
        from evenzero import ZeroOptimizer

        opt = ZeroOptimizer(model, torch.optim.Muon,
                            [{"params": hidden},
                             {"params": rest, "optimizer": torch.optim.AdamW, "lr": ADAM_LR,
                              "weight_decay": WD}], lr=LR, weight_decay=WD)
        return model, (lambda loss: loss.backward()), opt.step, opt.zero_grad, hidden
    if system == "ddp":
        ddp = nn.parallel.DistributedDataParallel(model)
        muon = torch.optim.Muon(hidden, lr=LR, weight_decay=WD)
        adamw = torch.optim.AdamW(rest, lr=ADAM_LR, weight_decay=WD)

        def step():
            muon.step()
            adamw.step()

        def zero():
            muon.zero_grad()
            adamw.zero_grad()

        return ddp, (lambda loss: loss.backward()), step, zero, hidden
    import deepspeed

    stage = 0 if system == "deepspeed-stage0" else 2
    config = {"train_micro_batch_size_per_gpu": args.per_rank, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10**9,
              "zero_allow_untested_optimizer": True,
              "optimizer": {"type": "Muon", "params": {"lr": LR, "adam_lr": ADAM_LR,
                                                       "weight_decay": WD}}}
    engine, _, _, _ = deepspeed.initialize(model=model, config=config,
                                           model_parameters=list(model.parameters()))
    return engine, engine.backward, engine.step, (lambda: None), hidden


def run_all(rank: int, world: int, args) -> dict[str, tuple[list[float], list[float], float]]:
    """Every system steps in turn, step by step, so that a busy moment of the machine
    falls on all of them alike."""
    systems = {name: build(name, args) for name in args.systems}
    before = {name: [p.detach().clone() for p in sys[4]] for name, sys in systems.items()}
    out = {name: ([], [], 0.0) for name in systems}
    for s in range(args.steps):
        g = torch.Generator().manual_seed(s)
        batch = torch.randint(0, args.vocab, (args.per_rank * world, args.seq + 1), generator=g)
        mine = batch[rank * args.per_rank:(rank + 1) * args.per_rank]
        for name, (fwd, backward, step, zero, hidden) in systems.items():
            dist.barrier()
            t0 = time.perf_counter()
            loss = loss_of(fwd, mine)
            backward(loss)
            step()
            zero()
            out[name][0].append(time.perf_counter() - t0)
            out[name][1].append(loss.item())
            if s == 0:
                moved = sum(float((p.detach() - b).square().sum())
                            for p, b in zip(hidden, before[name], strict=True)) ** 0.5
                out[name] = (out[name][0], out[name][1], moved)
    return out


def worker(rank: int, world: int, store: str, args, out) -> None:
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world),
                      DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    result = {}
    for system, (times, losses, first) in run_all(rank, world, args).items():
        t = torch.tensor(times)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when its slowest rank does
        result[system] = (statistics.median(t.tolist()[2:]), losses[:4], first)
    if rank == 0:
        out.put(result)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--per-rank", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--ff", type=int, default=688)
    ap.add_argument("--systems", nargs="+",
                    default=["evenzero", "ddp", "deepspeed", "deepspeed-stage0"])
    args = ap.parse_args()
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    store = os.path.join(tempfile.mkdtemp(), "store")
    procs = [ctx.Process(target=worker, args=(r, args.world, store, args, out))
             for r in range(args.world)]
    for p in procs:
        p.start()
    result = out.get()
    for p in procs:
        p.join()
    base = result["evenzero"][0] if "evenzero" in result else None
    print(f"{args.world} ranks, d={args.d}, layers={args.layers}, ff={args.ff}, "
          f"vocab={args.vocab}, {args.per_rank}x{args.seq} tokens per rank")
    moved = result["evenzero"][2] if "evenzero" in result else None
    print("| system | median step | vs evenzero | losses, steps 0-3 | first update of the "
          "Muon matrices vs evenzero |")
    print("|---|---:|---:|---|---:|")
    for system, (median, losses, first) in result.items():
        ratio = f"{median / base:.2f}x" if base else "-"
        update = f"{first / moved:.4f}x" if moved else "-"
        print(f"| {system} | {median * 1e3:.1f} ms | {ratio} | "
              f"{', '.join(f'{x:.5f}' for x in losses)} | {update} |")


if __name__ == "__main__":
    main()
