"""A DeepSpeed JSON config, read the way DeepSpeed 0.19.8 reads it.

Every key is in one of the tables of `evenzero.deepspeed.config_keys`: honoured, accepted
as a no-op (one log line says why), or refused with an error naming the key. Keys
DeepSpeed itself does not know are ignored by DeepSpeed; they get a warning here.

Batch sizes follow DeepSpeed's rules exactly (deepspeed/runtime/config.py@0.19.8,
`_set_batch_related_parameters` and `_batch_assertion`), including their integer
arithmetic and messages.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from evenzero.deepspeed.batch import BatchSizes, batch_sizes
from evenzero.deepspeed.config_keys import (
    BF16_KEYS,
    FP16_KEYS,
    HONOURED_KEYS,
    NO_OP_KEYS,
    REFUSED_SECTIONS,
    REMOVED_KEYS,
    ZERO_HONOURED,
    ZERO_NO_OP,
    ZERO_REFUSED,
    ZERO_REFUSED_OFF,
    ZERO_STAGE3_PREFIX,
    DeepSpeedConfigError,
)


@dataclass(frozen=True)
class Precision:
    """fp16/bf16 sections (deepspeed/runtime/precision_config.py@0.19.8)."""

    fp16: bool = False
    bf16: bool = False
    auto_cast: bool = False
    loss_scale: float = 0.0
    """0 means dynamic; > 0 a static scale."""
    initial_scale_power: int = 16
    loss_scale_window: int = 1000
    hysteresis: int = 2
    consecutive_hysteresis: bool = False
    min_loss_scale: float = 1
    bf16_check_grad_overflow: bool = True

    @property
    def dynamic_loss_scale(self) -> bool:
        return self.fp16 and self.loss_scale == 0


@dataclass(frozen=True)
class NamedSection:
    """An `optimizer` or `scheduler` section: a type name and its keyword arguments."""

    type: str
    params: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ZeroSection:
    stage: int = 0
    reduce_bucket_size: int | None = None
    """Elements per bucket when given; None keeps evenzero's default bucket size."""
    compute_grad_norm: bool = True
    offload_optimizer: str | None = None
    """`offload_optimizer.device` "cpu" (or the legacy `cpu_offload: true`); None: off."""
    pin_memory: bool = True
    """`offload_optimizer.pin_memory` (DeepSpeed 0.19.8's default: True)."""
    reduce_scatter: bool = True
    """DeepSpeed's key (its default true); only read to refuse what DeepSpeed refuses."""


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine reads from a DeepSpeed config, validated."""

    raw: Mapping[str, Any]
    """The config exactly as the user passed it (saved with checkpoints, like DeepSpeed)."""
    batch: BatchSizes
    precision: Precision
    zero: ZeroSection
    optimizer: NamedSection | None
    scheduler: NamedSection | None
    gradient_clipping: float
    communication_data_type: str | None
    steps_per_print: int | None
    dataloader_drop_last: bool
    use_data_before_expert_parallelism: bool
    no_ops: tuple[tuple[str, str], ...]
    """(key, why it changes nothing here) for every accepted no-op key present."""
    force_ds_cpu_optimizer: bool = True
    """`zero_force_ds_cpu_optimizer`: with offload, refuse a client optimizer other than
    DeepSpeedCPUAdam, as DeepSpeed does (deepspeed/runtime/engine.py@0.19.8:2342)."""
    unknown_keys: tuple[str, ...] = ()
    """Top-level keys DeepSpeed does not know (DeepSpeed ignores them; a warning says so)."""
    gradient_allreduce_op: str = "mean"
    """"mean" (DeepSpeed's default) or "sum": data-parallel gradients summed, not averaged."""
    managed_gradient_accumulation: bool = True
    """False: every `engine.step()` is an accumulation boundary that applies the update
    (the caller owns the boundary), as DeepSpeed 0.19.8's key says."""
    tag_validation: str = "WARN"
    """checkpoint.tag_validation: what a tag that differs across ranks does (FAIL raises)."""


def load_config(config: Any) -> dict:
    """A config dict from a dict, a JSON path or a base64-encoded JSON string, like
    `deepspeed.runtime.config.DeepSpeedConfig.__init__`@0.19.8 (which uses hjson)."""
    if isinstance(config, Mapping):
        return dict(config)
    if not isinstance(config, (str, os.PathLike)):
        raise DeepSpeedConfigError(f"config must be a dict, a JSON file path or a base64 JSON "
                                   f"string, got {type(config).__name__}")
    text = None
    if os.path.exists(config):
        with open(config) as f:
            text = f.read()
        where = str(config)
    else:
        try:
            text = base64.urlsafe_b64decode(str(config)).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError, ValueError):
            raise DeepSpeedConfigError(
                f"Expected a string path to an existing deepspeed config, or a dictionary or a "
                f"valid base64. Received: {config}") from None
        where = "the base64 config"
    return _parse_json(text, where)


