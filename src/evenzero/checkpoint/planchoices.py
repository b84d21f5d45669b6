"""The plan choices a checkpoint carries: recorded by a save, handed back by a load.

With `bucket_numel="auto"` a `ZeroOptimizer` refines its bucket size once from timings
it measures, and takes the gradient-arrival order from its first backward, so two
starts of one job may plan different buckets. A resumed run that planned its own would
lay its buckets and shards out differently and sum the step check's chunked gradient
norm in another order: once gradients are clipped, its weights then differ in the last
bits from those of the run that was never interrupted. So a save records what the run
settled (`protocol.PlanChoices`, kept in the manifest), and a load at the same world
size and strategy hands it back before it reads the tensors: the resumed run executes
the saving run's plan and refines nothing. At another world size the choices were made
for another world, and the run makes its own.
"""

from __future__ import annotations

from evenzero.checkpoint.format import CheckpointError, Manifest
from evenzero.checkpoint.protocol import PlanChoices, ShardedOptimizer
from evenzero.checkpoint.state import RankPlace


def saved_choices(opt: ShardedOptimizer) -> PlanChoices:
    """What a save records: the optimizer's settled choices, as plain values."""
    choices = opt.plan_choices()
    numel, arrival = choices["bucket_numel"], choices["arrival"]
    return {"bucket_numel": None if numel is None else int(numel),
            "arrival": None if arrival is None else tuple(arrival)}


def choices_to_adopt(m: Manifest, opt: ShardedOptimizer, place: RankPlace,
                     where: str) -> PlanChoices | None:
    """The saved choices a load hands to `opt`, checked against its plan; None where the
    run keeps its own: saved at another world size or under another strategy, or
    nothing settled when saved. No collective; every rank reads the same manifest."""
    if m.world_size != place.world_size or m.strategy != opt.plan.strategy:
        return None
    if m.bucket_numel is None and m.arrival is None:
        return None
    if m.arrival is not None:
        trained = {s.name for b in opt.plan.layouts for s in b.params}
        unknown = [n for n in m.arrival if n not in trained]
        if unknown:
            raise CheckpointError(f"{where}: the saved arrival order names parameter(s) "
                                  f"{unknown[:5]} that this run does not train; the checkpoint "
                                  f"is damaged, load an older one")
    return {"bucket_numel": m.bucket_numel, "arrival": m.arrival}


__all__ = ["choices_to_adopt", "saved_choices"]
