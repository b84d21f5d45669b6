"""`engine.save_checkpoint` / `load_checkpoint`: DeepSpeed's directory conventions on
evenzero's sharded format. A resumed run continues exactly where the saved one was (same
world size: bit for bit; another world size: to float rounding, the global batch being
the same), with its LR schedule, counters, loss scale and client state."""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dist_helpers import CheckResults, run_checks, run_distributed
from ds_train_script import CASES, Net
from evenzero.checkpoint import CheckpointError


def _has_tagged_checkpoints() -> bool:
    import inspect

    from evenzero import checkpoint

    return "tag" in inspect.signature(checkpoint.save).parameters


pytestmark = pytest.mark.skipif(not _has_tagged_checkpoints(), reason=(
    "needs evenzero.checkpoint.save(opt, dir, step, *, extra=, tag=) (being merged from the "
    "checkpoint branch)"))

CHUNKS = 4  # micro-batches per optimizer step over the whole world
MICRO = 3


def _config(world: int, fp16: bool = False) -> dict:
    cfg = copy.deepcopy(CASES["fp16_zero2" if fp16 else "zero2_adam"])
    cfg.update(train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=CHUNKS // world)
    if fp16:  # far too high: the first steps overflow, then the scale settles
        cfg["fp16"] = {**cfg["fp16"], "initial_scale_power": 24}
    cfg["scheduler"] = {"type": "WarmupDecayLR", "params": {
        "total_num_steps": 10, "warmup_min_lr": 1e-3, "warmup_max_lr": 8e-3,
        "warmup_num_steps": 3, "warmup_type": "linear"}}
    return cfg


def _engine(world: int, fp16: bool = False):
    import evenzero.deepspeed as deepspeed

    torch.manual_seed(0)
    model = Net()
    engine, *_ = deepspeed.initialize(model=model, config=_config(world, fp16),
                                      model_parameters=model.parameters())
    return engine


def _chunk(step: int, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + chunk)
    return torch.randn(MICRO, 8, generator=g) * 2, torch.randint(0, 4, (MICRO,), generator=g)


def _train(engine, first: int, steps: int) -> list[float]:
    """Optimizer steps first..first+steps-1; the global batch of a step is CHUNKS chunks,
    whatever the world size (rank r's micro-batch i is chunk i*W + r)."""
    import torch.distributed as dist

    world, rank = dist.get_world_size(), dist.get_rank()
    dtype = torch.float16 if engine.fp16_enabled() else torch.float32
    lrs = []
    for step in range(first, first + steps):
        for i in range(CHUNKS // world):
            x, y = _chunk(step, i * world + rank)
            engine.backward(F.cross_entropy(engine(x.to(dtype)).float(), y))
            engine.step()
        lrs.append(engine.get_lr()[0])
    return lrs


def _state(engine) -> dict:
    """Plain values (tensors do not survive the trip back from a finished process)."""
    return {"params": {n: p.detach().float().flatten().tolist()
                       for n, p in engine.module.named_parameters()},
            "buffers": {n: b.flatten().tolist() for n, b in engine.module.named_buffers()},
            "global_steps": engine.global_steps, "global_samples": engine.global_samples,
            "skipped": engine.skipped_steps, "lr": engine.get_lr(),
            "scale": engine.optimizer.cur_scale}


def save_and_continue(rank: int, world: int, root: str, fp16: bool) -> dict:
    """Train 3 steps, save (tag default), train 3 more: the reference continuation."""
    os.environ["LOCAL_RANK"] = str(rank)
    engine = _engine(world, fp16)
    _train(engine, 0, 3)
    saved = _state(engine)
    assert engine.save_checkpoint(root, client_state={"epoch": 7, "data": torch.arange(3)})
    lrs = _train(engine, 3, 3)
    return {"saved": saved, "final": _state(engine), "lrs": lrs,
            "plan": (engine.zero.plan.bucket_numel, engine.zero.plan.arrival)}


def resume(rank: int, world: int, root: str, fp16: bool) -> dict:
    os.environ["LOCAL_RANK"] = str(rank)
    engine = _engine(world, fp16)
    path, client = engine.load_checkpoint(root)
    loaded = _state(engine)
    plan = engine.zero.plan
    lrs = _train(engine, 3, 3)
    client = {k: v.tolist() if torch.is_tensor(v) else v for k, v in client.items()}
    return {"path": path, "client": client, "loaded": loaded, "final": _state(engine),
            "lrs": lrs, "plan": (plan.bucket_numel, plan.arrival), "note": plan.notes[-1]}


def _close(a: dict, b: dict, tol: float) -> float:
    assert set(a) == set(b)
    worst = max(abs(x - y) for n in a for x, y in zip(a[n], b[n], strict=True))
    assert worst <= tol, worst
    return worst


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("ds_ckpt"))
    return root, run_distributed(save_and_continue, 2, (root, False), timeout=300)[0]


def test_directory_follows_deepspeed(saved):
    root, ref = saved
    assert (Path(root) / "latest").read_text() == "global_step3"  # no newline, as DeepSpeed
    assert (Path(root) / "global_step3").is_dir()
    assert ref["saved"]["global_steps"] == 3


def test_resume_same_world_size_is_exact(saved):
    root, ref = saved
    got = run_distributed(resume, 2, (root, False), timeout=300)[0]
    assert got["path"] == str(Path(root) / "global_step3")
    for key in ("global_steps", "global_samples", "skipped", "scale"):
        assert got["loaded"][key] == ref["saved"][key], key
    _close(got["loaded"]["params"], ref["saved"]["params"], 0.0)
    _close(got["loaded"]["buffers"], ref["saved"]["buffers"], 0.0)
    assert got["lrs"] == ref["lrs"]
    _close(got["final"]["params"], ref["final"]["params"], 0.0)
    assert got["client"]["epoch"] == 7 and got["client"]["data"] == [0, 1, 2]
    assert "global_steps" not in got["client"] and "lr_scheduler" not in got["client"]
    # No reduce_bucket_size: "auto". The saving run's plan is taken over, not refined again
    # (evenzero.checkpoint.load under engine.load_checkpoint).
    assert got["plan"] == ref["plan"] and "the loaded checkpoint's" in got["note"], got["note"]


def test_resume_at_another_world_size(saved):
    """Saved on 2 ranks, resumed on 1 with the same global batch."""
    root, ref = saved
    got = run_distributed(resume, 1, (root, False), timeout=300)[0]
    assert got["loaded"]["global_steps"] == 3 and got["lrs"] == ref["lrs"]
    assert "the loaded checkpoint's" not in got["note"]  # its own plan for its own world
    _close(got["loaded"]["params"], ref["saved"]["params"], 0.0)
    _close(got["final"]["params"], ref["final"]["params"], 1e-5)


def _variants(rank: int, world: int, root: str) -> dict[str, str | None]:
    os.environ["LOCAL_RANK"] = str(rank)

    def module_only():
        engine = _engine(world)
        path, client = engine.load_checkpoint(root, load_module_only=True)
        assert engine.global_steps == 0 and engine.get_lr() == [1e-3]  # schedule not loaded
        assert client["global_steps"] == 3 and client["epoch"] == 7  # as DeepSpeed returns
        shard = engine.zero.shard_state("dense")
        assert set(shard["flats"]) == {"master"}  # fresh optimizer state
        assert all(not s for s in shard["param_scalars"].values())
        fresh = _engine(world)
        changed = [n for (n, p), (_, q) in zip(engine.module.named_parameters(),
                                               fresh.module.named_parameters(), strict=True)
                   if p.requires_grad and not torch.equal(p, q)]
        assert changed, "the module weights were not loaded"

    def without_optimizer_state():
        engine = _engine(world)
        _train(engine, 0, 1)
        before = {k: v.clone() for k, v in engine.zero.shard_state("dense")["flats"].items()
                  if k != "master"}
        assert before, "one step made no optimizer state"
        engine.load_checkpoint(root, load_optimizer_states=False)
        state = engine.zero.shard_state("dense")["flats"]
        assert set(state) == {"master", *before}
        assert all(torch.equal(state[k], v) for k, v in before.items())
        assert engine.global_steps == 3  # counters and schedule still load

    def explicit_tag_and_missing_latest():
        engine = _engine(world)
        engine.save_checkpoint(root + "/tagged", tag="mytag", save_latest=False)
        assert not (Path(root) / "tagged" / "latest").exists()
        assert engine.load_checkpoint(root + "/tagged") == (None, None)
        path, _ = engine.load_checkpoint(root + "/tagged", tag="mytag")
        assert path.endswith("mytag")

    def client_keys_overwrite_engine_keys():
        """DeepSpeed merges client_state over its own keys (state.update)."""
        engine = _engine(world)
        _train(engine, 0, 1)
        engine.save_checkpoint(root + "/override", client_state={"global_steps": 42})
        fresh = _engine(world)
        fresh.load_checkpoint(root + "/override")
        assert fresh.global_steps == 42

    def deepspeed_checkpoint_hook():
        engine = _engine(world)
        ds_dir = Path(root) / "ds_written" / "global_step1"
        if torch.distributed.get_rank() == 0:
            ds_dir.mkdir(parents=True, exist_ok=True)
            (ds_dir / "mp_rank_00_model_states.pt").write_bytes(b"")
            (ds_dir.parent / "latest").write_text("global_step1")
        torch.distributed.barrier()
        # A DeepSpeed-written directory goes to evenzero.checkpoint.load_deepspeed, which
        # refuses a damaged file on every rank.
        with pytest.raises(CheckpointError, match="truncated or damaged"):
            engine.load_checkpoint(str(ds_dir.parent))

    return run_checks({"module_only": module_only,
                       "without_optimizer_state": without_optimizer_state,
                       "explicit_tag_and_missing_latest": explicit_tag_and_missing_latest,
                       "client_keys_overwrite_engine_keys": client_keys_overwrite_engine_keys,
                       "deepspeed_checkpoint_hook": deepspeed_checkpoint_hook}, barrier=True)


VARIANTS = CheckResults(_variants, timeout=300)


@pytest.mark.parametrize("check", ["module_only", "without_optimizer_state",
                                   "explicit_tag_and_missing_latest",
                                   "client_keys_overwrite_engine_keys",
                                   "deepspeed_checkpoint_hook"])
def test_load_variants(check, saved):
    VARIANTS.assert_passed(check, 2, saved[0])


def test_fp16_loss_scale_resumes(tmp_path):
    """The dynamic loss scale (with its hysteresis and iteration counters) resumes too."""
    root = str(tmp_path)
    ref = run_distributed(save_and_continue, 2, (root, True), timeout=300)[0]
    got = run_distributed(resume, 2, (root, True), timeout=300)[0]
    assert got["loaded"]["scale"] == ref["saved"]["scale"] < 2.0 ** 24
    assert got["loaded"]["skipped"] == ref["saved"]["skipped"] > 0
    assert got["final"]["scale"] == ref["final"]["scale"]
    _close(got["final"]["params"], ref["final"]["params"], 0.0)
