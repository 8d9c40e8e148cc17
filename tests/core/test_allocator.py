"""Tests of SlotAllocator: placement preferences, atomic errors, resizing, and a stateful model
check against a plain set of free slots."""

from __future__ import annotations

import random
from itertools import pairwise

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tiered_cache.core.allocator import SlotAllocator
from tiered_cache.errors import CapacityError


def check_invariants(a: SlotAllocator, free: set[int] | None = None,
                     retired: set[int] = frozenset()) -> None:
    """Internal consistency; with `free`, also agreement with a reference set of free slots
    (and `retired`: free slots above a shrink's limit, which no run holds)."""
    n = a.num_slots
    runs = a.runs()
    covered: set[int] = set()
    for start, length in runs:
        assert length > 0 and 0 <= start and start + length <= n
        covered.update(range(start, start + length))
    # Runs are maximal: no two touch (sorted, so only neighbours can).
    for (s1, l1), (s2, _) in pairwise(runs):
        assert s1 + l1 < s2, f"runs {s1}+{l1} and {s2} should have been merged"
    assert sum(length for _, length in runs) == len(covered) == a.num_free
    assert all(s < a.capacity for s in covered)
    assert a.num_used == n - a.num_free - a._retired
    assert len(a._free) == n
    for s in range(n):
        assert a.is_free(s) == (s in covered or s >= a.capacity and bool(a._free[s]))
    assert {a._run_at_end[s + length]: length for s, length in runs} == dict(runs)
    assert len(a._run_at_end) == len(runs)
    # Bins agree with runs: each run is in exactly the bin of its length; the mask marks the
    # non-empty bins.
    binned = {}
    for k, bin_k in enumerate(a._bins):
        assert bool(a._bin_mask >> k & 1) == bool(bin_k)
        for start in bin_k:
            assert start not in binned
            binned[start] = k
    assert a._bin_mask >> len(a._bins) == 0
    assert binned == {s: length.bit_length() - 1 for s, length in runs}
    if free is not None:
        assert covered == free
        assert {s for s in range(a.capacity, n) if a._free[s]} == retired
        used = set(range(n)) - free - retired
        assert a.highest_used() == (max(used) if used else None)
        assert a.lowest_free() == (min(free) if free else None)


# -- placement ------------------------------------------------------------------------------


def test_fresh_allocator_is_contiguous() -> None:
    a = SlotAllocator(16)
    assert (a.num_slots, a.num_free, a.num_used) == (16, 16, 0)
    assert a.allocate(5) == [0, 1, 2, 3, 4]
    assert a.allocate(3) == [5, 6, 7]
    assert a.runs() == [(8, 8)]
    assert a.allocate(0) == []
    check_invariants(a)


def test_hint_extends_a_run() -> None:
    a = SlotAllocator(32)
    seq = a.allocate(4)  # 0..3
    other = a.allocate(4)  # 4..7
    a.allocate(10)  # 8..17
    a.free(other)
    assert a.runs() == [(4, 4), (18, 14)]
    # The run at the hint wins over the best fit (4, 4).
    assert a.allocate(3, hint=18) == [18, 19, 20]
    # A sequence grows contiguously by hinting last_slot + 1.
    assert a.allocate(2, hint=seq[-1] + 1) == [4, 5]
    assert a.allocate(1, hint=21) == [21]
    assert a.runs() == [(6, 2), (22, 10)]
    check_invariants(a)


def test_hint_run_too_short_takes_it_then_the_rest() -> None:
    a = SlotAllocator(16)
    a.allocate(16)
    a.free([2, 3, 10, 11, 12, 13])
    assert a.allocate(3, hint=2) == [2, 3, 10]
    assert a.runs() == [(11, 3)]
    check_invariants(a)


def test_hint_that_is_not_a_free_run_start_is_ignored() -> None:
    a = SlotAllocator(8)
    a.allocate(2)
    assert a.allocate(2, hint=0) == [2, 3]  # 0 is used
    assert a.allocate(1, hint=6) == [4]  # 6 is free but mid-run
    assert a.allocate(1, hint=99) == [5]  # out of range
    check_invariants(a)


