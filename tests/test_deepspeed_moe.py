"""`evenzero.deepspeed.moe`: DeepSpeed 0.19.8's MoE layer without DeepSpeed.

- One process: the layer, its gate and its gating functions give bit for bit what
  DeepSpeed's give (outputs, `l_aux`, expert counts, every gradient, and the global RNG
  state after), over top-1/2/3, noisy gates, token dropping and random token selection,
  residual MoE, train and eval, fp32 and bf16; the same parameter names and initial values
  after the same seed; the param-group split equals DeepSpeed's.
- 2 gloo ranks: the same training script (tests/ds_moe_script.py) under real DeepSpeed and
  under `evenzero.deepspeed`, ep_size 1 and 2: losses, `l_aux`, expert counts, parameters,
  an eval forward and the global RNG state after agree; a model built with real
  DeepSpeed's layer still trains under evenzero's engine; a forward before `initialize`
  creates the groups; the expert groups have DeepSpeed's rank sets in both layouts (also at
  4 ranks, slow, with a training run and the refusal of the D + E layout the runtime does
  not plan).
- Without DeepSpeed (imports of it blocked), the CIFAR example's MoE run still trains, and
  gives DeepSpeed's losses.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from dist_helpers import CheckResults, run_checks, run_distributed, torchrun_standalone

HERE = Path(__file__).parent
SCRIPT = HERE / "ds_moe_script.py"
TOL = 1e-5
"""Loss, l_aux and parameter agreement of the 2-rank runs: the layers compute the same
values, the engines reduce gradients in a different order (float rounding)."""


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These tensors are tiny: torch's intra-op threads only contend for the cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return pytest.importorskip("deepspeed", reason="DeepSpeed is not installed "
                                                   "(pip install deepspeed)")


# --------------------------------------------------------------------------- one process

def _run_layer(cls, options: dict, dtype=torch.float32, train: bool = True, steps: int = 2):
    """Build with seed 0 (the expert has dropout, so its RNG draws count too), run forward
    and backward `steps` times; every output, gradient and the RNG state after."""
    torch.manual_seed(0)
    expert = nn.Sequential(nn.Linear(8, 12), nn.Dropout(0.1), nn.ReLU(), nn.Linear(12, 8))
    layer = cls(8, expert, **options).to(dtype).train(train)
    got = [{n: p.detach().clone() for n, p in layer.named_parameters()}]
    for step in range(steps):
        x = torch.randn(3, 7, 8, generator=torch.Generator().manual_seed(step)).to(dtype)
        x.requires_grad_(True)
        out, l_aux, counts = layer(x)
        (out.float().square().mean() + 0.1 * l_aux).backward()
        got.append((out.detach(), l_aux.detach(), counts, x.grad))
    got.append({n: p.grad.clone() for n, p in layer.named_parameters()})
    got.append(torch.get_rng_state())
    return got


def _assert_identical(a, b, where=""):
    if isinstance(a, dict):
        assert list(a) == list(b), (where, list(a), list(b))
        for k in a:
            _assert_identical(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            _assert_identical(x, y, f"{where}[{i}]")
    else:
        assert a.dtype == b.dtype and torch.equal(a, b), (where, a, b)


_GRID = list(itertools.product((1, 2, 3), (2, 4), (None, "RSample", "Jitter"), (True, False),
                               (True, False), (False, True), (0, 4), (0.5, 1.0),
                               (True, False)))
LAYER_OPTIONS = [
    ({"num_experts": e, "k": k, "noisy_gate_policy": policy, "drop_tokens": drop,
      "use_rts": rts, "use_residual": residual, "min_capacity": min_capacity,
      "capacity_factor": factor, "eval_capacity_factor": 2 * factor}, train)
    # Every 23rd point of the grid (23 is prime to every axis length, so every value of
    # every option comes up, in many combinations); k = 3 needs more than 2 experts.
    for i, (k, e, policy, drop, rts, residual, min_capacity, factor, train) in enumerate(_GRID)
    if i % 23 == 0 and not (k == 3 and e < 3)
]


def test_layer_bit_identical_to_deepspeed():
    _deepspeed()
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from evenzero.deepspeed.moe.layer import MoE

    for options, train in LAYER_OPTIONS:
        _assert_identical(_run_layer(DeepSpeedMoE, options, train=train),
                          _run_layer(MoE, options, train=train), str((options, train)))


def test_layer_bit_identical_to_deepspeed_bf16():
    _deepspeed()
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from evenzero.deepspeed.moe.layer import MoE

    for options in ({"num_experts": 4, "k": 2, "noisy_gate_policy": "Jitter",
                     "use_residual": True},
                    {"num_experts": 2, "k": 1, "noisy_gate_policy": "RSample",
                     "min_capacity": 0}):
        _assert_identical(_run_layer(DeepSpeedMoE, options, torch.bfloat16),
                          _run_layer(MoE, options, torch.bfloat16), str(options))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_gate_dense_outputs_identical_to_deepspeed(k):
    """`TopKGate(...)(x)` without sparse routes: (l_aux, combine_weights, dispatch_mask,
    exp_counts), with `used_token` for top-1."""
    _deepspeed()
    from deepspeed.moe.sharded_moe import TopKGate as DeepSpeedGate

    from evenzero.deepspeed.moe.sharded_moe import TopKGate

    for policy, drop, rts, used in itertools.product((None, "RSample", "Jitter"), (True, False),
                                                     (True, False), (False, True)):
        got = []
        for cls in (DeepSpeedGate, TopKGate):
            torch.manual_seed(1)
            gate = cls(8, 4, k=k, noisy_gate_policy=policy, drop_tokens=drop, use_rts=rts,
                       min_capacity=2)
            used_token = (torch.arange(10) % 3 != 0).long() if used else None
            got.append([t.detach() for t in gate(torch.randn(10, 8), used_token)]
                       + [torch.get_rng_state()])
        _assert_identical(*got, where=str((k, policy, drop, rts, used)))


def test_parameters_names_and_initial_values_like_deepspeed():
    _deepspeed()
    from deepspeed.moe.layer import MoE as DeepSpeedMoE

    from evenzero.deepspeed.moe.layer import MoE

    def build(cls):
        torch.manual_seed(3)
        fc = nn.Linear(6, 6)
        return nn.Sequential(cls(6, fc, num_experts=4, ep_size=2, use_residual=True),
                             cls(6, fc, num_experts=2, k=2))

    theirs, ours = build(DeepSpeedMoE), build(MoE)
    _assert_identical(dict(theirs.named_parameters()), dict(ours.named_parameters()))
    markers = [[(getattr(p, "allreduce", None), getattr(p, "group_name", None))
                for p in m.parameters()] for m in (theirs, ours)]
    assert markers[0] == markers[1]
    assert ("ep_size_2" in {g for _, g in markers[1]}) and (False, "ep_size_1") in markers[1]


def _marked_params(sizes, experts, name="ep_size_2"):
    params = [nn.Parameter(torch.zeros(n)) for n in sizes]
    for i in experts:
        params[i].allreduce, params[i].group_name = False, name
    return params


def test_split_param_groups_like_deepspeed():
    utils = _deepspeed().moe.utils
    from evenzero.deepspeed.moe import utils as ours

    params = _marked_params([1, 2, 3, 4, 5, 6], [1, 2, 3, 5])

    def groups():
        return [{"params": params[:3], "name": "a", "lr": 0.1},
                {"params": params[3:], "name": "b", "weight_decay": 0.0}]

    def shape(gs):
        return [{**g, "params": [id(p) for p in g["params"]]} for g in gs]

    for make, max_size in ((groups, 178956971), (groups, 5), (groups, None), (groups, 1),
                           (lambda: tuple(groups()), 4), (lambda: groups()[0], 4),
                           (lambda: [{"params": params, "name": "x"},
                                     {"params": [], "name": "x"}], 4)):
        want, got = make(), make()
        assert shape(ours.split_params_into_different_moe_groups_for_optimizer(got, max_size)) \
            == shape(utils.split_params_into_different_moe_groups_for_optimizer(want, max_size))
        assert shape(_as_list(got)) == shape(_as_list(want))  # the input, changed in place
    assert shape(ours.configure_moe_param_groups(list(params))) == \
        shape(utils.configure_moe_param_groups(list(params)))
    grouped = [{"params": params, "moe": False}]
    assert ours.configure_moe_param_groups(grouped) is grouped
    assert ours.split_params_into_shared_and_expert_params(params) == \
        utils.split_params_into_shared_and_expert_params(params)


def _as_list(groups):
    return list(groups) if isinstance(groups, (list, tuple)) else [groups]


def test_split_param_groups_errors():
    from evenzero.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    params = _marked_params([2, 2], [1])
    with pytest.raises(KeyError, match="no 'name'"):
        split_params_into_different_moe_groups_for_optimizer({"params": params})
    with pytest.raises(ValueError, match="Unknown param group type"):
        split_params_into_different_moe_groups_for_optimizer(iter([{"params": params}]))
    # Without expert parameters nothing needs a name, as in DeepSpeed.
    plain = {"params": _marked_params([2], [])}
    assert split_params_into_different_moe_groups_for_optimizer(plain) == [plain]


def test_bad_arguments_are_refused_by_name():
    from evenzero.deepspeed.moe.layer import MoE
    from evenzero.deepspeed.moe.sharded_moe import TopKGate

    fc = nn.Linear(4, 4)
    cases = [({"num_experts": 3, "ep_size": 2}, AssertionError, "divisible"),
             ({"noisy_gate_policy": "Gaussian"}, AssertionError, "noisy_gate_policy"),
             ({"ep_size": 0}, ValueError, "ep_size"),
             ({"num_experts": 2, "k": 0}, ValueError, "k=0"),
             ({"num_experts": 2, "k": 3}, ValueError, "k=3")]
    for options, error, fragment in cases:
        with pytest.raises(error, match=fragment):
            MoE(4, fc, **options)
    with pytest.raises(AssertionError, match="min_capacity"):
        MoE(4, fc, num_experts=2, min_capacity=8)(torch.randn(5, 4))
    with pytest.raises(RuntimeError, match="torch.distributed initialized"):
        MoE(4, fc, num_experts=2, ep_size=2)(torch.randn(5, 4))
    gate = TopKGate(4, 2)
    gate._set_ep_group("g")
    gate._set_ep_group("g")
    with pytest.raises(AssertionError, match="override"):
        gate._set_ep_group("h")


def test_tutel_and_expert_tensor_parallelism_change_nothing():
    from evenzero.deepspeed.moe.layer import MoE

    def run(**extra):
        torch.manual_seed(0)
        layer = MoE(4, nn.Linear(4, 4), num_experts=2, min_capacity=0, **extra)
        return layer(torch.randn(6, 4, generator=torch.Generator().manual_seed(1)))

    plain = run()
    _assert_identical(plain, run(use_tutel=True))
    _assert_identical(plain, run(enable_expert_tensor_parallelism=True))


def test_submodules_are_deepspeeds_names():
    import importlib

    import evenzero.deepspeed as deepspeed

    for name, attrs in {"layer": ["MoE"], "utils": [
            "split_params_into_different_moe_groups_for_optimizer", "is_moe_param",
            "has_moe_layers", "configure_moe_param_groups", "is_moe_param_group"],
            "sharded_moe": ["TopKGate", "MOELayer", "top1gating", "top2gating", "topkgating",
                            "multiplicative_jitter", "gumbel_rsample"],
            "experts": ["Experts"], "mappings": ["gather_tokens", "drop_tokens"]}.items():
        module = importlib.import_module(f"evenzero.deepspeed.moe.{name}")
        assert getattr(deepspeed.moe, name) is module
        for attr in attrs:
            assert hasattr(module, attr), (name, attr)


def test_layer_runs_where_deepspeed_cannot_be_imported():
    """A fresh interpreter where `import deepspeed` fails: the layer trains a step."""
    code = f"""