def _parse_json(text: str, where: str) -> dict:
    def no_duplicates(pairs):
        out = {}
        for k, v in pairs:
            if k in out:
                raise DeepSpeedConfigError(f"{where}: duplicate key {k!r}")
            out[k] = v
        return out

    try:
        return json.loads(text, object_pairs_hook=no_duplicates)
    except json.JSONDecodeError as e:
        try:  # DeepSpeed reads configs with hjson (comments, unquoted keys) when installed
            import hjson
        except ImportError:
            raise DeepSpeedConfigError(f"{where}: not valid JSON ({e})") from None
        return dict(hjson.loads(text, object_pairs_hook=no_duplicates))


def parse_config(raw: Mapping[str, Any], world_size: int) -> EngineConfig:
    """Validate `raw` for a data-parallel world of `world_size` ranks."""
    _refuse_hf_auto(raw)
    for key in REMOVED_KEYS:
        if key in raw:
            raise DeepSpeedConfigError(f"config key {key!r} was removed from DeepSpeed (0.19.8 "
                                       f"raises on it too); delete it from the config")
    no_ops = []
    unknown = []
    for key, value in raw.items():
        if key in HONOURED_KEYS:
            continue
        if key in NO_OP_KEYS:
            no_ops.append((key, NO_OP_KEYS[key]))
        elif key in REFUSED_SECTIONS:
            _refuse_section(key, value, REFUSED_SECTIONS[key])
        else:
            unknown.append(key)
    zero, zero_no_ops = _zero_section(raw.get("zero_optimization", {}))
    no_ops += zero_no_ops
    precision = _precision(raw)
    comm = raw.get("communication_data_type")
    if comm is not None:
        comm = str(comm).lower()
        if comm not in ("fp32", "fp16", "bf16"):
            raise DeepSpeedConfigError(f"Invalid communication_data_type. Supported data types: "
                                       f"['fp16', 'bf16', 'fp32']. Got: {comm}")
    reduce_op, managed = _check_reduction_keys(raw, zero)
    tag_validation = _check_misc_sections(raw, precision)
    clipping = raw.get("gradient_clipping", 1.0)  # deepspeed/runtime/constants.py@0.19.8:203
    if isinstance(clipping, bool) or not isinstance(clipping, (int, float)) or clipping < 0:
        raise DeepSpeedConfigError(f"gradient_clipping must be a number >= 0 (0 disables it), "
                                   f"got {clipping!r}")
    return EngineConfig(
        raw=raw, batch=batch_sizes(raw, world_size), precision=precision, zero=zero,
        optimizer=_named(raw, "optimizer"), scheduler=_named(raw, "scheduler"),
        gradient_clipping=float(clipping), communication_data_type=comm,
        steps_per_print=raw.get("steps_per_print"),
        dataloader_drop_last=bool(raw.get("dataloader_drop_last", False)),
        use_data_before_expert_parallelism=bool(raw.get("use_data_before_expert_parallelism",
                                                        False)),
        no_ops=tuple(no_ops), unknown_keys=tuple(sorted(unknown)),
        force_ds_cpu_optimizer=_force_cpu_optimizer(raw),
        gradient_allreduce_op=reduce_op, managed_gradient_accumulation=managed,
        tag_validation=tag_validation)


