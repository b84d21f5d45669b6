"""Soak: a long run of the seed model's structure, its memory and file descriptors per rank.

    python benchmarks/soak.py --loop zero --world-size 4 --steps 2000 --out soak/
    python benchmarks/soak.py --loop deepspeed ... --plot soak.png

Trains `SeedModel` (fc1, fc2 and a top-1 MoE layer over expert-parallel groups of 4;
`--dim` wide) under torchrun at `--world-size` gloo ranks for `--steps` optimizer steps of
`--accum` micro-batches each, saves a checkpoint every `--every` steps and, once, at
`--resume-at`, loads the newest one back into the running job (a resume). Each rank
records its resident set size (`/proc/self/statm`) and its open file descriptors
(`/proc/self/fd`) every `--sample-every` steps, right after each save and after the
resume. Two loops:

* `zero`: the README's loop, `evenzero.ZeroOptimizer` with `evenzero.checkpoint.save` /
  `load`, no_sync() micro-batches and an LR scheduler;
* `deepspeed`: the same model under `import evenzero.deepspeed as deepspeed`, DeepSpeed's
  engine loop (`engine.backward`, `engine.step` at the accumulation boundary,
  `engine.save_checkpoint`, `engine.load_checkpoint`).

Output: `<out>/soak-<loop>.json` (every sample of every rank, and per rank the growth
of RSS from the end of warm-up, `--warmup` steps, to its largest later value, and whether
the descriptor count changed), a summary table, and with `--plot` a PNG of RSS over steps.
`tests/test_soak.py` runs it and checks growth <= 2% and an unchanged descriptor count.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve()


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --------------------------------------------------------------------------- one rank


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import evenzero
    from evenzero.moe import expert_parallel_groups
    from evenzero.repro.seedmodel import SeedModel, SeedModelConfig, seed_batch, seed_loss

    torch.set_num_threads(1)
    if args.loop == "zero":
        evenzero.init_process_group("gloo")
    else:
        import evenzero.deepspeed as deepspeed

        deepspeed.init_distributed("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    config = SeedModelConfig(dim=args.dim, num_experts=8, ep_size=4, tokens_per_rank=8)
    config.check(world)
    groups = expert_parallel_groups(config.ep_size)
    model = SeedModel(config, groups)
    samples: list[dict] = []

    def sample(step: int, event: str) -> None:
        samples.append({"step": step, "event": event, "rss": rss_bytes(), "fds": open_fds()})

    ckpt = Path(args.out) / f"ckpt-{args.loop}"
    micro_batches = (seed_batch(config, s, rank, world) for s in range(10**9))
    if args.loop == "zero":
        from evenzero import checkpoint

        opt = evenzero.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3, weight_decay=0.01,
                                     expert_groups={config.expert_group_name: groups.edp_group})
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 100))
        for step in range(args.steps):
            for micro in range(args.accum):
                x, y = next(micro_batches)
                loss = seed_loss(model(x), y) / args.accum
                if micro < args.accum - 1:
                    with opt.no_sync():
                        loss.backward()
                else:
                    loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            done = step + 1
            if done % args.every == 0:
                checkpoint.save(opt, ckpt, extra={"scheduler": sched.state_dict(),
                                                  "data": {"next_batch": done},
                                                  "rng": torch.get_rng_state()})
                sample(done, "save")
            if done == args.resume_at:
                resumed = checkpoint.load(opt, checkpoint.latest(ckpt))
                sched.load_state_dict(resumed.extra["scheduler"])
                sample(done, "resume")
            if done % args.sample_every == 0:
                sample(done, "step")
    else:
        import evenzero.deepspeed as deepspeed

        ds_config = {"train_micro_batch_size_per_gpu": config.tokens_per_rank,
                     "gradient_accumulation_steps": args.accum, "gradient_clipping": 1.0,
                     "optimizer": {"type": "AdamW", "params": {"lr": 1e-3,
                                                               "weight_decay": 0.01}},
                     "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 100}},
                     "zero_optimization": {"stage": 2}}
        engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config)
        for step in range(args.steps):
            for _micro in range(args.accum):
                x, y = next(micro_batches)
                engine.backward(seed_loss(engine(x), y))
                engine.step()
            done = step + 1
            if done % args.every == 0:
                engine.save_checkpoint(str(ckpt), client_state={"next_batch": done})
                sample(done, "save")
            if done == args.resume_at:
                engine.load_checkpoint(str(ckpt))
                sample(done, "resume")
            if done % args.sample_every == 0:
                sample(done, "step")
    Path(args.out, f"rank-{args.loop}-{rank}.json").write_text(json.dumps(samples))
    dist.barrier()


# --------------------------------------------------------------------------- the launcher


def summarise(samples: list[dict], warmup: int) -> dict:
    """RSS growth from the end of warm-up to the largest later sample, and the descriptor
    counts seen after warm-up."""
    after = [s for s in samples if s["step"] >= warmup]
    base = after[0]
    peak = max(after, key=lambda s: s["rss"])
    return {"rss_at_warmup": base["rss"], "rss_peak_after": peak["rss"],
            "peak_step": peak["step"], "rss_last": after[-1]["rss"],
            "growth": peak["rss"] / base["rss"] - 1, "fds": sorted({s["fds"] for s in after})}


def run(loop: str, world_size: int, steps: int, out: Path, *, every: int = 200,
        accum: int = 2, resume_at: int | None = None, warmup: int | None = None,
        sample_every: int = 20, dim: int = 64, timeout: float = 3600) -> dict:
    """Run the soak under torchrun; returns {"samples": {rank: [...]}, "ranks": {rank:
    summary}} and writes it to <out>/soak-<loop>.json."""
    out.mkdir(parents=True, exist_ok=True)
    resume_at = steps // 2 if resume_at is None else resume_at
    warmup = 2 * every if warmup is None else warmup
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(world_size), "--monitor-interval", "0.1", str(HERE), "--worker", "--loop", loop,
           "--steps", str(steps), "--every", str(every), "--accum", str(accum),
           "--resume-at", str(resume_at), "--sample-every", str(sample_every), "--dim",
           str(dim), "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise RuntimeError(f"soak {loop} failed ({done.returncode}):\n{done.stdout[-3000:]}"
                           f"\n{done.stderr[-5000:]}")
    samples = {r: json.loads((out / f"rank-{loop}-{r}.json").read_text())
               for r in range(world_size)}
    result = {"loop": loop, "world_size": world_size, "steps": steps, "every": every,
              "accum": accum, "resume_at": resume_at, "warmup": warmup, "dim": dim,
              "command": " ".join(["python", "benchmarks/soak.py", "--loop", loop,
                                   "--world-size", str(world_size), "--steps", str(steps)]),
              "samples": samples,
              "ranks": {r: summarise(s, warmup) for r, s in samples.items()}}
    (out / f"soak-{loop}.json").write_text(json.dumps(result, indent=1))
    return result


def plot(results: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.2), squeeze=False)
    for ax, result in zip(axes[0], results, strict=True):
        for rank, samples in sorted(result["samples"].items()):
            steps = [s["step"] for s in samples if s["event"] == "step"]
            rss = [s["rss"] / 2**20 for s in samples if s["event"] == "step"]
            ax.plot(steps, rss, label=f"rank {rank}", linewidth=1)
        ax.axvline(result["warmup"], color="grey", linestyle=":", linewidth=1)
        ax.axvline(result["resume_at"], color="grey", linestyle="--", linewidth=1)
        ax.set_title(f"{result['loop']} loop, {result['world_size']} ranks")
        ax.set_xlabel("optimizer step (dotted: end of warm-up, dashed: resume)")
        ax.set_ylabel("RSS (MiB)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def print_summary(result: dict) -> None:
    print(f"{result['loop']}: {result['steps']} steps x {result['accum']} micro-batches, "
          f"{result['world_size']} ranks, checkpoint every {result['every']}, resume at "
          f"{result['resume_at']}, warm-up {result['warmup']} steps")
    for rank, s in sorted(result["ranks"].items()):
        print(f"  rank {rank}: RSS {s['rss_at_warmup'] / 2**20:.1f} MiB at warm-up, peak "
              f"{s['rss_peak_after'] / 2**20:.1f} MiB at step {s['peak_step']} "
              f"({100 * s['growth']:+.2f}%), last {s['rss_last'] / 2**20:.1f} MiB; "
              f"open fds {s['fds']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--loop", choices=("zero", "deepspeed", "both"), default="both")
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--every", type=int, default=200)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--resume-at", type=int)
    ap.add_argument("--warmup", type=int)
    ap.add_argument("--sample-every", type=int, default=20)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--out", default="soak")
    ap.add_argument("--plot", type=Path)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    loops = ("zero", "deepspeed") if args.loop == "both" else (args.loop,)
    results = [run(loop, args.world_size, args.steps, Path(args.out), every=args.every,
                   accum=args.accum, resume_at=args.resume_at, warmup=args.warmup,
                   sample_every=args.sample_every, dim=args.dim) for loop in loops]
    for result in results:
        print_summary(result)
    if args.plot:
        plot(results, args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
