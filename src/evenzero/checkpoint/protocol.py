"""What `evenzero.checkpoint` needs from an optimizer: a small, documented Protocol.

The checkpoint package and the runtime do not import each other. `ZeroOptimizer`
satisfies `ShardedOptimizer` structurally (as torchtitan's components satisfy its
`Stateful` protocol), and exchanges plain dicts shaped like `GroupShard`; anything
else that offers the same members can be checkpointed the same way (the offline
DeepSpeed converter's `evenzero.checkpoint.deepspeed.offline.OfflineRun` does). Every
checkpoint entry point takes a `ShardedOptimizer` and uses only what is named here.

What a checkpoint reads, per plan group, on each rank (`shard_state`):

* `flats`: this rank's flat shard of the fp32 master weights (key "master") and of
  every elementwise optimizer-state tensor (`exp_avg`, ...), each laid out as
  `plan.shard_ranges(group, group_rank(group))` describes;
* `param_scalars`: per parameter with elements in this shard, its scalar optimizer
  state (`step`, NAdam's `mu_product`, ...; {} if it was never stepped). Parameters
  keep their own `step`, as in torch.optim, because a step where a parameter had no
  gradient leaves it alone;
* `hyperparameters`: the torch param group's options (lr, betas, ...; no "params");
* `stepped`: the parameters with elements in this shard that were stepped at least once.
  An optimizer without scalar state (SGD with momentum) has `{}` in `param_scalars` for
  them as for parameters never stepped, yet its next step differs (torch starts the
  momentum from the gradient only the first time).

What a load writes back (`load_shard_state`): the same per group, resharded to this
rank's ranges, plus the step counter and the loss scaler's state; the optimizer then
re-gathers the model's parameters from the masters.

Beyond the shards: the model (`module`: buffers and frozen parameters are saved whole),
the options the optimizer class defines (`defaults`, checked present in a checkpoint),
where the ranks agree (`world_group`, `control_device`), the loss scaler
(`loss_scaler`, read when a DeepSpeed loss scale is carried over), and what the run
settled about its plan while it ran (`plan_choices`: the bucket size an "auto" one was
refined to, the measured arrival order), which a load at the same world size hands back
(`adopt_plan_choices`) so that the resumed run executes the plan the saving run did.

An optimizer that compresses gradients with error feedback also offers
`ErrorFeedbackState`: each rank's residual per parameter, saved beside the shards and
resharded by `evenzero.checkpoint.residuals`.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol, TypedDict, runtime_checkable

import torch

from evenzero.plan import Plan


class GroupShard(TypedDict):
    """One plan group's state on one rank."""

    flats: Mapping[str, torch.Tensor]
    """"master" and each elementwise state tensor, shard-shaped, fp32."""
    param_scalars: Mapping[str, Mapping[str, Any]]
    """Parameter name -> its scalar optimizer state ({}: never stepped)."""
    hyperparameters: Mapping[str, Any]
    """The torch param group's options, without "params"."""
    stepped: Collection[str]
    """Parameters (with elements in this shard) stepped at least once."""


class PlanChoices(TypedDict):
    """What a run settled about its plan at run time. A run resumed at the same world
    size takes it over and so lays out its buckets and shards as the saving run did:
    the step check's chunked norm then sums in the same order, bit for bit."""

    bucket_numel: int | None
    """The bucket size (elements) the run keeps: fixed, refined at run time or loaded.
    None while an "auto" size is still to be refined, or where the strategy cuts no
    buckets."""
    arrival: Sequence[str] | None
    """The gradient-arrival order the plan is made for, once measured (or loaded); None
    while it is the assumed one."""


class ScaleSchedule(Protocol):
    """How a dynamic loss scale moves (evenzero's `LossScaleConfig`)."""

    growth_interval: int
    """Good steps in a row before the scale grows."""
    growth_factor: float
    backoff_factor: float
    min_scale: float


class LossScaling(Protocol):
    """evenzero's loss scaler (`evenzero.runtime.precision.LossScaler`), as far as a
    DeepSpeed loss scale is mapped onto it."""

    enabled: bool
    """False: the loss is not scaled (bf16 / fp32 runs)."""
    dynamic: bool
    scale: float
    config: ScaleSchedule

    def state_dict(self) -> dict[str, Any]:
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...


