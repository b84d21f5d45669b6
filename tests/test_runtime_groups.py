"""Parameter groups (runtime/groups.py), without a process group: grouping is local."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from evenzero.runtime.groups import build_groups


def _model() -> nn.Module:
    model = nn.Sequential(nn.Linear(3, 2), nn.Linear(2, 1))
    model.empty = nn.Parameter(torch.zeros(0))
    return model


def test_an_empty_parameter_in_param_groups_is_skipped_as_torch_accepts_it():
    # Found by the differential fuzzer (tests/fuzz): grouping model.parameters() by dtype,
    # as evenzero's own mixed-dtype error advises, was refused for an empty parameter.
    model = _model()
    world = object()  # grouping never communicates
    (group,) = build_groups(model, world, [{"params": list(model.parameters())}], None)
    assert group.names == ("0.weight", "0.bias", "1.weight", "1.bias")


def test_an_empty_tensor_that_is_not_the_modules_is_still_refused():
    model = _model()
    stranger = nn.Parameter(torch.zeros(0))
    with pytest.raises(Exception, match="not a trainable parameter of the module"):
        build_groups(model, object(), [{"params": [*model.parameters(), stranger]}], None)
