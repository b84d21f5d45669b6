"""`ShardedGrad` placeholders and torch's gradient-clearing rule over shards (no processes).

A one-rank stand-in for the engine (hooks -> tracker -> reduce into a flat shard ->
placeholder) runs the same user code as a plain torch model; after every reduction the
shard must equal the torch model's gradients and `has_grad` must say which of them
torch holds.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from evenzero.runtime.checks import ZeroRuntimeError
from evenzero.runtime.gradclear import ClearTracker, add_reduced
from evenzero.runtime.shardedgrad import AddSeen, ShardedGrad, drop_placeholders, placeholders
from evenzero.runtime.shardruns import ShardRuns
from evenzero.spec import GroupSpec, ModelSpec, ParamSpec
from evenzero.strategies import PlanOptions, plan


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(3, 3)
        self.b = nn.Linear(3, 2)
        self.extra = nn.Linear(2, 2)

    def forward(self, x, use_extra=False):
        y = self.b(torch.tanh(self.a(x)))
        return self.extra(y) if use_extra else y


class OneRank:
    """Hooks, tracker and a world-size-1 'reduction' into one flat shard."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.params = dict(model.named_parameters())
        self.tracker = ClearTracker(self.params, placeholders(list(self.params.items())))
        self.offsets, off = {}, 0
        for n, p in self.params.items():
            self.offsets[n] = (off, p.numel())
            off += p.numel()
        self.shard = torch.zeros(off)
        self.sync = True
        self.problems: list[str] = []
        for n, p in self.params.items():
            p.register_post_accumulate_grad_hook(lambda _p, n=n: self._hook(n))

    def _hook(self, name: str) -> None:
        problem = self.tracker.accumulated(name)
        if problem:
            self.problems.append(problem)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()
        if not self.sync:
            return
        for n, p in self.params.items():
            cleared = self.tracker.cleared(n)
            g = p.grad
            local = (torch.zeros(p.numel()) if g is None or isinstance(g, ShardedGrad)
                     else g.reshape(-1))
            off, numel = self.offsets[n]
            add_reduced(self.shard, off, local, 1.0, [(off, numel)] if cleared else [])
            self.tracker.reduced(n)

    def settle(self) -> None:
        for n in self.tracker.settle():
            off, numel = self.offsets[n]
            self.shard[off:off + numel].zero_()

    def check(self, ref: nn.Module) -> None:
        for n, rp in zip(self.params, ref.parameters(), strict=True):
            off, numel = self.offsets[n]
            want = torch.zeros(numel) if rp.grad is None else rp.grad.reshape(-1)
            torch.testing.assert_close(self.shard[off:off + numel], want, msg=n)
            assert self.tracker.has_grad[n] == (rp.grad is not None), n


def _pair():
    torch.manual_seed(0)
    model = Branchy()
    ref = Branchy()
    ref.load_state_dict(model.state_dict())
    return OneRank(model), ref


def _loss(model, i, use_extra=False):
    g = torch.Generator().manual_seed(i)
    return model(torch.randn(4, 3, generator=g), use_extra).pow(2).sum()


def _run(eng, ref, i, use_extra=False):
    eng.backward(_loss(eng.model, i, use_extra))
    _loss(ref, i, use_extra).backward()


def _both(eng, ref, fn):
    fn(eng.model)
    fn(ref)


def _opt_zero_grad(set_to_none):
    def fn(m):
        torch.optim.SGD(m.parameters(), lr=0.1).zero_grad(set_to_none=set_to_none)
    return fn


SEQUENCES = {
    "never cleared: accumulate across steps": [0, "step", 1, "step", 2],
    "opt.zero_grad()": [0, "step", _opt_zero_grad(True), 1, 2],
    "opt.zero_grad(set_to_none=False)": [0, _opt_zero_grad(False), "step", 1],
    "model.zero_grad()": [0, lambda m: m.zero_grad(), 1, "step", 2],
    "model.zero_grad(set_to_none=False)": [0, lambda m: m.zero_grad(set_to_none=False), 1, 2],
    "p.grad = None on one parameter": [0, lambda m: setattr(m.a.weight, "grad", None), 1],
    "unused parameter, cleared to None, then stepped": [
        ("extra", 0), lambda m: m.zero_grad(), 1, "step", ("extra", 2)],
    "unused parameter, zeroed, then stepped": [
        ("extra", 0), lambda m: m.zero_grad(set_to_none=False), 1, "step", 2],
    "cleared to None and stepped without backward": [0, lambda m: m.zero_grad(), "step"],
    "zeroed and stepped without backward": [0, lambda m: m.zero_grad(False), "step"],
    "no_sync micro-batches, cleared first": [
        0, lambda m: m.zero_grad(), ("nosync", 1), ("nosync", 2), 3],
    "no_sync micro-batches, kept from the last step": [0, "step", ("nosync", 1), 2],
    "no_sync, cleared to None between micro-batches": [
        0, "step", ("nosync", 1), lambda m: m.zero_grad(), ("nosync", 2), 3],
    "no_sync, one parameter unused in the last micro-batch": [
        lambda m: m.zero_grad(), ("nosync-extra", 1), 2],
}


