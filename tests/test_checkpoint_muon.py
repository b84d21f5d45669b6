"""Muon momentum in checkpoints: saved at 4 ranks, resumed at 2 and 8, equal to the run
that went on without stopping; `state_dict()` shows torch's Muon keys; the consolidated
export loads into plain torch.optim.Muon + AdamW."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dist_helpers import run_distributed
from muon_models import MUON, Reference, TinyLlama, llama_batch, llama_loss, muon_groups

GLOBAL = 8
"""Sequences per step, whatever the world size."""
FIRST, THEN = 3, 3


def make(world):
    from evenzero import ZeroOptimizer

    torch.manual_seed(0)
    model = TinyLlama()
    ref = Reference(model)
    opt = ZeroOptimizer(model, torch.optim.Muon, muon_groups(model), **MUON, bucket_numel=4096)
    return model, ref, opt


def steps(rank, world, model, ref, opt, start, count):
    for step in range(start, start + count):
        parts = list(llama_batch(step, GLOBAL).split(GLOBAL // world))
        llama_loss(model, parts[rank]).backward()
        opt.step()
        opt.zero_grad()
        ref.step(parts)
    opt.wait_for_params()


def save_job(rank, world, root):
    from evenzero import checkpoint

    model, ref, opt = make(world)
    steps(rank, world, model, ref, opt, 0, FIRST)
    checkpoint.save(opt, Path(root) / "ck")
    checkpoint.export_consolidated(opt, Path(root) / "export")
    if rank == 0:
        torch.save({"model": ref.model.state_dict(), "muon": ref.muon.state_dict(),
                    "adamw": ref.adamw.state_dict()}, Path(root) / "ref.pt")
    sd = opt.state_dict()
    muon = {i for i, p in enumerate(p for g in opt.param_groups for p in g["params"])
            if p.ndim == 2 and i in sd["state"] and "momentum_buffer" in sd["state"][i]}
    return sorted(muon)


def resume_job(rank, world, root):
    from evenzero import checkpoint

    model, ref, opt = make(world)
    checkpoint.load(opt, Path(root) / "ck")
    saved = torch.load(Path(root) / "ref.pt", weights_only=True)
    ref.model.load_state_dict(saved["model"])
    ref.muon.load_state_dict(saved["muon"])
    ref.adamw.load_state_dict(saved["adamw"])
    steps(rank, world, model, ref, opt, FIRST, THEN)
    want = dict(ref.model.named_parameters())
    return max((p.detach() - want[n].detach()).abs().max().item()
               for n, p in model.named_parameters())


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("muon-ck")
    owned = run_distributed(save_job, 4, (str(root),), timeout=300)
    return root, owned


@pytest.mark.slow
def test_state_dict_shows_torch_muon_keys(saved):
    _, owned = saved
    # each rank shows momentum_buffer for the matrices it owns; together, every matrix
    model = TinyLlama()
    matrices = len(muon_groups(model)[0]["params"])
    assert sum(len(o) for o in owned) == matrices
    assert len(set().union(*map(set, owned))) == matrices


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 8])
def test_resumes_at_another_world_size(saved, world):
    root, _ = saved
    worst = run_distributed(resume_job, world, (str(root),), timeout=400)
    assert max(worst) <= 1e-6, worst


@pytest.mark.slow
def test_export_loads_in_plain_torch_muon(saved):
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    root, _ = saved
    from safetensors.torch import load_file

    model = TinyLlama()
    model.load_state_dict(load_file(str(root / "export" / "model.safetensors")))
    groups = muon_groups(model)
    muon = torch.optim.Muon(groups[0]["params"], **MUON)
    adamw = torch.optim.AdamW(groups[1]["params"], **{k: v for k, v in groups[1].items()
                                                      if k not in ("params", "optimizer")})
    osd = torch.load(root / "export" / "optimizer.pt", weights_only=True)
    set_optimizer_state_dict(model, [muon, adamw], osd)
    saved_ref = torch.load(root / "ref.pt", weights_only=True)
    want = saved_ref["muon"]["state"]
    assert set(want) == set(muon.state_dict()["state"])
    for i, s in muon.state_dict()["state"].items():
        assert s["momentum_buffer"].shape == groups[0]["params"][i].shape
        assert (s["momentum_buffer"] - want[i]["momentum_buffer"]).abs().max() <= 1e-6
