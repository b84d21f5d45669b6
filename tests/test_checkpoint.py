"""Checkpoints of the real ZeroOptimizer on gloo ranks: resharding, export, corruption.

Each test trains the small model of ckpt_train_job.py on N ranks, saves, and loads on
M ranks (another bucket size, another stage); the consolidated state both sides export
must be equal bit for bit.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ckpt_train_job import JobOptions, TinyNet, batch, build, make_groups, train
from evenzero.moe import ExpertGroups
from evenzero.repro.localrun import LaunchOptions, RankContext, launch
from evenzero.repro.seedmodel import SeedModel, SeedModelConfig, seed_batch, seed_loss

STEPS = 3
RANKS = 4


def run(world: int, worker, payload):
    return launch(worker, payload, LaunchOptions(world, backend="gloo", timeout_s=300,
                                                 threads_per_rank=1))


CASES = {
    # id: (N, M, stage at N, stage at M, E, bucket at N, bucket at M)
    "dense-2to3": (2, 3, 2, 2, 1, 1000, 700),
    "dense-4to1-stage1to2": (4, 1, 1, 2, 1, 1000, 5000),
    "dense-1to4-stage2to1": (1, 4, 2, 1, 1, 600, 1000),
    "dense-3to3-stage1": (3, 3, 1, 1, 1, 1000, 1000),
    "experts-2to4": (2, 4, 2, 2, 2, 1000, 800),
    "experts-4to2-stage1": (4, 2, 1, 1, 2, 700, 1000),
}

CONTINUED = ("dense-2to3", "experts-2to4")
"""Cases that also train a step after loading (to "c") and import the export (to "d")."""


def matrix_worker(ctx: RankContext, root: Path) -> dict:
    """Every case on sub-worlds of the first N and M ranks of one 4-rank job."""
    import torch.distributed as dist

    from evenzero import checkpoint
    from evenzero.checkpoint.consolidate import export_consolidated, import_consolidated

    out = {}
    for e in (1, 2):
        groups = make_groups(list(range(1, RANKS + 1)), e)
        for case, (n, m, stage_n, stage_m, ce, bn, bm) in CASES.items():
            if ce != e:
                continue
            d = root / case
            if ctx.rank < n:
                model, opt = build(JobOptions(experts=e, stage=stage_n, bucket_numel=bn), groups[n])
                train(model, opt, 0, STEPS)
                checkpoint.save(opt, d / "ck")
                export_consolidated(opt, d / "a")
            dist.barrier()
            if ctx.rank < m:
                model, opt = build(JobOptions(experts=e, stage=stage_m, bucket_numel=bm), groups[m])
                manifest = checkpoint.load(opt, d / "ck")
                export_consolidated(opt, d / "b")
                out[case] = {"step": manifest.step, "world": manifest.world_size,
                             "step_count": opt.step_count}
                if case in CONTINUED:
                    train(model, opt, STEPS, STEPS + 1)
                    export_consolidated(opt, d / "c")
                    model, opt = build(JobOptions(experts=e, bucket_numel=bm), groups[m])
                    import_consolidated(opt, d / "a")
                    export_consolidated(opt, d / "d")
            dist.barrier()
    for case, (n, m) in MOE_CASES.items():
        moe_round_trip(ctx, root / case, n, m)
    corruption_worker(ctx, root / "corruption")
    return out


MOE = SeedModelConfig(dim=16, num_experts=4, ep_size=2, tokens_per_rank=4)
MOE_CASES = {"seed-moe-4to2": (4, 2), "seed-moe-2to4": (2, 4)}
"""evenzero.moe's all-to-all MoE (the seed model, small): E=2 kept, data-parallel size changed."""


