"""`deepspeed.pipe`: pipeline parallelism, which evenzero refuses. The module imports
(DeepSpeed's test harness and many model files import `PipelineModule` / `LayerSpec` at the
top); building any of them raises naming the feature, as `deepspeed.PipelineModule` does."""

from __future__ import annotations

from typing import Any

from evenzero.deepspeed.refusals import unsupported

PIPELINE = "pipeline parallelism is not supported"


class PipelineModule:
    """Refused on construction."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise unsupported("deepspeed.pipe.PipelineModule", PIPELINE)


class LayerSpec:
    """Refused on construction: a pipeline stage's layer."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise unsupported("deepspeed.pipe.LayerSpec", PIPELINE)


class TiedLayerSpec(LayerSpec):
    """Refused on construction: a pipeline layer shared between stages."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise unsupported("deepspeed.pipe.TiedLayerSpec", PIPELINE)


__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