def _refuse_hf_auto(raw: Mapping[str, Any]) -> None:
    """HF's `"auto"` placeholders left in a config that reaches `initialize`. HF Trainer
    (transformers/integrations/deepspeed.py, `HfTrainerDeepSpeedConfig`) and Accelerate
    (`DeepSpeedPlugin.deepspeed_config_process`) replace them before they call it; a script
    that calls it itself passes them on, and DeepSpeed 0.19.8 then fails on whichever it
    reads first (`bool("auto")` turns both fp16 and bf16 on)."""
    autos = [key for key, value in _leaves(raw) if value == "auto"]
    if autos:
        more = f" (and {', '.join(autos[1:])})" if len(autos) > 1 else ""
        raise DeepSpeedConfigError(
            f"config key {autos[0]!r} = \"auto\"{more}: \"auto\" values are filled in only by "
            f"HF Trainer and Accelerate, before they call deepspeed.initialize; this config "
            f"reached deepspeed.initialize without them, so give each key a value (for "
            f"example \"fp16\": {{\"enabled\": false}}) or launch through HF Trainer or "
            f"Accelerate")


def _leaves(section: Mapping[str, Any], prefix: str = ""):
    """(dotted key, value) of every non-dict value, depth first."""
    for key, value in section.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from _leaves(value, name + ".")
        else:
            yield name, value


def _refuse_section(key: str, value: Any, feature: str) -> None:
    if not isinstance(value, Mapping) or _enabled(key, value):
        raise DeepSpeedConfigError(f"config key {key!r}: {feature} is not supported by "
                                   f"evenzero.deepspeed; remove the key (evenzero runs ZeRO "
                                   f"stage 0-2 data parallelism only)")


def _enabled(key: str, section: Mapping[str, Any]) -> bool:
    if key == "tensor_parallel":
        tp = section.get("tp") or {}
        return int(section.get("autotp_size", 0) or 0) > 1 or int(tp.get("tp_size", 1) or 1) > 1
    if key == "compile":
        return bool(section.get("deepcompile", False))
    return bool(section.get("enabled", False))


def _zero_section(zero: Any) -> tuple[ZeroSection, list[tuple[str, str]]]:
    if not isinstance(zero, Mapping):
        raise DeepSpeedConfigError(f"zero_optimization must be a dict, got {type(zero).__name__}")
    no_ops = []
    offload, pin, offload_no_ops = _offload_section(zero)
    no_ops += offload_no_ops
    for key, value in zero.items():
        where = f"zero_optimization.{key}"
        if key in ZERO_HONOURED or key in OFFLOAD_KEYS:
            continue
        if key in ZERO_NO_OP:
            no_ops.append((where, ZERO_NO_OP[key]))
        elif key.startswith(ZERO_STAGE3_PREFIX):
            no_ops.append((where, "a ZeRO-3 setting"))
        elif key in ZERO_REFUSED:
            if _zero_feature_off(key, value):
                continue
            raise DeepSpeedConfigError(f"config key {where!r}: {ZERO_REFUSED[key]} is not "
                                       f"supported by evenzero.deepspeed; remove the key"
                                       + (f"; {ZEROPP_INSTEAD[key]}" if key in ZEROPP_INSTEAD
                                          else ""))
        else:
            # DeepSpeed's pydantic model forbids unknown keys here (extra="forbid").
            raise DeepSpeedConfigError(f"config key {where!r} is not a DeepSpeed ZeRO setting "
                                       f"(DeepSpeed 0.19.8 rejects it too)")
    stage = zero.get("stage", 0)
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise DeepSpeedConfigError(f"zero_optimization.stage must be 0, 1, 2 or 3, got {stage!r}")
    if stage == 3:
        raise DeepSpeedConfigError("config key 'zero_optimization.stage' = 3: ZeRO stage 3 "
                                   "(parameter partitioning) is not supported by "
                                   "evenzero.deepspeed; use stage 1 or 2")
    bucket = zero.get("reduce_bucket_size")
    if bucket is not None:
        if (isinstance(bucket, bool) or not isinstance(bucket, (int, float))
                or bucket <= 0 or int(bucket) != bucket):
            raise DeepSpeedConfigError(f"zero_optimization.reduce_bucket_size must be a positive "
                                       f"whole number of elements, got {bucket!r}")
        bucket = int(bucket)
    compute_norm = zero.get("compute_grad_norm", True)
    _check_allgather_bucket(zero, int(stage))
    return ZeroSection(int(stage), bucket, bool(compute_norm), offload, pin,
                       bool(zero.get("reduce_scatter", True))), no_ops