def moe_groups(world: int) -> tuple[ExpertGroups | None, Any]:
    """`expert_parallel_groups` for the first `world` ranks only; a collective."""
    import torch.distributed as dist

    rank, e = dist.get_rank(), MOE.ep_size
    ep = edp = None
    for k in range(world // e):
        g = dist.new_group(list(range(k * e, (k + 1) * e)))
        ep = g if k * e <= rank < (k + 1) * e else ep
    for i in range(e):
        g = dist.new_group(list(range(i, world, e)))
        edp = g if rank < world and rank % e == i else edp
    sub = dist.new_group(list(range(world)))
    return (ExpertGroups(ep, edp, rank % e, rank // e, e), sub) if rank < world else (None, None)


def moe_round_trip(ctx: RankContext, d: Path, n: int, m: int) -> None:
    import torch.distributed as dist

    from evenzero import ZeroOptimizer, checkpoint
    from evenzero.checkpoint.consolidate import export_consolidated

    def build_moe(world: int, bucket: int):
        groups, sub = moe_groups(world)
        if groups is None:
            return None, None, None
        torch.manual_seed(MOE.seed)
        model = SeedModel(MOE, groups)
        opt = ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, bucket_numel=bucket,
                            process_group=sub, expert_groups={MOE.expert_group_name:
                                                              groups.edp_group})
        return model, opt, world

    model, opt, world = build_moe(n, 300)
    if model is not None:
        for step in range(STEPS):
            x, y = seed_batch(MOE, step, ctx.rank, world)
            seed_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
        checkpoint.save(opt, d / "ck")
        export_consolidated(opt, d / "a")
    dist.barrier()
    model, opt, world = build_moe(m, 500)
    if model is not None:
        checkpoint.load(opt, d / "ck")
        export_consolidated(opt, d / "b")
    dist.barrier()


@pytest.mark.parametrize("case", list(MOE_CASES))
def test_round_trip_reshards_evenzero_moe_exactly(matrix, case):
    d = matrix[0] / case
    assert_same_export(d / "a", d / "b")
    v0, v1 = (load_file(d / "a" / f"ep-{v}" / "model.safetensors") for v in (0, 1))
    assert torch.equal(v0["fc1.weight"], v1["fc1.weight"])
    assert not torch.equal(v0["moe.experts.0.fc1.weight"], v1["moe.experts.0.fc1.weight"])
    manifest = json.loads(next((d / "ck").glob("step-*/manifest.json")).read_text())
    assert {"moe.experts.0.fc1.weight@ep0", "moe.experts.0.fc1.weight@ep1"} <= \
        set(manifest["params"])


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt-matrix")
    return root, run(RANKS, matrix_worker, root)


def assert_same_export(a: Path, b: Path) -> None:
    views = sorted(p.relative_to(a) for p in a.rglob("model.safetensors"))
    assert views and views == sorted(p.relative_to(b) for p in b.rglob("model.safetensors"))
    for view in views:
        ma, mb = load_file(a / view), load_file(b / view)
        assert ma.keys() == mb.keys()
        for k in ma:
            assert torch.equal(ma[k], mb[k]), f"{view}: {k}"
        oa = torch.load(a / view.parent / "optimizer.pt", weights_only=True)
        ob = torch.load(b / view.parent / "optimizer.pt", weights_only=True)
        assert oa["param_groups"] == ob["param_groups"]
        assert oa["state"].keys() == ob["state"].keys() and oa["state"]
        for name, st in oa["state"].items():
            assert st.keys() == ob["state"][name].keys()
            for k, v in st.items():
                assert torch.equal(v, ob["state"][name][k]), f"{view}: {name}.{k}"


@pytest.mark.parametrize("case", list(CASES))
def test_round_trip_reshards_exactly(matrix, case):
    root, results = matrix
    n, m, *_, e, _, _ = CASES[case]
    assert results[case] == {"step": STEPS, "world": n, "step_count": STEPS}
    d = root / case
    assert_same_export(d / "a", d / "b")
    # The state is a trained one, not the initial weights both sides could agree on.
    views = sorted(d.joinpath("a").rglob("model.safetensors"))
    assert len(views) == (e if e > 1 else 1)
    first = load_file(views[0])
    torch.manual_seed(JobOptions().seed)
    assert not torch.equal(first["embed.weight"], torch.nn.Linear(24, JobOptions().width).weight)
    assert int(first["steps_seen"]) == STEPS
    if e > 1:  # each expert-parallel rank's experts are its own
        second = load_file(views[1])
        assert not torch.equal(first["expert.weight"], second["expert.weight"])
        assert torch.equal(first["embed.weight"], second["embed.weight"])


@pytest.mark.parametrize("case", CONTINUED)
def test_import_consolidated_restores_the_exported_state(matrix, case):
    d = matrix[0] / case
    assert_same_export(d / "a", d / "d")


def test_export_continues_in_plain_pytorch(matrix):
    """Leave evenzero: the export loads into a plain module and torch.optim.AdamW, and a
    step there matches the step evenzero took after resharding to 3 ranks."""
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    d = matrix[0] / "dense-2to3"
    model = TinyNet(JobOptions())
    model.load_state_dict(load_file(d / "a" / "model.safetensors"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    set_optimizer_state_dict(model, opt, torch.load(d / "a" / "optimizer.pt", weights_only=True))
    rows = [batch(STEPS, rank) for rank in range(3)]
    x, y = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()
    want = load_file(d / "c" / "model.safetensors")
    before = load_file(d / "a" / "model.safetensors")
    for name, p in model.state_dict().items():
        torch.testing.assert_close(p, want[name], rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(want["head.weight"], before["head.weight"])


def corruption_worker(ctx: RankContext, root: Path) -> None:
    import torch.distributed as dist

    from evenzero import checkpoint
    from evenzero.checkpoint.format import CheckpointError

    model, opt = build(JobOptions())
    train(model, opt, 0, 2)
    good = checkpoint.save(opt, root / "good")
    train(model, opt, 2, 3)
    if ctx.rank == 0:
        for variant in ("flipped", "truncated", "missing"):
            shutil.copytree(good, root / variant / good.name)
        f = root / "flipped" / good.name / "rank-00001.safetensors"
        data = bytearray(f.read_bytes())
        data[-7] ^= 0x10
        f.write_bytes(bytes(data))
        f = root / "truncated" / good.name / "rank-00000.safetensors"
        f.write_bytes(f.read_bytes()[:-64])
        (root / "missing" / good.name / "rank-00001.safetensors").unlink()
    dist.barrier()
    before = {g.name: opt.master_shard(g.name).clone() for g in opt.plan.groups}
    params_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    state_before = {k: v.clone() for k, v in opt.shard_state("dense")["flats"].items()}
    messages = {}

    def attempt(label, o, path):
        try:
            checkpoint.load(o, path)
        except CheckpointError as e:
            messages[label] = str(e)
        else:
            messages[label] = "LOADED"

    for variant in ("flipped", "truncated", "missing"):
        attempt(variant, opt, root / variant)
    other_model, other_opt = build(JobOptions(width=48))
    attempt("model", other_opt, root / "good")
    sgd_model, sgd_opt = build(JobOptions(optimizer="sgd"))
    attempt("optimizer", sgd_opt, root / "good")
    # Nothing above may have touched the optimizer or the model.
    for g, t in before.items():
        assert torch.equal(opt.master_shard(g), t), g
    for n, p in model.named_parameters():
        assert torch.equal(p, params_before[n]), n
    for k, v in opt.shard_state("dense")["flats"].items():
        assert torch.equal(v, state_before[k]), k
    (root / f"messages-{ctx.rank}.txt").write_text(repr(messages))
    assert checkpoint.load(opt, root / "good").step == 2


def test_corruption_and_mismatch_are_reported_on_every_rank(matrix):
    root = matrix[0] / "corruption"
    for rank in range(RANKS):
        msgs = eval((root / f"messages-{rank}.txt").read_text())  # noqa: S307 - our own repr
        assert "rank-00001.safetensors: sha256 mismatch" in msgs["flipped"]
        assert "rank-00000.safetensors: " in msgs["truncated"]
        assert "truncated" in msgs["truncated"]
        assert "rank-00001.safetensors: shard file written by rank 1 is missing" in msgs["missing"]
        assert re.search(r"parameter '\w+\.weight' has shape \[\d*,? ?40,? ?\d*\] in the "
                         r"checkpoint but \[\d*,? ?48,? ?\d*\] here", msgs["model"]), msgs["model"]
        assert "saved with optimizer torch.optim.adamw.AdamW, this run uses " \
               "torch.optim.sgd.SGD" in msgs["optimizer"]
