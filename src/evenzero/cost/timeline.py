"""The timeline of one training step: compute and communication on two lanes per rank.

`evenzero.cost.predict` prices each collective as if nothing else ran. What a user
waits for is the step: forward, backward with the reductions hidden behind it as far as
the strategy's runtime lets them, the end-of-backward flush, the step's collectives and
the optimizer. `simulate` plays a plan's collectives against a `ComputeProfile`:

* compute lane: forward; backward in gradient-arrival order; copies of gradients into
  communication buffers; waits; the step's own work (`Plan.step_work`);
* comm lane: the plan's collectives one at a time, in launch order (NCCL runs a
  communicator's calls in issue order on its stream; gloo queues them per group). While
  a collective runs, compute slows by `DeviceCompute.comm_slowdown`, and while compute
  runs, the collective slows by `DeviceCompute.collective_slowdown` (on a host whose
  cores the ranks fill, the two share the cores rather than overlap).

The rules come from the plan (`Plan.execution`), never from the strategy's name:

* A bucket is complete when its last gradient has arrived (with
  `missing_grads_hold_bucket`, a parameter that never produces one holds it back until
  the flush). Its backward collectives are the consecutive calls that read it.
* Launch: when complete (`launch_in_order=False`) or once it and every bucket before it
  in plan order are complete (True: a complete bucket waits behind an incomplete one).
  With `max_in_flight` buckets outstanding, compute waits for the oldest first (the
  reducer's hook blocks; on a GPU the compute stream waits); 0 means every launch is
  waited for at once. `copies_grads` charges one copy of the bucket on the compute lane.
* End of backward: every bucket not launched yet is launched in plan order (the flush),
  then all are waited for.
* Step: per-parameter bookkeeping (the step's own visits, and a single-tensor
  optimizer's per-tensor loop), then the gradient norm (it feeds the step's
  all-reduces: norm, overflow, presence bits), which come before the optimizer, which
  needs them; then the master copies and the optimizer in its implementation. Each is
  `StepWork` amounts priced by `DeviceCompute` (bytes per element of the implementation
  at the copy bandwidth; seconds per parameter). The all-gathers carry the updated
  parameters, so they follow, and the step waits for them, unless
  `overlap_param_gather`: then each is waited for in the next forward just before its
  share of forward compute, the next one prefetched. A backend whose all-gather copies
  its output out of a temporary (`CostModel.all_gather_copies_output`, gloo) pays that
  copy on the comm lane after the exchange.

Every rank runs the same schedule, and expert groups run their calls at the same time
on disjoint ranks, so one rank's two lanes are the whole story. Pure Python, no torch.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from evenzero.cost.compute import ComputeProfile, DeviceCompute
from evenzero.cost.model import CostModel, CostModelError
from evenzero.plan import BACKWARD, Bucket, Collective, Execution, Plan, StepWork
from evenzero.wire import codec_traffic

COMPUTE = "compute"
COMM = "comm"
_EPS = 1e-15


@dataclass(frozen=True)
class Segment:
    """One interval on one lane."""

    lane: str
    """COMPUTE or COMM."""
    kind: str
    """forward, backward, copy, wait, bookkeeping, norm, optimizer, newton-schulz; or the
    collective's op on the comm lane."""
    start: float
    """Seconds since the step began."""
    end: float
    label: str = ""
    """Collective: op, group, bucket and size; compute: what ran."""
    phase: str = ""
    """Comm lane: the collective's plan phase (backward, step)."""


@dataclass(frozen=True)
class Timeline:
    """The predicted step of one plan on one cost model and compute profile."""

    strategy: str
    cost_model: str
    compute_source: str
    """Where the compute times came from (`ComputeProfile.source`)."""
    segments: tuple[Segment, ...]
    forward_end_s: float
    """When forward (and the gathers it waits for) ended."""
    backward_end_s: float
    """When backward compute and every backward reduction had finished."""
    total_s: float
    """The step: forward + backward + flush + step collectives + optimizer."""
    compute_s: float
    """Compute work alone (forward, backward, copies, the step's work), without waits."""
    comm_s: float
    """Time the comm lane was busy."""
    backward_comm_s: float
    """Comm lane time of the backward collectives."""

    @property
    def backward_s(self) -> float:
        """From backward start until its last reduction is done."""
        return self.backward_end_s - self.forward_end_s

    @property
    def step_phase_s(self) -> float:
        """After backward: step collectives and the optimizer."""
        return self.total_s - self.backward_end_s

    @property
    def exposed_comm_s(self) -> float:
        """What communication adds to the step: total minus compute alone."""
        return max(0.0, self.total_s - self.compute_s)

    @property
    def hidden_comm_s(self) -> float:
        """Communication that ran while compute ran."""
        return max(0.0, self.comm_s - self.exposed_comm_s)