def _force_cpu_optimizer(raw: Mapping[str, Any]) -> bool:
    value = raw.get("zero_force_ds_cpu_optimizer", True)
    if not isinstance(value, bool):
        raise DeepSpeedConfigError(f"zero_force_ds_cpu_optimizer must be true or false, got "
                                   f"{value!r}")
    return value


OFFLOAD_KEYS = ("offload_optimizer", "cpu_offload", "cpu_offload_use_pin_memory")
"""ZeRO keys that ask for optimizer offload (the last two: DeepSpeed's deprecated form)."""


def _offload_section(zero: Mapping[str, Any]) -> tuple[str | None, bool, list[tuple[str, str]]]:
    """(device or None, pin_memory, no-op keys) of `offload_optimizer`, by DeepSpeed 0.19.8's
    `DeepSpeedZeroOffloadOptimizerConfig` (deepspeed/runtime/zero/offload_config.py)."""
    section = zero.get("offload_optimizer")
    legacy = zero.get("cpu_offload")
    if section is None and legacy:
        pin = zero.get("cpu_offload_use_pin_memory")
        return "cpu", True if pin is None else _bool(pin, "cpu_offload_use_pin_memory"), []
    if section is None:
        return None, True, []
    if not isinstance(section, Mapping):
        raise DeepSpeedConfigError(f"zero_optimization.offload_optimizer must be a dict, got "
                                   f"{type(section).__name__}")
    extra = sorted(set(section) - set(OFFLOAD_OPTIMIZER_KEYS))
    if extra:
        raise DeepSpeedConfigError(f"config key 'zero_optimization.offload_optimizer.{extra[0]}' "
                                   f"is not a DeepSpeed offload setting (DeepSpeed 0.19.8 "
                                   f"rejects it too)")
    device = str(section.get("device", "none")).lower()
    if device == "none":
        return None, True, []
    if device == "nvme":
        raise DeepSpeedConfigError("config key 'zero_optimization.offload_optimizer.device' = "
                                   "'nvme': NVMe offload is not supported by evenzero.deepspeed; "
                                   "use \"device\": \"cpu\" (host memory)")
    if device != "cpu":
        raise DeepSpeedConfigError(f"zero_optimization.offload_optimizer.device must be 'cpu', "
                                   f"'nvme' or 'none', got {section.get('device')!r}")
    ratio = section.get("ratio", 1.0)
    if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not 0 <= ratio <= 1:
        raise DeepSpeedConfigError(f"zero_optimization.offload_optimizer.ratio must be a number "
                                   f"from 0 to 1, got {ratio!r}")
    if ratio < 1:
        raise DeepSpeedConfigError(
            f"config key 'zero_optimization.offload_optimizer.ratio' = {ratio}: partial offload "
            f"(a share of the optimizer stepped on the GPU) is not supported by "
            f"evenzero.deepspeed (DeepSpeed 0.19.8 honours it at ZeRO-3 only); remove it or set "
            f"1.0 to offload all of it")
    if section.get("super_offload"):
        raise DeepSpeedConfigError("config key 'zero_optimization.offload_optimizer."
                                   "super_offload': SuperOffload (a ZeRO-3 feature) is not "
                                   "supported by evenzero.deepspeed; remove it")
    count = section.get("buffer_count", 4)
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise DeepSpeedConfigError(f"zero_optimization.offload_optimizer.buffer_count must be "
                                   f"an integer >= 0, got {count!r}")
    no_ops = [(f"zero_optimization.offload_optimizer.{k}", why)
              for k, why in OFFLOAD_NO_OPS.items() if k in section]
    return "cpu", _bool(section.get("pin_memory", True), "offload_optimizer.pin_memory"), no_ops


