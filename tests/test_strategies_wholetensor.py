"""Matrix-aligned equal shards (strategies/wholetensor.py and its use in the evenzero plan)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from evenzero.cost.compute import estimate_profile
from evenzero.cost.memory import estimate_memory
from evenzero.cost.presets import PRESETS
from evenzero.cost.timeline import simulate
from evenzero.model_presets import preset
from evenzero.plan import PlanError
from evenzero.spec import ModelSpec, ParamSpec
from evenzero.strategies import PlanOptions, plan
from evenzero.strategies.wholetensor import (
    align_bucket,
    muon_params,
    muon_split,
    newton_schulz_flops,
)


def llama(vocab=8192, d=384, layers=8, ff=1024) -> ModelSpec:
    """A ~20M Llama-style model (untied head)."""
    ps = [ParamSpec("embed.weight", (vocab, d), layer="embedding")]
    for i in range(layers):
        ps.append(ParamSpec(f"layers.{i}.attn_norm.weight", (d,)))
        ps += [ParamSpec(f"layers.{i}.attn.{n}.weight", (d, d)) for n in "qkvo"]
        ps.append(ParamSpec(f"layers.{i}.mlp_norm.weight", (d,)))
        ps += [ParamSpec(f"layers.{i}.mlp.gate.weight", (ff, d)),
               ParamSpec(f"layers.{i}.mlp.up.weight", (ff, d)),
               ParamSpec(f"layers.{i}.mlp.down.weight", (d, ff))]
    ps += [ParamSpec("norm.weight", (d,)), ParamSpec("lm_head.weight", (vocab, d))]
    return ModelSpec(tuple(ps), name="llama-20m")


def owners(p, group):
    """name -> set of ranks holding some of it."""
    out: dict[str, set[int]] = {}
    for r in range(p.group(group).size):
        for s in p.shard_ranges(group, r):
            out.setdefault(s.param, set()).add(r)
    return out


def test_newton_schulz_flops_follows_torch_iteration():
    # 5 iterations of X Xt (2*3*3*5), A A (2*27), B X (2*3*3*5) for a 5x3 (or 3x5) matrix.
    assert newton_schulz_flops((5, 3)) == newton_schulz_flops((3, 5)) == 5 * (90 + 54 + 90)
    assert newton_schulz_flops((4, 4), steps=1) == 4 * 64 + 2 * 64


def test_muon_params_follow_torch_recipe():
    spec = llama(layers=1)
    got = muon_params(spec)
    assert "layers.0.attn.q.weight" in got and "layers.0.mlp.down.weight" in got
    assert not {"embed.weight", "lm_head.weight", "norm.weight"} & set(got)
    split, whole = muon_split(spec)
    assert whole == got
    assert [g.name for g in split.groups] == ["dense", "dense-adamw"]
    assert {p.name for p in split.group_params("dense")} == set(got)


def test_each_matrix_has_one_owner_and_shards_are_equal():
    spec, whole = muon_split(llama())
    for world in (2, 3, 8):
        p = plan(spec, world, "evenzero", PlanOptions(bucket_numel=1_000_000, whole_tensor=whole))
        for name, ranks in owners(p, "dense").items():
            assert len(ranks) == 1, (world, name, ranks)
        # still one equal reduce-scatter per bucket, no other backward call
        assert all(c.op == "reduce_scatter" and c.numel == p.buckets[i].numel
                   for i, c in enumerate(p.backward()))
        assert all(b.numel % world == 0 for b in p.buckets)
        # the step's collectives are the AdamW path's: the check and one gather per layout
        assert [c.op for c in p.step()] == ["all_reduce"] + ["all_gather"] * len(p.layouts)


def test_llama_padding_and_balance_at_8_ranks():
    spec, whole = muon_split(llama())
    total = sum(q.numel for q in spec.params)
    p = plan(spec, 8, "evenzero", PlanOptions(whole_tensor=whole))
    assert p.padding() <= 0.05 * total, p.padding()
    note = next(n for n in p.notes if "matrix-aligned" in n)
    ratio = float(note.split("max/mean ")[1].split()[0])
    assert ratio <= 1.3, note
    # the balance the note reports is the layout's
    work = [0] * 8
    flops = {q.name: newton_schulz_flops(q.shape) for q in spec.params if q.name in whole}
    for r in range(8):
        work[r] = sum(flops[s.param] for s in p.shard_ranges("dense", r) if s.param in flops)
    assert abs(max(work) / (sum(work) / 8) - ratio) < 1e-3


def test_elementwise_layout_unchanged():
    spec, whole = muon_split(llama(layers=2))
    base = plan(spec, 4, "evenzero", PlanOptions(bucket_numel=500_000))
    # the AdamW group of a Muon plan is laid out exactly as without Muon
    mixed = plan(spec, 4, "evenzero", PlanOptions(bucket_numel=500_000, whole_tensor=whole))
    assert mixed.group_layouts("dense-adamw") == base.group_layouts("dense-adamw")
    assert base.step_work.matrix_flops == 0 and base.memory.momentum_only_numel == 0
    assert not any("matrix-aligned" in n for n in base.notes)


def test_elementwise_params_fill_the_room():
    numel = {"a": 100, "b": 60, "c": 60, "x": 30, "y": 10}
    flops = {"a": 100, "b": 50, "c": 50}
    b = align_bucket(["a", "x", "b", "c", "y"], numel, flops, 2, 1)
    assert b.numel == 2 * 130  # (100 + 60 + 60 + 40) / 2
    slots = {s.name: s for s in b.slots}
    for m in flops:
        assert slots[m].offset // 130 == (slots[m].offset + slots[m].numel - 1) // 130
    offs = sorted((s.offset, s.offset + s.numel) for s in b.slots)
    assert all(a[1] <= c[0] for a, c in zip(offs, offs[1:], strict=False))  # no overlap
    assert sorted(b.flops) == [100, 100]


def test_bucket_grows_to_hold_the_largest_matrix():
    spec, whole = muon_split(llama(layers=1))
    p = plan(spec, 4, "evenzero", PlanOptions(bucket_numel=1000, whole_tensor=whole))
    assert any("grown from 1,000" in n and "mlp" in n for n in p.notes), p.notes
    assert len(owners(p, "dense")) == len(whole)


def test_memory_and_step_work_charge_muon():
    spec, whole = muon_split(llama(layers=2))
    opts = PlanOptions(bucket_numel=2_000_000)
    adam = plan(spec, 4, "evenzero", opts)
    muon = plan(spec, 4, "evenzero", replace(opts, whole_tensor=whole))
    assert muon.memory.momentum_only_numel > 0
    assert muon.step_work.matrix_flops >= sum(newton_schulz_flops(q.shape) for q in spec.params
                                              if q.name in whole) / 4
    cost = PRESETS["h100-nvlink-8"]
    ma, mm = estimate_memory(adam), estimate_memory(muon)
    # one momentum per matrix element where Adam keeps two moments (fp32: 4 bytes each)
    shard = sum(muon.shard_numel(g.name) for g in muon.groups)
    assert mm.optimizer_bytes == 8 * shard - 4 * muon.memory.momentum_only_numel
    assert mm.optimizer_bytes < ma.optimizer_bytes
    prof = estimate_profile(spec, cost.compute)
    ta, tm = simulate(adam, cost, prof), simulate(muon, cost, prof)
    assert any(s.kind == "newton-schulz" for s in tm.segments)
    assert not any(s.kind == "newton-schulz" for s in ta.segments)


def test_bad_whole_tensor_params_are_named():
    spec, _ = muon_split(llama(layers=1))
    with pytest.raises(PlanError, match=r"norm.weight.*\[384\].*2-D"):
        plan(spec, 2, "evenzero", PlanOptions(bucket_numel=10**6, whole_tensor=("norm.weight",)))
    with pytest.raises(PlanError, match="nope"):
        plan(spec, 2, "evenzero", PlanOptions(bucket_numel=10**6, whole_tensor=("nope",)))


def test_seed_case_plans():
    spec, whole = muon_split(preset("seed-moe"))
    p = plan(spec, 8, "evenzero", PlanOptions(whole_tensor=whole))
    assert all(len(r) == 1 for r in owners(p, "experts").values())
    assert sum(1 for n in p.notes if "matrix-aligned" in n) == 2


def test_plan_command_prints_padding_and_balance(capsys):
    from pathlib import Path

    from evenzero import cli

    model = str(Path(__file__).parent.parent / "benchmarks" / "models" / "llama-20m.json")
    assert cli.main(["plan", model, "--world-size", "8", "--optimizer", "muon",
                     "--strategy", "evenzero"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "group dense: matrix-aligned shards" in out and "max/mean 1.000" in out, out