class _Lanes:
    """A compute lane that runs work and waits, and a FIFO comm lane that runs beside it."""

    def __init__(self, cost: CostModel, device: DeviceCompute) -> None:
        self.cost, self.slowdown = cost, device.comm_slowdown
        self.comm_rate = 1.0 / (1.0 + device.collective_slowdown)
        self.device = device
        self.now = 0.0
        self.queue: deque[tuple[int, Collective]] = deque()
        self.current: list | None = None  # [id, remaining, start, collective]
        self.done: dict[int, float] = {}
        self.segments: list[Segment] = []
        self.work = 0.0
        self.ids = 0

    def launch(self, c: Collective) -> int:
        self.ids += 1
        self.queue.append((self.ids, c))
        self._start_next()
        return self.ids

    def _start_next(self) -> None:
        while self.current is None and self.queue:
            cid, c = self.queue.popleft()
            self.current = [cid, self.comm_seconds(c), self.now, c]
            if self.current[1] <= _EPS:
                self._finish()

    def comm_seconds(self, c: Collective) -> float:
        """The call as the cost model prices it, plus a gather's copy out of its
        temporary where the backend makes one."""
        seconds = self.cost.time(c.op, c.group_size, c.nbytes)
        if c.op == "all_gather" and self.cost.all_gather_copies_output and c.group_size > 1:
            seconds += self.device.copy_seconds(c.nbytes)
        return seconds

    def _finish(self) -> None:
        cid, _, start, c = self.current
        self.current = None
        self.done[cid] = self.now
        self.segments.append(Segment(COMM, c.op, start, self.now, _label(c), c.phase))
        self._start_next()

    def compute(self, seconds: float, kind: str, label: str = "") -> None:
        """Run `seconds` of compute work; slower while a collective is in progress, which
        is itself slower beside it. A collective's remaining time is in seconds alone."""
        if seconds <= 0:
            return
        start, left = self.now, seconds
        self.work += seconds
        rate = 1.0 / (1.0 + self.slowdown)
        while left > _EPS:
            if self.current is None:
                self.now += left
                break
            dt = min(self.current[1] / self.comm_rate, left / rate)
            self.now += dt
            left -= dt * rate
            self.current[1] -= dt * self.comm_rate
            if self.current[1] <= _EPS:
                self._finish()
        self.segments.append(Segment(COMPUTE, kind, start, self.now, label))

    def wait(self, ids: list[int], label: str = "") -> None:
        """Block compute until every collective in `ids` has finished. The lane runs its
        calls in launch order, so that is when the last launched of them finishes."""
        start = self.now
        last = max(ids, default=0)
        while last and last not in self.done:
            self.now += self.current[1]
            self.current[1] = 0.0
            self._finish()
        if self.now > start:
            self.segments.append(Segment(COMPUTE, "wait", start, self.now, label))


def _label(c: Collective) -> str:
    where = c.group if c.bucket is None else f"{c.group}[{c.bucket}]"
    return f"{c.op} {where} {c.numel:,} x{c.wire}B on {c.group_size}"


@dataclass
class _Unit:
    """The backward collectives that read one bucket, consecutive in plan order."""

    bucket: Bucket | None
    calls: list[Collective]
    ready: float  # arrival index after which it is complete; inf: only at the flush
    ids: list[int]

    @property
    def bucket_bytes(self) -> int:
        """Bytes of the gradients its calls read, as the bucket holds them."""
        return sum(c.numel * c.itemsize for c in self.calls)

    def codec(self, error_feedback: bool) -> tuple[int, int]:
        """Memory traffic of compressing its calls' messages and of decoding them."""
        enc = dec = 0
        for c in self.calls:
            e, d = codec_traffic(c.compression, c.numel, c.itemsize, c.group_size,
                                 error_feedback)
            enc, dec = enc + e, dec + d
        return enc, dec


