"""Issue 27's convergence check: does training with `grad_compression` reach fp32's loss?

One local gloo job per model; on every rank one model per mode (the same initial
weights), each with its own `ZeroOptimizer` (AdamW, defaults otherwise), trained step by
step on the same batches: exact (None), "bf16", "int8", "int8" with error feedback.
Printed: each mode's final loss (mean of the last 10% of steps) and its difference from
exact; `--plot` draws the curves (a PNG for BENCHMARKS.md), `--json` keeps them.

Models: "seed", the repro's seed MoE (its learnable teacher; experts over 2 ranks so
that the expert group compresses too), and "llama", the ~20M Llama-style model of
`benchmarks/llama_dense.py` (random tokens: its loss falls towards log(vocab) as it
learns the unigram distribution, then little). The issue's run: 2,000 steps at 4 ranks
for each (`--steps 2000`, about an hour per model on 2 cores with the four modes).

    python benchmarks/compression_convergence.py --model seed --steps 2000 [--plot F.png]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import evenzero  # noqa: F401
except ImportError:
    sys.path.insert(0, str(HERE.parent / "src"))

MODES = {"exact": {}, "bf16": {"grad_compression": "bf16"},
         "int8": {"grad_compression": "int8"},
         "int8+ef": {"grad_compression": "int8", "grad_compression_error_feedback": True}}


def worker(ctx, payload: dict) -> dict:
    import torch

    from evenzero.runtime import ZeroOptimizer

    steps, which = payload["steps"], payload["model"]
    if which == "seed":
        from evenzero.moe import expert_parallel_groups
        from evenzero.repro.seedmodel import SeedModel, SeedModelConfig, seed_batch, seed_loss

        m = SeedModelConfig(**payload["seed"])
        groups = expert_parallel_groups(m.ep_size)

        def build():
            return SeedModel(m, groups).to(ctx.device)

        def batch(step):
            return seed_batch(m, step, ctx.rank, ctx.world_size)

        loss_fn, extra = seed_loss, {"expert_groups": {m.expert_group_name: groups.edp_group}}
        lr = 1e-3
    else:
        import llama_dense

        c = llama_dense.LlamaConfig(**payload["llama"])

        def build():
            torch.manual_seed(c.seed)
            return llama_dense.Llama(c).to(ctx.device)

        def batch(step):
            return llama_dense.batch(c, step, ctx.rank, ctx.world_size)

        loss_fn, extra, lr = llama_dense.loss_fn, {}, 3e-4
    runs = {}
    for name, settings in MODES.items():
        if name not in payload["modes"]:
            continue
        model = build()
        runs[name] = (model, ZeroOptimizer(model, torch.optim.AdamW, lr=lr, weight_decay=0.01,
                                           **extra, **settings))
    losses = {name: [] for name in runs}
    seconds = {name: 0.0 for name in runs}
    for step in range(steps):
        x, y = batch(step)
        for name, (model, opt) in runs.items():
            t0 = time.perf_counter()
            loss = loss_fn(model(x), y)
            loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            seconds[name] += time.perf_counter() - t0
            value = loss.detach().clone()
            torch.distributed.all_reduce(value)
            losses[name].append(float(value) / ctx.world_size)
        if step % 50 == 0:
            ctx.emit(("step", step))
        if payload["partial"] and ctx.rank == 0 and (step + 1) % 100 == 0:
            # A 2,000-step run takes hours on a shared machine: keep what it has so far, so
            # that a killed run still leaves its curves.
            Path(payload["partial"]).write_text(json.dumps({"steps_done": step + 1,
                                                            "losses": losses}))
    notes = {name: [n for n in opt.plan.notes if "grad_compression" in n]
             for name, (_, opt) in runs.items()}
    return {"losses": losses, "seconds": seconds, "notes": notes}


def main(argv: list[str] | None = None) -> int:
    from evenzero.repro.localrun import LaunchOptions, launch

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("seed", "llama"), default="seed")
    p.add_argument("--world-size", type=int, default=4)
    p.add_argument("--steps", type=int, default=2000)
    p.add_argument("--tiny", action="store_true", help="toy model sizes (checks the script)")
    p.add_argument("--plot", type=Path)
    p.add_argument("--json", type=Path)
    p.add_argument("--modes", nargs="+", choices=list(MODES), default=list(MODES),
                   help="a subset of the modes (the same weights and batches: runs of "
                        "different subsets compare step for step)")
    p.add_argument("--partial", type=Path,
                   help="rank 0 rewrites the losses so far here every 100 steps")
    p.add_argument("--from-json", type=Path, nargs="+", metavar="FILE",
                   help="run nothing: tabulate and plot the losses of --json/--partial files "
                        "(a mode in a later file replaces it from an earlier one), at the "
                        "steps every mode reached")
    args = p.parse_args(argv)
    if args.from_json:
        losses: dict[str, list[float]] = {}
        for f in args.from_json:
            losses.update(json.loads(f.read_text())["losses"])
        matched = min(len(v) for v in losses.values())
        report = {"losses": {n: v[:matched] for n, v in losses.items()}, "seconds": {},
                  "notes": {}}
        args.steps = matched
        return _summarise(args, argv, report, None)
    import llama_dense

    from evenzero.repro.seedmodel import SeedModelConfig

    seed = SeedModelConfig(dim=64 if args.tiny else 1000, ep_size=2)
    llama = llama_dense.TINY if args.tiny else llama_dense.LlamaConfig()
    payload = {"model": args.model, "steps": args.steps, "seed": asdict(seed),
               "llama": asdict(llama), "partial": str(args.partial) if args.partial else "",
               "modes": list(args.modes)}
    t0 = time.perf_counter()
    report = launch(worker, payload, LaunchOptions(args.world_size, "gloo", timeout_s=6 * 3600))
    return _summarise(args, argv, report, time.perf_counter() - t0)


def _summarise(args, argv, report: dict, wall: float | None) -> int:
    losses = report["losses"]
    tail = max(1, args.steps // 10)
    final = {n: sum(v[-tail:]) / tail for n, v in losses.items()}
    print(f"{args.model}, {args.world_size} gloo ranks, {args.steps} steps, AdamW, clip 1.0 "
          f"({'from files' if wall is None else f'{wall:.0f} s'})")
    print("\n| mode | final loss (mean of last 10%) | vs exact | seconds in its steps |")
    print("|---|---:|---:|---:|")
    for n, v in final.items():
        versus = f"{(v - final['exact']) / final['exact']:+.2%}" if "exact" in final else "-"
        spent = report["seconds"].get(n)
        print(f"| {n} | {v:.5f} | {versus} | {'-' if spent is None else f'{spent:.0f}'} |")
    for n, notes in report["notes"].items():
        for note in notes:
            print(f"{n}: {note}")
    print(f"command: python {' '.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])])}")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"plot": str(args.plot),
                                                                "json": str(args.json)},
                                         **report, "final": final}, indent=1, default=str))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(8, 4.5))
        for n, v in losses.items():
            ax.plot(range(len(v)), v, label=f"{n} (final {final[n]:.4f})", linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel("loss (mean over ranks)")
        ax.set_yscale("log")
        ax.set_title(f"grad_compression: {args.model}, {args.world_size} ranks")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        print(f"wrote {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
