"""Plan dataclasses: shard ranges, padding, lookups (no processes, no tensors)."""

import pytest

from evenzero.plan import Bucket, Collective, GroupInfo, Plan, Slot, align_up


def _plan():
    # Two layouts in group "g" of size 2: [a(3) b(4) pad(1)] and [c(6) pad(2)].
    l0 = Bucket("g", 0, 8, (Slot("a", 0, 3), Slot("b", 3, 4)))
    l1 = Bucket("g", 1, 8, (Slot("c", 0, 6),))
    rs = [Collective("backward", "reduce_scatter", "g", 2, None, b.index, 0, b.numel) for b in (l1, l0)]
    return Plan("test", 2, (GroupInfo("g", 2, 1, 13),), (l1, l0), (l1, l0), tuple(rs))


def test_shard_ranges_cover_every_element_once():
    p = _plan()
    r0, r1 = p.shard_ranges("g", 0), p.shard_ranges("g", 1)
    assert [(s.param, s.start, s.numel, s.layout, s.layout_offset, s.shard_offset) for s in r0] == [
        ("a", 0, 3, 0, 0, 0), ("b", 0, 1, 0, 3, 3), ("c", 0, 4, 1, 0, 4)]
    assert [(s.param, s.start, s.numel, s.shard_offset) for s in r1] == [
        ("b", 1, 3, 0), ("c", 4, 2, 4)]
    assert p.shard_numel("g") == 8
    assert p.padding() == 3


def test_lookups_and_errors():
    p = _plan()
    assert p.locate("c") == ("g", 1, 0)
    assert [b.index for b in p.group_layouts("g")] == [0, 1]
    assert len(p.backward()) == 2 and p.step() == ()
    with pytest.raises(ValueError, match="outside group 'g' of size 2"):
        p.shard_ranges("g", 2)
    with pytest.raises(KeyError, match="no group 'h'"):
        p.group("h")


def test_collective_equality_ignores_algorithm():
    a = Collective("backward", "reduce_scatter", "g", 2, None, 0, 0, 8, algorithm="native")
    b = Collective("backward", "reduce_scatter", "g", 2, None, 0, 0, 8, algorithm="all_to_all+sum")
    assert a == b and a.nbytes == 32 and a.pieces() == ((0, 8),)


def test_align_up():
    assert [align_up(x, 16) for x in (0, 1, 16, 17)] == [0, 16, 16, 32]
