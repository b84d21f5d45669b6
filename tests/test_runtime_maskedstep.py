"""Stepping flat shards per parameter equals torch.optim on the separate parameters
(no processes): absent parameters untouched, each with its own step count, whether the
shard is one tensor or one piece per layout (stepped together or piece by piece)."""

from __future__ import annotations

import pytest
import torch

from evenzero.runtime.maskedstep import MaskedStep, SplitShard
from evenzero.runtime.shardruns import ShardRuns
from evenzero.spec import GroupSpec, ModelSpec, ParamSpec
from evenzero.strategies import PlanOptions, plan

SHAPES = {"a": (7, 5), "b": (13,), "c": (3, 4), "d": (9,), "e": (6, 2)}
OPTIMIZERS = {
    "AdamW": (torch.optim.AdamW, {"lr": 0.05, "weight_decay": 0.1}),
    "Adam-amsgrad": (torch.optim.Adam, {"lr": 0.05, "amsgrad": True, "weight_decay": 0.01}),
    "SGD-momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "dampening": 0.2,
                                       "weight_decay": 0.01}),
    "SGD-nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True}),
    "RMSprop": (torch.optim.RMSprop, {"lr": 0.01, "momentum": 0.5, "centered": True}),
    "Adagrad": (torch.optim.Adagrad, {"lr": 0.1, "lr_decay": 0.01, "weight_decay": 0.01}),
    "NAdam": (torch.optim.NAdam, {"lr": 0.05, "weight_decay": 0.01}),
    "RAdam": (torch.optim.RAdam, {"lr": 0.05, "decoupled_weight_decay": True,
                                  "weight_decay": 0.1}),
    "Adamax": (torch.optim.Adamax, {"lr": 0.05}),
    "ASGD": (torch.optim.ASGD, {"lr": 0.05, "t0": 2}),
}
# Which parameters have a gradient at each step: everything (fast path), one absent,
# one never seen before, classes of different step counts, nothing here at all.
PRESENCE = [set("abce"), set("abcde"), set("abcde"), set("acd"), set("abcde"), set("bd"),
            set("abcde"), set(), set("abcde")]


def _plan(world: int, bucket: int):
    spec = ModelSpec(tuple(ParamSpec(n, s, "dense") for n, s in SHAPES.items()),
                     (GroupSpec("dense"),), tuple(reversed(SHAPES)))
    return plan(spec, world, "evenzero", PlanOptions(bucket_numel=bucket, alignment_bytes=4))


def _gather(p, ranges, values):
    out = torch.zeros(p.shard_numel("dense"))
    for r in ranges:
        out[r.shard_offset:r.shard_offset + r.numel] = values[r.param].reshape(-1)[
            r.start:r.start + r.numel]
    return out


def _cut(p, flat):
    """A flat shard as one tensor per layout (what `GroupShard` gives the optimizer)."""
    return [flat[s.shard_offset:s.shard_offset + s.numel].clone() for s in p.layout_shards("dense")]


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("world,rank,bucket,pieces", [
    (1, 0, 1000, "one"), (3, 1, 16, "one"), (2, 0, 24, "one"),
    (3, 1, 16, "together"), (2, 0, 24, "one by one")])
