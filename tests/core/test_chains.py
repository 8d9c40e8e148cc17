"""core/chains.py: each compiled pass over a chain does what a plain Python loop over the same
cells does (random tables, 1 to 3 tiers, chains with pinned, private, slot-less and candidate
blocks); the passes' use in the cache is checked by the differential tests
(tests/policies/test_fast_paths.py) and by every test of open, close and eviction."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tiered_cache.core import chains
from tiered_cache.core.blocks import NO_BLOCK, NO_SLOT, BlockTable

BS = 4


def table(rng: random.Random, tiers: int, n: int = 40) -> BlockTable:
    t = BlockTable(tiers, BS, n)
    for b in range(n):
        t.parent[b] = rng.choice([NO_BLOCK, rng.randrange(n)])
        t.root_id[b] = rng.randrange(3)
        t.ref_count[b] = rng.choice([0, 0, 0, 1, 2])
        t.in_flight[b] = rng.choice([0, 0, 1])
        t.published[b] = rng.choice([0, 1, 1, 1])
        t.candidate[b] = rng.randrange(1 << tiers) if rng.random() < 0.3 else 0
        t.hits[b] = rng.randrange(5)
        t.last_access[b] = rng.randrange(100)
        t.first_child[b] = rng.choice([NO_BLOCK, rng.randrange(n)])
        t.prev_sibling[b] = rng.choice([NO_BLOCK, NO_BLOCK, rng.randrange(n)])
        t.next_sibling[b] = rng.choice([NO_BLOCK, NO_BLOCK, rng.randrange(n)])
        t.gen[b] = rng.choice([0, 7, 0xFFFFFFFF])
        for i in range(tiers):
            t.slots[i][b] = rng.choice([NO_SLOT, rng.randrange(64)])
            t.resident_children[i][b] = rng.choice([0, 0, 1, 2])
        t.tokens[b] = [rng.randrange(4) for _ in range(BS)]
    return t


def chain(rng: random.Random, t: BlockTable, k: int) -> np.ndarray:
    return np.asarray(rng.sample(range(t.capacity), k), dtype=np.intp)


def snapshot(t: BlockTable) -> dict:
    out = {f: list(getattr(t, f)) for f, _, _ in t._FIELDS}
    for f, _, _ in t._PER_TIER:
        out[f] = [list(c) for c in getattr(t, f)]
    out["tokens"] = t.tokens.tolist()
    return out


CASES = [(seed, tiers) for seed in range(30) for tiers in (1, 2, 3)]


@pytest.mark.parametrize("seed,tiers", CASES)
def test_verify(seed, tiers):
    rng = random.Random(seed)
    t = table(rng, tiers)
    ids = chain(rng, t, rng.randrange(1, 12))
    n = len(ids)
    for b, p in zip(ids[1:], ids[:-1]):              # a chain, mostly
        if rng.random() < 0.9:
            t.parent[int(b)] = int(p)
    t.parent[int(ids[0])] = NO_BLOCK if rng.random() < 0.9 else 3
    want = np.concatenate([t.tokens[int(b)] for b in ids]).astype(np.int32)
    if rng.random() < 0.5:
        want[rng.randrange(len(want))] += 1
    rid = t.root_id[int(ids[0])] if rng.random() < 0.8 else 9
    first = NO_BLOCK if rng.random() < 0.7 else t.parent[int(ids[0])]
    for tokens in (True, False):
        good = n
        for i, b in enumerate(ids.tolist()):
            ok = (t.parent[b] == first and (first != NO_BLOCK or t.root_id[b] == rid)) \
                if i == 0 else t.parent[b] == int(ids[i - 1])
            if tokens:
                ok = ok and list(t.tokens[b]) == list(want[i * BS:(i + 1) * BS])
            if not ok:
                good = i
                break
        assert chains.verify(ids, t.view("parent"), t.view("root_id"), t.tokens, want, BS,
                             first, rid, tokens) == good


@pytest.mark.parametrize("seed", range(30))
def test_ancestors(seed):
    """A forest of chains (each parent an earlier row): the chain of n blocks ending at b,
    root first, as the parents give it, or False when b has fewer than n - 1 ancestors."""
    rng = random.Random(seed)
    t = BlockTable(1, BS, 40)
    for b in range(40):
        t.parent[b] = rng.choice([NO_BLOCK, rng.randrange(b)]) if b else NO_BLOCK
    b = rng.randrange(40)
    walk = []
    x = b
    while x != NO_BLOCK:
        walk.append(x)
        x = t.parent[x]
    walk.reverse()
    for n in range(1, len(walk) + 3):
        out = np.full(n, -7, dtype=np.intp)
        ok = chains.ancestors(t.view("parent"), b, n, out)
        assert ok == (n <= len(walk))
        if ok:
            assert out.tolist() == walk[len(walk) - n:]


@pytest.mark.parametrize("seed,tiers", CASES)
def test_survey_pin_touch(seed, tiers):
    rng = random.Random(seed)
    t = table(rng, tiers)
    ids = chain(rng, t, rng.randrange(1, 12))
    before = snapshot(t)
    copies = np.empty((tiers, len(ids)), dtype=bool)
    refs = np.empty(len(ids), dtype=np.int32)
    away = np.full((3, len(ids)), 7, dtype=np.intp)
    got = chains.survey(ids, t.view("ref_count"), t.tier_views("slots"), copies, refs, away)
    bl = ids.tolist()
    want_copies = [[t.slots[i][b] != NO_SLOT for b in bl] for i in range(tiers)]
    assert copies.tolist() == want_copies
    gone = [b for b in bl if t.slots[0][b] == NO_SLOT]
    fastest = [t.fastest_tier(b) for b in gone]
    assert away[:, :len(gone)].tolist() == [
        gone, fastest, [t.slots[f][b] if f >= 0 else NO_SLOT for b, f in zip(gone, fastest)]]
    assert refs.tolist() == [t.ref_count[b] for b in bl]
    assert got == (sum(1 for b in bl if t.ref_count[b]),
                   sum(want_copies[0]),
                   sum(1 for i, b in enumerate(bl) if want_copies[0][i] and not t.ref_count[b]))
    assert snapshot(t) == before                      # a survey writes nothing
    # pin
    counts = np.zeros(tiers, dtype=np.int64)
    out = np.empty(len(ids), dtype=np.intp)
    want_counts = [0] * tiers
    want_refresh = []
    for i, b in enumerate(bl):
        if refs[i] == 0:
            for ti in range(1, tiers):
                want_counts[ti] += want_copies[ti][i]
            if t.candidate[b]:
                want_refresh.append(b)
    want_refs = [int(r) + 1 for r in refs]
    m = chains.pin(ids, refs, t.view("ref_count"), t.view("candidate"), copies, counts, out)
    assert [t.ref_count[b] for b in bl] == want_refs
    assert out[:m].tolist() == want_refresh and counts.tolist() == want_counts
    # touch
    hits = [t.hits[b] for b in bl]
    served = np.zeros(tiers, dtype=np.int64)
    chains.touch(ids, t.view("hits"), t.view("last_access"), 123, copies, served)
    assert [t.hits[b] for b in bl] == [h + 1 for h in hits]
    assert [t.last_access[b] for b in bl] == [123] * len(bl)
    want_served = [0] * tiers
    for i in range(len(bl)):
        if not want_copies[0][i]:
            for ti in range(1, tiers):
                if want_copies[ti][i]:
                    want_served[ti] += 1
                    break
    assert served.tolist() == want_served


@pytest.mark.parametrize("seed,tiers", CASES)
@pytest.mark.parametrize("rev", [False, True])
def test_unpin_stamp_releasable(seed, tiers, rev):
    rng = random.Random(seed)
    t = table(rng, tiers)
    ids = chain(rng, t, rng.randrange(1, 12))
    for b in ids.tolist():
        t.ref_count[b] = rng.choice([1, 1, 2])
    order = ids.tolist()[::-1] if rev else ids.tolist()
    zero_want, refresh_want, counts_want = [], [], [0] * tiers
    for b in order:
        if t.ref_count[b] - 1 == 0:
            zero_want.append(b)
            maybe = False
            for i in range(tiers):
                if t.slots[i][b] != NO_SLOT:
                    counts_want[i] += 1
                    maybe = maybe or t.resident_children[i][b] == 0
            if maybe:
                refresh_want.append(b)
    refs_want = [t.ref_count[b] - 1 for b in ids.tolist()]
    counts = np.zeros(tiers, dtype=np.int64)
    zero = np.empty(len(ids), dtype=np.intp)
    refresh = np.empty(len(ids), dtype=np.intp)
    z, r = chains.unpin(ids, rev, t.view("ref_count"), t.tier_views("slots"),
                        t.tier_views("resident_children"), counts, zero, refresh)
    assert [t.ref_count[b] for b in ids.tolist()] == refs_want
    assert zero[:z].tolist() == zero_want and refresh[:r].tolist() == refresh_want
    assert counts.tolist() == counts_want
    pub = [b for b in ids.tolist() if t.published[b]]
    assert chains.stamp(ids, t.view("published"), t.view("last_access"), 77) == len(pub)
    assert all(t.last_access[b] == 77 for b in pub)
    out = np.empty(len(ids), dtype=np.intp)
    m = chains.releasable(zero, z, t.view("published"), t.view("in_flight"), out)
    assert out[:m].tolist() == [b for b in zero_want
                                if not t.published[b] and not t.in_flight[b]]


def linear(rng: random.Random, tiers: int, t_evict: int, n: int):
    """A chain of n blocks (root first), each the only child of the one before, mostly simple
    leaves-to-be of tier t_evict, with random breaks."""
    t = BlockTable(tiers, BS, n + 4)
    ids = list(range(n))
    for i, b in enumerate(ids):
        t.parent[b] = ids[i - 1] if i else NO_BLOCK
        t.first_child[b] = ids[i + 1] if i + 1 < n else NO_BLOCK
        t.published[b] = 1
        t.slots[t_evict][b] = 10 + b
        t.resident_children[t_evict][b] = 1 if i + 1 < n else 0
    for b in ids[:-1]:                  # breaks
        r = rng.random()
        if r < 0.05:
            t.ref_count[b] = 1
        elif r < 0.1:
            t.in_flight[b] = 1
        elif r < 0.15:
            t.candidate[b] = 1 << t_evict
        elif r < 0.2:
            t.slots[(t_evict + 1) % tiers][b] = 3
        elif r < 0.25:
            t.published[b] = 0
        elif r < 0.3:
            t.resident_children[t_evict][b] = 2
        elif r < 0.33:
            t.next_sibling[ids[ids.index(b) + 1]] = n + 1
        elif r < 0.36:
            t.slots[t_evict][b] = 10_000           # in a shrink's tail
    return t, ids


@pytest.mark.parametrize("seed", range(40))
@pytest.mark.parametrize("tiers", [1, 2])
def test_leaving_and_the_run_passes(seed, tiers):
    rng = random.Random(seed)
    te = rng.randrange(tiers)
    n = rng.randrange(2, 20)
    t, ids = linear(rng, tiers, te, n)
    v = ids[-1]
    limit = 1000
    want = []
    c = v
    while True:
        p = t.parent[c]
        if p == NO_BLOCK or t.prev_sibling[c] != NO_BLOCK or t.next_sibling[c] != NO_BLOCK:
            break
        if (t.resident_children[te][p] != 1 or not t.published[p] or t.in_flight[p]
                or t.ref_count[p] or t.candidate[p] & (1 << te)
                or t.slots[te][p] == NO_SLOT or t.slots[te][p] >= limit
                or any(t.slots[u][p] != NO_SLOT for u in range(tiers) if u != te)):
            break
        want.append(p)
        c = p
    for room in (len(want) + 3, max(1, len(want) // 2)):
        out = np.empty(room, dtype=np.intp)
        m = chains.leaving(v, te, limit, t.view("parent"), t.view("prev_sibling"),
                           t.view("next_sibling"), t.view("resident_children", te),
                           t.view("published"), t.view("in_flight"), t.view("ref_count"),
                           t.view("candidate"), t.tier_views("slots"), out)
        assert out[:m].tolist() == want[:room]
    if not want:
        return
    out = np.asarray(want, dtype=np.intp)
    m = len(want)
    before = snapshot(t)
    fc, kids = t.view("first_child"), t.view("resident_children", te)
    chains.unlink_run(out, 0, m, fc, kids, False)
    assert all(t.first_child[b] == NO_BLOCK and t.resident_children[te][b] == 0 for b in want)
    k = rng.randrange(m + 1)
    chains.unlink_run(out, k + 1, m, fc, kids, True)
    for i, b in enumerate(want):
        if i > k:
            assert t.first_child[b] == before["first_child"][b] == want[i - 1]
            assert t.resident_children[te][b] == 1
    owner = np.zeros(20_000, dtype=np.int32) + 5
    slots = np.empty(k, dtype=np.intp)
    chains.free_run(out, k, t.view("slots", te), owner, t.view("gen"), slots)
    assert slots.tolist() == [before["slots"][te][b] for b in want[:k]]
    for b in want[:k]:
        assert t.slots[te][b] == NO_SLOT and owner[before["slots"][te][b]] == NO_BLOCK
        assert t.gen[b] == (before["gen"][b] + 1) & 0xFFFFFFFF