import sys
sys.path.insert(0, {str(HERE)!r})
import ds_moe_script
ds_moe_script.block_deepspeed()
import torch
import evenzero.deepspeed as deepspeed
from evenzero.deepspeed.moe.layer import MoE
from evenzero.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
try:
    import deepspeed as real
    raise SystemExit("deepspeed imported")
except ModuleNotFoundError:
    pass
torch.manual_seed(0)
model = torch.nn.Sequential(MoE(8, torch.nn.Linear(8, 8), num_experts=4, k=2,
                                noisy_gate_policy="Jitter", use_residual=True))
groups = split_params_into_different_moe_groups_for_optimizer(
    {{"params": list(model.parameters()), "name": "parameters"}})
assert [g["name"] for g in groups] == ["parameters", "ep_size_1"], groups
opt = torch.optim.SGD(groups, lr=0.1)
out, l_aux, counts = model[0](torch.randn(4, 5, 8))
(out.square().mean() + l_aux).backward()
opt.step()
assert deepspeed.moe.layer.MoE is MoE and counts.sum().item() == 40
assert not any(n == "deepspeed" or n.startswith("deepspeed.") for n in sys.modules)
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


# --------------------------------------------------------------------------- 2 ranks

def compare(a: dict, b: dict, case: str) -> dict:
    """Figures of one case; raises AssertionError past the tolerance."""
    assert len(a["losses"]) == len(b["losses"]) > 0 and a["global_steps"] == b["global_steps"]
    assert a["exp_counts"] == b["exp_counts"], f"{case}: expert counts differ"
    assert a["eval"]["exp_counts"] == b["eval"]["exp_counts"], f"{case}: eval counts differ"
    assert set(a["params"]) == set(b["params"])
    fig = {
        "micro_steps": len(a["losses"]),
        "max_loss_diff": max(abs(x - y) for x, y in zip(a["losses"], b["losses"], strict=True)),
        "max_l_aux_diff": max(abs(x - y) for x, y in zip(a["l_aux"], b["l_aux"], strict=True)),
        "max_param_diff": max(abs(x - y) for n in a["params"]
                              for x, y in zip(a["params"][n], b["params"][n], strict=True)),
        "max_eval_diff": max(abs(x - y) for x, y in
                             zip(a["eval"]["logits"], b["eval"]["logits"], strict=True)),
        "rng_after_equal": a["rng_after"] == b["rng_after"],
    }
    assert fig["rng_after_equal"], f"{case}: the global RNG advanced differently"
    for key in ("max_loss_diff", "max_l_aux_diff", "max_param_diff", "max_eval_diff"):
        assert math.isfinite(fig[key]) and fig[key] <= TOL, f"{case}: {fig}"
    return fig


