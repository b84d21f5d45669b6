"""`deepspeed.ops.aio`: the async-I/O op behind NVMe offload, which evenzero refuses. The
module imports (DeepSpeed's tests probe `AsyncIOBuilder.NAME` at import time); the builder
reports itself incompatible and refuses to load."""

from __future__ import annotations

from evenzero.deepspeed.ops.op_builder import AsyncIOBuilder  # type: ignore[attr-defined]

__all__ = ["AsyncIOBuilder"]