def test_masked_step_equals_torch_per_parameter(name, world, rank, bucket, pieces):
    cls, kw = OPTIMIZERS[name]
    gen = torch.Generator().manual_seed(0)
    init = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
    ref = {n: torch.nn.Parameter(v.clone()) for n, v in init.items()}
    ref_opt = cls(list(ref.values()), **kw)

    p = _plan(world, bucket)
    ranges = p.shard_ranges("dense", rank)
    runs = ShardRuns.of(p, "dense", rank)
    flat = _gather(p, ranges, init)
    masters = [flat] if pieces == "one" else _cut(p, flat)
    assert pieces == "one" or len(masters) > 1, "the case needs several layouts"
    opt = cls(masters, **kw)
    stepper = MaskedStep(opt, masters, runs)

    for step, present in enumerate(PRESENCE):
        grads = {n: torch.randn(s, generator=gen) for n, s in SHAPES.items()}
        for n, prm in ref.items():
            prm.grad = grads[n].clone() if n in present else None
        ref_opt.step()
        grad = _gather(p, ranges, grads)
        grad_pieces = [grad] if pieces == "one" else _cut(p, grad)
        if pieces == "one by one" and stepper.begin(grad_pieces, present):
            for i in reversed(range(len(masters))):
                stepper.step_pieces([i])
            stepper.finish()
        elif pieces != "one by one":
            stepper.step(grad_pieces, present)
        want = _gather(p, ranges, {n: v.detach() for n, v in ref.items()})
        torch.testing.assert_close(torch.cat(masters), want, rtol=1e-6, atol=1e-6,
                                   msg=lambda m, s=step: f"step {s}: {m}")
        for n, count in stepper.step_counts().items():
            st = ref_opt.state.get(ref[n], {})
            if "step" in st:
                assert count == int(st["step"]), (n, count, st["step"])
    assert all(m.grad is None for m in masters)


def test_split_shard_indexes_across_pieces():
    whole = torch.arange(10.0)
    split = SplitShard([whole[:3].clone(), whole[3:3].clone(), whole[3:7].clone(),
                        whole[7:].clone()])
    idx = torch.tensor([0, 2, 3, 6, 7, 9])
    assert split.take(idx).tolist() == [0, 2, 3, 6, 7, 9]
    split.put_(idx, -split.take(idx))
    assert torch.cat(split.tensors).tolist() == [0, 1, -2, -3, 4, 5, -6, -7, 8, -9]
    assert split.take(torch.zeros(0, dtype=torch.long)).numel() == 0


def test_uniform_presence_stays_on_the_fast_path():
    p = _plan(2, 16)
    runs = ShardRuns.of(p, "dense", 0)
    master = torch.nn.Parameter(torch.zeros(p.shard_numel("dense")))
    opt = torch.optim.AdamW([master], lr=0.1)
    stepper = MaskedStep(opt, [master], runs)
    calls = []
    original = stepper._step_slow
    stepper._step_slow = lambda *a: calls.append(a) or original(*a)
    for _ in range(3):
        stepper.step([torch.ones_like(master)], SHAPES)
    assert not calls
    # One absent step: slow; afterwards the lagging parameter keeps its own class.
    stepper.step([torch.ones_like(master)], set(SHAPES) - {runs.names[0]})
    assert len(calls) == 1
    counts = stepper.step_counts()
    assert counts[runs.names[0]] == 3 and all(c == 4 for n, c in counts.items()
                                               if n != runs.names[0])


def test_state_round_trip_merges_equal_classes():
    p = _plan(1, 1000)
    runs = ShardRuns.of(p, "dense", 0)
    master = torch.nn.Parameter(torch.zeros(p.shard_numel("dense")))
    opt = torch.optim.Adam([master], lr=0.1)
    stepper = MaskedStep(opt, [master], runs)
    stepper.step([torch.ones_like(master)], {"a", "b"})
    saved = stepper.param_state()
    assert saved["c"] == {} and int(saved["a"]["step"]) == 1
    other = MaskedStep(opt, [master], runs)
    other.load_param_state(saved)
    assert other.class_of["a"] is other.class_of["b"]
    assert other.class_of["a"] is not other.class_of["c"]
    with pytest.raises(KeyError, match="no optimizer state"):
        other.load_param_state({"a": {}})