def _prepare_rank(rank: int) -> None:
    os.environ["LOCAL_RANK"] = str(rank)
    os.environ["DS_ACCELERATOR"] = "cpu"
    import logging

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    logging.getLogger("evenzero.deepspeed").setLevel(logging.WARNING)


def run_case(case: str) -> dict:
    import ds_moe_script as script

    ds = script.train(script.load_deepspeed("deepspeed"), case)
    ez = script.train(script.load_deepspeed("evenzero"), case)
    return {"figures": compare(ds, ez, case), "deepspeed": ds}


def _check_real_layer_under_evenzero() -> None:
    """A model built with real DeepSpeed's `deepspeed.moe.layer.MoE`, trained by evenzero's
    engine: the path that adopts DeepSpeed's groups; the same run as under DeepSpeed."""
    import deepspeed

    import ds_moe_script as script

    case = "top1_ep2_rsample"
    ds = script.train(deepspeed, case)
    model = script.build_model(deepspeed, case)
    assert type(model.moe[0]).__module__ == "deepspeed.moe.layer"
    ez = script.train(script.load_deepspeed("evenzero"), case, model=model)
    compare(ds, ez, case)


def _check_forward_before_initialize() -> None:
    """A forward before `initialize` creates the groups (E + D layout) on every rank, and
    `initialize` reuses them; asking for the D + E layout after that is refused on every
    rank. Runs first in its job, before anything created evenzero's "ep_size_2" groups."""
    import torch.distributed as dist

    import ds_moe_script as script
    from evenzero.deepspeed.moe.groups import expert_groups_named

    deepspeed = script.load_deepspeed("evenzero")
    case = "top1_ep2_rsample"
    assert expert_groups_named("ep_size_2") is None
    model = script.build_model(deepspeed, case)
    x = script.dataset(case).tensors[0][:4]
    with torch.no_grad():
        model(x)
    made = expert_groups_named("ep_size_2")
    assert dist.get_process_group_ranks(made.ep_group) == [0, 1]
    assert model.moe[0].deepspeed_moe.ep_group is made.ep_group
    config = {**script.CONFIGS[case], "use_data_before_expert_parallelism": True}
    with pytest.raises(ValueError, match="E \\+ D layout"):
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    result = script.train(deepspeed, case, model=model, epochs=1)
    assert all(math.isfinite(v) for v in result["losses"])