OFFLOAD_OPTIMIZER_KEYS = ("device", "nvme_path", "buffer_count", "pin_memory", "pipeline_read",
                          "pipeline_write", "fast_init", "ratio", "super_offload",
                          "cpuadam_cores_perc")
OFFLOAD_NO_OPS = {
    "buffer_count": "it sizes DeepSpeed's NVMe swap buffers; host offload keeps whole shards",
    "fast_init": "it speeds up NVMe initialisation; host offload has none",
    "nvme_path": "NVMe only; the device is cpu",
    "pipeline_read": "NVMe tiling (ZeRO-Infinity) only",
    "pipeline_write": "NVMe tiling (ZeRO-Infinity) only",
    "cpuadam_cores_perc": "it only applies with super_offload (ZeRO-3)",
}
"""`offload_optimizer` keys accepted with device cpu, and why they change nothing."""


def _bool(value: Any, key: str) -> bool:
    if not isinstance(value, bool):
        raise DeepSpeedConfigError(f"zero_optimization.{key} must be true or false, got "
                                   f"{value!r}")
    return value


NCCL_START_ALIGNMENT_FACTOR = 2
"""DeepSpeed's ZeRO-1/2 partition alignment in elements (4 bytes of fp16,
deepspeed/runtime/zero/stage_1_and_2.py@0.19.8); `allgather_bucket_size` must be a multiple."""


def _check_allgather_bucket(zero: Mapping[str, Any], stage: int) -> None:
    """DeepSpeed's ZeRO-1/2 optimizer asserts this when built; here the config is checked
    before any collective, so every rank raises the same AssertionError at once."""
    size = zero.get("allgather_bucket_size")
    if stage not in (1, 2) or size is None:
        return
    if isinstance(size, bool) or not isinstance(size, (int, float)) or size <= 0:
        raise DeepSpeedConfigError(f"zero_optimization.allgather_bucket_size must be a positive "
                                   f"number of elements, got {size!r}")
    if int(size) % NCCL_START_ALIGNMENT_FACTOR != 0:
        raise AssertionError(f"allgather_bucket_size must be a multiple of "
                             f"nccl_start_alignment_factor, {NCCL_START_ALIGNMENT_FACTOR} "
                             f"(zero_optimization.allgather_bucket_size = {size!r})")


ZEROPP_INSTEAD = {
    "zero_quantized_gradients": "DeepSpeed's qgZ is ZeRO-3 only; at stage 1/2 evenzero "
                                "compresses the gradient reduce-scatter itself: "
                                "ZeroOptimizer(..., grad_compression=\"int8\", "
                                "grad_compression_error_feedback=True), or "
                                "\"communication_data_type\": \"bf16\" in this config",
    "zero_quantized_weights": "DeepSpeed's qwZ is ZeRO-3 only; evenzero gathers exact "
                              "parameters and compresses gradients instead: "
                              "ZeroOptimizer(..., grad_compression=\"int8\")",
    "zero_quantized_nontrainable_weights": "a ZeRO-3 setting; evenzero gathers exact "
                                           "parameters (grad_compression=\"int8\" compresses "
                                           "the gradients)",
    "zero_hpz_partition_size": "DeepSpeed's hpZ is ZeRO-3 only; to send fewer bytes at stage "
                               "1/2 use ZeroOptimizer(..., grad_compression=\"int8\")",
}
"""What to use instead of each ZeRO++ key at stage 1/2 (named in its refusal)."""


def _zero_feature_off(key: str, value: Any) -> bool:
    if key in ("offload_optimizer", "offload_param"):
        return value is None or (isinstance(value, Mapping)
                                 and str(value.get("device", "none")).lower() == "none")
    return value in ZERO_REFUSED_OFF.get(key, ())


