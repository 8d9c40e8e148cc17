"""Eviction policies: the candidate-set contract for every registered policy, plus hand-made
cases with known answers for each one."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_cache.block import Block
from tiered_cache.errors import ConfigError
from tiered_cache.policies import (
    POLICIES,
    ARCPolicy,
    CachePolicy,
    ClassCreditPolicy,
    CostAwarePolicy,
    HitDensityPolicy,
    LFUPolicy,
    LRUPolicy,
    PriorityPolicy,
    S3FIFOPolicy,
    resolve,
)
from tiered_cache.policies.hit_density import (
    _MID,
    NB,
    NCLASS,
    SPARE,
    UnguardedHitDensityPolicy,
    age_bucket,
    density_bounds,
)

NAMES = sorted(POLICIES)


def mk(i: int, depth: int = 0, hits: int = 0, last_access: int = 0) -> Block:
    b = Block(id=i, depth=depth, num_tiers=2)
    b.hits = hits
    b.last_access = last_access
    return b


def hit(policy: CachePolicy, block: Block, now: int) -> None:
    """What the cache does on a reuse: update the history, then tell the policy."""
    block.hits += 1
    block.last_access = now
    policy.access(block)


def ids(blocks: list[Block]) -> list[int]:
    return [b.id for b in blocks]


# --- registry ---------------------------------------------------------------------------------


def test_registry_names_all_policies():
    assert set(POLICIES) == {"lru", "lfu", "cost_aware", "s3fifo", "arc", "belady",
                             "reuse_credit", "class_credit", "hit_density"}
    for name, cls in POLICIES.items():
        assert resolve(name) is cls
        assert cls.name == name
        assert issubclass(cls, CachePolicy)


def test_resolve_dotted_path_and_errors():
    assert resolve("tiered_cache.policies.arc:ARCPolicy") is ARCPolicy
    with pytest.raises(ConfigError, match="unknown policy"):
        resolve("mru")
    with pytest.raises(ConfigError, match="not a subclass"):
        resolve("tiered_cache.block:Block")


# --- the contract, for every policy -----------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_victims_are_candidates_each_once_at_most_n(name):
    policy = POLICIES[name](capacity_blocks=32)
    blocks = [mk(i, depth=i % 5, hits=i % 3, last_access=i) for i in range(20)]
    for b in blocks:
        policy.insert(b)
    removed = {blocks[i].id for i in (0, 3, 7, 11, 19)}
    for i in removed:
        policy.remove(blocks[i])
    assert len(policy) == 15
    assert policy.victims(0) == []

    first = policy.victims(4)
    assert len(first) == 4
    assert len(policy) == 11
    rest = policy.victims(100)
    assert len(rest) == 11
    got = ids(first + rest)
    assert len(set(got)) == len(got)
    assert set(got) == {b.id for b in blocks} - removed
    assert len(policy) == 0
    assert policy.victims(5) == []


@pytest.mark.parametrize("name", NAMES)
def test_len_tracks_candidates_and_redundant_calls_are_harmless(name):
    policy = POLICIES[name](capacity_blocks=8)
    a, b = mk(1), mk(2, depth=1)
    assert len(policy) == 0
    policy.insert(a)
    policy.insert(a)                      # already a candidate
    assert len(policy) == 1
    policy.remove(b)                      # never a candidate
    assert len(policy) == 1
    policy.insert(b)
    assert len(policy) == 2
    policy.remove(a)
    policy.remove(a)
    assert len(policy) == 1
    assert ids(policy.victims(5)) == [2]
    assert len(policy) == 0


@pytest.mark.parametrize("name", NAMES)
def test_insert_remove_churn_stays_consistent(name):
    policy = POLICIES[name](capacity_blocks=16)
    blocks = [mk(i, depth=i % 4, last_access=i) for i in range(10)]
    now = 100
    for rnd in range(50):
        for b in blocks:
            policy.insert(b)
        for b in blocks[rnd % 3::3]:
            policy.remove(b)              # pinned
            now += 1
            hit(policy, b, now)
            policy.insert(b)              # unpinned
        for b in blocks[::2]:
            policy.remove(b)
        assert len(policy) == 5
        for b in blocks[::2]:
            policy.insert(b)
        assert len(policy) == 10
    out = policy.victims(10)
    assert sorted(ids(out)) == list(range(10))
    assert len(policy) == 0


@pytest.mark.parametrize("name", NAMES)
def test_state_stays_bounded(name):
    cap = 16
    policy = POLICIES[name](capacity_blocks=cap)
    hot = [mk(i, depth=1) for i in range(4)]
    for b in hot:
        policy.insert(b)
    now = 0
    for i in range(100, 5100):            # a stream of blocks that come and go
        b = mk(i, depth=i % 7)
        now += 1
        hit(policy, b, now)               # hit before it was ever a candidate here
        policy.insert(b)
        if i % 3 == 0:
            policy.remove(b)              # pinned, then its copy is dropped: never back
        if len(policy) > cap:
            policy.victims(len(policy) - cap)
        h = hot[i % 4]
        now += 1
        hit(policy, h, now)               # hot candidates hit over and over
    assert len(policy) <= cap
    if isinstance(policy, PriorityPolicy):
        assert len(policy._heap) <= max(1024, 2 * len(policy._live))
    if isinstance(policy, S3FIFOPolicy):
        assert len(policy._ghost) <= cap and len(policy._parked) <= cap
        assert len(policy._freq) == len(policy)
    if isinstance(policy, ARCPolicy):
        assert len(policy._b1) + len(policy._b2) <= cap and len(policy._parked) <= cap
        assert len(policy._t1) + len(policy._b1) <= cap
        assert 0 <= policy.p <= cap


def test_priority_heap_does_not_grow_under_access_only():
    # Regression: re-keying a candidate on `access` pushes a new heap entry; compaction used to run
    # only in `remove`, so hits without removes grew the heap without bound.
    policy = LRUPolicy(capacity_blocks=8)
    blocks = [mk(i) for i in range(4)]
    for b in blocks:
        policy.insert(b)
    for now in range(1, 20_001):
        hit(policy, blocks[now % 4], now)
    assert len(policy._heap) <= 1024
    assert len(policy) == 4


# --- LRU --------------------------------------------------------------------------------------


def test_lru_evicts_oldest_last_access():
    policy = LRUPolicy(capacity_blocks=8)
    for i, la in enumerate([5, 1, 3, 4, 2]):
        policy.insert(mk(i, last_access=la))
    assert ids(policy.victims(5)) == [1, 4, 2, 3, 0]


def test_lru_tie_goes_to_deeper_block():
    policy = LRUPolicy(capacity_blocks=8)
    policy.insert(mk(1, depth=2, last_access=7))
    policy.insert(mk(2, depth=9, last_access=7))
    policy.insert(mk(3, depth=5, last_access=7))
    policy.insert(mk(4, depth=20, last_access=8))
    assert ids(policy.victims(4)) == [2, 3, 1, 4]


def test_lru_access_rekeys_candidate():
    policy = LRUPolicy(capacity_blocks=8)
    a, b = mk(1, last_access=1), mk(2, last_access=2)
    policy.insert(a)
    policy.insert(b)
    hit(policy, a, 3)
    assert ids(policy.victims(2)) == [2, 1]


# --- LFU-DA -----------------------------------------------------------------------------------


def test_lfu_evicts_least_hit_first():
    policy = LFUPolicy(capacity_blocks=8)
    for i, h in enumerate([3, 0, 2, 1]):
        policy.insert(mk(i, hits=h, last_access=10 - i))
    assert ids(policy.victims(4)) == [1, 3, 2, 0]


def test_lfu_ties_go_to_least_recent():
    policy = LFUPolicy(capacity_blocks=8)
    policy.insert(mk(1, hits=2, last_access=9))
    policy.insert(mk(2, hits=2, last_access=4))
    policy.insert(mk(3, hits=2, last_access=6))
    assert ids(policy.victims(3)) == [2, 3, 1]


def test_lfu_access_raises_priority():
    policy = LFUPolicy(capacity_blocks=8)
    a, b = mk(1, last_access=1), mk(2, last_access=2)
    policy.insert(a)
    policy.insert(b)
    hit(policy, a, 3)
    assert ids(policy.victims(1)) == [2]


def test_lfu_aging_lets_a_new_block_outlive_an_old_favourite():
    # A was hit 4 times long ago (priority 0 + 4). Each round a fresh block with 1 hit arrives
    # and one block is evicted. Plain LFU would keep A forever; with aging the clock rises to
    # each victim's priority (1, 2, 3), so the 4th newcomer enters at 3 + 1 = 4, level with A,
    # and A, the least recent, goes. From then on A would lose to any newcomer.
    policy = LFUPolicy(capacity_blocks=2)
    old = mk(0, hits=4, last_access=0)
    policy.insert(old)
    for rnd in range(1, 4):
        policy.insert(mk(rnd, hits=1, last_access=rnd))
        assert ids(policy.victims(1)) == [rnd]          # the newcomer loses while young
        assert policy.clock == rnd
    newcomer = mk(4, hits=1, last_access=4)
    policy.insert(newcomer)
    assert ids(policy.victims(1)) == [0]                 # 4 hits, but aged out
    assert len(policy) == 1 and policy.victims(1) == [newcomer]


# --- cost-aware (GDSF) ------------------------------------------------------------------------


def test_cost_aware_formula():
    policy = CostAwarePolicy(capacity_blocks=8, block_size=16, cost_context_tokens=53_000.0)
    assert policy.cost(mk(0, depth=0)) == pytest.approx(1 + 0.5 * 16 / 53_000)
    assert policy.cost(mk(1, depth=1000)) == pytest.approx(1 + 1000.5 * 16 / 53_000)
    assert policy.priority(mk(2, depth=10, hits=3)) == pytest.approx(4 * (1 + 10.5 * 16 / 53_000))


def test_cost_aware_keeps_deeper_block_at_equal_hits():
    # The heap's own tie-break would take the deeper block first; the cost term overrides it.
    policy = CostAwarePolicy(capacity_blocks=8)
    policy.insert(mk(1, depth=0, hits=2))
    policy.insert(mk(2, depth=300, hits=2))
    policy.insert(mk(3, depth=50, hits=2))
    assert ids(policy.victims(3)) == [1, 3, 2]


def test_cost_aware_keeps_frequent_block_at_equal_depth():
    policy = CostAwarePolicy(capacity_blocks=8)
    policy.insert(mk(1, depth=40, hits=5))
    policy.insert(mk(2, depth=40, hits=0))
    policy.insert(mk(3, depth=40, hits=2))
    assert ids(policy.victims(3)) == [2, 3, 1]


def test_cost_aware_frequency_outweighs_mild_depth_cost():
    # For a 70B model a block 16K tokens deep costs ~1.3x a first block: one extra hit is worth
    # more than that.
    policy = CostAwarePolicy(capacity_blocks=8, block_size=16, cost_context_tokens=53_000.0)
    policy.insert(mk(1, depth=0, hits=1))
    policy.insert(mk(2, depth=1000, hits=0))
    assert ids(policy.victims(1)) == [2]


def test_cost_aware_clock_is_last_victim_priority():
    policy = CostAwarePolicy(capacity_blocks=8)
    a = mk(1, depth=3, hits=1)
    policy.insert(a)
    expected = policy.priority(a)
    policy.insert(mk(2, depth=3, hits=5))
    policy.victims(1)
    assert policy.clock == pytest.approx(expected)
    late = mk(3, depth=3, hits=0)
    assert policy.priority(late) == pytest.approx(expected + policy.cost(late))


# --- S3-FIFO ----------------------------------------------------------------------------------


def fill_and_scan(policy: CachePolicy, cap: int, scan: int, now: int) -> set[int]:
    """Insert `scan` one-hit blocks, evicting down to `cap` after each; return ids evicted."""
    evicted: set[int] = set()
    for i in range(1000, 1000 + scan):
        now += 1
        policy.insert(mk(i, last_access=now))
        if len(policy) > cap:
            evicted |= set(ids(policy.victims(len(policy) - cap)))
    return evicted


def test_s3fifo_scan_does_not_push_out_block_used_twice():
    cap = 10
    policy = S3FIFOPolicy(capacity_blocks=cap)
    hot = mk(1, last_access=1)
    policy.insert(hot)
    hit(policy, hot, 2)
    hit(policy, hot, 3)
    evicted = fill_and_scan(policy, cap, scan=200, now=3)
    assert hot.id not in evicted
    assert len(evicted) == 200 - (cap - 1)
    assert hot.id in policy._main

    # LRU, by contrast, loses it to the scan.
    lru = LRUPolicy(capacity_blocks=cap)
    hot2 = mk(1, last_access=1)
    lru.insert(hot2)
    hit(lru, hot2, 2)
    hit(lru, hot2, 3)
    assert hot2.id in fill_and_scan(lru, cap, scan=200, now=3)


def test_s3fifo_scan_resistance_with_pin_unpin_flow():
    # The cache's real flow for a reuse: pinned (remove), hit (access), unpinned (insert).
    cap = 10
    policy = S3FIFOPolicy(capacity_blocks=cap)
    hot = mk(1, last_access=1)
    policy.insert(hot)
    for now in (2, 3):
        policy.remove(hot)
        hit(policy, hot, now)
        policy.insert(hot)
    assert hot.id not in fill_and_scan(policy, cap, scan=200, now=3)


def test_s3fifo_unused_block_leaves_small_to_ghost_and_returns_to_main():
    policy = S3FIFOPolicy(capacity_blocks=10)
    a, b = mk(1), mk(2)
    policy.insert(a)
    policy.insert(b)
    assert ids(policy.victims(1)) == [1]                 # FIFO, never used: straight out
    assert 1 in policy._ghost
    policy.insert(a)                                     # back soon: evicted too early
    assert 1 in policy._main and 1 not in policy._ghost


def test_s3fifo_main_gives_second_chances_by_frequency():
    policy = S3FIFOPolicy(capacity_blocks=10)            # small target: 1 block
    blocks = [mk(i) for i in range(3)]
    for b in blocks:
        policy.insert(b)
        hit(policy, b, b.id + 1)
    # Small over target: 0 and 1 were used, so they move to main (bits cleared) until small is
    # back at its target; then main's oldest, 0, with no bit left, is the victim.
    assert ids(policy.victims(1)) == [0]
    assert list(policy._main) == [1] and list(policy._small) == [2]
    hit(policy, blocks[1], 10)                           # 1 earns a bit while in main
    policy.insert(mk(3))
    # 2 is promoted (small over target), then main: 1 spends its bit and goes round, 2 goes.
    assert ids(policy.victims(1)) == [2]
    assert ids(policy.victims(2)) == [1, 3]


def test_s3fifo_freq_and_queue_survive_leaving_candidacy():
    policy = S3FIFOPolicy(capacity_blocks=10)
    a, b = mk(1), mk(2)
    policy.insert(a)
    policy.insert(b)
    policy.remove(a)                                     # pinned
    hit(policy, a, 5)
    policy.insert(a)                                     # unpinned: small, tail, freq 1
    assert 1 in policy._small and policy._freq[1] == 1
    assert ids(policy.victims(1)) == [2]                 # a's bit saves it
    assert policy.victims(1) == [a]                      # promoted (bits cleared), then evicted
    # A block in main that is pinned and unpinned goes back to main.
    c = mk(3)
    policy.insert(c)
    hit(policy, c, 6)
    policy.insert(mk(4))
    policy.insert(mk(5))
    policy.victims(1)                                    # c promoted to main, 4 evicted
    assert 3 in policy._main
    policy.remove(c)
    policy.insert(c)
    assert 3 in policy._main and 3 not in policy._small


# --- ARC --------------------------------------------------------------------------------------


def test_arc_scan_does_not_push_out_block_used_twice():
    cap = 10
    policy = ARCPolicy(capacity_blocks=cap)
    hot = mk(1, last_access=1)
    policy.insert(hot)
    hit(policy, hot, 2)
    assert hot.id in policy._t2
    evicted = fill_and_scan(policy, cap, scan=200, now=3)
    assert hot.id not in evicted
    assert len(evicted) == 200 - (cap - 1)


def test_arc_scan_resistance_with_pin_unpin_flow():
    cap = 10
    policy = ARCPolicy(capacity_blocks=cap)
    hot = mk(1, last_access=1)
    policy.insert(hot)
    policy.remove(hot)
    hit(policy, hot, 2)
    policy.insert(hot)
    assert hot.id in policy._t2
    assert hot.id not in fill_and_scan(policy, cap, scan=200, now=3)


def test_arc_block_hit_before_first_candidacy_is_frequent():
    policy = ARCPolicy(capacity_blocks=10)
    a = mk(1)
    hit(policy, a, 1)                                    # pinned from birth, reused
    policy.insert(a)
    assert 1 in policy._t2


def test_arc_ghost_hits_adapt_p():
    policy = ARCPolicy(capacity_blocks=4)
    blocks = [mk(i) for i in range(4)]
    for b in blocks:
        policy.insert(b)
    assert ids(policy.victims(2)) == [0, 1]              # LRU of T1 -> B1
    assert list(policy._b1) == [0, 1]
    policy.insert(blocks[0])                             # B1 hit: T1 was too small
    assert policy.p == 1.0 and 0 in policy._t2 and 0 not in policy._b1
    hit(policy, blocks[2], 5)                            # T1: [3], T2: [0, 2]
    assert ids(policy.victims(1)) == [0]                 # |T1| = 1 = p: take T2's LRU
    assert list(policy._b2) == [0]
    policy.insert(blocks[0])                             # B2 hit: frequency list too small
    assert policy.p == 0.0 and 0 in policy._t2
    assert ids(policy.victims(1)) == [3]                 # |T1| = 1 > p = 0: T1's LRU


def test_arc_falls_back_to_other_list():
    policy = ARCPolicy(capacity_blocks=4)
    a, b = mk(1), mk(2)
    policy.insert(a)
    policy.insert(b)
    hit(policy, a, 1)
    hit(policy, b, 2)                                    # T1 empty
    assert ids(policy.victims(2)) == [1, 2]


# --- random operations against a reference candidate set -------------------------------------

N_BLOCKS = 12
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, N_BLOCKS - 1)),
        st.tuples(st.just("remove"), st.integers(0, N_BLOCKS - 1)),
        st.tuples(st.just("access"), st.integers(0, N_BLOCKS - 1)),
        st.tuples(st.just("victims"), st.integers(0, 5)),
    ),
    max_size=80,
)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=200, deadline=None)
@given(ops=OPS, capacity=st.integers(1, 8))
def test_random_operations_match_reference(name, ops, capacity):
    policy = POLICIES[name](capacity_blocks=capacity)
    blocks = [mk(i, depth=i % 4) for i in range(N_BLOCKS)]
    candidates: set[int] = set()
    now = 0
    for op, arg in ops:
        if op == "insert":
            if arg not in candidates:     # the cache only inserts non-candidates
                policy.insert(blocks[arg])
                candidates.add(arg)
        elif op == "remove":
            if arg in candidates:         # ... and only removes candidates
                policy.remove(blocks[arg])
                candidates.discard(arg)
        elif op == "access":
            now += 1
            hit(policy, blocks[arg], now)
        else:
            out = ids(policy.victims(arg))
            assert len(out) == len(set(out)) == min(arg, len(candidates))
            assert set(out) <= candidates
            candidates -= set(out)
        assert len(policy) == len(candidates)
    rest = ids(policy.victims(N_BLOCKS + 1))
    assert sorted(rest) == sorted(candidates)
    assert len(policy) == 0


def test_priority_heap_sheds_stale_entries_without_a_full_rebuild():
    """Pin/unpin churn leaves stale heap entries; they are drained a bounded number per call
    (no stop-the-world rebuild) while victims keep coming out in priority order."""
    from tiered_cache.policies.lru import LRUPolicy

    p = LRUPolicy(5000)
    blocks = [mk(i, last_access=i) for i in range(5000)]
    for b in blocks:
        p.insert(b)
    clock = 5000
    for _ in range(6):                           # every block pinned and unpinned again
        for b in blocks:
            p.remove(b)
            clock += 1
            b.last_access = clock
            p.insert(b)
        assert len(p._heap) + len(p._old) <= 2 * len(p) + 1024 + 2 * p._DRAIN
    out = p.victims(5000)
    assert [b.last_access for b in out] == sorted(b.last_access for b in blocks)
    assert len(p) == 0



@pytest.mark.parametrize("name", ["s3fifo", "arc"])
def test_ghosts_remember_content_not_block_objects(name):
    """Evicted content comes back as a new Block (new id, same key): the ghost must hit."""
    from tiered_cache.policies import POLICIES as registry

    p = registry[name](4)
    first = mk(1)
    first.key = b"k" * 16
    p.insert(first)
    assert p.victims(1) == [first]                      # evicted: remembered as a ghost
    again = mk(2)
    again.key = b"k" * 16                               # same content, new block
    p.insert(again)
    # A ghost hit admits straight to the frequency side: S3-FIFO's main queue, ARC's T2.
    frequent = p._main if name == "s3fifo" else p._t2
    assert again.id in frequent
    stranger = mk(3)
    stranger.key = b"o" * 16
    p.insert(stranger)
    assert stranger.id not in frequent                  # no history: probation / T1


# --- class_credit -------------------------------------------------------------------------------


def keyed(i: int, depth: int = 0, last_access: int = 0, parent: Block | None = None) -> Block:
    b = mk(i, depth=depth, last_access=last_access)
    b.key = i.to_bytes(16, "little")
    b.parent = parent
    return b


def test_class_credit_dead_tails_go_first_once_measured():
    p = ClassCreditPolicy(capacity_blocks=4)
    # Before anything is measured a tail is an ordinary block: LRU order.
    body, tail = keyed(1, last_access=5), keyed(2, depth=1, last_access=9)
    p.insert(keyed(3, depth=1, last_access=5, parent=body))   # body has had a child
    p.remove(p.victims(1)[0])
    p.insert(body)
    p.insert(tail)
    assert ids(p.victims(2)) == [1, 2]
    # Eight requests of two blocks: the tail (no child, never hit) is evicted and never comes
    # back; the block before it is evicted and its content comes back (the next turn).
    for r in range(8):
        parent = keyed(100 + r)
        child = keyed(200 + r, depth=1, parent=parent)
        p.insert(child)
        assert p.victims(1) == [child]
        p.insert(parent)
        assert p.victims(1) == [parent]
        again = keyed(100 + r)              # same content, new block: a ghost return
        p.insert(again)
        assert p.victims(1) == [again]
    assert p.tails_dead()
    # Now a tail goes before an older body block, unless it was hit.
    old = keyed(300, last_access=100)
    p.insert(keyed(301, depth=1, last_access=100, parent=old))
    p.victims(1)
    p.insert(old)
    new_tail = keyed(302, depth=1, last_access=200)
    p.insert(new_tail)
    assert p.victims(1) == [new_tail]
    hit_tail = keyed(303, depth=1, last_access=200)
    p.insert(hit_tail)
    hit(p, hit_tail, 201)                   # used twice: an ordinary block again
    assert p.victims(1) == [old]
    assert p.victims(1) == [hit_tail] and len(p) == 0


def test_class_credit_scales_credit_by_measured_odds():
    p = ClassCreditPolicy(8)
    b = Block(id=1, depth=0, num_tiers=1)
    b.hits, b.inserted_at, b.last_access = 3, 10, 200       # 4 uses: class 2 * 3
    assert p.credit(b) == 0.0               # no lifetime measured yet: LRU
    p._lifetime = 8.0
    p._cls[1] = 6
    assert p.odds(6) < 1.0
    assert p.credit(b) == pytest.approx(16.0)               # no trials: reuse_credit's credit
    p._trials[6], p._succ[6] = 9.0, 9.0     # the class: 9 reused of 9
    p._all_trials, p._all_succ = 98.0, 24.0  # the tier: mean (24 + 1) / (98 + 2) = 0.25
    r = (9 + 0.25) / 10                     # shrunk by one pseudo-trial at the mean
    k = (r - (r * (1 - r) / 10) ** 0.5) / 0.25              # one standard error low: 3.37
    assert p.odds(6) == pytest.approx(k) and k == pytest.approx(3.3668, abs=1e-4)
    assert p.credit(b) == pytest.approx(16.0 * k)
    assert p.priority(b) == pytest.approx(200 + 16.0 * k)
    b.inserted_at = 190                     # 4 uses within 10 ticks: the overdue cap still holds
    assert p.credit(b) == pytest.approx(2 * 10 / 3)
    b.inserted_at = 10
    p._succ[6] = 0.0                        # a class reused less than average: not below 1x
    assert p.credit(b) == pytest.approx(16.0)


def test_class_credit_counts_a_hit_taken_while_pinned():
    # In a single tier a hit block is pinned (not a candidate) when the cache reports its hit
    # (`access`): a success of its old class, a trial of the new one, kept across the pin.
    p = ClassCreditPolicy(capacity_blocks=4)
    b = keyed(1, last_access=5)
    p.insert(b)
    assert p._cls[1] == 3 and p._trials[3] == 1.0 and p._succ[3] == 0.0    # a tail used once
    p.remove(b)                             # pinned by the request that hits it
    hit(p, b, 9)
    p.insert(b)                             # unpinned: 2 uses now
    assert p._succ[3] == 1.0 and p._all_succ == 1.0
    assert p._cls[1] == 2 * (2).bit_length() and p._trials[4] == 1.0
    p.remove(b)
    p.insert(b)                             # re-inserted without a hit: nothing new
    assert p._succ[3] == 1.0 and p._trials[4] == 1.0 and p._all_trials == 2.0
    assert p.victims(1) == [b] and not p._cls


# --- hit_density --------------------------------------------------------------------------------


def test_hit_density_bounds_on_a_known_histogram():
    # One class, 10 trials, all reused in age bucket 4 (ages 3 to 4.66).
    trials = np.zeros(2)
    trials[1] = 10.0
    reuse = np.zeros((2, NB))
    reuse[1, 4] = 10.0
    high, low = density_bounds(trials, reuse)
    # From age 0 the best horizon is through bucket 4: 10 hits, each block held until its reuse
    # (the bucket's middle); one Poisson error is sqrt(10 + 1).
    held = 10 * _MID[4]
    assert high[1, 0] == pytest.approx((10 + 11 ** 0.5) / held)
    assert low[1, 0] == pytest.approx((10 - 11 ** 0.5) / held)
    assert high[1, 4] > high[1, 2] > high[1, 0]     # the density rises towards the mode
    assert high[1, 5] == 0.0 and low[1, 5] == 0.0   # past it nothing is left to reuse
    assert not high[0].any()                        # a class without trials
    high2, low2 = density_bounds(trials, reuse, z=2.0)
    assert high2[1, 0] > high[1, 0] and low2[1, 0] < low[1, 0]


def test_hit_density_is_lru_without_evidence_and_spares_go_first():
    p = HitDensityPolicy(capacity_blocks=8)
    blocks = [mk(i, last_access=t) for i, t in enumerate([5, 1, 4, 2, 3])]
    for b in blocks:
        p.insert(b)
    spare = mk(9, last_access=9)
    spare.slots[:] = [0, 0]                 # a copy in both tiers: dropping one loses no hit
    p.insert(spare)
    assert ids(p.victims(6)) == [9, 1, 3, 4, 2, 0]


def test_hit_density_counts_a_hit_taken_while_pinned():
    p = HitDensityPolicy(capacity_blocks=8)
    b = mk(1, last_access=5)
    b.key = b"k" * 16
    p.insert(b)
    assert p._trials[1] == 1.0
    p.remove(b)                             # pinned by the request that hits it
    hit(p, b, 9)
    p.insert(b)
    assert p._reuse[1][age_bucket(4)] == 1.0 and p._trials[2] == 1.0    # 2 uses now
    p.remove(b)
    p.insert(b)                             # no new hit: nothing counted
    assert sum(p._trials) == 2.0 and sum(map(sum, p._reuse)) == 1.0
    assert p.victims(1) == [b]
    again = mk(2, last_access=30)           # same content back after the eviction
    again.key = b"k" * 16
    p.insert(again)
    assert p._reuse[2][age_bucket(21)] == 1.0 and p._trials[2] == 2.0   # 3 uses: class 2


def _tables(p: HitDensityPolicy, young_high: float) -> None:
    """Every density is known to lie in [0.5, 1.0], except age 0 of class 1: upper bound
    `young_high`."""
    high, low = np.full((NCLASS, NB), 1.0), np.full((NCLASS, NB), 0.5)
    high[1, 0] = young_high
    high[SPARE] = low[SPARE] = -1.0
    p._table, p._low = high, low


@pytest.mark.parametrize("young_high,first", [(0.1, "young"), (0.6, "old")])
def test_hit_density_leaves_lru_order_only_on_evidence(young_high, first):
    # The young block goes before the old one only when its density is surely lower (upper
    # bound 0.1 < the old block's lower bound 0.5); 0.6 might not be lower: LRU order.
    for cls in (HitDensityPolicy, UnguardedHitDensityPolicy):
        p = cls(capacity_blocks=8)
        _tables(p, young_high)
        old, young = mk(1, last_access=0), mk(2, last_access=40)
        p.insert(old)
        p.insert(young)
        got = ids(p.victims(2))
        if cls is UnguardedHitDensityPolicy:      # by the upper bounds alone: young first
            assert got == [2, 1]
        else:
            assert got == ([2, 1] if first == "young" else [1, 2])


def test_hit_density_candidate_appearing_during_a_batch_competes():
    p = HitDensityPolicy(capacity_blocks=64)
    _tables(p, 0.1)
    olds = [mk(i, last_access=i) for i in range(10)]
    for b in olds:
        p.insert(b)
    p._now = 50                             # the olds are 41-50 ticks old: LRU order
    assert ids(p.victims(1)) == [0]
    assert p._batch                         # the next victims are chosen already
    fresh = mk(99, last_access=50)          # age 0: surely the worst
    p.insert(fresh)
    assert ids(p.victims(2)) == [99, 1]
    p.remove(olds[2])                       # a chosen victim that is pinned meanwhile
    assert ids(p.victims(7)) == [3, 4, 5, 6, 7, 8, 9]