@pytest.mark.parametrize("seq", SEQUENCES, ids=list(SEQUENCES))
def test_shard_equals_torch_gradients(seq):
    eng, ref = _pair()
    for item in SEQUENCES[seq]:
        if item == "step":
            eng.settle()
            eng.check(ref)
        elif callable(item):
            _both(eng, ref, item)
        elif isinstance(item, tuple):
            kind, i = item
            eng.sync = not kind.startswith("nosync")
            _run(eng, ref, i, use_extra=kind.endswith("extra"))
            eng.sync = True
        else:
            _run(eng, ref, item)
            eng.check(ref)
    assert not eng.problems
    eng.settle()
    eng.check(ref)


def test_in_place_change_under_no_sync_while_kept_is_reported():
    eng, ref = _pair()
    _run(eng, ref, 0)
    eng.sync = False
    _run(eng, ref, 1)
    eng.model.zero_grad(set_to_none=False)
    _run(eng, ref, 2)
    assert eng.problems and "changed in place between backwards under no_sync()" in eng.problems[0]


def test_placeholder_after_backward_and_its_errors():
    eng, _ = _pair()
    eng.backward(_loss(eng.model, 0))
    g = eng.model.a.weight.grad
    assert isinstance(g, ShardedGrad) and g.shape == eng.model.a.weight.shape
    assert "ShardedGrad('a.weight'" in repr(g) and "sharded" in repr(g)
    with pytest.raises(ZeroRuntimeError, match=r"use opt\.clip_grad_norm_\(max_norm\)"):
        torch.nn.utils.clip_grad_norm_(eng.model.parameters(), 1.0)
    with pytest.raises(ZeroRuntimeError, match="foreach|clip_grad_norm_"):
        torch.nn.utils.clip_grad_norm_(eng.model.parameters(), 1.0, foreach=True)
    with pytest.raises(ZeroRuntimeError, match="'a.weight'"):
        g.sum()
    with pytest.raises(ZeroRuntimeError, match="placeholder"):
        torch.ones(3, 3) + g  # an addition outside backward is not autograd's
    eng.model.zero_grad(set_to_none=False)
    assert g.cleared and eng.model.a.weight.grad is g


def test_accumulation_is_seen_and_returns_the_new_gradient():
    p = nn.Parameter(torch.ones(3))
    ph = ShardedGrad(p, "p")
    p.grad = ph
    (p * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert ph.add_seen is AddSeen.KEPT and p.grad.tolist() == [1, 2, 3]
    p.grad = ph
    ph.zero_()
    (p * 2).sum().backward()
    assert ph.add_seen is AddSeen.CLEARED and p.grad.tolist() == [2, 2, 2]


def test_shard_runs_and_add_reduced_mixed_window():
    spec = ModelSpec((ParamSpec("x", (10,), "dense"), ParamSpec("y", (7,), "dense")),
                     (GroupSpec("dense"),), ("y", "x"))
    p = plan(spec, 2, "evenzero", PlanOptions(bucket_numel=8, alignment_bytes=4))
    for rank in (0, 1):
        runs = ShardRuns.of(p, "dense", rank)
        assert sum(n for r in runs.runs.values() for _, n in r) == sum(
            r.numel for r in p.shard_ranges("dense", rank))
        assert runs.covered(runs.names) == sum(r.numel for r in p.shard_ranges("dense", rank))
    runs = ShardRuns(8, {"x": ((0, 3), (5, 1)), "y": ((3, 2),)})
    assert runs.of_params(["x", "y"]) == [(0, 6)]
    assert runs.covered(["x"]) == 4
    shard = torch.ones(8)
    add_reduced(shard, 2, torch.full((6,), 4.0), 0.5, runs.of_params(["x"]))
    assert shard.tolist() == [1, 1, 2, 3, 3, 2, 3, 3]
    add_reduced(shard, 0, torch.full((8,), 2, dtype=torch.bfloat16), 0.5, [(0, 20)])
    assert shard.tolist() == [1.0] * 8


def test_landing_receives_the_new_gradient_in_place():
    p = nn.Parameter(torch.ones(3))
    buf = torch.zeros(5)
    ph = ShardedGrad(p, "p")
    ph.landing = buf[1:4]
    p.grad = ph
    (p * 3).sum().backward()
    assert p.grad.data_ptr() == buf[1:].data_ptr() and buf.tolist() == [0, 3, 3, 3, 0]
    (p * 1).sum().backward()  # a second backward accumulates in place, as into any .grad
    assert buf.tolist() == [0, 4, 4, 4, 0]


def test_closing_leaves_what_torch_would_hold():
    # Found by the differential fuzzer (tests/fuzz): zero_grad(set_to_none=False), close(),
    # a new optimizer, then the parameter frozen: torch still steps it on its zero gradient
    # (momentum, weight decay), so close() must leave zeros there, not None.
    cleared, kept = nn.Parameter(torch.ones(2, 3)), nn.Parameter(torch.ones(4))
    cleared.grad, kept.grad = ShardedGrad(cleared, "cleared"), ShardedGrad(kept, "kept")
    cleared.grad.zero_()
    drop_placeholders({"cleared": cleared, "kept": kept})
    assert type(cleared.grad) is torch.Tensor and torch.equal(cleared.grad, torch.zeros(2, 3))
    assert kept.grad is None  # the reduced gradient lived in the closed optimizer's shards