def _precision(raw: Mapping[str, Any]) -> Precision:
    fp16 = raw.get("fp16", {}) or {}
    bf16 = raw.get("bf16", raw.get("bfloat16", {})) or {}
    for name, section, keys in (("fp16", fp16, FP16_KEYS), ("bf16", bf16, BF16_KEYS)):
        if not isinstance(section, Mapping):
            raise DeepSpeedConfigError(f"{name} must be a dict, got {type(section).__name__}")
        extra = sorted(set(section) - keys)
        if extra:
            raise DeepSpeedConfigError(f"config key '{name}.{extra[0]}' is not a DeepSpeed {name} "
                                       f"setting (DeepSpeed 0.19.8 rejects it too)")
    on16, onbf = bool(fp16.get("enabled", False)), bool(bf16.get("enabled", False))
    if on16 and onbf:
        raise DeepSpeedConfigError("bfloat16 and fp16 modes cannot be simultaneously enabled")
    for key in ("fp16_master_weights_and_grads",):
        if fp16.get(key):
            raise DeepSpeedConfigError(f"config key 'fp16.{key}': fp16 master weights are not "
                                       f"supported (evenzero keeps fp32 masters); remove it")
    for key in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
        if bf16.get(key):
            raise DeepSpeedConfigError(f"config key 'bf16.{key}': bf16 master weights/optimizer "
                                       f"state are not supported (evenzero keeps fp32 masters); "
                                       f"remove it")
    loss_scale = fp16.get("loss_scale", 0)
    if (isinstance(loss_scale, bool) or not isinstance(loss_scale, (int, float))
            or not math.isfinite(loss_scale) or loss_scale < 0):
        raise DeepSpeedConfigError(f"fp16.loss_scale must be a finite number >= 0 (0 enables "
                                   f"dynamic loss scaling), got {loss_scale!r}")
    p = Precision(fp16=on16, bf16=onbf, auto_cast=bool(fp16.get("auto_cast", False)),
                  loss_scale=float(loss_scale),
                  initial_scale_power=_int(fp16, "initial_scale_power", 16),
                  loss_scale_window=_int(fp16, "loss_scale_window", 1000),
                  hysteresis=_int(fp16, "hysteresis", 2),
                  consecutive_hysteresis=bool(fp16.get("consecutive_hysteresis", False)),
                  min_loss_scale=_int(fp16, "min_loss_scale", 1),
                  bf16_check_grad_overflow=bool(bf16.get("check_grad_overflow", True)))
    if p.dynamic_loss_scale:
        if p.loss_scale_window <= 0:
            raise DeepSpeedConfigError("fp16.loss_scale_window must be > 0 when dynamic loss "
                                       "scaling is enabled (loss_scale=0)")
        if p.min_loss_scale <= 0:
            raise DeepSpeedConfigError("fp16.min_loss_scale must be > 0 when dynamic loss "
                                       "scaling is enabled (loss_scale=0)")
    return p


def _int(section: Mapping[str, Any], key: str, default: int) -> int:
    v = section.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise DeepSpeedConfigError(f"fp16.{key} must be an integer, got {v!r}")
    return int(v)