def _check_groups_like_deepspeed(rank: int, world: int) -> None:
    """Rank sets of the expert-parallel and expert-data-parallel groups, E + D and D + E,
    against DeepSpeed's `_create_expert_and_data_parallel`."""
    import deepspeed
    import torch.distributed as dist
    from deepspeed.utils import groups as ds_groups

    from evenzero.moe import expert_parallel_groups

    deepspeed.comm.init_distributed(dist_backend="gloo", verbose=False)
    for ep_size, data_first in itertools.product(sorted({1, 2, world}), (False, True)):
        name = f"ep_size_{ep_size}"
        for table in (ds_groups._EXPERT_PARALLEL_GROUP, ds_groups._EXPERT_DATA_PARALLEL_GROUP):
            table.pop(name, None)
        ds_groups._create_expert_and_data_parallel(ep_size,
                                                   use_data_before_expert_parallel_=data_first)
        ours = expert_parallel_groups(ep_size, data_before_expert=data_first)
        want = (list(ds_groups._get_expert_parallel_group_ranks(name)),
                list(ds_groups._get_expert_data_parallel_group_ranks(name)))
        got = (dist.get_process_group_ranks(ours.ep_group),
               dist.get_process_group_ranks(ours.edp_group))
        assert got == want, (ep_size, data_first, got, want)
        assert (ours.ep_rank, ours.edp_rank) == (want[0].index(rank), want[1].index(rank))


