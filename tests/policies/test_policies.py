"""Eviction policies: the candidate-set contract for every registered policy, plus hand-made
cases with known answers for each one.

Blocks are rows of a `BlockTable` written directly here (in the cache only the control plane's
index writes them); a policy gets the table as `blocks=` and sees plain int ids."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_cache.core.blocks import NO_BLOCK, NO_SLOT, BlockTable
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
    ReuseCreditPolicy,
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
from tiered_cache.policies.s3fifo import ghost_id

NAMES = sorted(POLICIES)


def make(policy: str | type[CachePolicy], capacity: int, *, num_tiers: int = 2,
         **kw) -> CachePolicy:
    """A policy over a fresh table of its own (`policy.blocks`)."""
    cls = POLICIES[policy] if isinstance(policy, str) else policy
    return cls(capacity, blocks=BlockTable(num_tiers, block_size=4, capacity=8), **kw)


def mk(t: BlockTable, depth: int = 0, hits: int = 0, last_access: int = 0,
       key: bytes | None = None, parent: int = NO_BLOCK) -> int:
    """A new block: a row of `t` (the lowest free id) with these fields; `parent` links it as a
    published child."""
    b = t.new(depth)
    t.hits[b] = hits
    t.last_access[b] = last_access
    t.key[b] = key
    if parent != NO_BLOCK:
        t.parent[b] = parent
        first = t.first_child[parent]
        t.next_sibling[b] = first
        if first != NO_BLOCK:
            t.prev_sibling[first] = b
        t.first_child[parent] = b
    return b


def drop(t: BlockTable, b: int) -> None:
    """Block b is gone for good (no copy, unpublished): its row goes back to the table, and the
    next `mk` gets the same id."""
    parent = t.parent[b]
    if parent != NO_BLOCK:
        nxt, prv = t.next_sibling[b], t.prev_sibling[b]
        if prv != NO_BLOCK:
            t.next_sibling[prv] = nxt
        else:
            t.first_child[parent] = nxt
        if nxt != NO_BLOCK:
            t.prev_sibling[nxt] = prv
    for slots in t.slots:
        slots[b] = NO_SLOT
    t.free(b)


def hit(policy: CachePolicy, b: int, now: int) -> None:
    """What the cache does on a reuse: update the history, then tell the policy."""
    t = policy.blocks
    t.hits[b] += 1
    t.last_access[b] = now
    policy.access(b)


def content(i: int) -> bytes:
    """A 16-byte content key."""
    return i.to_bytes(16, "little")


# --- registry ---------------------------------------------------------------------------------


def test_registry_names_all_policies():
    assert set(POLICIES) == {"lru", "lfu", "cost_aware", "s3fifo", "arc", "belady",
                             "reuse_credit", "class_credit", "hit_density", "adaptive"}
    for name, cls in POLICIES.items():
        assert resolve(name) is cls
        assert cls.name == name
        assert issubclass(cls, CachePolicy)


def test_resolve_dotted_path_and_errors():
    assert resolve("tiered_cache.policies.arc:ARCPolicy") is ARCPolicy
    with pytest.raises(ConfigError, match="unknown policy"):
        resolve("mru")
    with pytest.raises(ConfigError, match="not a subclass"):
        resolve("tiered_cache.core.blocks:BlockTable")


# --- the contract, for every policy -----------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_victims_are_candidates_each_once_at_most_n(name):
    policy = make(name, 32)
    t = policy.blocks
    blocks = [mk(t, depth=i % 5, hits=i % 3, last_access=i) for i in range(20)]
    for b in blocks:
        policy.insert(b)
    removed = {blocks[i] for i in (0, 3, 7, 11, 19)}
    for b in removed:
        policy.remove(b)
    assert len(policy) == 15
    assert policy.victims(0) == []

    first = policy.victims(4)
    assert len(first) == 4
    assert len(policy) == 11
    rest = policy.victims(100)
    assert len(rest) == 11
    got = first + rest
    assert len(set(got)) == len(got)
    assert set(got) == set(blocks) - removed
    assert len(policy) == 0
    assert policy.victims(5) == []


@pytest.mark.parametrize("name", NAMES)
def test_len_tracks_candidates_and_redundant_calls_are_harmless(name):
    policy = make(name, 8)
    t = policy.blocks
    a, b = mk(t), mk(t, depth=1)
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
    assert policy.victims(5) == [b]
    assert len(policy) == 0


@pytest.mark.parametrize("name", NAMES)
def test_insert_remove_churn_stays_consistent(name):
    policy = make(name, 16)
    t = policy.blocks
    blocks = [mk(t, depth=i % 4, last_access=i) for i in range(10)]
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
    assert sorted(out) == sorted(blocks)
    assert len(policy) == 0


@pytest.mark.parametrize("name", NAMES)
def test_state_stays_bounded(name):
    cap = 16
    policy = make(name, cap)
    t = policy.blocks
    hot = [mk(t, depth=1) for i in range(4)]
    for b in hot:
        policy.insert(b)
    now = 0
    for i in range(100, 5100):            # a stream of blocks that come and go
        b = mk(t, depth=i % 7, key=content(i))
        now += 1
        hit(policy, b, now)               # hit before it was ever a candidate here
        policy.insert(b)
        if i % 3 == 0:
            policy.remove(b)              # pinned, then its copy is dropped: never back
            drop(t, b)                    # (its id is handed out again)
        if len(policy) > cap:
            for v in policy.victims(len(policy) - cap):
                if v not in hot:          # an evicted hot block is still hit below
                    drop(t, v)
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
    policy = make(LRUPolicy, 8)
    blocks = [mk(policy.blocks) for i in range(4)]
    for b in blocks:
        policy.insert(b)
    for now in range(1, 20_001):
        hit(policy, blocks[now % 4], now)
    assert len(policy._heap) <= 1024
    assert len(policy) == 4


# --- LRU --------------------------------------------------------------------------------------


def test_lru_evicts_oldest_last_access():
    policy = make(LRUPolicy, 8)
    b = [mk(policy.blocks, last_access=la) for la in [5, 1, 3, 4, 2]]
    for x in b:
        policy.insert(x)
    assert policy.victims(5) == [b[1], b[4], b[2], b[3], b[0]]


def test_lru_tie_goes_to_deeper_block():
    policy = make(LRUPolicy, 8)
    t = policy.blocks
    b = [mk(t, depth=d, last_access=la) for d, la in [(2, 7), (9, 7), (5, 7), (20, 8)]]
    for x in b:
        policy.insert(x)
    assert policy.victims(4) == [b[1], b[2], b[0], b[3]]


def test_lru_access_rekeys_candidate():
    policy = make(LRUPolicy, 8)
    a, b = mk(policy.blocks, last_access=1), mk(policy.blocks, last_access=2)
    policy.insert(a)
    policy.insert(b)
    hit(policy, a, 3)
    assert policy.victims(2) == [b, a]


# --- LFU-DA -----------------------------------------------------------------------------------


def test_lfu_evicts_least_hit_first():
    policy = make(LFUPolicy, 8)
    b = [mk(policy.blocks, hits=h, last_access=10 - i) for i, h in enumerate([3, 0, 2, 1])]
    for x in b:
        policy.insert(x)
    assert policy.victims(4) == [b[1], b[3], b[2], b[0]]


def test_lfu_ties_go_to_least_recent():
    policy = make(LFUPolicy, 8)
    b = [mk(policy.blocks, hits=2, last_access=la) for la in (9, 4, 6)]
    for x in b:
        policy.insert(x)
    assert policy.victims(3) == [b[1], b[2], b[0]]


def test_lfu_access_raises_priority():
    policy = make(LFUPolicy, 8)
    a, b = mk(policy.blocks, last_access=1), mk(policy.blocks, last_access=2)
    policy.insert(a)
    policy.insert(b)
    hit(policy, a, 3)
    assert policy.victims(1) == [b]


def test_lfu_aging_lets_a_new_block_outlive_an_old_favourite():
    # A was hit 4 times long ago (priority 0 + 4). Each round a fresh block with 1 hit arrives
    # and one block is evicted. Plain LFU would keep A forever; with aging the clock rises to
    # each victim's priority (1, 2, 3), so the 4th newcomer enters at 3 + 1 = 4, level with A,
    # and A, the least recent, goes. From then on A would lose to any newcomer.
    policy = make(LFUPolicy, 2)
    t = policy.blocks
    old = mk(t, hits=4, last_access=0)
    policy.insert(old)
    for rnd in range(1, 4):
        young = mk(t, hits=1, last_access=rnd)
        policy.insert(young)
        assert policy.victims(1) == [young]             # the newcomer loses while young
        assert policy.clock == rnd
    newcomer = mk(t, hits=1, last_access=4)
    policy.insert(newcomer)
    assert policy.victims(1) == [old]                    # 4 hits, but aged out
    assert len(policy) == 1 and policy.victims(1) == [newcomer]


# --- cost-aware (GDSF) ------------------------------------------------------------------------


def test_cost_aware_formula():
    policy = make(CostAwarePolicy, 8, block_size=16, cost_context_tokens=53_000.0)
    t = policy.blocks
    assert policy.cost(mk(t, depth=0)) == pytest.approx(1 + 0.5 * 16 / 53_000)
    assert policy.cost(mk(t, depth=1000)) == pytest.approx(1 + 1000.5 * 16 / 53_000)
    assert policy.priority(mk(t, depth=10, hits=3)) == pytest.approx(
        4 * (1 + 10.5 * 16 / 53_000))


def test_cost_aware_keeps_deeper_block_at_equal_hits():
    # The heap's own tie-break would take the deeper block first; the cost term overrides it.
    policy = make(CostAwarePolicy, 8)
    b = [mk(policy.blocks, depth=d, hits=2) for d in (0, 300, 50)]
    for x in b:
        policy.insert(x)
    assert policy.victims(3) == [b[0], b[2], b[1]]


def test_cost_aware_keeps_frequent_block_at_equal_depth():
    policy = make(CostAwarePolicy, 8)
    b = [mk(policy.blocks, depth=40, hits=h) for h in (5, 0, 2)]
    for x in b:
        policy.insert(x)
    assert policy.victims(3) == [b[1], b[2], b[0]]


def test_cost_aware_frequency_outweighs_mild_depth_cost():
    # For a 70B model a block 16K tokens deep costs ~1.3x a first block: one extra hit is worth
    # more than that.
    policy = make(CostAwarePolicy, 8, block_size=16, cost_context_tokens=53_000.0)
    policy.insert(mk(policy.blocks, depth=0, hits=1))
    deep = mk(policy.blocks, depth=1000, hits=0)
    policy.insert(deep)
    assert policy.victims(1) == [deep]


def test_cost_aware_clock_is_last_victim_priority():
    policy = make(CostAwarePolicy, 8)
    t = policy.blocks
    a = mk(t, depth=3, hits=1)
    policy.insert(a)
    expected = policy.priority(a)
    policy.insert(mk(t, depth=3, hits=5))
    policy.victims(1)
    assert policy.clock == pytest.approx(expected)
    late = mk(t, depth=3, hits=0)
    assert policy.priority(late) == pytest.approx(expected + policy.cost(late))


# --- S3-FIFO ----------------------------------------------------------------------------------


def fill_and_scan(policy: CachePolicy, cap: int, scan: int, now: int) -> set[int]:
    """Insert `scan` one-hit blocks, evicting down to `cap` after each; return ids evicted."""
    evicted: set[int] = set()
    for _ in range(scan):
        now += 1
        policy.insert(mk(policy.blocks, last_access=now))
        if len(policy) > cap:
            evicted |= set(policy.victims(len(policy) - cap))
    return evicted


def test_s3fifo_scan_does_not_push_out_block_used_twice():
    cap = 10
    policy = make(S3FIFOPolicy, cap)
    hot = mk(policy.blocks, last_access=1)
    policy.insert(hot)
    hit(policy, hot, 2)
    hit(policy, hot, 3)
    evicted = fill_and_scan(policy, cap, scan=200, now=3)
    assert hot not in evicted
    assert len(evicted) == 200 - (cap - 1)
    assert hot in policy._main

    # LRU, by contrast, loses it to the scan.
    lru = make(LRUPolicy, cap)
    hot2 = mk(lru.blocks, last_access=1)
    lru.insert(hot2)
    hit(lru, hot2, 2)
    hit(lru, hot2, 3)
    assert hot2 in fill_and_scan(lru, cap, scan=200, now=3)


def test_s3fifo_scan_resistance_with_pin_unpin_flow():
    # The cache's real flow for a reuse: pinned (remove), hit (access), unpinned (insert).
    cap = 10
    policy = make(S3FIFOPolicy, cap)
    hot = mk(policy.blocks, last_access=1)
    policy.insert(hot)
    for now in (2, 3):
        policy.remove(hot)
        hit(policy, hot, now)
        policy.insert(hot)
    assert hot not in fill_and_scan(policy, cap, scan=200, now=3)


@pytest.mark.parametrize("published", [True, False])
def test_s3fifo_unused_block_leaves_small_to_ghost_and_returns_to_main(published):
    policy = make(S3FIFOPolicy, 10)
    t = policy.blocks
    a, b = (mk(t, key=content(i) if published else None) for i in (1, 2))
    policy.insert(a)
    policy.insert(b)
    assert policy.victims(1) == [a]                      # FIFO, never used: straight out
    assert ghost_id(t, a) in policy._ghost
    policy.insert(a)                                     # back soon: evicted too early
    assert a in policy._main and ghost_id(t, a) not in policy._ghost


def test_s3fifo_main_gives_second_chances_by_frequency():
    policy = make(S3FIFOPolicy, 10)                      # small target: 1 block
    blocks = [mk(policy.blocks) for i in range(3)]
    for i, b in enumerate(blocks):
        policy.insert(b)
        hit(policy, b, i + 1)
    # Small over target: 0 and 1 were used, so they move to main (bits cleared) until small is
    # back at its target; then main's oldest, 0, with no bit left, is the victim.
    assert policy.victims(1) == [blocks[0]]
    assert list(policy._main) == [blocks[1]] and list(policy._small) == [blocks[2]]
    hit(policy, blocks[1], 10)                           # 1 earns a bit while in main
    b3 = mk(policy.blocks)
    policy.insert(b3)
    # 2 is promoted (small over target), then main: 1 spends its bit and goes round, 2 goes.
    assert policy.victims(1) == [blocks[2]]
    assert policy.victims(2) == [blocks[1], b3]


def test_s3fifo_freq_and_queue_survive_leaving_candidacy():
    policy = make(S3FIFOPolicy, 10)
    t = policy.blocks
    a, b = mk(t), mk(t)
    policy.insert(a)
    policy.insert(b)
    policy.remove(a)                                     # pinned
    hit(policy, a, 5)
    policy.insert(a)                                     # unpinned: small, tail, freq 1
    assert a in policy._small and policy._freq[a] == 1
    assert policy.victims(1) == [b]                      # a's bit saves it
    assert policy.victims(1) == [a]                      # promoted (bits cleared), then evicted
    # A block in main that is pinned and unpinned goes back to main.
    c = mk(t)
    policy.insert(c)
    hit(policy, c, 6)
    d = mk(t)
    policy.insert(d)
    policy.insert(mk(t))
    assert policy.victims(1) == [d]                      # c promoted to main, d evicted
    assert c in policy._main
    policy.remove(c)
    policy.insert(c)
    assert c in policy._main and c not in policy._small


# --- ARC --------------------------------------------------------------------------------------


def test_arc_scan_does_not_push_out_block_used_twice():
    cap = 10
    policy = make(ARCPolicy, cap)
    hot = mk(policy.blocks, last_access=1)
    policy.insert(hot)
    hit(policy, hot, 2)
    assert hot in policy._t2
    evicted = fill_and_scan(policy, cap, scan=200, now=3)
    assert hot not in evicted
    assert len(evicted) == 200 - (cap - 1)


def test_arc_scan_resistance_with_pin_unpin_flow():
    cap = 10
    policy = make(ARCPolicy, cap)
    hot = mk(policy.blocks, last_access=1)
    policy.insert(hot)
    policy.remove(hot)
    hit(policy, hot, 2)
    policy.insert(hot)
    assert hot in policy._t2
    assert hot not in fill_and_scan(policy, cap, scan=200, now=3)


def test_arc_block_hit_before_first_candidacy_is_frequent():
    policy = make(ARCPolicy, 10)
    a = mk(policy.blocks)
    hit(policy, a, 1)                                    # pinned from birth, reused
    policy.insert(a)
    assert a in policy._t2


def test_arc_ghost_hits_adapt_p():
    policy = make(ARCPolicy, 4)
    blocks = [mk(policy.blocks, key=content(i)) for i in range(4)]
    for b in blocks:
        policy.insert(b)
    assert policy.victims(2) == blocks[:2]               # LRU of T1 -> B1
    assert list(policy._b1) == [content(0), content(1)]
    policy.insert(blocks[0])                             # B1 hit: T1 was too small
    assert policy.p == 1.0 and blocks[0] in policy._t2 and content(0) not in policy._b1
    hit(policy, blocks[2], 5)                            # T1: [3], T2: [0, 2]
    assert policy.victims(1) == [blocks[0]]              # |T1| = 1 = p: take T2's LRU
    assert list(policy._b2) == [content(0)]
    policy.insert(blocks[0])                             # B2 hit: frequency list too small
    assert policy.p == 0.0 and blocks[0] in policy._t2
    assert policy.victims(1) == [blocks[3]]              # |T1| = 1 > p = 0: T1's LRU


def test_arc_falls_back_to_other_list():
    policy = make(ARCPolicy, 4)
    a, b = mk(policy.blocks), mk(policy.blocks)
    policy.insert(a)
    policy.insert(b)
    hit(policy, a, 1)
    hit(policy, b, 2)                                    # T1 empty
    assert policy.victims(2) == [a, b]


# --- random operations against a reference candidate set -------------------------------------

N_BLOCKS = 12
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), st.integers(0, N_BLOCKS - 1)),
        st.tuples(st.just("remove"), st.integers(0, N_BLOCKS - 1)),
        st.tuples(st.just("access"), st.integers(0, N_BLOCKS - 1)),
        st.tuples(st.just("victims"), st.integers(0, 5)),
        st.tuples(st.just("recycle"), st.integers(0, N_BLOCKS - 1)),
    ),
    max_size=80,
)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=200, deadline=None)
@given(ops=OPS, capacity=st.integers(1, 8))
def test_random_operations_match_reference(name, ops, capacity):
    policy = make(name, capacity)
    t = policy.blocks
    # half published (keyed by content, some contents shared), half private
    blocks = [mk(t, depth=i % 4, key=content(i % 5) if i % 2 else None) for i in range(N_BLOCKS)]
    candidates: set[int] = set()      # block ids
    now = 0
    for op, arg in ops:
        if op == "insert":
            if blocks[arg] not in candidates:     # the cache only inserts non-candidates
                policy.insert(blocks[arg])
                candidates.add(blocks[arg])
        elif op == "remove":
            if blocks[arg] in candidates:         # ... and only removes candidates
                policy.remove(blocks[arg])
                candidates.discard(blocks[arg])
        elif op == "access":
            now += 1
            hit(policy, blocks[arg], now)
        elif op == "recycle":
            if blocks[arg] not in candidates:     # gone for good; its id goes to a new block
                key = t.key[blocks[arg]]
                drop(t, blocks[arg])
                blocks[arg] = mk(t, depth=arg % 4, key=key)
        else:
            out = policy.victims(arg)
            assert len(out) == len(set(out)) == min(arg, len(candidates))
            assert set(out) <= candidates
            candidates -= set(out)
        assert len(policy) == len(candidates)
    rest = policy.victims(N_BLOCKS + 1)
    assert sorted(rest) == sorted(candidates)
    assert len(policy) == 0


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=150, deadline=None)
@given(ops=OPS, offers=st.lists(st.integers(0, N_BLOCKS - 1), max_size=20),
       capacity=st.integers(1, 8))
def test_offer_is_insert_then_victim(name, ops, offers, capacity):
    """`offer(b)` (eviction: a victim's parent became a leaf) takes b exactly when `insert(b)`
    then `victim()` would return it, and leaves the same order behind either way: a policy
    that offers and one that inserts and picks agree victim by victim."""
    cls = POLICIES[name]
    t = BlockTable(2, block_size=4, capacity=8)
    fast, slow = cls(capacity, blocks=t), cls(capacity, blocks=t)
    blocks = [mk(t, depth=i % 4, key=content(i % 5) if i % 2 else None) for i in range(N_BLOCKS)]
    candidates: set[int] = set()
    now = 0
    steps = [("offer", b) for b in offers]
    steps = [x for pair in zip(ops, steps) for x in pair] + ops[len(steps):]
    for op, arg in steps:
        b = blocks[arg] if op != "victims" else -1
        if op in ("insert", "offer") and b in candidates or op == "remove" and b not in candidates:
            continue
        if op == "insert":
            fast.insert(b)
            slow.insert(b)
            candidates.add(b)
        elif op == "offer":
            took = fast.offer(b)
            got = b if took else fast.victim()
            slow.insert(b)
            assert slow.victim() == got
            candidates.add(b)
            candidates.discard(got)
        elif op == "remove":
            fast.remove(b)
            slow.remove(b)
            candidates.discard(b)
        elif op == "access":
            now += 1
            t.hits[b] += 1
            t.last_access[b] = now
            fast.access(b)
            slow.access(b)
        elif op == "victims":
            out = fast.victims(arg)
            assert out == slow.victims(arg)
            candidates -= set(out)
        # "recycle" is left out: both would see the same table anyway
        assert len(fast) == len(slow) == len(candidates)
    assert fast.victims(N_BLOCKS + 1) == slow.victims(N_BLOCKS + 1)


def test_priority_heap_sheds_stale_entries_without_a_full_rebuild():
    """Pin/unpin churn leaves stale heap entries; they are drained a bounded number per call
    (no stop-the-world rebuild) while victims keep coming out in priority order."""
    from tiered_cache.policies.lru import LRUPolicy

    p = make(LRUPolicy, 5000)
    t = p.blocks
    blocks = [mk(t, last_access=i) for i in range(5000)]
    for b in blocks:
        p.insert(b)
    clock = 5000
    for _ in range(6):                           # every block pinned and unpinned again
        for b in blocks:
            p.remove(b)
            clock += 1
            t.last_access[b] = clock
            p.insert(b)
        assert len(p._heap) + len(p._old) <= 2 * len(p) + 1024 + 2 * p._DRAIN
    out = p.victims(5000)
    assert [t.last_access[b] for b in out] == sorted(t.last_access[b] for b in blocks)
    assert len(p) == 0


@pytest.mark.parametrize("name", ["s3fifo", "arc"])
def test_ghosts_remember_content_not_block_ids(name):
    """Evicted content comes back as a new block (another id, same key): the ghost must hit."""
    p = make(name, 4)
    t = p.blocks
    mk(t)                                               # keep `again` off first's row
    first = mk(t, key=b"k" * 16)
    p.insert(first)
    assert p.victims(1) == [first]                      # evicted: remembered as a ghost
    again = mk(t, key=b"k" * 16)                        # same content, new block
    assert again != first
    p.insert(again)
    # A ghost hit admits straight to the frequency side: S3-FIFO's main queue, ARC's T2.
    frequent = p._main if name == "s3fifo" else p._t2
    assert again in frequent
    stranger = mk(t, key=b"o" * 16)
    p.insert(stranger)
    assert stranger not in frequent                     # no history: probation / T1


# --- class_credit -------------------------------------------------------------------------------


def keyed(t: BlockTable, i: int, depth: int = 0, last_access: int = 0,
          parent: int = NO_BLOCK) -> int:
    """A published block whose content key is i."""
    return mk(t, depth=depth, last_access=last_access, key=content(i), parent=parent)


def test_class_credit_dead_tails_go_first_once_measured():
    p = make(ClassCreditPolicy, 4)
    t = p.blocks
    # Before anything is measured a tail is an ordinary block: LRU order.
    body = keyed(t, 1, last_access=5)
    p.insert(keyed(t, 3, depth=1, last_access=5, parent=body))   # body has had a child
    gone = p.victims(1)[0]
    drop(t, gone)                           # evicted from the only tier: gone for good
    tail = keyed(t, 2, depth=1, last_access=9)                     # (on the child's old id)
    p.insert(body)
    p.insert(tail)
    assert p.victims(2) == [body, tail]
    # Eight requests of two blocks: the tail (no child, never hit) is evicted and never comes
    # back; the block before it is evicted and its content comes back (the next turn). Evicted
    # blocks are gone, so their ids are handed out again.
    drop(t, body)
    drop(t, tail)
    for r in range(8):
        parent = keyed(t, 100 + r)
        child = keyed(t, 200 + r, depth=1, parent=parent)
        p.insert(child)
        assert p.victims(1) == [child]
        drop(t, child)
        p.insert(parent)
        assert p.victims(1) == [parent]
        drop(t, parent)
        again = keyed(t, 100 + r)           # same content, new block: a ghost return
        p.insert(again)
        assert p.victims(1) == [again]
        drop(t, again)
    assert p.tails_dead()
    # Now a tail goes before an older body block, unless it was hit.
    old = keyed(t, 300, last_access=100)
    p.insert(keyed(t, 301, depth=1, last_access=100, parent=old))
    drop(t, p.victims(1)[0])
    p.insert(old)
    new_tail = keyed(t, 302, depth=1, last_access=200)
    p.insert(new_tail)
    assert p.victims(1) == [new_tail]
    drop(t, new_tail)
    hit_tail = keyed(t, 303, depth=1, last_access=200)
    p.insert(hit_tail)
    hit(p, hit_tail, 201)                   # used twice: an ordinary block again
    assert p.victims(1) == [old]
    assert p.victims(1) == [hit_tail] and len(p) == 0


def test_class_credit_scales_credit_by_measured_odds():
    p = make(ClassCreditPolicy, 8, num_tiers=1)
    t = p.blocks
    b = mk(t)
    t.hits[b], t.inserted_at[b], t.last_access[b] = 3, 10, 200     # 4 uses: class 2 * 3
    assert p.credit(b) == 0.0               # no lifetime measured yet: LRU
    p._lifetime = 8.0
    p._cls[b] = (6, t.gen[b])
    assert p.odds(6) < 1.0
    assert p.credit(b) == pytest.approx(16.0)               # no trials: reuse_credit's credit
    p._trials[6], p._succ[6] = 9.0, 9.0     # the class: 9 reused of 9
    p._all_trials, p._all_succ = 98.0, 24.0  # the tier: mean (24 + 1) / (98 + 2) = 0.25
    r = (9 + 0.25) / 10                     # shrunk by one pseudo-trial at the mean
    k = (r - (r * (1 - r) / 10) ** 0.5) / 0.25              # one standard error low: 3.37
    assert p.odds(6) == pytest.approx(k) and k == pytest.approx(3.3668, abs=1e-4)
    assert p.credit(b) == pytest.approx(16.0 * k)
    assert p.priority(b) == pytest.approx(200 + 16.0 * k)
    t.inserted_at[b] = 190                  # 4 uses within 10 ticks: the overdue cap still holds
    assert p.credit(b) == pytest.approx(2 * 10 / 3)
    t.inserted_at[b] = 10
    p._succ[6] = 0.0                        # a class reused less than average: not below 1x
    assert p.credit(b) == pytest.approx(16.0)


def test_class_credit_counts_a_hit_taken_while_pinned():
    # In a single tier a hit block is pinned (not a candidate) when the cache reports its hit
    # (`access`): a success of its old class, a trial of the new one, kept across the pin.
    p = make(ClassCreditPolicy, 4)
    t = p.blocks
    b = keyed(t, 1, last_access=5)
    p.insert(b)
    assert p.class_of(b) == 3 and p._trials[3] == 1.0 and p._succ[3] == 0.0   # a tail used once
    p.remove(b)                             # pinned by the request that hits it
    hit(p, b, 9)
    p.insert(b)                             # unpinned: 2 uses now
    assert p._succ[3] == 1.0 and p._all_succ == 1.0
    assert p.class_of(b) == 2 * (2).bit_length() and p._trials[4] == 1.0
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
    p = make(HitDensityPolicy, 8)
    t = p.blocks
    blocks = [mk(t, last_access=la) for la in [5, 1, 4, 2, 3]]
    for b in blocks:
        p.insert(b)
    spare = mk(t, last_access=9)
    t.slots[0][spare] = t.slots[1][spare] = 0   # a copy in both tiers: dropping one loses no hit
    p.insert(spare)
    assert p.victims(6) == [spare] + [blocks[i] for i in (1, 3, 4, 2, 0)]


def test_hit_density_counts_a_hit_taken_while_pinned():
    p = make(HitDensityPolicy, 8)
    t = p.blocks
    b = mk(t, last_access=5, key=b"k" * 16)
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
    drop(t, b)                              # gone: its id goes to the next block
    again = mk(t, last_access=30, key=b"k" * 16)    # same content back after the eviction
    assert again == b
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
        p = make(cls, 8)
        _tables(p, young_high)
        old, young = mk(p.blocks, last_access=0), mk(p.blocks, last_access=40)
        p.insert(old)
        p.insert(young)
        got = p.victims(2)
        if cls is UnguardedHitDensityPolicy:      # by the upper bounds alone: young first
            assert got == [young, old]
        else:
            assert got == ([young, old] if first == "young" else [old, young])


def test_hit_density_candidate_appearing_during_a_batch_competes():
    p = make(HitDensityPolicy, 64)
    _tables(p, 0.1)
    olds = [mk(p.blocks, last_access=i) for i in range(10)]
    for b in olds:
        p.insert(b)
    p._now = 50                             # the olds are 41-50 ticks old: LRU order
    assert p.victims(1) == [olds[0]]
    assert p._batch                         # the next victims are chosen already
    fresh = mk(p.blocks, last_access=50)    # age 0: surely the worst
    p.insert(fresh)
    assert p.victims(2) == [fresh, olds[1]]
    p.remove(olds[2])                       # a chosen victim that is pinned meanwhile
    assert p.victims(7) == olds[3:]


# --- recycled ids -------------------------------------------------------------------------------
# A row freed by the table is handed out again by `new`: the same int id names another block.
# State a policy keeps past `remove` carries the row's generation, and ghosts are keyed by
# content, so the new block starts afresh (a miss of history is allowed; inheriting it is not).


def test_s3fifo_recycled_id_inherits_no_parked_state():
    p = make(S3FIFOPolicy, 10)              # small target: 1 block
    t = p.blocks
    a = keyed(t, 1)
    p.insert(a)
    p.remove(a)                             # pinned: parked with its queue and bits
    hit(p, a, 5)
    hit(p, a, 6)
    assert p._parked.get(a) == (1, 2)       # (SMALL, two bits)
    drop(t, a)                              # its copy dropped while pinned: gone for good
    c = keyed(t, 2)
    assert c == a                           # the same id, another block
    assert p._parked.get(c) is None
    p.insert(c)
    assert c in p._small and p._freq[c] == 0        # a newcomer: probation, no bits
    assert p.victims(1) == [c]
    # nor is a main-queue block's place inherited
    drop(t, c)
    d = keyed(t, 3)
    p.insert(d)
    hit(p, d, 7)
    x, y = keyed(t, 4), keyed(t, 5)
    p.insert(x)
    p.insert(y)
    assert p.victims(1) == [x]              # d promoted to main, x evicted
    assert d in p._main
    p.remove(d)
    drop(t, d)
    e = keyed(t, 6)
    assert e == d
    p.insert(e)
    assert e in p._small and e not in p._main and p._freq[e] == 0


@pytest.mark.parametrize("name", ["s3fifo", "arc"])
@pytest.mark.parametrize("published", [True, False])
def test_recycled_id_inherits_no_ghost(name, published):
    p = make(name, 8)
    t = p.blocks
    frequent = p._main if name == "s3fifo" else p._t2
    ghosts = p._ghost if name == "s3fifo" else p._b1

    def block(i: int) -> int:
        return keyed(t, i) if published else mk(t)

    a, z = block(1), block(2)
    p.insert(a)
    p.insert(z)
    assert p.victims(2) == [a, z]           # evicted from probation / T1: two ghosts
    assert len(ghosts) == 2
    p.insert(a)                             # the same block back: its ghost hits
    assert a in frequent and len(ghosts) == 1
    adapted = p.p if name == "arc" else None
    drop(t, z)
    c = block(3)                            # another block on z's id
    assert c == z
    p.insert(c)
    assert c not in frequent and len(ghosts) == 1       # no ghost hit
    if name == "arc":
        assert p.p == adapted               # nor any adaptation from one
    if published:
        # z's content itself coming back, on whatever id, still hits its ghost
        p.remove(c)
        drop(t, c)
        back = keyed(t, 2)
        assert back == z
        p.insert(back)
        assert back in frequent and not ghosts


def test_arc_recycled_id_inherits_no_parked_state():
    p = make(ARCPolicy, 10)
    t = p.blocks
    a = keyed(t, 1)
    p.insert(a)
    p.remove(a)                             # pinned out of T1
    hit(p, a, 2)                            # reused while pinned: parked for T2
    drop(t, a)
    c = keyed(t, 2)
    assert c == a
    p.insert(c)
    assert c in p._t1 and c not in p._t2
    # a block hit before it was ever a candidate (parked as NEW_HIT), then dropped
    d = keyed(t, 3)
    hit(p, d, 3)
    drop(t, d)
    e = keyed(t, 4)
    assert e == d
    p.insert(e)
    assert e in p._t1


@pytest.mark.parametrize("cls", [ReuseCreditPolicy, ClassCreditPolicy])
def test_reuse_credit_recycled_id_resumes_no_uses(cls):
    p = make(cls, 8)
    t = p.blocks
    a = keyed(t, 1, last_access=1)
    hit(p, a, 2)
    hit(p, a, 3)                            # 3 uses
    p.insert(a)
    assert p.victims(1) == [a]              # filed in the ghost: 3 uses
    drop(t, a)
    back = keyed(t, 1, last_access=10)      # the content is back, on the same id
    p.insert(back)
    assert p.uses(back) == 4                # its earlier uses are resumed
    p.remove(back)                          # pinned, then dropped unannounced
    drop(t, back)
    other = keyed(t, 2, last_access=20)     # another block gets the id
    assert other == back
    p._lifetime = 8.0                       # so that any inherited uses would earn credit
    assert p.uses(other) == 1 and p.first_use(other) == t.inserted_at[other]
    assert p.credit(other) == 0.0           # used once: no credit, whatever `back` had
    p.insert(other)
    assert p.uses(other) == 1
    hit(p, other, 30)                       # its own second use
    assert p.uses(other) == 2
    if cls is ClassCreditPolicy:
        assert p.class_of(other) == 2 * (2).bit_length()   # a trial of 2 uses, not 5


def test_class_credit_recycled_id_inherits_no_class_or_child():
    p = make(ClassCreditPolicy, 8)
    t = p.blocks
    body = keyed(t, 1)
    child = keyed(t, 2, depth=1, parent=body)
    p.insert(child)                         # body has had a candidate child
    hit(p, body, 3)                         # body: a trial of class 2 * 2
    assert p.class_of(body) == 4
    assert p.victims(1) == [child]
    drop(t, child)
    drop(t, body)                           # body dropped without being evicted here
    trials = p._all_trials
    tail = keyed(t, 3)                      # a new leaf used once, on body's id
    assert tail == body
    assert p.class_of(tail) is None
    p.insert(tail)
    assert p.class_of(tail) == 3            # a tail: not "had a child", not class 4
    assert p._all_trials == trials + 1      # its own trial, not a continuation
    assert p._succ[4] == 0.0                # and no success credited to body's class
    # A block on a recycled id that had a child of its own is a body block, not a tail.
    p.remove(tail)
    drop(t, tail)
    body2 = keyed(t, 4)
    assert body2 == body
    kid = keyed(t, 5, depth=1, parent=body2)
    p.insert(kid)
    assert p.victims(1) == [kid]
    drop(t, kid)                            # its child left: only the policy remembers it
    p.insert(body2)
    assert p.class_of(body2) == 2
    # nor the measured odds of the class of the block that had its id
    p.remove(body2)
    drop(t, body2)
    x = keyed(t, 6)
    assert x == body2
    p._trials[2], p._succ[2] = 9.0, 9.0     # body2's class: measured well reused
    assert p.odds(2) > 1.0 and p.scale(x) == 1.0


def test_hit_density_recycled_id_continues_no_trial():
    p = make(HitDensityPolicy, 8)
    t = p.blocks
    a = keyed(t, 1, last_access=1)
    hit(p, a, 2)                            # a trial with hits = 1
    p.insert(a)
    p.remove(a)                             # pinned, then dropped unannounced
    drop(t, a)
    reuse = sum(map(sum, p._reuse))
    b = keyed(t, 2, last_access=5)          # another block, never hit, on the same id
    assert b == a
    p.insert(b)
    assert sum(map(sum, p._reuse)) == reuse     # no "reuse" read off a's trial
    assert p._state[b][2] == 0 and p._state[b][4] == t.gen[b]
    assert p.victims(1) == [b]
    # resumed uses are not inherited either
    drop(t, b)
    back = keyed(t, 2, last_access=9)       # b's content is back: resumes b's one use
    p.insert(back)
    assert p._resumed_uses(back, t.gen[back]) == 1
    p.remove(back)
    drop(t, back)
    other = keyed(t, 3, last_access=12)
    assert other == back
    hit(p, other, 13)                       # seen first with a hit: uses from its own hits only
    assert p._resumed_uses(other, t.gen[other]) == 0
    assert p._state[other][0] == (2).bit_length()
