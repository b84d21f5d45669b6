"""The checkpoint format without processes: split shards, write files, reshard, validate.

A "rank" here is a plan's shard of plain tensors; the multi-process tests with the real
optimizer are in test_checkpoint.py.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from evenzero.checkpoint.compat import LocalModel, LocalParam, check_compatible
from evenzero.checkpoint.files import (
    RangeReader,
    read_manifest,
    verify_file,
    write_file,
    write_text,
)
from evenzero.checkpoint.format import (
    MASTER,
    CheckpointError,
    Manifest,
    StoredGroup,
    StoredParam,
    rank_file,
    storage_name,
)
from evenzero.checkpoint.reshard import (
    assemble_shard,
    fill_shard,
    plan_reads,
    runs_index,
    split_shard,
)
from evenzero.checkpoint.values import decode_value, encode_value
from evenzero.checkpoint.writer import RankIndex, merge_indices
from evenzero.plan import Plan
from evenzero.spec import GroupSpec, ModelSpec, ParamSpec
from evenzero.strategies import PlanOptions, plan

KINDS = (MASTER, "exp_avg")


def small_spec(shapes: list[tuple[int, ...]], expert_shapes: list[tuple[int, ...]] = (),
               e: int = 1) -> ModelSpec:
    params = [ParamSpec(f"p{i}", s) for i, s in enumerate(shapes)]
    params += [ParamSpec(f"x{i}", s, "experts") for i, s in enumerate(expert_shapes)]
    groups = (GroupSpec("dense"),) + ((GroupSpec("experts", e),) if expert_shapes else ())
    return ModelSpec(tuple(params), groups)


def full_values(spec: ModelSpec, e: int, seed: int) -> dict[str, dict[str, torch.Tensor]]:
    """kind -> storage name -> whole tensor: what a consolidated state would hold."""
    g = torch.Generator().manual_seed(seed)
    out: dict[str, dict[str, torch.Tensor]] = {k: {} for k in KINDS}
    for p in spec.params:
        copies = e if p.group == "experts" else 1
        for r in range(copies):
            for k in KINDS:
                out[k][storage_name(p.name, copies, r)] = torch.randn(p.shape, generator=g)
    return out


def rank_view(pl: Plan, global_rank: int, group: str) -> tuple[int, int, int]:
    """(group-local rank, ep rank, E) of a global rank, by GroupInfo's convention."""
    info = pl.group(group)
    e = info.expert_parallel_size
    return info.ranks_of(global_rank, pl.world_size).index(global_rank), global_rank % e, e


def save_plain(pl: Plan, spec: ModelSpec, full, directory: Path) -> Manifest:
    indices = []
    for rank in range(pl.world_size):
        tensors, params = {}, []
        for g in pl.groups:
            local, ep, e = rank_view(pl, rank, g.name)
            ranges = pl.shard_ranges(g.name, local)
            key = lambda n, e=e, ep=ep: storage_name(n, e, ep)  # noqa: E731
            flats = {k: fill_shard(ranges, pl.shard_numel(g.name), lambda n, k=k, key=key:
                                   full[k][key(n)]) for k in KINDS}
            tensors.update(split_shard(ranges, key, flats))
            meta = lambda n, g=g, ep=ep: StoredParam(  # noqa: E731
                "", n, g.name, ep, spec.param(n).shape, "float32", ())
            params += runs_index(ranges, rank_file(rank), key, meta)
        record = write_file(directory / rank_file(rank), tensors, rank)
        indices.append(RankIndex(record, tuple(params), ()))
    merged, _ = merge_indices(indices)
    groups = tuple(StoredGroup(g.name, g.expert_parallel_size, g.size, {"lr": 0.1}, {}, ("exp_avg",))
                   for g in pl.groups)
    m = Manifest(7, 7, pl.world_size, pl.strategy, "test", "torch.optim.adam.Adam", groups,
                 merged, tuple(i.file for i in indices))
    write_text(directory / "manifest.json", m.dumps())
    return m


def load_plain(pl: Plan, directory: Path) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    m = read_manifest(directory)
    stored = {p.key: p for p in m.params}
    out = {}
    with RangeReader(directory) as reader:
        for rank in range(pl.world_size):
            for g in pl.groups:
                local, ep, e = rank_view(pl, rank, g.name)
                reads = plan_reads(pl.shard_ranges(g.name, local),
                                   lambda n, e=e, ep=ep: storage_name(n, e, ep), stored)
                out[rank, g.name] = assemble_shard(reads, KINDS, pl.shard_numel(g.name),
                                                   reader.read)
    return out


