"""`MemoryReport` prints with units and keeps its raw byte counts."""

from __future__ import annotations

from evenzero.runtime.memory import MemoryReport


def test_memory_report_prints_units_and_keeps_bytes():
    report = MemoryReport(gradient_shards=1024, gradient_buffers=3 * 2**20, pending_grads=0,
                          master_weights=5 * 2**30, optimizer_state=123, parameters=17)
    assert report.gradient_buffers == 3 * 2**20 and report.gradients == 1024 + 3 * 2**20
    text = str(report)
    assert text == repr(report)
    for part in ("gradient_shards=1.0 KiB", "gradient_buffers=3.0 MiB", "pending_grads=0 B",
                 "master_weights=5.0 GiB", "optimizer_state=123 B", "bucket_pool=0 B",
                 "gradients in all 3.0 MiB"):
        assert part in text, text