def _check_reduction_keys(raw: Mapping[str, Any], zero: ZeroSection) -> tuple[str, bool]:
    sp = raw.get("sequence_parallel_size", 1)
    if sp not in (None, 1):
        raise DeepSpeedConfigError(f"config key 'sequence_parallel_size' = {sp!r}: sequence "
                                   f"parallelism is not supported by evenzero.deepspeed; remove "
                                   f"the key")
    op = raw.get("gradient_allreduce_op", "mean")
    op = op.lower() if isinstance(op, str) else op
    if op not in ALLREDUCE_OPS:
        # DeepSpeed's message (deepspeed/runtime/config.py@0.19.8:241-249).
        raise DeepSpeedConfigError(f"Invalid gradient_allreduce_op. Supported operations: "
                                   f"{list(ALLREDUCE_OPS)}. Got: {op!r}")
    managed = raw.get("managed_gradient_accumulation", True)
    if not isinstance(managed, bool):
        raise DeepSpeedConfigError(f"config key 'managed_gradient_accumulation' must be true or "
                                   f"false, got {managed!r}")
    # Dividing by the factor before the reduce and by world/factor after it is the same mean,
    # so any factor is honoured by the one average. DeepSpeed's ZeRO-2 refuses a factor other
    # than 1 when it reduce-scatters (deepspeed/runtime/zero/stage_1_and_2.py@0.19.8:350);
    # the same assertion here keeps a config that fails there failing here.
    factor = raw.get("gradient_predivide_factor", 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor > 0:
        raise DeepSpeedConfigError(f"config key 'gradient_predivide_factor' must be a number > 0, "
                                   f"got {factor!r}")
    if factor != 1.0 and zero.stage == 2 and zero.reduce_scatter:
        raise AssertionError("gradient_predivide_factor != 1.0 is not yet supported with ZeRO-2 "
                             "with reduce scatter enabled")
    return op, managed


ALLREDUCE_OPS = ("mean", "sum")
TAG_VALIDATION_MODES = ("WARN", "IGNORE", "FAIL")


def _check_misc_sections(raw: Mapping[str, Any], precision: Precision) -> str:
    """Checks the checkpoint and data_types sections; returns checkpoint.tag_validation."""
    ckpt = raw.get("checkpoint", {}) or {}
    mode = ckpt.get("tag_validation", "Warn")
    mode = mode.upper() if isinstance(mode, str) else mode
    if mode not in TAG_VALIDATION_MODES:
        # DeepSpeed's message (deepspeed/runtime/config.py@0.19.8:387-395); raised while the
        # config is parsed, before any collective, so every rank raises it.
        raise DeepSpeedConfigError(f"Checkpoint config contains invalid tag_validation value of "
                                   f"{mode}, expecting one of {list(TAG_VALIDATION_MODES)}")
    for key in ("load_universal", "use_node_local_storage"):
        if ckpt.get(key):
            raise DeepSpeedConfigError(f"config key 'checkpoint.{key}' is not supported: evenzero "
                                       f"checkpoints load at any world size without conversion")
    if ckpt.get("parallel_write", {}).get("pipeline_stage"):
        raise DeepSpeedConfigError("config key 'checkpoint.parallel_write' is not supported")
    types = raw.get("data_types", {}) or {}
    model = "fp16" if precision.fp16 else "bf16" if precision.bf16 else "fp32"
    for key in ("grad_accum_dtype", "param_dtype", "buffer_dtype"):
        value = types.get(key)
        # Gradients accumulate in fp32 shards whatever the model dtype, so an fp32
        # grad_accum_dtype is what already happens.
        if key == "grad_accum_dtype" and value is not None and _dtype_name(value) == "fp32":
            continue
        if value is not None and _dtype_name(value) != model:
            raise DeepSpeedConfigError(f"config key 'data_types.{key}' = {value!r} is not "
                                       f"supported: gradients accumulate in fp32 shards and "
                                       f"parameters/buffers keep the model dtype ({model}); "
                                       f"remove the key")
    extra = sorted(set(types) - {"grad_accum_dtype", "param_dtype", "buffer_dtype",
                                 "keep_in_fp32_modules"})
    if extra:
        raise DeepSpeedConfigError(f"config key 'data_types.{extra[0]}' is not supported")
    return mode


def _dtype_name(value: Any) -> str:
    text = str(value).lower().removeprefix("torch.")
    return {"float16": "fp16", "half": "fp16", "bfloat16": "bf16", "float32": "fp32",
            "float": "fp32"}.get(text, text)


def _named(raw: Mapping[str, Any], key: str) -> NamedSection | None:
    section = raw.get(key)
    if section is None:
        return None
    if not isinstance(section, Mapping) or "type" not in section:
        if isinstance(section, Mapping) and not section:
            return None
        raise DeepSpeedConfigError(f"config key {key!r} must be {{\"type\": ..., \"params\": "
                                   f"{{...}}}}, got {section!r}")
    extra = sorted(set(section) - {"type", "params", "legacy_fusion"})
    if extra:
        raise DeepSpeedConfigError(f"config key '{key}.{extra[0]}' is not supported")
    if section.get("legacy_fusion"):
        raise DeepSpeedConfigError(f"config key '{key}.legacy_fusion' is not supported")
    params = section.get("params") or {}
    if not isinstance(params, Mapping):
        raise DeepSpeedConfigError(f"{key}.params must be a dict, got {type(params).__name__}")
    return NamedSection(str(section["type"]), dict(params))