def expected_shards(pl: Plan, full) -> dict[tuple[int, str], dict[str, torch.Tensor]]:
    out = {}
    for rank in range(pl.world_size):
        for g in pl.groups:
            local, ep, e = rank_view(pl, rank, g.name)
            ranges = pl.shard_ranges(g.name, local)
            out[rank, g.name] = {k: fill_shard(ranges, pl.shard_numel(g.name),
                                               lambda n, k=k, e=e, ep=ep: full[k][storage_name(n, e, ep)])
                                 for k in KINDS}
    return out


def assert_shards_equal(got, want) -> None:
    assert got.keys() == want.keys()
    for key in want:
        for k in KINDS:
            assert torch.equal(got[key][k], want[key][k]), (key, k)


SHAPES = [(33, 7), (5,), (128,), (3, 3, 3), (1000,), (17,)]


@pytest.mark.parametrize("n,m,bucket_n,bucket_m", [(4, 1, 300, None), (1, 3, None, 257),
                                                    (2, 4, 64, 1000), (3, 2, 500, 500)])
def test_reshard_dense_is_exact(tmp_path, n, m, bucket_n, bucket_m):
    spec = small_spec(SHAPES)
    full = full_values(spec, 1, seed=n * 10 + m)
    save_plain(plan(spec, n, options=PlanOptions(bucket_numel=bucket_n)), spec, full, tmp_path)
    target = plan(spec, m, options=PlanOptions(bucket_numel=bucket_m))
    assert_shards_equal(load_plain(target, tmp_path), expected_shards(target, full))


def test_reshard_expert_group_keeps_each_ep_rank_copy(tmp_path):
    spec = small_spec(SHAPES[:3], [(40, 3), (9,)], e=2)
    full = full_values(spec, 2, seed=3)
    save_plain(plan(spec, 2, options=PlanOptions(bucket_numel=50)), spec, full, tmp_path)
    target = plan(spec, 4, options=PlanOptions(bucket_numel=90))
    got = load_plain(target, tmp_path)
    assert_shards_equal(got, expected_shards(target, full))
    # ranks 1 and 3 share ep rank 1 and so hold slices of x0@ep1, not of x0@ep0
    assert not torch.equal(got[0, "experts"][MASTER], got[1, "experts"][MASTER])


def test_padding_is_not_stored(tmp_path):
    spec = small_spec([(3,), (5,)])
    pl = plan(spec, 4, options=PlanOptions(alignment_bytes=64))
    assert pl.padding() > 0
    m = save_plain(pl, spec, full_values(spec, 1, 0), tmp_path)
    assert sum(r.numel for p in m.params for r in p.ranges) == spec.numel


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(shapes=st.lists(st.integers(1, 300), min_size=1, max_size=6),
       n=st.integers(1, 5), m=st.integers(1, 5),
       bn=st.integers(1, 700), bm=st.integers(1, 700), align=st.sampled_from([4, 16, 128]))
def test_reshard_property(tmp_path_factory, shapes, n, m, bn, bm, align):
    d = tmp_path_factory.mktemp("ck")
    spec = small_spec([(s,) for s in shapes])
    full = full_values(spec, 1, seed=sum(shapes))
    save_plain(plan(spec, n, options=PlanOptions(bucket_numel=bn, alignment_bytes=align)),
               spec, full, d)
    target = plan(spec, m, options=PlanOptions(bucket_numel=bm, alignment_bytes=align))
    assert_shards_equal(load_plain(target, d), expected_shards(target, full))


def test_checksum_detects_flipped_byte_and_truncation(tmp_path):
    spec = small_spec(SHAPES)
    m = save_plain(plan(spec, 2), spec, full_values(spec, 1, 1), tmp_path)
    for f in m.files:
        verify_file(tmp_path, f)
    flipped, truncated = m.files
    data = bytearray((tmp_path / flipped.name).read_bytes())
    data[len(data) // 2] ^= 0x01
    (tmp_path / flipped.name).write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=r"rank-00000.safetensors: sha256 mismatch"):
        verify_file(tmp_path, flipped)
    data = (tmp_path / truncated.name).read_bytes()
    (tmp_path / truncated.name).write_bytes(data[: len(data) - 100])
    with pytest.raises(CheckpointError, match=r"rank-00001.safetensors: .* truncated"):
        verify_file(tmp_path, truncated)
    (tmp_path / truncated.name).unlink()
    with pytest.raises(CheckpointError, match=r"rank-00001.safetensors: shard file written by "
                                              r"rank 1 is missing"):
        verify_file(tmp_path, truncated)