def test_stepped_parameters_without_scalar_state_stay_stepped():
    """SGD with momentum keeps no scalar state: `{}` is what a stepped parameter saves
    too, so a new stepper (a re-layout) is told which were stepped, or it would drop
    their momentum at the next step."""
    p = _plan(1, 1000)
    runs = ShardRuns.of(p, "dense", 0)
    master = torch.nn.Parameter(torch.zeros(p.shard_numel("dense")))
    opt = torch.optim.SGD([master], lr=0.1, momentum=0.9)
    stepper = MaskedStep(opt, [master], runs)
    stepper.step([torch.ones_like(master)], set(SHAPES))
    assert stepper.param_state()["a"] == {} and stepper.stepped() == set(SHAPES)
    ref = master.detach().clone()
    ref_buf = opt.state[master]["momentum_buffer"].clone()
    other = MaskedStep(opt, [master], runs)
    other.load_param_state(stepper.param_state(), stepper.stepped())
    other.step([torch.ones_like(master)], set(SHAPES))
    buf = ref_buf * 0.9 + 1  # momentum kept: not restarted from the gradient
    torch.testing.assert_close(opt.state[master]["momentum_buffer"], buf)
    torch.testing.assert_close(master.detach(), ref - 0.1 * buf)


def test_groups_of_one_optimizer_step_independently():
    """Two masters in one optimizer (dense and experts, different lr): one group on the
    fast path, the other with an absent parameter, in the same step."""
    gen = torch.Generator().manual_seed(1)
    shapes = {"x": (5,), "y": (3,), "u": (4,), "v": (6,)}
    init = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
    ref = {n: torch.nn.Parameter(v.clone()) for n, v in init.items()}
    ref_opt = torch.optim.AdamW([{"params": [ref["x"], ref["y"]]},
                                 {"params": [ref["u"], ref["v"]], "lr": 0.3}], lr=0.1)
    dense = torch.nn.Parameter(torch.cat([init["x"], init["y"]]))
    experts = torch.nn.Parameter(torch.cat([init["u"], init["v"]]))
    opt = torch.optim.AdamW([{"params": [dense]}, {"params": [experts], "lr": 0.3}], lr=0.1)
    runs = {"dense": ShardRuns(8, {"x": ((0, 5),), "y": ((5, 3),)}),
            "experts": ShardRuns(10, {"u": ((0, 4),), "v": ((4, 6),)})}
    steppers = {"dense": MaskedStep(opt, [dense], runs["dense"]),
                "experts": MaskedStep(opt, [experts], runs["experts"])}
    for present in [set("xyuv"), set("xyu"), set("xyuv"), set("uv")]:
        grads = {n: torch.randn(s, generator=gen) for n, s in shapes.items()}
        for n, prm in ref.items():
            prm.grad = grads[n] if n in present else None
        ref_opt.step()
        stepped = {g for g, cat in (("dense", "xy"), ("experts", "uv"))
                   if steppers[g].step([torch.cat([grads[n] for n in cat])], present)}
        assert stepped == {g for g, r in runs.items() if set(r.names) & present}
        torch.testing.assert_close(dense.detach(), torch.cat([ref["x"], ref["y"]]).detach(),
                                   rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(experts.detach(), torch.cat([ref["u"], ref["v"]]).detach(),
                                   rtol=1e-6, atol=1e-6)
    assert dense.grad is None and experts.grad is None


def test_a_group_active_elsewhere_gets_its_state_kinds_here():
    """Nothing of this rank's shard had a gradient, but the group stepped on another
    rank: the state tensors exist here too (checkpoints gather them), values untouched."""
    p = _plan(1, 1000)
    runs = ShardRuns.of(p, "dense", 0)
    master = torch.nn.Parameter(torch.randn(p.shard_numel("dense")))
    before = master.detach().clone()
    opt = torch.optim.AdamW([master], lr=0.1, weight_decay=0.5)
    stepper = MaskedStep(opt, [master], runs)
    assert not stepper.step([torch.ones_like(master)], set(), active=True)
    assert torch.equal(master.detach(), before)
    assert set(opt.state[master]) == {"exp_avg", "exp_avg_sq"}
    assert all(s == {} for s in stepper.param_state().values())
    stepper.step([torch.ones_like(master)], set(SHAPES))
    assert all(int(s["step"]) == 1 for s in stepper.param_state().values())