CASES = ("top1_ep2_rsample", "top1_ep1_jitter", "top1_ep2_min_capacity", "top2_ep2_residual",
         "top2_ep2_no_drop", "two_groups", "cifar_moe")
RESULTS: dict[str, dict] = {}


def _job(rank: int, world: int, cases: tuple[str, ...]) -> tuple[dict, dict]:
    _prepare_rank(rank)
    results: dict[str, dict] = {}

    def one(case):
        results[case] = run_case(case)

    checks = {"forward_before_initialize": _check_forward_before_initialize}
    checks.update({case: (lambda c=case: one(c)) for case in cases})
    checks["real_layer_under_evenzero"] = _check_real_layer_under_evenzero
    checks["groups_like_deepspeed"] = lambda: _check_groups_like_deepspeed(rank, world)
    return run_checks(checks, barrier=True), results


class _Job(CheckResults):
    """The job's per-check results, and rank 0's figures and DeepSpeed results kept."""

    def assert_passed(self, check: str, world: int, *args) -> None:
        key = (world, *args)
        if key not in self._cache:
            out = run_distributed(self.job, world, args, timeout=self.timeout)
            self._cache[key] = [checks for checks, _ in out]
            RESULTS.update(out[0][1])
        super().assert_passed(check, world, *args)