def test_manifest_round_trip_and_damage(tmp_path):
    spec = small_spec(SHAPES)
    m = save_plain(plan(spec, 3, options=PlanOptions(bucket_numel=100)), spec,
                   full_values(spec, 1, 2), tmp_path)
    assert read_manifest(tmp_path) == m
    data = json.loads((tmp_path / "manifest.json").read_text())
    data["params"]["p4"]["ranges"].pop()
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=r"parameter 'p4' stores \d+ of 1000 elements"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": "evenzero-checkpoint", ')
    with pytest.raises(CheckpointError, match="manifest is not valid JSON"):
        read_manifest(tmp_path)


def test_value_encoding_is_exact():
    values = {"step": torch.tensor(12345.0), "betas": (0.9, 0.999), "lr": 1 / 3,
              "scale": torch.tensor([2.0**16], dtype=torch.float64), "flag": None,
              "nested": {"a": [1, 2.5, "x"]}, "bf": torch.tensor(1.5, dtype=torch.bfloat16)}
    back = decode_value(json.loads(json.dumps(encode_value(values))))
    assert back.keys() == values.keys()
    for k, v in values.items():
        if isinstance(v, torch.Tensor):
            assert back[k].dtype == v.dtype and back[k].shape == v.shape and torch.equal(back[k], v)
        else:
            assert back[k] == v and type(back[k]) is type(v)
    with pytest.raises(CheckpointError, match="too large"):
        encode_value(torch.zeros(1000))


def local_model(params: list[tuple[str, tuple[int, ...]]], **kw) -> LocalModel:
    base = dict(params=tuple(LocalParam(n, "dense", s, "float32") for n, s in params),
                expert_parallel_size={"dense": 1}, ep_ranks={"dense": 0},
                optimizer_class="torch.optim.adam.Adam", option_keys=frozenset({"lr"}),
                hyperparameters={"dense": {"lr": 0.5}}, extras=())
    base.update(kw)
    return LocalModel(**base)


def test_compatibility_errors_name_the_difference(tmp_path):
    spec = small_spec(SHAPES)
    m = save_plain(plan(spec, 2), spec, full_values(spec, 1, 0), tmp_path)
    ok = [(p.name, p.shape) for p in spec.params]
    check_compatible(m, local_model(ok), "ck")
    bad_shape = [(n, (34, 7) if n == "p0" else s) for n, s in ok]
    with pytest.raises(CheckpointError, match=r"parameter 'p0' has shape \[33, 7\] in the "
                                              r"checkpoint but \[34, 7\] here"):
        check_compatible(m, local_model(bad_shape), "ck")
    with pytest.raises(CheckpointError, match=r"'p9' is not in the checkpoint"):
        check_compatible(m, local_model(ok + [("p9", (2,))]), "ck")
    with pytest.raises(CheckpointError, match=r"checkpoint has parameter\(s\) \['p5'\]"):
        check_compatible(m, local_model(ok[:-1]), "ck")
    with pytest.raises(CheckpointError, match="saved with optimizer torch.optim.adam.Adam, "
                                              "this run uses torch.optim.sgd.SGD"):
        check_compatible(m, local_model(ok, optimizer_class="torch.optim.sgd.SGD"), "ck")
    # Keys that LR schedulers add to the running groups are not the optimizer's setup ...
    check_compatible(m, local_model(ok, hyperparameters={"dense": {"lr": 0.5, "initial_lr": 0.5}}),
                     "ck")
    # ... but the optimizer class's own options are.
    with pytest.raises(CheckpointError, match=r"options of group 'dense' lack \['betas'\], which "
                                              r"torch.optim.adam.Adam defines"):
        check_compatible(m, local_model(ok, option_keys=frozenset({"lr", "betas"})), "ck")


