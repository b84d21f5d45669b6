"""`deepspeed.ops.op_builder`: DeepSpeed's builders of compiled ops. evenzero compiles none,
so every builder is importable (tests and scripts probe `Builder.NAME` and
`is_compatible()` to decide whether to skip) and `load()` refuses by name. The two whose
optimizers evenzero provides in PyTorch (`ops.adam.FusedAdam`, `ops.adam.DeepSpeedCPUAdam`)
report themselves compatible, so code that checks before building those optimizers builds
them; every other op reports itself incompatible. `deepspeed.ops.__compatible_ops__` and
`git_version_info.compatible_ops` are built from `ALL_OPS`."""

from __future__ import annotations

from typing import Any

from evenzero.deepspeed.refusals import unsupported

NO_OPS = "DeepSpeed's compiled ops are not built by evenzero; its optimizers are " \
         "deepspeed.ops.adam.FusedAdam / DeepSpeedCPUAdam written in PyTorch"


class OpBuilder:
    """One of DeepSpeed's op builders: never compatible here, `load()` refuses."""

    NAME = "deepspeed_not_implemented"
    BUILD_VAR = "DS_BUILD_NOT_IMPLEMENTED"

    def __init__(self, name: str | None = None) -> None:
        self.name = name or self.NAME

    def absolute_name(self) -> str:
        return f"deepspeed.ops.{self.name}_op"

    def is_compatible(self, verbose: bool = False) -> bool:
        return self.NAME in PROVIDED_IN_PYTORCH

    def load(self, verbose: bool = True) -> Any:
        raise unsupported(f"{type(self).__name__}().load()", NO_OPS)

    def jit_load(self, verbose: bool = True) -> Any:
        raise unsupported(f"{type(self).__name__}().jit_load()", NO_OPS)

    def builder(self) -> Any:
        raise unsupported(f"{type(self).__name__}().builder()", NO_OPS)


def _builder(class_name: str, name: str) -> type[OpBuilder]:
    return type(class_name, (OpBuilder,), {"NAME": name, "BUILD_VAR": f"DS_BUILD_{name.upper()}",
                                          "__doc__": f"DeepSpeed's `{name}` op: not built."})


PROVIDED_IN_PYTORCH = ("fused_adam", "cpu_adam")
"""Ops whose optimizer `deepspeed.ops.adam` provides, written in PyTorch."""

# DeepSpeed 0.19.8's builder classes and their NAMEs (deepspeed/ops/op_builder/*.py).
_NAMES = {
    "AsyncIOBuilder": "async_io", "CCLCommBuilder": "deepspeed_ccl_comm",
    "CPUAdagradBuilder": "cpu_adagrad", "CPUAdamBuilder": "cpu_adam", "CPULionBuilder": "cpu_lion",
    "DeepCompileBuilder": "dc", "EvoformerAttnBuilder": "evoformer_attn",
    "FPQuantizerBuilder": "fp_quantizer", "FusedAdamBuilder": "fused_adam",
    "FusedLambBuilder": "fused_lamb", "FusedLionBuilder": "fused_lion", "GDSBuilder": "gds",
    "InferenceBuilder": "transformer_inference", "InferenceCoreBuilder": "inference_core_ops",
    "NotImplementedBuilder": "deepspeed_not_implemented", "PinMemoryBuilder": "pin_memory",
    "QuantizerBuilder": "quantizer", "RandomLTDBuilder": "random_ltd",
    "ShareMemCommBuilder": "deepspeed_shm_comm", "SpatialInferenceBuilder": "spatial_inference",
    "TransformerBuilder": "transformer", "UtilsBuilder": "utils",
}
_BUILDERS = {cls: _builder(cls, name) for cls, name in _NAMES.items()}
globals().update(_BUILDERS)
ALL_OPS: dict[str, OpBuilder] = {b.NAME: b() for b in _BUILDERS.values()}

def compatible_ops() -> dict[str, bool]:
    """{op name: whether its builder is compatible}, DeepSpeed's `__compatible_ops__`."""
    return {name: builder.is_compatible() for name, builder in ALL_OPS.items()}


__all__ = ["ALL_OPS", "OpBuilder", "PROVIDED_IN_PYTORCH", "compatible_ops", *_BUILDERS]
