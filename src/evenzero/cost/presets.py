"""Cost-model presets, each number with its source (shared/reference/nccl-costs.md).

`busbw` is nccl-tests' bus bandwidth in GB/s (1e9 bytes); alpha in microseconds.

* Single-node NVLink presets hold at 8 ranks (`reference_ranks=8`); ring alphas shrink
  for smaller groups following the per-step rule of nccl-costs §5.3. They describe one
  node: for more than 8 ranks use an InfiniBand preset.
* Multi-node presets assume 8 GPUs and 8 NICs per node, rail-optimised InfiniBand, with
  alpha given at 128 ranks (16 nodes) and scaled to other group sizes by §5.3 (ring:
  linear in hops, network hops dearer; tree: log2 of nodes). These alphas are *effective*
  for 1-100 MB messages (they fold in ring pipeline fill), §9.
* All-reduce has tree variants (small messages, and large ones at scale); reduce has a
  low-latency protocol variant. Reduce-scatter, all-gather and reduce have no tree in NCCL
  (§2), so their alpha grows linearly with the group: ~1.6 ms per call at 1024 ranks. The model charges whichever applicable variant is cheapest (NCCL's tuner does
  the same, §2); variants with `max_bytes` apply only up to that size.
* RoCE is not offered: the reference has one user report of its bus bandwidth (§3,
  nccl#1368) and no latency, which is not enough for a preset. Calibrate instead.
"""

from __future__ import annotations

from pathlib import Path

from evenzero.cost import CostModel, CostModelError, OpCost, Sample, Variant, fit_op
from evenzero.userjson import read_json_file

SMALL = 64 * 1024
"""Messages up to 64 KiB use NCCL's low-latency paths (tree all-reduce, LL reduce), §0."""


def _nvlink_node(name: str, gpu: str, ar_ring: float, ar_nvls: float | None, rs: float,
                 sources: str) -> CostModel:
    ring = "ring"
    all_reduce = [Variant("ring", 15.0, ar_ring, scaling=ring)]
    if ar_nvls is not None:
        # NVLS (NVLink SHARP) latency 25 us: NCCL's model constant (tuning.cc, §2).
        all_reduce.append(Variant("nvls", 25.0, ar_nvls))
    return CostModel(
        name=name, description=f"8x {gpu} in one NVLink/NVSwitch node",
        all_reduce=OpCost(tuple(all_reduce)),
        reduce_scatter=OpCost((Variant("ring", 11.0, rs, scaling=ring),)),
        all_gather=OpCost((Variant("ring", 11.0, rs, scaling=ring),)),
        reduce=OpCost((Variant("ring", 11.0, rs, scaling=ring),)),
        reference_ranks=8, gpus_per_node=8, sources=sources)


def _ib_cluster(name: str, gpu: str, busbw: float, sources: str) -> CostModel:
    return CostModel(
        name=name, description=f"{gpu} nodes, 8 GPUs + 8 NICs each, rail-optimised InfiniBand",
        # The scans of §5.2 put all-reduce at alpha ~0.33-0.39 ms on 128 GPUs and only
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
        reference_ranks=128, gpus_per_node=8, sources=sources)


# The project's own gloo anchors (nccl-costs §6): 8 local ranks, one host, fp32 assumed
# (the dtype was not recorded). Fitting the two sizes per op with the same least-squares
# fit that `evenzero calibrate` uses keeps the preset reproducible from its data.
_GLOO_ANCHORS = {
    # op: ((elements, ms per call), ...); reduce = 8 calls / 8
    "reduce_scatter": ((2**16, 2.0), (2**20, 8.8)),
    "all_reduce": ((2**16, 1.8), (2**20, 6.5)),
    "reduce": ((2**16, 10.6 / 8), (2**20, 19.9 / 8)),
}


def _gloo_local() -> CostModel:
    fitted = {op: fit_op([Sample(op, 8, n * 4, ms * 1e-3) for n, ms in pts], "gloo")
              for op, pts in _GLOO_ANCHORS.items()}
    return CostModel(
        name="gloo-local", description="gloo over TCP loopback, 8 processes on one 16-core host",
        all_reduce=OpCost((fitted["all_reduce"],)),
        reduce_scatter=OpCost((fitted["reduce_scatter"],)),
        # Not measured: gloo's all-gather assumed to cost like its reduce-scatter.
        all_gather=OpCost((fitted["reduce_scatter"],)),
        reduce=OpCost((fitted["reduce"],)),
        reference_ranks=8, gpus_per_node=8,
        sources="project anchors (nccl-costs §6), two-point fit per op; alpha flat in n "
                "(no data on how it scales); run `evenzero calibrate` for your host")


PRESETS: dict[str, CostModel] = {
    m.name: m for m in (
        _nvlink_node(
            "h100-nvlink-8", "H100/H200", ar_ring=365.0, ar_nvls=470.0, rs=360.0,
            sources="busbw: 8xH200 nccl-tests RS 362.9, AG 361.4, AR ring 367, NVLS 473-482 "
                    "(ml-engineering); ring 370 (nccl-tests#212). alpha: NCCL model ring/LL "
                    "AR 15.0 us, RS/AG 10.8 us (tuning.cc). reduce busbw assumed = ring"),
        _nvlink_node(
            "a100-nvlink-8", "A100", ar_ring=230.0, ar_nvls=None, rs=230.0,
            sources="busbw: 232 (GTC24 S62129), 234.6 (ml-engineering), ~240 (nccl#1712). "
                    "alpha: NCCL model ring/LL AR 15.0 us, RS/AG 10.8 us, reduce 11.4 us"),
        _ib_cluster(
            "h100-ndr-ib", "H100 + 8x NDR 400 Gb/s", 330.0,
            sources="busbw: 380 peak DGX H100 (GTC24), plateau 340-360 (arXiv 2411.13055); "
                    "alpha: alpha-beta fit at 128 GPUs ~0.33-0.39 ms (AR), RS/AG/reduce ~half "
                    "(127 ring steps); tree 55 us from NCCL's model; scaled per §5.3"),
        _ib_cluster(
            "a100-hdr-ib", "A100 + 8x HDR 200 Gb/s", 180.0,
            sources="busbw: 192 DGX A100 8x200Gb IB (nccl#812, GTC24), 8 ch x 24 GB/s in "
                    "NCCL's model; alpha as h100-ndr-ib (same ring step counts); scaled per §5.3"),
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