@pytest.mark.parametrize("saved,scalars,message", [
    ({"lr": float("nan")}, {}, r"option 'lr' is nan, not finite"),
    ({"lr": "fast"}, {}, r"option 'lr' is 'fast' in the checkpoint but 0.1 here"),
    ({"lr": True}, {}, r"option 'lr' is True in the checkpoint but 0.1 here"),
    ({"lr": 0.1, "betas": (0.9, float("inf"))}, {}, r"option 'betas'\[1\] is \(0.9, inf\)"),
    ({"lr": 0.1, "betas": (0.9,)}, {}, r"option 'betas' is \(0.9,\) in the checkpoint"),
    ({"lr": 0.1, "initial_lr": float("-inf")}, {}, r"option 'initial_lr' is -inf, not finite"),
    ({"lr": 0.1}, {"step": torch.tensor(-7.0)}, r"optimizer state 'step' is tensor\(-7.\), not a "
                                                 r"non-negative count"),
    ({"lr": 0.1}, {"step": torch.tensor(float("nan"))}, r"optimizer state 'step' is tensor\(nan\)"),
])
def test_saved_options_must_be_finite_values_of_the_running_kind(saved, scalars, message):
    from evenzero.checkpoint.compat import check_options

    now = {"lr": 0.1, "betas": (0.9, 0.999), "foreach": None, "fused": False}
    with pytest.raises(CheckpointError, match=r"ck: group 'dense': " + message):
        check_options(encode_value(saved), encode_value(scalars), now, "ck: group 'dense'")


def test_saved_options_of_an_equivalent_kind_load():
    from evenzero.checkpoint.compat import check_options

    now = {"lr": 0.1, "betas": (0.9, 0.999), "foreach": None, "fused": False, "max_eval": None}
    saved = {"lr": torch.tensor(0.01), "betas": [0.8, 0.9], "foreach": False, "fused": None,
             "max_eval": 25, "initial_lr": 0.1}
    check_options(encode_value(saved), encode_value({"step": torch.tensor(3.0)}), now, "ck")


def test_merge_rejects_ranks_that_disagree(tmp_path):
    spec = small_spec(SHAPES)
    pl = plan(spec, 2)
    save_plain(pl, spec, full_values(spec, 1, 0), tmp_path)
    a = StoredParam("p0", "p0", "dense", 0, (33, 7), "float32", ())
    b = StoredParam("p0", "p0", "dense", 0, (7, 33), "float32", ())
    rec = read_manifest(tmp_path).files
    with pytest.raises(CheckpointError, match="ranks disagree on parameter 'p0'"):
        merge_indices([RankIndex(rec[0], (a,), ()), RankIndex(rec[1], (b,), ())])
    assert math.prod(a.shape) == a.numel


def test_written_files_are_plain_safetensors(tmp_path):
    from safetensors.torch import load_file

    tensors = {"a": torch.randn(7, 3), "b::master::0": torch.arange(10.0)[2:9],
               "steps": torch.tensor(5), "half": torch.randn(5).to(torch.bfloat16),
               "empty": torch.zeros(0), "flag": torch.tensor([True, False])}
    record = write_file(tmp_path / "x.safetensors", tensors, 3)
    back = load_file(tmp_path / "x.safetensors")
    assert back.keys() == tensors.keys()
    for k, v in tensors.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v), k
    assert record.nbytes == (tmp_path / "x.safetensors").stat().st_size
    verify_file(tmp_path, record)


def _damage(data: dict, edit: str) -> None:
    """Apply one named kind of damage to a manifest's JSON."""
    first = data["files"][0]["name"]
    if edit.startswith("file:"):
        bad = edit.removeprefix("file:")
        data["files"][0]["name"] = bad
        for p in data["params"].values():
            p["ranges"] = [[bad if f == first else f, s, n] for f, s, n in p["ranges"]]
    elif edit.startswith("range-file:"):
        data["params"]["p0"]["ranges"][0][0] = edit.removeprefix("range-file:")
    elif edit == "duplicate-file":
        data["files"].append(dict(data["files"][0]))
    elif edit == "overlap":
        f, s, n = data["params"]["p4"]["ranges"][-1]
        data["params"]["p4"]["ranges"].append([f, s, n])
    elif edit == "user-state-rank":
        data["user_state"] = {"5": first}
    else:
        target, _, value = edit.partition("=")
        *path, last = target.split(".")
        node = data
        for key in path:
            node = node[int(key)] if isinstance(node, list) else node[key]
        node[last] = json.loads(value)


