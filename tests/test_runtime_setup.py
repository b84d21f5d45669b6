"""Settings reach the plan: every `ZeroConfig` field is a plan option or says why not,
and the strategy's registry record, not its name, decides whether the bucket size is
refined at run time (no processes)."""

from __future__ import annotations

import dataclasses

import pytest

from evenzero.runtime.config import ZeroConfig
from evenzero.runtime.setup import (
    NOT_PLAN_OPTIONS,
    PLAN_OPTION_OF,
    plan_options,
    tunes_bucket_size,
)
from evenzero.strategies import REGISTRY, PlanOptions

CHANGED = {"stage": 1, "bucket_numel": 4096, "alignment_bytes": 256, "reduce_dtype": "bf16",
           "master_dtype": "float64", "max_buckets_in_flight": 3, "overlap_param_gather": True,
           "optimizer_impl": "fused", "grad_compression": "int8", "grad_compression_block": 1024,
           "grad_compression_error_feedback": True, "offload_optimizer": "cpu",
           "whole_tensor": ("fc.weight",)}
"""A value other than the default for every field `PLAN_OPTION_OF` maps."""
NEEDS = {"grad_compression_error_feedback": {"grad_compression": "int8"}}
"""Settings a changed field is only valid with (set on both sides of the comparison)."""


def test_every_config_field_is_a_plan_option_or_on_the_runtime_only_list():
    fields = ZeroConfig.field_names()
    mapped, runtime_only = set(PLAN_OPTION_OF), set(NOT_PLAN_OPTIONS)
    assert not mapped & runtime_only, mapped & runtime_only
    missing = fields - mapped - runtime_only
    assert not missing, (f"ZeroConfig field(s) {sorted(missing)} reach neither the plan nor "
                         f"the runtime-only list of evenzero/runtime/setup.py")
    assert not (mapped | runtime_only) - fields, "the tables name fields ZeroConfig lacks"
    options = {f.name for f in dataclasses.fields(PlanOptions)}
    assert set(PLAN_OPTION_OF.values()) <= options
    assert set(CHANGED) == mapped


@pytest.mark.parametrize("field", sorted(CHANGED))
def test_plan_options_carry_the_field_and_nothing_else(field):
    context = NEEDS.get(field, {})
    default = plan_options(ZeroConfig(**context))
    changed = plan_options(ZeroConfig(**context, **{field: CHANGED[field]}))
    target = PLAN_OPTION_OF[field]
    assert getattr(changed, target) != getattr(default, target)
    others = [f.name for f in dataclasses.fields(PlanOptions) if f.name != target]
    assert [getattr(changed, f) for f in others] == [getattr(default, f) for f in others]


def test_the_optimizer_implementation_that_runs_reaches_the_plan():
    # `config.optimizer_impl` is what runtime/innerstep.py chose at construction.
    assert plan_options(ZeroConfig()).optimizer_impl is None
    assert plan_options(ZeroConfig(optimizer_impl="foreach")).optimizer_impl == "foreach"


def test_the_registry_flag_decides_bucket_refinement():
    for s in REGISTRY:
        assert tunes_bucket_size(s.name) is s.tunes_bucket_size
    assert tunes_bucket_size("evenzero")
    assert not tunes_bucket_size("deepspeed-0.6")
    assert not tunes_bucket_size(lambda spec, world, options: None)  # a custom planner