def test_best_fit_keeps_big_runs_intact() -> None:
    a = SlotAllocator(64)
    a.allocate(64)
    a.free(range(0, 20))  # big run first, so first-fit would split it
    a.free(range(30, 33))  # 3
    a.free(range(40, 45))  # 5
    assert a.allocate(3) == [30, 31, 32]  # exact fit
    assert a.allocate(4) == [40, 41, 42, 43]  # the 5-run, not the 20-run
    assert a.runs() == [(0, 20), (44, 1)]
    assert a.allocate(2) == [0, 1]  # only the big run holds 2
    check_invariants(a)


def test_best_fit_prefers_the_smaller_run_within_a_bin() -> None:
    a = SlotAllocator(64)
    a.allocate(64)
    a.free(range(0, 7))  # 7, bin 2
    a.free(range(10, 15))  # 5, bin 2
    assert a.allocate(5) == [10, 11, 12, 13, 14]
    check_invariants(a)


def test_gather_across_runs_when_fragmented() -> None:
    a = SlotAllocator(32)
    a.allocate(32)
    a.free([1, 2])  # 2
    a.free(range(5, 10))  # 5
    a.free([12])  # 1
    a.free(range(20, 23))  # 3
    got = a.allocate(9)
    # Largest runs first, each piece ascending from its low end.
    assert got[:5] == [5, 6, 7, 8, 9]
    assert got[5:8] == [20, 21, 22]
    assert got[8:] in ([1], [12])
    assert len(set(got)) == 9
    assert a.num_free == 2
    check_invariants(a)


def test_free_coalesces_in_any_order() -> None:
    rng = random.Random(7)
    a = SlotAllocator(100)
    slots = a.allocate(100)
    assert a.runs() == []
    rng.shuffle(slots)
    for i in range(0, 100, 7):
        a.free(slots[i : i + 7])
        check_invariants(a)
    assert a.runs() == [(0, 100)]
    assert a.num_free == 100


def test_allocate_at() -> None:
    a = SlotAllocator(10)
    a.allocate_at(4)
    assert a.runs() == [(0, 4), (5, 5)]
    a.allocate_at(0)
    a.allocate_at(9)
    assert a.runs() == [(1, 3), (5, 4)]
    assert not a.is_free(4) and a.is_free(5)
    check_invariants(a)
    with pytest.raises(ValueError, match="slot 4"):
        a.allocate_at(4)
    with pytest.raises(ValueError, match="slot 10"):
        a.allocate_at(10)
    assert a.runs() == [(1, 3), (5, 4)]


# -- errors leave state unchanged --------------------------------------------------------------


def snapshot(a: SlotAllocator) -> tuple:
    return (a.runs(), a.num_free, a.num_slots, bytes(a._free))


def test_over_allocate_raises_and_changes_nothing() -> None:
    a = SlotAllocator(8)
    a.allocate(5)
    before = snapshot(a)
    with pytest.raises(CapacityError, match=r"asked for 4 .* 3 of 8"):
        a.allocate(4)
    with pytest.raises(CapacityError):
        a.allocate(4, hint=5)
    assert snapshot(a) == before
    assert a.can_allocate(3) and not a.can_allocate(4)
    with pytest.raises(ValueError):
        a.allocate(-1)
    with pytest.raises(ValueError):
        SlotAllocator(-1)
    assert snapshot(a) == before


@pytest.mark.parametrize(
    ("batch", "message"),
    [
        ([0, 1, 6], "slot 6 is already free"),  # double free, after valid slots
        ([0, 8], "slot 8 is out of range"),
        ([0, -1], "slot -1 is out of range"),
        ([2, 3, 2], "slot 2 appears more than once"),
    ],
)
def test_bad_free_raises_and_changes_nothing(batch: list[int], message: str) -> None:
    a = SlotAllocator(8)
    a.allocate(5)
    before = snapshot(a)
    with pytest.raises(ValueError, match=message):
        a.free(batch)
    assert snapshot(a) == before
    check_invariants(a)


