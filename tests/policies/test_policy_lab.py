"""Policies replayed through the real cache on tiny hand-made traces with known answers.

Traces use block_size 2 and capacities of 2-4 blocks, so every eviction can be followed by hand.
A request is a list of trace ids; block j of a request holds tokens all equal to its id.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tiered_cache.core.blocks import NO_SLOT, BlockTable
from tiered_cache.policies import POLICIES
from tiered_cache.policies.belady import NEVER, BeladyPolicy, NextUseOracle, block_key
from tiered_cache.policies.reuse_credit import ReuseCreditPolicy
from tiered_cache.tools.replay import attach_oracle, build_cache, replay

BS = 2


def trace(*requests):
    return [{"hash_ids": list(r)} for r in requests]


def per_request_hits(requests, policy, gpu, host=0):
    """Replay through the real cache, returning the hit blocks of every request."""
    cache = build_cache(block_size=BS, gpu_blocks=gpu, host_blocks=host, policy=policy)
    oracle = attach_oracle(cache, requests)
    out = []
    for i, r in enumerate(requests):
        if oracle is not None:
            oracle.advance(i)
        seq = cache.open(np.repeat(np.asarray(r["hash_ids"], np.int32), BS))
        out.append(seq.num_cached_tokens // BS)
        cache.mark_computed(seq)
        cache.close(seq)
    return out, cache


def test_new_policies_are_registered():
    assert POLICIES["belady"] is BeladyPolicy
    assert POLICIES["reuse_credit"] is ReuseCreditPolicy


# --- a loop one block larger than the cache ---------------------------------------------------
# Capacity 2, requests [1] [2] [3] [1] [2] [3]. LRU (and LFU: nothing is ever hit, ties go to
# the least recent) always evicts the block needed next: 0 hits. Belady at [3] evicts 2 (next
# use 4 > 3) and keeps 1: hit at [1]; at [2] it evicts 1 (never used again) and keeps 3: hit.

LOOP = trace([1], [2], [3], [1], [2], [3])


@pytest.mark.parametrize("policy,hits", [("lru", 0), ("lfu", 0), ("belady", 2),
                                         ("reuse_credit", 0), ("class_credit", 0),
                                         ("hit_density", 0)])
def test_loop_larger_than_cache(policy, hits):
    got, _ = per_request_hits(LOOP, policy, gpu=2)
    assert sum(got) == hits
    if policy == "belady":
        assert got == [0, 0, 0, 1, 0, 1]


# --- frequency against recency ----------------------------------------------------------------
# Capacity 2: [1] [1] [2] [3] [1]. Request 1 hits block 1. At [3] the candidates are 1 (one
# hit, last used at request 1) and 2 (no hit, used at request 2). LRU evicts 1 and misses it at
# the end; LFU and Belady evict 2 (LFU: fewer hits; Belady: never used again) and hit 1.
# reuse_credit has seen no eviction yet, so it has no lifetime to credit and is LRU.

FREQ = trace([1], [1], [2], [3], [1])


@pytest.mark.parametrize("policy,hits", [("lru", [0, 1, 0, 0, 0]), ("lfu", [0, 1, 0, 0, 1]),
                                         ("belady", [0, 1, 0, 0, 1]),
                                         ("reuse_credit", [0, 1, 0, 0, 0]),
                                         ("class_credit", [0, 1, 0, 0, 0]),
                                         ("hit_density", [0, 1, 0, 0, 0])])
def test_frequency_against_recency(policy, hits):
    got, _ = per_request_hits(FREQ, policy, gpu=2)
    assert got == hits


# --- prefix chains: leaves go first -----------------------------------------------------------
# Capacity 4: [1 2 3] then [4 5 6]: one free slot, two of 1, 2, 3 must go, and only leaves can:
# 3, then 2 (the chain is cut from the tail, whatever the policy). [1 2 3] then hits block 1.

CHAIN = trace([1, 2, 3], [4, 5, 6], [1, 2, 3])


@pytest.mark.parametrize("policy", ["lru", "lfu", "belady", "reuse_credit", "class_credit",
                                    "hit_density"])
def test_chains_are_cut_from_the_tail(policy):
    got, _ = per_request_hits(CHAIN, policy, gpu=4)
    assert got == [0, 0, 1]


# --- hit_density: a loop larger than the tier, with enough evidence ---------------------------
# Sixty rounds of 20 one-block requests through 16 slots. LRU (and reuse_credit, class_credit:
# LRU plus credit) always evicts the block needed next: 0 hits. The optimum keeps 15 of the 20
# and hits 15 requests in 19. hit_density measures the reuse distance (20 requests) from ghost
# returns; the block just used is then surely the furthest from its next use, and the policy
# reaches the optimum once the counts are in.


def test_hit_density_learns_a_loop_larger_than_the_tier():
    loop = trace(*([[i] for i in range(1, 21)] * 60))
    for policy in ("lru", "class_credit"):
        got, _ = per_request_hits(loop, policy, gpu=16)
        assert sum(got) == 0
    got, cache = per_request_hits(loop, "hit_density", gpu=16)
    assert sum(got[-200:]) >= 150                # the last ten rounds: 15/19 = 0.79 at best
    assert sum(got[:40]) == 0                    # the first two rounds: no evidence yet, LRU


# --- every tier holding a copy hears of a reuse, pinned or not -------------------------------
# [1 2] then [1 2] again in a single tier: the second request pins blocks 1 and 2 (they leave
# the candidates) and then reuses them. ARC must see that reuse (`access`) to move them from
# T1 (used once) to T2 (used twice) when they come back as candidates.


def test_a_reuse_of_pinned_blocks_reaches_the_policy():
    got, cache = per_request_hits(trace([1, 2], [1, 2]), "arc", gpu=4)
    assert got == [0, 2]
    arc = cache.tiers[0].policy
    assert len(arc._t2) == 1 and not arc._t1        # the leaf is a candidate again, in T2
    got, cache = per_request_hits(trace([1, 2], [1, 2]), "class_credit", gpu=4)
    # the leaf's reuse is a success; block 1 was never a candidate before (its child was), so
    # its reuse only starts its first trial here
    p = cache.tiers[0].policy
    assert p._all_succ == 1.0 and p._all_trials == 3.0


# --- reuse_credit: frequency that survives eviction ---------------------------------------------
# Capacity 2, forty rounds of [1] [x] [y] with x, y fresh each round. LRU loses block 1 to the
# two fresh blocks every round (0 hits); so do LFU, ARC and S3-FIFO, whose counts and ghosts are
# per Block and die with it. reuse_credit remembers block 1's uses in its ghost (by content key)
# and, once it has measured the tier's lifetime, credits it lifetime * log2(uses) > its gap:
# one eviction per request from request 2 on; the first sets the clock, the lifetime is measured
# after 16 more (request 18, the 7th round's [1], a miss); from round 7 on every [1] hits: 33.


def hot_block_rounds(rounds=40):
    reqs, fresh = [], 100
    for _ in range(rounds):
        reqs += [[1], [fresh], [fresh + 1]]
        fresh += 2
    return trace(*reqs)


@pytest.mark.parametrize("policy,hits", [("lru", 0), ("lfu", 0), ("arc", 0), ("s3fifo", 0),
                                         ("reuse_credit", 33), ("class_credit", 33),
                                         ("hit_density", 0), ("belady", 39)])
def test_hot_block_among_one_hit_wonders(policy, hits):
    # class_credit: every block here is the tail of its request, and tails are measured dead;
    # block 1 still is not one, because it is used more than once (its uses live in the ghost).
    # hit_density: two slots keep 64 trials of counts, too few to be 3 standard errors sure
    # that the fresh block is worth less than block 1: LRU order throughout.
    got, cache = per_request_hits(hot_block_rounds(), policy, gpu=2)
    assert sum(got) == hits
    if policy in ("reuse_credit", "class_credit"):
        assert got[0::3] == [0] * 7 + [1] * 33
        p = cache.tiers[0].policy
        assert p.lifetime > 0


def test_reuse_credit_formula_and_overdue_cap():
    t = BlockTable(num_tiers=1, block_size=BS)
    p = ReuseCreditPolicy(8, blocks=t)
    b = t.new(0)
    t.hits[b], t.inserted_at[b], t.last_access[b] = 3, 10, 50
    assert p.uses(b) == 4
    assert p.credit(b) == 0.0                      # no lifetime measured yet: LRU
    p._lifetime = 8.0
    assert p.credit(b) == pytest.approx(16.0)      # 8 * log2(4)
    assert p.priority(b) == pytest.approx(66.0)
    t.inserted_at[b] = 45                          # 4 uses within 5 ticks, silent since:
    assert p.credit(b) == pytest.approx(2 * 5 / 3)  # at most twice the mean interval (5/3)
    once = t.new(0)
    t.last_access[once] = 50
    assert p.credit(once) == 0.0                   # used once: no credit


def test_reuse_credit_is_lru_without_reuse():
    # Distinct single-use chains: nothing earns credit, so the hit rate equals LRU's.
    rng = random.Random(1)
    reqs = trace(*[[rng.randrange(1, 60)] for _ in range(400)])
    a = replay(reqs, gpu_blocks=4, block_size=BS, policy="lru")["hit_blocks"]
    b = replay(reqs, gpu_blocks=4, block_size=BS, policy="reuse_credit")["hit_blocks"]
    assert b >= a * 0.9


# --- Belady --------------------------------------------------------------------------------------


def min_hits(seq, cap):
    """Textbook MIN for single-block requests: on a miss with a full cache, evict the cached id
    whose next use is farthest."""
    cache, hits = set(), 0
    for i, x in enumerate(seq):
        if x in cache:
            hits += 1
            continue
        if len(cache) >= cap:
            rest = seq[i + 1:]
            cache.remove(max(sorted(cache),
                             key=lambda y, rest=rest: rest.index(y) if y in rest else len(seq)))
        cache.add(x)
    return hits


@pytest.mark.parametrize("seed", range(4))
def test_belady_matches_textbook_min_on_single_block_requests(seed):
    rng = random.Random(seed)
    seq = [rng.randrange(1, 9) for _ in range(120)]
    got = replay(trace(*[[x] for x in seq]), gpu_blocks=3, block_size=BS,
                 policy="belady")["hit_blocks"]
    assert got == min_hits(seq, 3)


def test_belady_is_never_worse_than_lru_on_random_chains():
    rng = random.Random(7)
    reqs = []
    for _ in range(300):
        root = rng.randrange(5)
        reqs.append([root * 100 + k for k in range(rng.randrange(1, 5))])
    for cap in (4, 6, 10):
        lru = replay(trace(*reqs), gpu_blocks=cap, block_size=BS, policy="lru")
        bel = replay(trace(*reqs), gpu_blocks=cap, block_size=BS, policy="belady")
        assert bel["hit_blocks"] >= lru["hit_blocks"]


def test_belady_handles_ids_that_are_not_prefix_chained():
    # Id 7 appears at depth 0 and at depth 1 (a trace that is not prefix-chained): two blocks
    # share one trace id, and block 7 at depth 1 is requested without being hit whenever its
    # parent is gone. The oracle re-keys both; the replay must not fail and must beat nothing
    # less than LRU.
    reqs = trace([7], [3, 7], [7], [4], [3, 7], [5], [7], [3, 7])
    for cap in (2, 3):
        bel = replay(reqs, gpu_blocks=cap, block_size=BS, policy="belady")
        lru = replay(reqs, gpu_blocks=cap, block_size=BS, policy="lru")
        assert bel["hit_blocks"] >= lru["hit_blocks"]


def test_next_use_oracle():
    o = NextUseOracle([[1, 2], [2], [3], [1]])
    assert o.next_use(1) == 0 and o.next_use(3) == 2      # before any advance: first use
    o.advance(0)
    assert o.next_use(1) == 3 and o.next_use(2) == 1 and o.next_use(9) == NEVER
    o.advance(1)
    assert o.next_use(2) == NEVER
    o.advance(3)
    assert o.next_use(1) == NEVER


def test_belady_without_oracle_is_lru_and_reads_block_keys():
    t = BlockTable(num_tiers=1, block_size=BS)
    p = BeladyPolicy(4, blocks=t)
    blocks = []
    for la in [5, 1, 3]:
        b = t.new(0)
        t.last_access[b] = la
        blocks.append(b)
        p.insert(b)
    assert p.victims(3) == [blocks[1], blocks[2], blocks[0]]
    b = t.new(0)
    t.tokens[b] = np.full(BS, 1234, np.int32)     # what replay publishes for trace id 1234
    t.key[b] = b"k" * 16
    assert block_key(t, b) == 1234
    private = t.new(0)
    t.tokens[private] = 99                        # a private row's tokens mean nothing
    assert block_key(t, private) is None


def test_two_tier_replay_reports_moves():
    # gpu 3 + host 3, LRU, write_back: [1 2 3] fills the device; [4 5 6] demotes 3, 2, 1 to the
    # host; [1 2 3] hits all three in the host and promotes them, evicting 4 5 6 from the device;
    # the host is full of the promoted blocks' copies, so 4 5 6 are dropped.
    r = replay(trace([1, 2, 3], [4, 5, 6], [1, 2, 3]), gpu_blocks=3, host_blocks=3,
               block_size=BS, policy="lru")
    assert r["hit_blocks"] == 3
    assert r["hit_rate_by_tier"] == {"gpu": 0.0, "host": pytest.approx(3 / 9)}
    assert r["promotions"]["blocks"] == 3 and r["demotions"]["blocks"] == 3
    assert r["evictions"] == {"gpu": 6, "host": 0}
    assert r["dropped_blocks"] == 3


def test_reuse_credit_spare_copies_go_first_and_stale_ones_are_rekeyed():
    t = BlockTable(num_tiers=2, block_size=BS)

    def blk(la, slots):
        b = t.new(0)
        t.last_access[b] = la
        for tier, slot in enumerate(slots):
            t.slots[tier][b] = slot
        return b

    p = ReuseCreditPolicy(8, blocks=t)
    only = blk(5, [NO_SLOT, 3])           # the block's only copy, least recent
    spare = blk(10, [0, 4])               # also held by the device tier: a spare copy
    p.insert(only)
    p.insert(spare)
    assert p.victims(1) == [spare]
    p.insert(spare)
    t.slots[0][spare] = NO_SLOT           # its device copy left; nobody re-keyed it here
    assert p.victims(1) == [only]         # so it is re-keyed by its own recency instead
    assert p.victims(1) == [spare] and len(p) == 0


def test_reuse_credit_two_tiers_not_below_lru():
    rng = random.Random(5)
    reqs = []
    for _ in range(400):
        root = rng.choice([0, 0, 0, 1, 2, 3, 4, 5, 6, 7])
        reqs.append([root * 100 + k for k in range(rng.randrange(1, 6))])
    reqs = trace(*reqs)
    lru = replay(reqs, gpu_blocks=6, host_blocks=6, block_size=BS, policy="lru")
    ours = replay(reqs, gpu_blocks=6, host_blocks=6, block_size=BS, policy="reuse_credit")
    assert ours["hit_blocks"] >= lru["hit_blocks"]
    cc = replay(reqs, gpu_blocks=6, host_blocks=6, block_size=BS, policy="class_credit")
    assert cc["hit_blocks"] >= lru["hit_blocks"]