@pytest.mark.parametrize("edit,message", [
    ("file:../step-000001/rank-00000.safetensors", r"files\[0\].name '\.\./step-000001/rank-00000"
                                                   r"\.safetensors' is not a plain file name"),
    ("file:/etc/passwd", r"'/etc/passwd' is not a plain file name inside the checkpoint"),
    ("file:sub\\rank.safetensors", r"is not a plain file name"),
    ("file:..", r"'\.\.' is not a plain file name"),
    ("range-file:../x", r"params\['p0'\].ranges\[0\] file '\.\./x' is not a plain file name"),
    ("duplicate-file", r"files lists a file name twice"),
    ("overlap", r"parameter 'p4' has runs that do not tile it"),
    ("user-state-rank", r"user_state entry '5'"),
    ("step_count=-7", r"step_count is -7, below 0"),
    ("step=-1", r"step is -1, below 0"),
    ("step=7.5", r"step is 7.5, not an integer"),
    ('step="7"', r"step is '7', not an integer"),
    ("world_size=0", r"world_size is 0, below 1"),
    ("files.0.bytes=-3", r"files\[0\].bytes is -3, below 0"),
    ("files.0.rank=9", r"written by rank 9 of 3"),
    ('files.0.sha256="abc"', r"files\[0\].sha256 'abc' is not a sha256 hex digest"),
    ("optimizer.groups.0.size=true", r"optimizer.groups\[0\].size is True, not an integer"),
    ('loss_scaler={"scale": NaN, "good_steps": 0}', r"loss_scaler.scale is nan, not a finite"),
    ('loss_scaler={"scale": 8.0, "good_steps": -1}', r"loss_scaler.good_steps is -1, below 0"),
    ("format_version=2", r"format version 2, this evenzero reads version 1"),
    ("plan=[]", r"plan is not an object"),
    ('plan={"bucket_numel": 0}', r"plan.bucket_numel is 0, below 1"),
    ('plan={"bucket_numel": 512.5}', r"plan.bucket_numel is 512.5, not an integer"),
    ('plan={"arrival": "p0"}', r"plan.arrival is not a list"),
    ('plan={"arrival": ["p0", 3]}', r"plan.arrival is 3, not a string"),
    ('plan={"arrival": ["p1", "p0", "p1"]}', r"plan.arrival lists a parameter twice"),
])
def test_damaged_manifest_is_an_error_naming_the_file_and_field(tmp_path, edit, message):
    spec = small_spec(SHAPES)
    save_plain(plan(spec, 3, options=PlanOptions(bucket_numel=100)), spec,
               full_values(spec, 1, 2), tmp_path)
    data = json.loads((tmp_path / "manifest.json").read_text())
    _damage(data, edit)
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(CheckpointError, match=re.escape(str(tmp_path / "manifest.json")) + ": .*"
                       + message):
        read_manifest(tmp_path)


def test_manifest_written_before_user_state_existed_still_reads(tmp_path):
    """Format 1 manifests from before `extra=` have no "user_state" entry."""
    spec = small_spec(SHAPES)
    m = save_plain(plan(spec, 2), spec, full_values(spec, 1, 0), tmp_path)
    data = json.loads((tmp_path / "manifest.json").read_text())
    del data["user_state"]
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    assert read_manifest(tmp_path) == m and m.user_state == {}


def test_manifest_records_the_saved_plans_choices(tmp_path):
    """The bucket size and arrival order a load at the same world size adopts
    (`evenzero.checkpoint.planchoices`) round-trip; manifests from before they were
    recorded (format 1 without "plan") read as None: nothing to adopt."""
    import dataclasses

    spec = small_spec(SHAPES)
    m = save_plain(plan(spec, 2), spec, full_values(spec, 1, 0), tmp_path)
    assert (m.bucket_numel, m.arrival) == (None, None)
    chosen = dataclasses.replace(m, bucket_numel=512, arrival=("p2", "p0", "p1"))
    write_text(tmp_path / "manifest.json", chosen.dumps())
    assert read_manifest(tmp_path) == chosen
    data = json.loads((tmp_path / "manifest.json").read_text())
    assert data["format_version"] == 1 and data["plan"] == {"bucket_numel": 512,
                                                             "arrival": ["p2", "p0", "p1"]}
    del data["plan"]
    (tmp_path / "manifest.json").write_text(json.dumps(data))
    assert read_manifest(tmp_path) == m