def test_is_free_out_of_range() -> None:
    a = SlotAllocator(4)
    with pytest.raises(ValueError, match="slot 4"):
        a.is_free(4)
    with pytest.raises(ValueError, match="slot -1"):
        a.is_free(-1)


# -- resizing and statistics ---------------------------------------------------------------------


def test_grow_coalesces_with_trailing_run() -> None:
    a = SlotAllocator(0)
    assert a.runs() == [] and a.allocate(0) == []
    a.grow(4)
    assert a.allocate(2) == [0, 1]
    a.grow(6)
    assert a.runs() == [(2, 8)]
    a.allocate(8)
    a.grow(3)
    assert a.runs() == [(10, 3)]
    assert a.num_slots == 13
    check_invariants(a)


def test_shrink() -> None:
    a = SlotAllocator(16)
    a.allocate(4)
    a.shrink(10)
    assert (a.num_slots, a.runs()) == (6, [(4, 2)])
    a.shrink(2)
    assert (a.num_slots, a.runs()) == (4, [])
    check_invariants(a)
    a.shrink(0)
    with pytest.raises(ValueError, match="slot 3 is in use"):
        a.shrink(1)
    with pytest.raises(ValueError):
        a.shrink(5)
    assert a.num_slots == 4


def test_shrink_over_used_slot_raises_and_changes_nothing() -> None:
    a = SlotAllocator(16)
    a.allocate(16)
    a.free([10, 11, 13, 14, 15])
    before = snapshot(a)
    with pytest.raises(ValueError, match="slot 12 is in use"):
        a.shrink(6)
    assert snapshot(a) == before
    a.shrink(3)
    assert a.runs() == [(10, 2)]
    check_invariants(a)


def test_fragmentation_and_extremes() -> None:
    a = SlotAllocator(20)
    assert a.fragmentation() == 0.0
    assert a.lowest_free() == 0 and a.highest_used() is None
    a.allocate(10)  # 0..9
    assert a.fragmentation() == 0.0
    assert a.highest_used() == 9
    a.free([2, 3, 5])  # 7 used, 3 holes below slot 9
    assert a.lowest_free() == 2
    assert a.fragmentation() == pytest.approx(3 / 7)
    a.free([9])  # highest used drops to 8: holes 2, 3, 5 over 6 used
    assert a.highest_used() == 8
    assert a.fragmentation() == pytest.approx(3 / 6)
    a.allocate(a.num_free)
    assert a.highest_used() == 19 and a.lowest_free() is None
    assert a.fragmentation() == 0.0
    a.free(range(20))
    assert a.fragmentation() == 0.0 and a.highest_used() is None


# -- stateful model check ------------------------------------------------------------------------


class AllocatorMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.a = SlotAllocator(0)
        self.free: set[int] = set()     # allocatable free slots
        self.retired: set[int] = set()  # free slots at or above a shrink's limit
        self.limit: int | None = None   # a shrink under way
        self.n = 0

    @initialize(n=st.integers(0, 64))
    def init_size(self, n: int) -> None:
        self.a = SlotAllocator(n)
        self.n = n
        self.free = set(range(n))

    @rule(n=st.integers(0, 70), hint=st.one_of(st.none(), st.integers(-2, 70)))
    def allocate(self, n: int, hint: int | None) -> None:
        if n > len(self.free):
            before = self.a.runs()
            with pytest.raises(CapacityError):
                self.a.allocate(n, hint=hint)
            assert self.a.runs() == before
            return
        hinted = hint is not None and hint in dict(self.a.runs())
        got = self.a.allocate(n, hint=hint)
        assert len(got) == len(set(got)) == n
        assert set(got) <= self.free
        assert self.limit is None or all(s < self.limit for s in got)
        if hinted and n:
            assert got[0] == hint
        self.free -= set(got)

    @rule(data=st.data())
    def free_some(self, data: st.DataObject) -> None:
        used = sorted(set(range(self.n)) - self.free - self.retired)
        batch = data.draw(st.lists(st.sampled_from(used), unique=True) if used else st.just([]))
        if data.draw(st.booleans()) and len(batch) == 1:
            self.a.free_one(batch[0])
        else:
            self.a.free(batch)
        limit = self.n if self.limit is None else self.limit
        self.free |= {s for s in batch if s < limit}
        self.retired |= {s for s in batch if s >= limit}

    @rule(slot=st.integers(-1, 65))
    def bad_free(self, slot: int) -> None:
        if 0 <= slot < self.n and slot not in self.free | self.retired:
            batch = [slot, slot]  # duplicate within the call
        else:
            batch = [slot]  # double free or out of range
        before = self.a.runs()
        with pytest.raises(ValueError):
            self.a.free(batch)
        assert self.a.runs() == before

    @rule(slot=st.integers(-1, 65))
    def allocate_at(self, slot: int) -> None:
        if slot in self.free:
            self.a.allocate_at(slot)
            self.free.discard(slot)
        else:
            with pytest.raises(ValueError):
                self.a.allocate_at(slot)

    @precondition(lambda self: self.n < 64)
    @rule(k=st.integers(0, 8))
    def grow(self, k: int) -> None:
        if self.limit is not None:
            with pytest.raises(ValueError, match="shrink is under way"):
                self.a.grow(k)
            return
        self.a.grow(k)
        self.free |= set(range(self.n, self.n + k))
        self.n += k

    @rule(k=st.integers(0, 10))
    def shrink(self, k: int) -> None:
        tail = set(range(self.n - k, self.n))
        if self.limit is None and k <= self.n and tail <= self.free:
            self.a.shrink(k)
            self.free -= tail
            self.n -= k
        else:
            before = self.a.runs()
            with pytest.raises(ValueError):
                self.a.shrink(k)
            assert self.a.runs() == before

    @precondition(lambda self: self.limit is None)
    @rule(k=st.integers(0, 10))
    def begin_shrink(self, k: int) -> None:
        if k > self.n:
            with pytest.raises(ValueError):
                self.a.begin_shrink(self.n - k)
            return
        self.a.begin_shrink(self.n - k)
        if k == 0:
            assert not self.a.shrinking         # a shrink to the same size is a no-op
            return
        self.limit = self.n - k
        self.retired = {s for s in self.free if s >= self.limit}
        self.free -= self.retired

    @precondition(lambda self: self.limit is not None)
    @rule()
    def finish_shrink(self) -> None:
        if len(self.retired) < self.n - self.limit:
            assert not self.a.drained()
            with pytest.raises(ValueError, match="is in use"):
                self.a.finish_shrink()
            return
        assert self.a.drained()
        self.a.finish_shrink()
        self.n, self.limit, self.retired = self.limit, None, set()

    @precondition(lambda self: self.limit is not None)
    @rule()
    def cancel_shrink(self) -> None:
        self.a.cancel_shrink()
        self.free |= self.retired
        self.limit, self.retired = None, set()

    @invariant()
    def consistent(self) -> None:
        assert self.a.num_slots == self.n
        assert self.a.capacity == (self.n if self.limit is None else self.limit)
        assert self.a.num_free == len(self.free)
        assert self.a.draining == (0 if self.limit is None
                                   else self.n - self.limit - len(self.retired))
        check_invariants(self.a, self.free, self.retired)


AllocatorMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None
)
TestAllocatorMachine = AllocatorMachine.TestCase


def test_free_one_matches_free_and_rejects_bad_slots():
    a, b = SlotAllocator(16), SlotAllocator(16)
    slots = a.allocate(10)
    b.allocate(10)
    for s in (3, 4, 9, 0):
        a.free_one(s)
        b.free([s])
    assert a.runs() == b.runs() and a.num_free == b.num_free
    before = a.runs()
    with pytest.raises(ValueError, match="double free"):
        a.free_one(3)
    with pytest.raises(ValueError, match="out of range"):
        a.free_one(16)
    assert a.runs() == before
    assert slots == list(range(10))