JOB = _Job(_job, timeout=900)


@pytest.mark.parametrize("case", CASES + ("real_layer_under_evenzero",
                                          "forward_before_initialize"))
def test_same_as_deepspeed_2_ranks(case):
    _deepspeed()
    JOB.assert_passed(case, 2, CASES)


def test_expert_groups_rank_sets_like_deepspeed_2_ranks():
    _deepspeed()
    JOB.assert_passed("groups_like_deepspeed", 2, CASES)


def _check_data_before_expert_refused() -> None:
    """`use_data_before_expert_parallelism: true` with 1 < ep_size < world: refused by name
    on every rank (ZeroOptimizer plans expert groups in the E + D layout only)."""
    import ds_moe_script as script

    deepspeed = script.load_deepspeed("evenzero")
    case = "top2_ep2_residual"
    config = {**script.CONFIGS[case], "use_data_before_expert_parallelism": True}
    model = script.build_model(deepspeed, case)
    with pytest.raises(deepspeed.DeepSpeedConfigError, match="use_data_before_expert_parallelism"):
        deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)


def _four_rank_job(rank: int, world: int) -> dict[str, str | None]:
    _prepare_rank(rank)
    return run_checks({
        "top2_ep2_residual": lambda: run_case("top2_ep2_residual"),
        "data_before_expert_refused": _check_data_before_expert_refused,
        "groups_like_deepspeed": lambda: _check_groups_like_deepspeed(rank, world),
    }, barrier=True)


FOUR_RANKS = CheckResults(_four_rank_job, timeout=1800)


@pytest.mark.slow
@pytest.mark.parametrize("check", ["top2_ep2_residual", "data_before_expert_refused",
                                   "groups_like_deepspeed"])
def test_4_ranks(check):
    """At 4 ranks ep_size 2 has expert-data-parallel pairs, and D + E differs from E + D."""
    _deepspeed()
    FOUR_RANKS.assert_passed(check, 4)


def test_cifar_moe_without_deepspeed(tmp_path):
    """DeepSpeedExamples' CIFAR MoE run (ds_moe_script.py `cifar_moe`) at 2 ranks under
    torchrun with `import deepspeed` blocked: it trains, never imports DeepSpeed, and where
    DeepSpeed is installed its losses are DeepSpeed's."""
    out = tmp_path / "result.json"
    done = torchrun_standalone(SCRIPT, ["--impl", "evenzero", "--case", "cifar_moe", "--out",
                                        str(out), "--block-deepspeed"], timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(out.read_text())
    assert not result["deepspeed_imported"]
    assert result["global_steps"] == 8 and all(math.isfinite(x) for x in result["losses"])
    try:
        _deepspeed()
    except pytest.skip.Exception:
        return
    JOB.assert_passed("cifar_moe", 2, CASES)
    compare(RESULTS["cifar_moe"]["deepspeed"], result, "cifar_moe without DeepSpeed")


def _figures_job(rank: int, world: int, cases: tuple[str, ...]) -> dict:
    _prepare_rank(rank)
    return {case: run_case(case)["figures"] for case in cases}


if __name__ == "__main__":
    cases = tuple(sys.argv[1:]) or CASES
    figures = run_distributed(_figures_job, 2, (cases,), timeout=1200)[0]
    print(f"{'case':24} {'micro-steps':>11} {'max |loss diff|':>16} {'max |l_aux diff|':>17} "
          f"{'max |param diff|':>17} {'max |eval diff|':>16}")
    for case, f in figures.items():
        print(f"{case:24} {f['micro_steps']:>11} {f['max_loss_diff']:>16.3g} "
              f"{f['max_l_aux_diff']:>17.3g} {f['max_param_diff']:>17.3g} "
              f"{f['max_eval_diff']:>16.3g}")