def _units(plan: Plan, position: dict[str, int], execution: Execution) -> list[_Unit]:
    by_key = {(b.group, b.index): b for b in plan.buckets}
    # A bucket that spans param groups (DeepSpeed's IPG buffer) carries a label no group
    # has; its calls name their own group, so it is found by index.
    groups = {g.name for g in plan.groups}
    shared = {b.index: b for b in plan.buckets if b.group not in groups}
    units: list[_Unit] = []
    for c in plan.backward():
        bucket = by_key.get((c.group, c.bucket)) or shared.get(c.bucket)
        if units and bucket is not None and units[-1].bucket is bucket:
            units[-1].calls.append(c)
            continue
        units.append(_Unit(bucket, [c], _ready(bucket, position, execution), []))
    return units


def _ready(bucket: Bucket | None, position: dict[str, int], execution: Execution) -> float:
    if bucket is None:
        return float("inf")
    arrived = [position[s.name] for s in bucket.params if s.name in position]
    if execution.missing_grads_hold_bucket and len(arrived) < len(bucket.params):
        return float("inf")
    return max(arrived, default=-1)


def optimizer_elements(plan: Plan) -> int:
    """Master elements one rank's optimizer updates: its shards, or everything (DDP)."""
    if plan.sharded:
        return sum(plan.shard_numel(g.name) for g in plan.groups)
    return sum(g.numel for g in plan.groups)


def step_work_of(plan: Plan) -> StepWork:
    """The plan's step work; for a plan whose planner gave none, the optimizer over the
    rank's elements in torch's default implementation and nothing else."""
    return plan.step_work or StepWork(optimizer_elements(plan))


def device_for(cost: CostModel) -> DeviceCompute:
    if cost.compute is None:
        raise CostModelError(f"cost model {cost.name} has no compute figures, which the timeline "
                             f"needs; use a preset, or re-run `evenzero calibrate` (it measures them)")
    return cost.compute


