"""The adaptive policy: it follows the expert its duel of mini caches picks, starts at LRU and
comes back to it, keeps bounded state keyed by content, and no recycled id inherits anything.

Replays go through the real cache (`storage: none`) on small hand-made streams whose answer is
known: a hot set among one-time scans (LRU loses it), and hot sets that move on (LRU is right
and frequency keeps the old ones)."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from tiered_cache.core.blocks import NO_BLOCK, BlockTable
from tiered_cache.policies import POLICIES, AdaptivePolicy
from tiered_cache.policies.base import CachePolicy
from tiered_cache.policies.duel import Duel, sample_rate
from tiered_cache.policies.duel_arrays import ArrayDuel
from tiered_cache.policies.reuse_credit import GHOST_PER_SLOT
from tiered_cache.policies.shadow import EXPERTS, PARENT, Expert, credit
from tiered_cache.tools.replay import build_cache, replay

BS = 4


def trace(requests):
    return [{"hash_ids": list(r)} for r in requests]


def run(requests, policy, gpu, host=0):
    """Replay through the real cache; (hit blocks, the device tier's policy, the cache)."""
    cache = build_cache(block_size=BS, gpu_blocks=gpu, host_blocks=host, policy=policy)
    hits = 0
    for r in requests:
        seq = cache.open(np.repeat(np.asarray(r["hash_ids"], np.int32), BS))
        hits += seq.num_cached_tokens // BS
        cache.mark_computed(seq)
        cache.close(seq)
    return hits, cache.tiers[0].policy, cache


def scan_with_hot_set(n=6000, hot=48, seed=0):
    """One request in three reuses one of `hot` blocks; the others are one-time scans. Between
    two uses of a hot block come ~144 distinct blocks, so LRU in 64 slots never keeps one."""
    rng = random.Random(seed)
    reqs, fresh = [], 10_000
    for i in range(n):
        if i % 3 == 0:
            reqs.append([1 + rng.randrange(hot)])
        else:
            reqs.append([fresh])
            fresh += 1
    return trace(reqs)


def moving_hot_sets(n=6000, size=24, per=400, seed=0):
    """Phases of `per` requests, each reusing one of `size` blocks of its phase, never used
    again after it: the recent phase is all that matters (LRU), and frequency keeps the old."""
    rng = random.Random(seed)
    return trace([[1 + (i // per) * size + rng.randrange(size)] for i in range(n)])


# --- the choice -----------------------------------------------------------------------------


def test_registered_and_lru_first():
    assert POLICIES["adaptive"] is AdaptivePolicy
    assert EXPERTS[0].name == "lru" and EXPERTS[0].lifetimes == 0.0
    with pytest.raises(ValueError, match="first expert must be LRU"):
        Duel(100, (Expert("reuse", 1.0, 2.0),))


def test_switches_away_from_lru_where_lru_loses():
    reqs = scan_with_hot_set()
    lru, _, _ = run(reqs, "lru", 64)
    got, policy, _ = run(reqs, "adaptive", 64)
    assert policy.expert.name != "lru"
    assert policy.duel.switches >= 1
    assert got > 2 * lru                        # measured: 1898 against 746


class Freq(AdaptivePolicy):
    """adaptive, following `freq` whatever its duel says."""

    name = "adaptive_freq"
    pinned = "freq"


@pytest.mark.slow                       # a long trace
def test_stays_with_lru_where_recency_wins(monkeypatch):
    reqs = moving_hot_sets()
    lru, _, _ = run(reqs, "lru", 32)
    got, policy, _ = run(reqs, "adaptive", 32)
    assert policy.expert.name == "lru" and policy.duel.switches == 0
    assert got == lru                           # following LRU, it is LRU, block for block
    d = policy.duel
    freq = [e.name for e in EXPERTS].index("freq")
    assert d.wins[0][freq] > d.wins[freq][0]    # the duel saw frequency lose here ...
    monkeypatch.setitem(POLICIES, Freq.name, Freq)
    pinned, _, _ = run(reqs, Freq.name, 32)
    assert pinned < lru                         # ... and following it would have lost


def test_without_reuse_it_is_lru():
    rng = random.Random(3)
    reqs = trace([[rng.randrange(1, 200) for _ in range(rng.randrange(1, 6))]
                  for _ in range(1500)])
    a = replay(reqs, gpu_blocks=40, block_size=BS, policy="lru")["hit_blocks"]
    got, policy, _ = run(reqs, "adaptive", 40)
    if policy.duel.switches == 0:
        assert got == a
    assert got >= 0.99 * a


def test_mcnemar_rule_needs_z_standard_errors():
    d = Duel(1000, z=2.0)
    reuse = 1
    d.wins[reuse][0], d.wins[0][reuse] = 14.0, 6.0  # d = 8 < 2 * sqrt(20) = 8.94
    d._choose()
    assert d.choice == 0
    d.wins[reuse][0] = 16.0                          # d = 10 > 2 * sqrt(22) = 9.38
    d._choose()
    assert d.choice == reuse and d.switches == 1
    d.wins[0][reuse] = 40.0                          # LRU pulls ahead: back to the floor
    d._choose()
    assert d.choice == 0 and d.switches == 2


def test_pinned_follows_one_expert():
    class Reuse(AdaptivePolicy):
        pinned = "reuse"

    t = BlockTable(1, block_size=BS)
    p = Reuse(16, blocks=t)
    assert p.expert.name == "reuse" and p.duel.fixed == 1
    p.duel.wins[0][1] = 1e6
    p.duel._choose()
    assert p.duel.choice == 1


def test_switches_are_paced_by_the_capacity():
    """A switch snapshots the candidates for re-keying (O(candidates)): at most one per
    `capacity` hook calls, so that costs O(1) amortised per call."""
    t = BlockTable(1, block_size=BS, capacity=8)
    p = AdaptivePolicy(100, blocks=t)
    p.duel.choice = 1
    p._follow()
    assert p.expert.name == "reuse"
    p.duel.choice = 0
    p._calls += 99
    p._follow()
    assert p.expert.name == "reuse"             # too soon: the switch waits
    p._calls += 1
    p._follow()
    assert p.expert.name == "lru"


def test_a_chain_is_announced_to_the_duel_once():
    """A never-hit chain reaches the duel when its last block first becomes a candidate; its
    blocks becoming candidates again later (the leaf evicted, in any order) walk no further
    than one segment (`adaptive.WALK` blocks) past the first announced block, so a fresh
    insert costs O(1), not O(depth)."""
    from tiered_cache.policies.adaptive import WALK

    depth = 3 * WALK + 8
    t = BlockTable(1, block_size=BS, capacity=depth)
    p = AdaptivePolicy(48, blocks=t)
    assert p.duel.rate == 1                         # every key is sampled
    chain, parent = [], NO_BLOCK
    for i in range(depth):
        b = t.new(i)
        t.key[b], t.parent[b], t.inserted_at[b], t.last_access[b] = content(i), parent, 7, 7
        if parent != NO_BLOCK:
            t.first_child[parent] = b
        chain.append(b)
        parent = b
    calls = []                                      # (duel entry point, keys handed in)

    def spy(name):
        real = getattr(p.duel, name)
        setattr(p.duel, name, lambda keys, *a: (calls.append((name, len(keys))),
                                                real(keys, *a))[1])

    for name in ("publish", "publish_keys", "walk_publish", "deepest_announced",
                 "first_announced"):
        spy(name)
    p.insert(chain[-1])
    assert calls[-1] == ("walk_publish", depth)     # the whole chain, once
    assert len(p.duel.hist) == depth
    for b in reversed(chain[1:]):
        calls.clear()
        assert p.victim() == b
        p._exposed = NO_BLOCK                       # as if another victim came in between
        t.first_child[t.parent[b]] = NO_BLOCK
        p.insert(t.parent[b])
        # one look at no more than a segment: its first sampled block is announced
        assert len(calls) == 1 and calls[0][1] <= WALK, calls
    assert all(e[0] == 1 for e in p.duel.hist.values())     # nothing used twice


def test_credit_formula():
    assert credit(0.0, math.inf, 100.0, 8, 50) == 0.0          # LRU
    assert credit(16.0, 2.0, 10.0, 1, 50) == 0.0               # used once
    assert credit(16.0, 2.0, 10.0, 5, 40) == pytest.approx(20.0)   # 2 * 40 / 4 < 16 * 10 * 2
    assert credit(16.0, math.inf, 10.0, 4, 40) == pytest.approx(320.0)
    assert credit(1.0, 2.0, 10.0, 4, 3000) == pytest.approx(20.0)  # 1 lifetime per doubling


def test_sample_rate():
    assert sample_rate(10) == 1 and sample_rate(63) == 1
    assert sample_rate(64) == 2 and sample_rate(500) == 8 and sample_rate(131071) == 8
    assert sample_rate(131072) == 16 and sample_rate(10**6) == 64 and sample_rate(2**40) == 256
    assert sample_rate(10**6, max_rate=64) == 64


# --- state: bounded, keyed by content ---------------------------------------------------------


def churn(n=5000, seed=7):
    """Chains that branch and repeat: shared roots, reused middles, one-time tails."""
    rng = random.Random(seed)
    reqs = []
    for i in range(n):
        root = rng.randrange(30)
        mid = [100 + root * 50 + rng.randrange(8) for _ in range(rng.randrange(0, 3))]
        tail = [10_000 + i * 8 + k for k in range(rng.randrange(1, 6))]
        reqs.append([1 + root] + mid + tail)
    return trace(reqs)


@pytest.mark.parametrize("host", [0, pytest.param(96, marks=pytest.mark.slow)])
def test_state_stays_bounded_under_churn(host):
    cap = 48
    _, _, cache = run(churn(), "adaptive", cap, host)
    for tier in cache.tiers:
        p = tier.policy
        slots = tier.allocator.num_slots
        assert len(p._ghost.current()) + len(p._ghost.old()) <= GHOST_PER_SLOT * slots
        assert len(p._ghost.current()) == len(p._ghost) > 0
        assert len(p._live) == len(p) <= slots
        assert len(p._heap) + len(p._old) <= max(1024, 2 * len(p._live)) + 2 * p._DRAIN
        assert len(p._rekey) <= len(p._live)
        d = p.duel
        assert len(d.hist) <= d.hist_limit + len(d.minis)
        for m in d.minis:
            assert len(m) <= d.cap + 1
            if m.kind == "lru":
                assert len(m.heap) == len(m.res)
            else:
                assert len(m.heap) <= 4 * m.cap + 64 + len(m.res)
                assert set(m.kids) <= set(m.res)


@pytest.mark.slow                       # a long trace through every mini cache
def test_mini_caches_stay_prefix_closed():
    """A mini cache never holds a key without its (sampled) parent: leaves first, as the real
    cache, on the projected tree. Every key is sampled at this size (R = 1)."""
    _, policy, _ = run(churn(3000, seed=11), "adaptive", 48)
    d = policy.duel
    assert d.rate == 1
    for m in d.minis:
        keys = m.res
        for h in keys:
            parent = d.hist[h][PARENT]
            assert parent is None or parent in keys
        if m.kind == "credit":
            for h, n in m.kids.items():
                assert n == sum(1 for k in keys if d.hist[k][PARENT] == h)


def content(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_recycled_ids_never_inherit_state():
    class Reuse(AdaptivePolicy):
        pinned = "reuse"
        mini_slots = 1

    t = BlockTable(1, block_size=BS, capacity=8)
    p = Reuse(8, blocks=t)
    p._turnover.lifetime = 10.0
    # a block used 4 times, then evicted: the ghost remembers its content's uses
    a = t.new(0)
    t.key[a], t.inserted_at[a], t.last_access[a], t.hits[a] = content(1), 1, 30, 3
    p.insert(a)
    assert p.victim() == a
    t.key[a] = None
    t.free(a)
    # its row goes to other content: no credit from the ghost, no state of a's
    b = t.new(0)
    assert b == a
    t.key[b], t.inserted_at[b], t.last_access[b] = content(2), 40, 40
    assert p.priority(b) == 40.0
    # a's content back under another id resumes its uses: 5 uses since clock 1
    c = t.new(0)
    assert c != a
    t.key[c], t.inserted_at[c], t.last_access[c] = content(1), 50, 50
    assert p.priority(c) == pytest.approx(50.0 + min(1.0 * 10.0 * math.log2(5), 2.0 * 49 / 4))


def test_a_copy_evicted_and_back_counts_its_uses_once():
    """In a lower tier the same block can be evicted, come back (demoted again) and be
    evicted again, with its hit counter still counting: the ghost replaces its hits of the
    first time instead of adding them again."""
    class Freq(AdaptivePolicy):
        pinned = "freq"

    t = BlockTable(2, block_size=BS, capacity=8)
    p = Freq(8, blocks=t)
    p._turnover.lifetime = 10.0
    a = t.new(0)
    t.key[a], t.inserted_at[a], t.last_access[a], t.hits[a] = content(1), 1, 20, 2
    p.insert(a)
    assert p.victim() == a                           # filed: 3 uses
    assert p._uses(a) == (3, 1)
    t.hits[a], t.last_access[a] = 5, 40              # the same block, hit 3 more times
    assert p._uses(a) == (6, 1)                      # not 3 + 6
    p.insert(a)
    assert p.priority(a) == pytest.approx(40.0 + 16.0 * 10.0 * math.log2(6))
    assert p.victim() == a
    other = t.new(0)                                 # its content, published again
    t.key[other], t.inserted_at[other], t.last_access[other] = content(1), 50, 50
    assert p._uses(other) == (7, 1)


def test_a_recycled_parent_id_is_a_fresh_block():
    """`_exposed` (the parent of the last victim, not a fresh chain when it is inserted) keeps
    the row's generation: a fresh block that got the parent's id after it left is fresh."""
    t = BlockTable(1, block_size=BS, capacity=8)
    p = AdaptivePolicy(8, blocks=t)
    assert p.duel.rate == 1                         # every key is sampled
    parent = t.new(0)
    t.key[parent] = content(10)
    leaf = t.new(1)
    t.key[leaf], t.parent[leaf] = content(11), parent
    t.first_child[parent] = leaf
    p.insert(leaf)                                  # fresh: the chain goes to the duel
    assert content(11) in p.duel.hist and content(10) in p.duel.hist
    assert p.victim() == leaf and p._exposed == parent
    # the parent leaves without ever being a candidate here; its row is reused
    t.first_child[parent] = NO_BLOCK
    for b in (leaf, parent):
        t.key[b] = None
        t.free(b)
    again = t.new(0)
    assert again == parent
    t.key[again], t.last_access[again], t.inserted_at[again] = content(12), 5, 5
    p.insert(again)
    assert content(12) in p.duel.hist               # walked: a fresh chain, not an exposure


def test_remove_drops_per_block_state():
    t = BlockTable(1, block_size=BS, capacity=8)
    p = AdaptivePolicy(8, blocks=t)
    blocks = []
    for i in range(6):
        b = t.new(0)
        t.key[b], t.last_access[b] = content(i), i
        p.insert(b)
        blocks.append(b)
    for b in blocks:
        p.remove(b)
    assert len(p) == 0 and not p._live
    assert p.victims(3) == []


# --- two tiers -------------------------------------------------------------------------------


def test_each_tier_has_its_own_duel():
    reqs = scan_with_hot_set(3000)
    _, _, cache = run(reqs, "adaptive", 64, host=64)
    dev, host = (t.policy for t in cache.tiers)
    assert dev.duel is not host.duel
    assert dev.duel.hist and host.duel.hist
    lru = replay(reqs, gpu_blocks=64, host_blocks=64, block_size=BS, policy="lru")
    got = replay(reqs, gpu_blocks=64, host_blocks=64, block_size=BS, policy="adaptive")
    assert got["hit_blocks"] >= lru["hit_blocks"]


# --- a restart of the disk tier ----------------------------------------------------------------


def test_a_disk_restart_rebuilds_candidates_with_their_use_counts(tmp_path):
    """As for every policy, a restart starts the policies empty and `restore` inserts the
    restored leaves; the use counts come back in the table (`hits`, from the records), which
    is where this policy reads them."""
    from tests.helpers import make_cache, write_pattern_all
    from tiered_cache.core.invariants import check_invariants

    def disk_cache():
        return make_cache(gpu_blocks=8, host_blocks=8, policy="adaptive",
                          migrator={"enabled": True, "wait_timeout_s": 20.0},
                          extra={"tiers": {"disk": {"path": str(tmp_path), "num_blocks": 256}}})

    def serve(cache, toks):
        seq = cache.open(toks)
        for layer in range(cache.num_layers):
            cache.wait(seq, layer)
        write_pattern_all(cache, seq)
        got = seq.cached_tokens_by_tier.get("disk", 0)
        cache.close(seq)
        return got

    prompts = [[i * 1000 + j for j in range(2 * BS)] for i in range(20)]
    cache = disk_cache()
    for _ in range(3):
        for toks in prompts:
            serve(cache, toks)
    cache.migrator.settle()
    cache.shutdown()
    again = disk_cache()
    t, policy = again.index.blocks, again.tiers[2].policy
    assert isinstance(policy, AdaptivePolicy) and len(policy) > 0
    assert any(t.hits[b] for b in policy._live)
    for b in policy._live:
        assert policy._uses(b) == (t.hits[b] + 1, 0)     # uses from the record, clock 0
    check_invariants(again)
    assert sum(serve(again, toks) for toks in prompts) > 0
    check_invariants(again)
    again.shutdown()


# --- the compiled paths against the plain ones ---------------------------------------------


class Plain(AdaptivePolicy):
    """adaptive on its plain paths: the reference duel (`duel.Duel`), `access` block by block,
    the walk block by block in Python, the general `offer`, and eviction one block at a time
    (no runs)."""

    name = "adaptive_plain"
    duel_class = Duel
    access_many = CachePolicy.access_many             # one block at a time
    offer = AdaptivePolicy._offer
    offer_run = CachePolicy.offer_run                 # eviction offers block by block
    offers_runs = False
    _walk = AdaptivePolicy._walk_each


def _duel_state(d) -> tuple:
    return (d.choice, d.switches, d.tails_dead, [list(r) for r in d.wins],
            list(d.hist.items()))


@pytest.mark.parametrize("workload,gpu,host", [
    pytest.param("churn", 40, 0, marks=pytest.mark.slow), ("churn", 120, 0), ("churn", 300, 0),
    ("scan", 64, 0), pytest.param("chat", 100, 0, marks=pytest.mark.slow), ("agent", 300, 0),
    pytest.param("rag", 120, 0, marks=pytest.mark.slow), ("churn", 48, 96),
    pytest.param("chat", 60, 120, marks=pytest.mark.slow),      # (slow: the long four)
])
def test_fast_paths_do_what_the_plain_paths_do(workload, gpu, host, monkeypatch):
    """The same requests through a cache on the default policy and one on `Plain`: the same
    hits, the same blocks in the same slots, the same duel (scores, choice, every history
    entry), request by request, at sample rates 1 to 8, on one tier and two."""
    from tiered_cache.tools import workloads

    monkeypatch.setitem(POLICIES, Plain.name, Plain)
    if workload == "churn":
        reqs = churn(900, seed=gpu)
    elif workload == "scan":
        reqs = scan_with_hot_set(1500)
    else:
        reqs = workloads.generate(workload, 250, seed=1, block_size=BS)
    fast = build_cache(block_size=BS, gpu_blocks=gpu, host_blocks=host, policy="adaptive")
    plain = build_cache(block_size=BS, gpu_blocks=gpu, host_blocks=host, policy=Plain.name)
    assert isinstance(fast.tiers[0].policy.duel, ArrayDuel)
    hits = [0, 0]
    for n, r in enumerate(reqs):
        toks = np.repeat(np.asarray(r["hash_ids"], np.int32), BS)[:gpu * BS]
        for i, cache in enumerate((fast, plain)):
            seq = cache.open(toks)
            hits[i] += seq.num_cached_tokens
            cache.mark_computed(seq)
            cache.close(seq)
        assert hits[0] == hits[1], n
        assert dict(fast.index.prefix) == dict(plain.index.prefix), n
        assert [list(s) for s in fast.index.blocks.slots] == \
            [list(s) for s in plain.index.blocks.slots], n
        if n % 25 == 0 or n == len(reqs) - 1:
            for a, b in zip(fast.tiers, plain.tiers):
                assert _duel_state(a.policy.duel) == _duel_state(b.policy.duel), n
                assert a.policy._ghost == b.policy._ghost and a.policy.expert == b.policy.expert
    assert fast.tiers[0].policy.duel.rate == plain.tiers[0].policy.duel.rate


@pytest.mark.parametrize("case", ["chain", "candidate", "candidates", "gaps", "unpublished",
                                  "deep"])
def test_access_many_is_access_block_by_block(case):
    """One call for a reused chain does what `access` does block by block: the same duel, the
    same clock, the same switch pacing, whatever the chain holds."""
    t = BlockTable(1, block_size=BS, capacity=64)
    one, many = AdaptivePolicy(40, blocks=t), AdaptivePolicy(40, blocks=t)
    keyed = AdaptivePolicy(40, blocks=t)             # handed the chain's keys, as the index does
    assert one.duel.rate == 1
    chain, parent = [], NO_BLOCK
    for i in range(12):
        b = t.new(i)
        t.key[b], t.parent[b], t.inserted_at[b], t.last_access[b] = content(100 + i), parent, 3, 3
        if parent != NO_BLOCK:
            t.first_child[parent] = b
        chain.append(b)
        parent = b
    for p in (one, many, keyed):
        p.insert(chain[-1])                        # published: the duel hears the chain
        if case == "candidates":                   # the first, two adjacent, the last
            for b in (chain[0], chain[5], chain[6], chain[9]):
                p.insert(b)
    blocks = chain
    if case == "gaps":
        blocks = chain[::2]
    elif case == "unpublished":
        t.key[chain[7]] = None
    elif case == "deep":
        blocks = chain[4:]
    if case not in ("candidate", "candidates"):
        for p in (one, many, keyed):
            p.remove(chain[-1])
    for clock in (5, 9, 14):
        for b in chain:
            t.hits[b] += 1
            t.last_access[b] = clock
        for b in blocks:
            one.access(b)
        many.access_many(np.asarray(blocks, dtype=np.intp))
        if case == "unpublished":                  # (no keys to hand over: never passed)
            keyed.access_many(np.asarray(blocks, dtype=np.intp))
        else:
            keyed.access_many(np.asarray(blocks, dtype=np.intp),
                              keys=b"".join(t.key[b] for b in blocks))
        assert (many._calls, many._now) == (one._calls, one._now)
        assert _duel_state(many.duel) == _duel_state(one.duel)
        assert sorted(many._live.items()) == sorted(one._live.items())
        assert (keyed._calls, keyed._now) == (one._calls, one._now)
        assert _duel_state(keyed.duel) == _duel_state(one.duel)
        assert sorted(keyed._live.items()) == sorted(one._live.items())
