"""The full seed case on 8 ranks (slow: about two minutes on 2 cores)."""

from __future__ import annotations

import pytest

from evenzero.repro import ReproConfig, run
from evenzero.repro.report import loss_agreement, seed_rows

# The seed case as observed under DeepSpeed v0.12.3's per-destination reduces
# (deepspeed/runtime/zero/stage_1_and_2.py@v0.12.3, average_tensor): the 13 rows of the
# report, sorted by destination, and the 14th (the gate) that appears when the gate's
# gradient hook is intact.
REPORT_ROWS = [(0, 1002000, 252250), (0, 6006000, 4004000), (1, 1254250, 252250),
               (1, 2002000, 4004000), (2, 1506500, 252250), (3, 1000, 8000), (3, 1001000, 1000),
               (3, 1758750, 243250), (4, 9000, 252250), (5, 261250, 252250), (6, 513500, 252250),
               (7, 0, 1000), (7, 765750, 235250)]
GATE_ROW = (7, 10010000, 16000)


@pytest.mark.slow
def test_seed_case_on_eight_ranks():
    report = run(ReproConfig(world_size=8, steps=3, max_steps=3, warmup=1,
                             systems=("evenzero", "deepspeed-0.6-schedule", "ddp")))
    assert report["numel_per_rank"] == 10_026_000
    by_name = {s["name"]: s for s in report["systems"]}
    rows = sorted((dst, off, n) for dst, off, n, _ in seed_rows(by_name["deepspeed-0.6-schedule"]))
    assert rows == sorted(REPORT_ROWS + [GATE_ROW])
    ez = by_name["evenzero"]["backward_collectives"]
    assert all(c["op"] == "reduce_scatter" for c in ez)
    assert {c["group_size"] for c in ez} == {8, 2}
    ok, lines = loss_agreement(report["systems"])
    assert ok, lines
