"""Which DeepSpeed config keys evenzero honours, accepts as no-ops, or refuses.

A key is honoured when it maps onto evenzero; a no-op when it only tunes how DeepSpeed
schedules communication or what it logs (the reason is logged once); refused when it
asks for a feature evenzero does not have, since following it silently would train
something else. The key lists follow DeepSpeed 0.19.8's config models
(deepspeed/runtime/config.py, deepspeed/runtime/zero/config.py,
deepspeed/runtime/precision_config.py).
"""

from __future__ import annotations


class DeepSpeedConfigError(ValueError):
    """A config key evenzero cannot honour, or a value DeepSpeed would reject."""


# deepspeed/runtime/config.py@0.19.8:80-141 (`_REMOVED_TOP_LEVEL_CONFIG_KEYS`): DeepSpeed
# itself raises on these.
REMOVED_KEYS = ("nebula", "compression_training", "amp", "quantize_training",
                "sparse_gradients", "eigenvalue", "sparse_attention", "elasticity",
                "graph_harvesting", "curriculum_learning", "progressive_layer_drop")

HONOURED_KEYS = frozenset({
    "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
    "optimizer", "scheduler", "fp16", "bf16", "bfloat16", "gradient_clipping",
    "zero_optimization", "communication_data_type", "steps_per_print", "dataloader_drop_last",
    "gradient_allreduce_op", "managed_gradient_accumulation", "checkpoint",
    "use_data_before_expert_parallelism", "data_types", "gradient_predivide_factor",
    "sequence_parallel_size", "data_parallel_size", "zero_force_ds_cpu_optimizer",
})

NO_OP_KEYS = {
    "zero_allow_untested_optimizer": "every elementwise torch optimizer is accepted",
    "wall_clock_breakdown": "DeepSpeed's timers are not kept; use torch.profiler",
    "memory_breakdown": "use ZeroOptimizer.memory_report()",
    "dump_state": "DeepSpeed's state dump is not written",
    "flops_profiler": "DeepSpeed's flops profiler is not run",
    "comms_logger": "DeepSpeed's comms logger is not run; ZeroOptimizer.trace lists the "
                    "collectives",
    "tensorboard": "DeepSpeed's monitors are not written",
    "wandb": "DeepSpeed's monitors are not written",
    "csv_monitor": "DeepSpeed's monitors are not written",
    "comet": "DeepSpeed's monitors are not written",
    "timers": "DeepSpeed's timers are not kept",
    "activation_checkpointing": "it configures deepspeed.checkpointing, which the engine "
                                "does not call",
    "aio": "it only matters with NVMe offload, which is refused",
    "vocabulary_size": "it only drives a DeepSpeed warning",
    "disable_allgather": "parameters are always all-gathered per bucket",
    "disable_python_gc": "the Python garbage collector is left alone",
    "log_level": "evenzero logs through the 'evenzero.deepspeed' logger",
    "seq_parallel_communication_data_type": "sequence parallelism is not used",
    "prescale_gradients": "gradients are averaged once after the reduce; pre-scaling only "
                          "changes rounding",
    "pipeline": "it only configures PipelineModule models, which are refused",
}

# Sections that exist for DeepSpeed features evenzero does not have. A section that is
# present but switched off (its "enabled" flag false) is accepted.
REFUSED_SECTIONS = {
    "tensor_parallel": "tensor parallelism (AutoTP)",
    "expert_parallel": "AutoEP expert parallelism",
    "hybrid_engine": "the hybrid (RLHF) engine",
    "autotuning": "the autotuner",
    "compile": "DeepCompile",
    "torch_autocast": "torch autocast inside the engine",
    "data_efficiency": "data efficiency (curriculum, random-LTD)",
    "weight_quantization": "weight quantization",
    "datastates": "DataStates asynchronous checkpointing",
}

ZERO_HONOURED = frozenset({"stage", "reduce_bucket_size"})
ZERO_NO_OP = {
    "overlap_comm": "a bucket is always reduced as soon as its last gradient arrives, "
                    "overlapped with backward",
    "contiguous_gradients": "gradients always live in flat bucket buffers",
    "reduce_scatter": "every bucket is always one equal reduce-scatter",
    "allgather_bucket_size": "parameters are all-gathered once per bucket of the layout",
    "round_robin_gradients": "the layout follows gradient-arrival order instead",
    "use_multi_rank_bucket_allreduce": "every bucket is always one equal reduce-scatter",
    "allgather_partitions": "parameters are always all-gathered",
    "elastic_checkpoint": "evenzero checkpoints always load at any world size",
    "ignore_unused_parameters": "parameters without a gradient are stepped with a zero "
                                "gradient, as DeepSpeed does",
    "parameter_alignment": "shards are always aligned (alignment_bytes)",
    "load_from_fp32_weights": "checkpoints always restore the fp32 masters",
    "compute_grad_norm": "the global norm rides on the step's one all-reduce anyway",
    "sub_group_size": "a ZeRO-3 setting",
    "memory_efficient_linear": "a ZeRO-3 setting",
    "leaf_module": "a ZeRO-3 setting",
    "log_trace_cache_warnings": "a ZeRO-3 setting",
    "enable_sanity_checks": "ranks always agree on the model before training",
}
ZERO_STAGE3_PREFIX = "stage3_"
ZERO_REFUSED = {
    "offload_param": "parameter offload",
    "cpu_offload_param": "parameter offload",
    "zenflow": "ZenFlow",
    "zero_hpz_partition_size": "hierarchical partitioning (ZeRO++ hpZ)",
    "zero_quantized_weights": "quantized weights (ZeRO++ qwZ)",
    "zero_quantized_nontrainable_weights": "quantized weights (ZeRO++)",
    "zero_quantized_gradients": "quantized gradients (ZeRO++ qgZ)",
    "legacy_stage1": "the legacy stage-1 optimizer",
    "pipeline_loading_checkpoint": "a ZeRO-3 setting",
    "override_module_apply": "a ZeRO-3 setting",
    "save_muon_momentum_buffer_in_memory": "the Muon optimizer",
    "mics_shard_size": "MiCS (removed from DeepSpeed too)",
    "mics_hierarchical_params_gather": "MiCS (removed from DeepSpeed too)",
    "zeropp_loco_param": "LoCo-Zero++ (removed from DeepSpeed too)",
}
# Defaults that mean "feature off", so the key is harmless when it holds them.
ZERO_REFUSED_OFF = {"zero_hpz_partition_size": (0, 1), "legacy_stage1": (False,),
                    "zero_quantized_weights": (False,), "zero_quantized_gradients": (False,),
                    "zero_quantized_nontrainable_weights": (False,),
                    "pipeline_loading_checkpoint": (False,), "override_module_apply": (True,),
                    "cpu_offload_param": (False, None),
                    "save_muon_momentum_buffer_in_memory": (False,)}

FP16_KEYS = frozenset({"enabled", "auto_cast", "loss_scale", "initial_scale_power",
                       "loss_scale_window", "hysteresis", "consecutive_hysteresis",
                       "min_loss_scale", "fp16_master_weights_and_grads"})
BF16_KEYS = frozenset({"enabled", "immediate_grad_update", "check_grad_overflow",
                       "bf16_master_weights_and_grads", "bf16_optimizer_states"})
