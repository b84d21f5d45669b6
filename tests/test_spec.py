"""Model specs: JSON parsing, validation messages, module measurement, presets."""

import json

import pytest
import torch
from torch import nn

from evenzero import model_presets
from evenzero.spec import ModelSpec, ModuleSpecOptions, ParamSpec, SpecError, from_module
from evenzero.spec_json import from_json


def _doc(**over):
    doc = {"params": [{"name": "fc1.weight", "shape": [4, 3], "group": "dense"},
                      {"name": "fc1.bias", "shape": [4]},
                      {"name": "e.weight", "shape": [2, 2], "group": "experts", "dtype": "bfloat16"}],
           "groups": {"dense": {}, "experts": {"expert_parallel_size": 2}},
           "arrival": ["fc1.bias", "fc1.weight", "e.weight"]}
    doc.update(over)
    return doc


def test_json_round_trip():
    spec = from_json(_doc())
    assert [p.name for p in spec.params] == ["fc1.weight", "fc1.bias", "e.weight"]
    assert spec.group("experts").expert_parallel_size == 2
    assert spec.param("e.weight").dtype == "bfloat16"
    assert spec.param("fc1.bias").group == "dense"
    again = from_json(spec.to_json())
    assert again.params == spec.params and again.arrival_order == spec.arrival_order


def test_arrival_defaults_to_reverse_registration():
    doc = _doc()
    del doc["arrival"]
    spec = from_json(doc)
    assert spec.arrival_order == ("e.weight", "fc1.bias", "fc1.weight")
    assert spec.arrival_source == "reverse-registration"


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d["params"][0].update(shape=[4, -1]), "params[0] (fc1.weight).shape"),
    (lambda d: d["params"][1].update(shape="4"), "params[1] (fc1.bias).shape"),
    (lambda d: d["params"][0].update(group="nope"), "unknown group 'nope'"),
    (lambda d: d["params"][0].update(dtype="int8"), ".dtype"),
    (lambda d: d["params"][0].pop("name"), "params[0].name"),
    (lambda d: d["params"][0].update(colour="red"), "unknown key"),
    (lambda d: d.update(arrival=["fc1.bias", "fc1.bias"]), "arrival: duplicate name 'fc1.bias'"),
    (lambda d: d.update(arrival=["fc9.bias"]), "arrival: unknown parameter name 'fc9.bias'"),
    (lambda d: d["groups"].update(experts={"expert_parallel_size": 0}), "expert_parallel_size"),
    (lambda d: d["groups"].update(experts={"expert_parallel_size": "4"}), "expert_parallel_size"),
    (lambda d: d.update(params=[]), "params: expected a non-empty list"),
])
def test_json_errors_name_the_field(mutate, needle):
    doc = _doc()
    mutate(doc)
    with pytest.raises(SpecError) as e:
        from_json(doc)
    assert needle in str(e.value)


def test_json_file_errors(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text('{"params": [')
    with pytest.raises(SpecError, match="not valid JSON at line 1"):
        from_json(bad)
    with pytest.raises(SpecError, match="cannot read"):
        from_json(tmp_path / "missing.json")
    good = tmp_path / "m.json"
    good.write_text(json.dumps(_doc()))
    assert from_json(good).name == "m"


def test_duplicate_param_names_rejected():
    with pytest.raises(SpecError, match="duplicate parameter name"):
        ModelSpec((ParamSpec("a", (1,)), ParamSpec("a", (2,))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(8, 8)
        self.fc2 = nn.Linear(8, 4)
        self.unused = nn.Linear(3, 3)
        self.frozen = nn.Linear(8, 8)
        self.frozen.requires_grad_(False)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.frozen(x))))


def test_from_module_measures_arrival_on_meta():
    with torch.device("meta"):
        net = Net()
    spec = from_module(net, lambda: torch.randn(2, 8, device="meta"))
    assert spec.arrival_source == "measured"
    # Backward order: later layers first, bias before weight; unused params never arrive;
    # frozen params are not trainable at all.
    assert spec.arrival_order == ("fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight")
    assert [p.name for p in spec.params] == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias",
                                             "unused.weight", "unused.bias"]
    assert all(p.grad is None for p in net.parameters())


def test_from_module_falls_back_and_says_so():
    with torch.device("meta"):
        net = Net()
    spec = from_module(net)
    assert spec.arrival_source == "reverse-registration"
    assert spec.arrival_order[0] == "unused.bias"
    broken = from_module(net, lambda: torch.randn(2, 5, device="meta"))
    assert broken.arrival_source.startswith("reverse-registration (meta backward failed")


def test_from_module_expert_marker():
    with torch.device("meta"):
        net = Net()
    for p in net.fc2.parameters():
        p.allreduce = False
        p.group_name = "ep_size_2"
    spec = from_module(net, options=ModuleSpecOptions(expert_parallel_size=2))
    assert spec.param("fc2.weight").group == "ep_size_2"
    assert spec.group("ep_size_2").expert_parallel_size == 2


def test_seed_preset_matches_the_report():
    spec = model_presets.preset("seed-moe")
    dense = sum(p.numel for p in spec.group_params("dense"))
    experts = sum(p.numel for p in spec.group_params("experts"))
    assert (dense, experts, spec.numel) == (2_018_000, 8_008_000, 10_026_000)
    order = spec.arrival_order
    assert order[:4] == ("fc2.bias", "fc2.weight", "fc1.bias", "fc1.weight")
    assert order[4:8] == tuple(f"moe.experts.3.{n}" for n in ("fc2.bias", "fc2.weight", "fc1.bias",
                                                              "fc1.weight"))
    assert order[-1] == "moe.gate.wg.weight"
    lost = model_presets.preset("seed-moe-gate-lost")
    assert "moe.gate.wg.weight" not in lost.arrival_order
    assert len(lost.arrival_order) == len(order) - 1


@pytest.mark.parametrize("name, billions", [("gpt2-xl", 1.56), ("llama-7b", 6.74),
                                            ("gemma2-27b", 27.2), ("llama-70b", 69.0)])
def test_transformer_presets_have_published_sizes(name, billions):
    spec = model_presets.preset(name)
    assert spec.numel / 1e9 == pytest.approx(billions, rel=0.02)
    assert sorted(spec.arrival_order) == sorted(p.name for p in spec.params)


def test_unknown_preset():
    with pytest.raises(SpecError, match="unknown preset 'gpt5'; choose one of"):
        model_presets.preset("gpt5")
