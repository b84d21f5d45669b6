"""Cost-model presets, each number with its source.

`busbw` is nccl-tests' bus bandwidth in GB/s (1e9 bytes; NVIDIA/nccl-tests
doc/PERFORMANCE.md); alpha in microseconds.

* Single-node NVLink presets hold at 8 ranks (`reference_ranks=8`); ring alphas shrink
  for smaller groups following NCCL's ring latency model (a fixed part plus one step
  per rank; NVIDIA/nccl src/graph/tuning.cc @v2.30.7-1, L384-436). They describe one
  node: for more than 8 ranks use an InfiniBand preset.
* Multi-node presets assume 8 GPUs and 8 NICs per node, rail-optimised InfiniBand, with
  alpha given at 128 ranks (16 nodes) and scaled to other group sizes by the same model
  (ring: linear in hops, network hops dearer; tree: log2 of nodes). These alphas are
  *effective* for 1-100 MB messages: an alpha-beta fit of published all-reduce scans
  (arXiv 2411.13055; NVIDIA GTC24 S62129), which folds in ring pipeline fill.
* All-reduce has tree variants (small messages, and large ones at scale); reduce has a
  low-latency protocol variant. Reduce-scatter, all-gather and reduce have no tree in
  NCCL (tuning.cc L294: reduce is ring-only), so their alpha grows linearly with the
  group: ~1.6 ms per call at 1024 ranks. The model charges whichever applicable variant
  is cheapest (NCCL's tuner does the same); `max_bytes` variants apply up to that size.
* Compute (`DeviceCompute`, for the step timeline): half the datasheet's dense BF16 peak
  (large-model training reaches 40-55% of it) and ~85% of the HBM bandwidth; the
  step's own work (optimizer per implementation, gradient norms, per-parameter host
  time) from the passes each implementation makes (`_GPU_STEP`).
* RoCE is not offered: one user report of its bus bandwidth (NVIDIA/nccl#1368) and no
  latency is not enough for a preset. Calibrate instead.
* `gloo-local` is fitted on the project's own measurements at 8 local ranks; it says
  so when used at another world size. `evenzero calibrate` measures your host.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from evenzero.cost.compute import DeviceCompute
from evenzero.cost.fit import Sample, fit_op
from evenzero.cost.model import CostModel, CostModelError, OpCost, Variant
from evenzero.userjson import read_json_file

SMALL = 64 * 1024
"""Messages up to 64 KiB use NCCL's low-latency paths (tree all-reduce, LL reduce); NCCL
logs RING/LL up to 1 MiB on 8xH200 (stas00/ml-engineering network/README.md @744d01e1)."""

# The step's own work on a GPU, per element of fp32 state (bytes at the HBM bandwidth):
# fused AdamW reads master, gradient and both moments and writes master and moments,
# 7 x 4 = 28; torch's foreach AdamW (torch/optim/adamw.py `_multi_tensor_adamw`, torch
# 2.13) runs lerp (12), mul (8), addcmul (12), decay (8), sqrt (8), div (8), add (8) and
# addcdiv (16) as separate passes: 80; the single-tensor path runs the same passes one
# tensor at a time. A norm of fp32 chunks reads 4; of an fp64 copy, 4 + 8 + 8 = 20.
# Host time: a single-tensor step issues ~10 eager ops per tensor at ~5 us each; a step's
# own per-parameter visit reads a few attributes (~1 us, as measured on CPU).
_GPU_STEP = dict(optimizer_bytes_per_element=80.0, default_optimizer_impl="foreach",
                 single_tensor_bytes_per_element=80.0, fused_bytes_per_element=28.0,
                 norm_fp32_bytes_per_element=4.0, norm_fp64_bytes_per_element=20.0,
                 tensor_overhead_us=50.0, param_overhead_us=1.0)
_GPU_STEP_SOURCES = ("; step: fused AdamW 28 B/element, foreach and single-tensor 80 (their "
                     "passes in torch/optim/adamw.py), norms 4 (fp32 chunks) and 20 (fp64 "
                     "copy) B/element, 50 us per tensor of a single-tensor step, 1 us per "
                     "parameter visit")

# offload_optimizer (not measured here; `evenzero calibrate` measures both on a GPU):
# pinned copies at about 80% of the link (PCIe Gen5 x16 64 GB/s, Gen4 32 GB/s each way),
# and a fused CPU AdamW step at ~15 B/element (CPU_LOCAL below) on an ~10 GB/s share of
# the host's memory bandwidth per GPU of an 8-GPU host.
_HOST_STEP_NS = 1.5
H100 = DeviceCompute(
    "h100", tflops=495.0, memory_gbs=2850.0, **_GPU_STEP,
    host_link_gbs=50.0, host_step_ns_per_element=_HOST_STEP_NS,
    sources="H100 SXM datasheet: 989 TFLOP/s dense BF16, 3.35 TB/s HBM3; half and 85% of "
            "them sustained" + _GPU_STEP_SOURCES)
A100 = DeviceCompute(
    "a100", tflops=156.0, memory_gbs=1730.0, **_GPU_STEP,
    host_link_gbs=25.0, host_step_ns_per_element=_HOST_STEP_NS,
    sources="A100 SXM 80GB datasheet: 312 TFLOP/s dense BF16, 2.04 TB/s HBM2e; half and 85% "
            "of them sustained" + _GPU_STEP_SOURCES)
CPU_LOCAL = DeviceCompute(
    "cpu-local", tflops=0.1, memory_gbs=8.0, optimizer_bytes_per_element=124.0,
    default_optimizer_impl="single_tensor", foreach_bytes_per_element=50.0,
    fused_bytes_per_element=15.0, single_tensor_small_bytes_per_element=60.0,
    foreach_small_bytes_per_element=20.0, fused_small_bytes_per_element=15.0,
    norm_fp32_bytes_per_element=4.0,
    norm_fp64_bytes_per_element=90.0, tensor_overhead_us=80.0, param_overhead_us=1.0,
    comm_slowdown=0.3,
    sources="matmul, bandwidth and slowdown: rough guesses for one of 8 ranks on a 16-core "
            "x86 host (2 threads each), not measured; the step's figures relative to the "
            "copy bandwidth, measured on the project's 2-core host, one thread "
            "(`evenzero.calibration.measure_step_costs`, +-30%: a loaded machine): AdamW "
            "single-tensor 124, foreach 50, fused 15 B/element on 4M-element tensors, 60, "
            "20 and 15 on 64K-element ones (their passes stay in the caches), norms 4 "
            "(fp32 chunks) and 90 (fp64 copy) B/element, 80 us per tensor of a "
            "single-tensor step, 1 us per parameter visit. `evenzero calibrate` measures "
            "them on your host")


def _nvlink_node(name: str, gpu: str, ar_ring: float, ar_nvls: float | None, rs: float,
                 sources: str) -> CostModel:
    ring = "ring"
    all_reduce = [Variant("ring", 15.0, ar_ring, scaling=ring)]
    if ar_nvls is not None:
        # NVLS (NVLink SHARP) latency 25 us: NCCL's model constant (tuning.cc L149-175).
        all_reduce.append(Variant("nvls", 25.0, ar_nvls))
    return CostModel(
        name=name, description=f"8x {gpu} in one NVLink/NVSwitch node",
        all_reduce=OpCost(tuple(all_reduce)),
        reduce_scatter=OpCost((Variant("ring", 11.0, rs, scaling=ring),)),
        all_gather=OpCost((Variant("ring", 11.0, rs, scaling=ring),)),
        reduce=OpCost((Variant("ring", 11.0, rs, scaling=ring),)),
        reference_ranks=8, gpus_per_node=8, sources=sources,
        compute=H100 if gpu.startswith("H100") else A100)


def _ib_cluster(name: str, gpu: str, busbw: float, sources: str) -> CostModel:
    return CostModel(
        name=name, description=f"{gpu} nodes, 8 GPUs + 8 NICs each, rail-optimised InfiniBand",
        # Alpha-beta fits of the published all-reduce scans (arXiv 2411.13055; NVIDIA
        # GTC24 S62129, NVLSTree) put alpha at ~0.33-0.39 ms on 128 GPUs and only
        # ~0.66-0.68 ms on 1024: NCCL leaves the ring for (NVLS)trees at scale. The
        # "tree" variant is that fit, anchored at 400 us on 128 ranks with log2(nodes)
        # growth (it gives 617 us at 1024); "tree-small" is NCCL's tree/LL for <= 64 KiB.
        all_reduce=OpCost((Variant("ring", 400.0, busbw, scaling="ring"),
                           Variant("tree", 400.0, busbw, scaling="tree"),
                           Variant("tree-small", 55.0, busbw, max_bytes=SMALL, scaling="tree"))),
        reduce_scatter=OpCost((Variant("ring", 200.0, busbw, scaling="ring"),)),
        all_gather=OpCost((Variant("ring", 200.0, busbw, scaling="ring"),)),
        reduce=OpCost((Variant("ring", 200.0, busbw, scaling="ring"),
                       Variant("ring-ll", 160.0, busbw, max_bytes=SMALL, scaling="ring"))),
        reference_ranks=128, gpus_per_node=8, sources=sources,
        compute=H100 if gpu.startswith("H100") else A100)


# The project's own gloo measurements: 8 local ranks on a 16-core host, fp32 assumed
# (the dtype was not recorded). What is priced is what the runtime issues on gloo:
# its reduce-scatter is all_to_all_single + a local sum (evenzero.runtime.collectives),
# not gloo's reduce_scatter_tensor (2.0 / 8.8 ms at these sizes, slower than an
# all-reduce). The reduces were timed as 8 calls, one per root, each of 1/8 of the
# buffer (a reduce-scatter done DeepSpeed's way): one call moves 1/8 of it. Fitting two
# sizes per op with the least squares `evenzero calibrate` uses keeps the preset
# reproducible from its data.
_GLOO_ANCHORS = {
    # op: ((elements per call, ms per call), ...)
    "reduce_scatter": ((2**16, 0.9), (2**20, 3.1)),
    "all_reduce": ((2**16, 1.8), (2**20, 6.5)),
    "reduce": ((2**16 // 8, 10.6 / 8), (2**20 // 8, 19.9 / 8)),
}
_GLOO_FIXED_SHARE = 0.125
"""Part of a gloo call's alpha assumed fixed (the call itself); the rest grows with the
peers it exchanges with (pairwise sends: n - 1 of them). Not measured at other sizes."""


def _gloo_local() -> CostModel:
    fitted = {}
    for op, pts in _GLOO_ANCHORS.items():
        v = fit_op([Sample(op, 8, n * 4, ms * 1e-3) for n, ms in pts], "gloo")
        step = v.alpha_us * (1 - _GLOO_FIXED_SHARE) / 7
        fitted[op] = Variant("gloo", v.alpha_us, v.busbw_gbs, scaling="linear", step_us=step)
    return CostModel(
        name="gloo-local", description="gloo over TCP loopback, 8 processes on one 16-core host",
        all_reduce=OpCost((fitted["all_reduce"],)),
        reduce_scatter=OpCost((replace(fitted["reduce_scatter"], name="all_to_all+sum"),)),
        # Not measured: gloo's all-gather assumed to cost like the all_to_all (the same
        # bytes leave each rank).
        all_gather=OpCost((fitted["reduce_scatter"],)),
        reduce=OpCost((fitted["reduce"],)),
        reference_ranks=8, gpus_per_node=8, compute=CPU_LOCAL, fitted_ranks=(8,),
        all_gather_copies_output=True,
        sources="project measurements at 8 local ranks, two-point fit per op; alpha assumed "
                f"{_GLOO_FIXED_SHARE:.0%} fixed + the rest linear in group size; the "
                "all-gather's exchange priced as the all_to_all, its copy out of gloo's "
                "temporary at the copy bandwidth; compute guessed; run `evenzero calibrate` "
                "for your host")


PRESETS: dict[str, CostModel] = {
    m.name: m for m in (
        _nvlink_node(
            "h100-nvlink-8", "H100/H200", ar_ring=365.0, ar_nvls=470.0, rs=360.0,
            sources="busbw: 8xH200 nccl-tests RS 362.9, AG 361.4, AR ring 367, NVLS 473-482 "
                    "(stas00/ml-engineering network/README.md); ring 370 (nccl-tests#212). "
                    "alpha: NCCL model ring/LL "
                    "AR 15.0 us, RS/AG 10.8 us (tuning.cc). reduce busbw assumed = ring"),
        _nvlink_node(
            "a100-nvlink-8", "A100", ar_ring=230.0, ar_nvls=None, rs=230.0,
            sources="busbw: 232 (GTC24 S62129), 234.6 (ml-engineering), ~240 (nccl#1712). "
                    "alpha: NCCL model ring/LL AR 15.0 us, RS/AG 10.8 us, reduce 11.4 us"),
        _ib_cluster(
            "h100-ndr-ib", "H100 + 8x NDR 400 Gb/s", 330.0,
            sources="busbw: 380 peak DGX H100 (GTC24), plateau 340-360 (arXiv 2411.13055); "
                    "alpha: alpha-beta fit at 128 GPUs ~0.33-0.39 ms (AR), RS/AG/reduce ~half "
                    "(127 ring steps); tree 55 us from NCCL's model; scaled per NCCL's ring/tree latency "
                    "model (tuning.cc L384-436)"),
        _ib_cluster(
            "a100-hdr-ib", "A100 + 8x HDR 200 Gb/s", 180.0,
            sources="busbw: 192 DGX A100 8x200Gb IB (nccl#812, GTC24), 8 ch x 24 GB/s in "
                    "NCCL's model (search.cc L1052-1064); alpha as h100-ndr-ib (same ring step counts)"),
        _gloo_local(),
    )
}


def cost_preset(name: str) -> CostModel:
    try:
        return PRESETS[name]
    except KeyError:
        raise CostModelError(f"unknown cost preset {name!r}; choose one of {', '.join(PRESETS)} "
                             f"or pass a JSON file written by `evenzero calibrate --json`") from None


def default_cost_preset(world_size: int) -> str:
    """One NVLink node fits 8 ranks; beyond that the job spans InfiniBand."""
    return "h100-nvlink-8" if world_size <= 8 else "h100-ndr-ib"


def load_cost_model(name_or_path: str) -> CostModel:
    """A preset by name, or a cost model saved as JSON (by `evenzero calibrate --json`)."""
    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.suffix != ".json" and not path.exists():
        return cost_preset(name_or_path)
    # Strict reading: huge literals, NaN, non-UTF-8, deep nesting are one-line errors.
    data = read_json_file(path, CostModelError, "cost model")
    try:
        return CostModel.from_json(data)
    except CostModelError as e:
        raise CostModelError(f"{path}: {e}") from None


__all__ = ["PRESETS", "cost_preset", "default_cost_preset", "load_cost_model"]