@runtime_checkable
class DeepSpeedScaling(Protocol):
    """A loss scaler that follows DeepSpeed's own update rule (the one the
    `evenzero.deepspeed` engine installs): it takes a saved DeepSpeed scaler's fields as
    they are, hysteresis included, instead of evenzero's mapping."""

    enabled: bool

    def state_from_deepspeed(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        """This scaler's state dict continuing DeepSpeed's saved scaler `saved`."""
        ...

    def state_dict(self) -> dict[str, Any]:
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        ...


@runtime_checkable
class ShardedOptimizer(Protocol):
    """An optimizer whose master weights and state are sharded over data-parallel ranks."""

    plan: Plan
    """The executed plan: groups, layouts and which rank owns which runs."""
    world_group: Any
    """The data-parallel world process group (None: no process group, one rank)."""
    step_count: int
    """Steps taken (skipped fp16 overflow steps excluded)."""
    defaults: Mapping[str, Any]
    """The optimizer class's options with this run's defaults (torch's
    `Optimizer.defaults`); a checkpoint must hold every one of these keys per group."""
    loss_scaler: LossScaling | DeepSpeedScaling | None
    """The loss scaler (None: none at all, as a disabled one)."""

    @property
    def control_device(self) -> torch.device:
        """Where the small tensors of agreement collectives over `world_group` live (the
        CUDA device under NCCL, else the CPU)."""
        ...

    @property
    def module(self) -> torch.nn.Module:
        """The model, with every parameter holding its current value."""
        ...

    @property
    def inner_optimizer_class(self) -> type[torch.optim.Optimizer]:
        """The torch optimizer class that steps the shards (its `defaults` name the options)."""
        ...

    def process_group(self, group: str) -> Any:
        """The process group plan group `group` is reduced and gathered over."""
        ...

    def group_rank(self, group: str) -> int:
        """This rank's rank inside `process_group(group)`."""
        ...

    def shard_state(self, group: str) -> GroupShard:
        """This rank's state of plan group `group` (tensors are not copies)."""
        ...

    def loss_scaler_state(self) -> dict[str, Any] | None:
        """The loss scaler's state dict, or None without loss scaling."""
        ...

    def check_loss_scaler_state(self, state: Mapping[str, Any]) -> None:
        """Raise ValueError if `state` could not be loaded; changes nothing."""
        ...

    def load_shard_state(self, shards: Mapping[str, GroupShard], step_count: int | None,
                         loss_scaler: Mapping[str, Any] | None) -> None:
        """Replace every group's state (all groups at once), the step counter (None:
        keep) and the loss scaler (None: keep); then re-gather the parameters."""
        ...

    def plan_choices(self) -> PlanChoices:
        """What this run settled about its plan so far (the same on every rank)."""
        ...

    def adopt_plan_choices(self, choices: PlanChoices) -> None:
        """Take over a saved run's choices: its arrival order counts as measured; an
        "auto" bucket size becomes its `bucket_numel` and is no longer refined, a fixed
        one is kept; None leaves that choice to this run. Re-plans (moving the shards)
        where the executed plan changes: a collective, every rank passes the same."""
        ...


@runtime_checkable
class ErrorFeedbackState(Protocol):
    """An optimizer that keeps per-rank error-feedback residuals (`ZeroOptimizer` with
    `grad_compression_error_feedback=True`; checked with isinstance, so an optimizer
    without them is checkpointed as before)."""

    @property
    def keeps_error_feedback(self) -> bool:
        """Whether this optimizer keeps residuals now."""
        ...

    def error_feedback_state(self) -> Mapping[str, torch.Tensor]:
        """This rank's residual per parameter: CPU fp32 copies, flat, in units of the
        unscaled gradient; empty when it keeps none."""
        ...

    def load_error_feedback_state(self, residuals: Mapping[str, torch.Tensor]) -> None:
        """Replace this rank's residuals (parameters not named: zero); ignored when it
        keeps none."""
        ...