def simulate(plan: Plan, cost: CostModel, profile: ComputeProfile,
             execution: Execution | None = None, device: DeviceCompute | None = None) -> Timeline:
    """Play one step of `plan`. `execution` overrides `plan.execution` (e.g. the runtime's
    `max_buckets_in_flight`); `device` overrides `cost.compute`."""
    ex = execution or plan.execution
    dev = device or device_for(cost)
    lanes = _Lanes(cost, dev)
    gathers = [c for c in plan.step() if c.op == "all_gather"]
    before_optimizer = [c for c in plan.step() if c.op != "all_gather"]

    # Forward, with last step's all-gathers when they belong to it.
    if ex.overlap_param_gather and gathers:
        total = sum(c.numel for c in gathers) or 1
        ids = [lanes.launch(gathers[0])]
        for i, c in enumerate(gathers):
            if i + 1 < len(gathers):
                ids.append(lanes.launch(gathers[i + 1]))
            lanes.wait([ids[i]], f"forward needs {_label(c)}")
            lanes.compute(profile.forward_s * c.numel / total, "forward")
        gathers = []
    else:
        lanes.compute(profile.forward_s, "forward")
    forward_end = lanes.now

    # Backward: compute in arrival order, buckets launched per the plan's rules.
    position = {name: i for i, (name, _) in enumerate(profile.backward)}
    units = _units(plan, position, ex)
    launched = [False] * len(units)
    inflight: deque[_Unit] = deque()
    by_ready: dict[float, list[int]] = {}
    for i, u in enumerate(units):
        by_ready.setdefault(u.ready, []).append(i)
    cursor = 0

    def decode(u: _Unit) -> None:
        lanes.compute(dev.moved_seconds(u.codec(ex.error_feedback)[1]), "decode",
                      "compressed pieces summed in fp32")

    def launch(i: int) -> None:
        u = units[i]
        limit = ex.max_in_flight
        while limit and len(inflight) >= limit:
            oldest = inflight.popleft()
            lanes.wait(oldest.ids, f"bucket limit {limit}")
            decode(oldest)
        if ex.copies_grads:
            lanes.compute(dev.copy_seconds(u.bucket_bytes), "copy", "gradients into bucket")
        lanes.compute(dev.moved_seconds(u.codec(ex.error_feedback)[0]), "encode",
                      "gradients compressed")
        u.ids = [lanes.launch(c) for c in u.calls]
        launched[i] = True
        if limit == 0:
            lanes.wait(u.ids, "reduction blocks compute")
            decode(u)
        else:
            inflight.append(u)

    def launch_ready(step: float) -> None:
        nonlocal cursor
        if ex.launch_in_order:
            while cursor < len(units) and units[cursor].ready <= step:
                launch(cursor)
                cursor += 1
        else:
            for i in by_ready.get(step, ()):
                launch(i)

    launch_ready(-1)
    for i, (name, seconds) in enumerate(profile.backward):
        lanes.compute(seconds, "backward", name)
        launch_ready(i)
    lanes.compute(profile.tail_s, "backward", "after the last gradient")
    for i in range(len(units)):  # the end-of-backward flush
        if not launched[i]:
            launch(i)
    lanes.wait([x for u in units for x in u.ids], "end of backward")
    for u in inflight:
        decode(u)
    backward_end = lanes.now

    # Step: bookkeeping and the norm, what the optimizer needs, the master copies and the
    # optimizer, then the parameter all-gathers.
    work = step_work_of(plan)
    lanes.compute(dev.bookkeeping_seconds(work.params, work.optimizer_tensors,
                                          work.optimizer_impl), "bookkeeping",
                  f"{work.params:,} parameters, {work.optimizer_tensors:,} optimizer tensors")
    lanes.compute(dev.norm_seconds(work.norm_elements, work.norm), "norm",
                  f"{work.norm} norm of {work.norm_elements:,} elements")
    for c in before_optimizer:
        lanes.wait([lanes.launch(c)], "step needs it")
    lanes.compute(dev.moved_seconds(work.copy_bytes), "copy", "parameters and masters")
    impl = work.optimizer_impl or dev.default_optimizer_impl
    if work.host_step:
        # offload_optimizer: the gradients' copies to the host ran beside the backward;
        # what the backward did not hide is waited for, then the host step and the
        # parameters' copies (charged in full: their overlap with the step is not modelled).
        hidden = sum(seconds for _, seconds in profile.backward) + profile.tail_s
        lanes.compute(max(0.0, dev.host_link_seconds(work.host_link_backward_bytes) - hidden),
                      "host link", f"{work.host_link_backward_bytes:,} gradient bytes to the host")
        lanes.compute(dev.host_step_seconds(work.optimizer_elements, work.optimizer_impl,
                                            work.optimizer_tensor_numels),
                      "optimizer", f"host {impl} on {work.optimizer_elements:,} elements")
        lanes.compute(dev.host_link_seconds(work.host_link_bytes), "host link",
                      f"{work.host_link_bytes:,} parameter bytes across the host link")
    else:
        lanes.compute(dev.optimizer_seconds(work.optimizer_elements, work.optimizer_impl,
                                            work.optimizer_tensor_numels),
                      "optimizer", f"{impl} on {work.optimizer_elements:,} elements in "
                                   f"{work.optimizer_tensors:,} tensors")
    if work.matrix_flops:
        lanes.compute(dev.seconds(work.matrix_flops, 0.0), "newton-schulz",
                      f"{work.matrix_flops / 1e9:,.2f} GFLOP of whole-matrix updates")
    if gathers:
        lanes.wait([lanes.launch(c) for c in gathers], "parameters gathered")

    comm = [s for s in lanes.segments if s.lane == COMM]
    return Timeline(plan.strategy, cost.name, profile.source, tuple(lanes.segments),
                    forward_end, backward_end, lanes.now, lanes.work,
                    sum(s.end - s.start for s in comm),
                    sum(s.end - s.start for s in comm if s.phase == BACKWARD))


__all__ = ["COMM", "COMPUTE", "Segment", "Timeline", "device_for", "optimizer_elements",
           "simulate", "step_work_of"]
