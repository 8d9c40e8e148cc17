"""`ArrayDuel` (the duel over arrays, compiled) against `duel.Duel` (the reference): random
streams of chains published and reused, the state compared after every call: scores, choice,
the history entry by entry and in order, every mini cache's resident set, child counts, live
heap entries and measured turnover."""

from __future__ import annotations

import math
import random

import pytest

from tiered_cache.policies.duel import Duel
from tiered_cache.policies.duel_arrays import ArrayDuel
from tiered_cache.policies.shadow import EXPERTS, Expert


def key(i: int) -> bytes:
    # spread over both words, and keys sharing a word (LRU ties go to the bytes)
    return (i % 7).to_bytes(8, "big") + (i * 0x9E3779B1 % (1 << 64)).to_bytes(8, "big")


def credit_live(ref_m, arr_m, arr) -> tuple[list, list]:
    """(priority, -depth, key) of the live entries of a credit mini cache in both duels."""
    ref = sorted((float(p), d, h) for p, d, s, h, _ in ref_m.heap
                 if ref_m.res.get(h) == s and h not in ref_m.kids)
    slot_key = {}
    S = arr._S
    from tiered_cache.policies import duel_kernels as K
    from tiered_cache.policies.duel_arrays import _key
    for s in range(arr._G[K.G_FRESH]):
        slot_key[s] = _key(S[s, K.KHI], S[s, K.KLO])
    got = []
    for p, d, serial, slot in arr_m.heap:
        h = slot_key[slot]
        if arr_m.res.get(h) == serial and h not in arr_m.kids:
            got.append((float(p), d, h))
    return ref, sorted(got)


def same(ref: Duel, arr: ArrayDuel) -> None:
    assert arr.choice == ref.choice and arr.switches == ref.switches
    assert arr.tails_dead == ref.tails_dead and arr.now == ref.now
    assert [list(r) for r in arr.wins] == ref.wins
    hist = arr.hist
    assert list(hist.items()) == list(ref.hist.items())
    for m_ref, m_arr in zip(ref.minis, arr.minis):
        assert m_arr.kind == m_ref.kind and len(m_arr) == len(m_ref)
        if m_ref.kind == "lru":
            assert m_arr.res == m_ref.res
            assert sorted((float(a), b, c) for a, b, c in m_arr.heap) == \
                sorted((float(a), b, c) for a, b, c in m_ref.heap)
        else:
            assert set(m_arr.res) == set(m_ref.res)
            assert {h for h, v in m_arr.res.items() if v == -1} == \
                {h for h, v in m_ref.res.items() if v == -1}
            assert m_arr.kids == m_ref.kids
            a, b = credit_live(m_ref, m_arr, arr)
            assert a == b
    assert arr.lifetimes == [m.turnover.lifetime for m in ref.minis]


class Stream:
    """Chains over a tree of keys: roots, shared middles, fresh tails; reuses of known chains;
    now and then a use at a clock already seen (announced)."""

    def __init__(self, seed: int, roots: int = 40) -> None:
        self.rng = random.Random(seed)
        self.roots = roots
        self.fresh = 10_000
        self.chains: list[list[int]] = []
        self.clock = 0

    def step(self):
        rng = self.rng
        if rng.random() < 0.85:
            self.clock += rng.choice((1, 1, 1, 2, 5))
        if self.chains and rng.random() < 0.45:
            chain = rng.choice(self.chains[-300:])
            cut = rng.randrange(1, len(chain) + 1)
            return "hits", chain[:cut], self.clock
        root = rng.randrange(self.roots)
        mids = [100 + root * 20 + rng.randrange(4) for _ in range(rng.randrange(3))]
        tail = list(range(self.fresh, self.fresh + rng.randrange(1, 6)))
        self.fresh += len(tail)
        chain = [root] + mids + tail
        self.chains.append(chain)
        return "publish", chain, self.clock


def drive(duels, stream: Stream, ops: int, check_every: int = 1) -> None:
    depth = {}
    for i in range(ops):
        kind, chain, t = stream.step()
        for j, c in enumerate(chain):
            depth.setdefault(c, j)
        keys = [key(c) for c in chain]
        depths = [depth[c] for c in chain]
        if kind == "hits":
            stop = stream.rng.choice((-1, -1, 0, 1))
            done = {d.hits(keys, [t] * len(keys), depths, None, stop) for d in duels}
            assert len(done) == 1
        else:
            start = stream.rng.randrange(0, len(chain))      # a prefix was a hit before
            parent = keys[start - 1] if start else None
            tail = stream.rng.random() < 0.7
            for d in duels:
                d.publish_keys(keys[start:], [t] * (len(keys) - start), depths[start:], parent,
                               tail)
        if i < 300 or i % check_every == 0:
            same(*duels)
    same(*duels)


@pytest.mark.parametrize("seed", [pytest.param(0, marks=pytest.mark.slow), 1, 2, 3, 4,
                                  pytest.param(5, marks=pytest.mark.slow)])   # (the long two)
def test_random_streams_match_the_reference(seed):
    rng = random.Random(seed)
    cap = rng.choice((8, 16, 40))
    experts = EXPERTS if seed % 3 else (EXPERTS[0], Expert("gap", 16.0, 2.0), EXPERTS[2])
    kw = dict(experts=experts, z=rng.choice((1.0, 2.0)), mini_slots=4, max_rate=1)
    duels = (Duel(cap, **kw), ArrayDuel(cap, **kw))
    assert duels[1].cap == duels[0].cap and duels[1].hist_limit == duels[0].hist_limit
    drive(duels, Stream(seed, roots=rng.choice((10, 40, 200))), 2500, check_every=5)
    assert duels[0].switches > 0 or seed % 2        # streams that do move the choice


def test_long_run_trims_and_grows():
    """Past the history limit (trims, slots reused) and past the first allocations (arrays
    grown), still the reference's state, checked every 400 calls."""
    duels = (Duel(24, mini_slots=4, max_rate=1), ArrayDuel(24, mini_slots=4, max_rate=1))
    drive(duels, Stream(99, roots=300), 12_000, check_every=400)
    ref, arr = duels
    assert len(ref.hist) >= ref.hist_limit          # trimming
    assert arr._S.shape[0] > 768                     # grown past its first rows


def test_fixed_and_choose():
    d = ArrayDuel(1000, z=2.0)
    reuse = 1
    d.wins[reuse][0], d.wins[0][reuse] = 14.0, 6.0  # d = 8 < 2 * sqrt(20) = 8.94
    d._choose()
    assert d.choice == 0
    d.wins[reuse][0] = 16.0                          # d = 10 > 2 * sqrt(22) = 9.38
    d._choose()
    assert d.choice == reuse and d.switches == 1
    d.fixed = 2
    d._choose()
    assert d.choice == 2 and d.fixed == 2


def test_walk_helpers_match_the_reference():
    duels = (Duel(16, mini_slots=4, max_rate=1), ArrayDuel(16, mini_slots=4, max_rate=1))
    keys = [key(i) for i in range(6)]
    for d in duels:
        d.publish_keys(keys[:3], [5] * 3, [0, 1, 2], None, True)
    for d in duels:
        assert d.first_announced(keys, [5] * 6) == 0
        assert d.first_announced(keys[3:], [5] * 3) == -1
        assert d.first_announced(keys, [6] * 6) == -1
    import numpy as np
    la = np.array([5, 5, 5, 7, 7, 7], np.int64)      # block i holds key i (last use la[i])
    born = np.array([5, 5, 5, 7, 7, 7], np.int64)
    dep = np.arange(6, dtype=np.int64)
    walk = np.array([5, 4, 3, 2, 1], np.int64)        # deepest first, from block 5 up
    for d in duels:
        assert d.deepest_announced([keys[i] for i in walk], walk, la, 0) == 3    # block 2
        # a walk from block 5 up to 1: 1 and 2 are announced, so 3..5 go (parent 2)
        assert d.walk_publish([keys[i] for i in walk], walk, la, born, dep, 0, key(99)) == 3
    same(*duels)
    assert duels[0].hist[keys[3]][3] == keys[2] and duels[0].hist[keys[5]][5] == 1   # tail


def test_keys_must_be_16_bytes():
    d = ArrayDuel(64)
    with pytest.raises(ValueError, match="16 bytes"):
        d.hit(b"short", 1, None, 0)
    assert not d.hist


def test_log2_matches_python():
    """The credit experts rank by lifetimes * L * log2(uses): compiled log2 must be libm's,
    as CPython's (checked through the priorities both duels give)."""
    import numpy as np
    from numba import njit

    from tiered_cache.policies import duel_kernels as K

    @njit
    def log2s(xs):
        out = np.empty(len(xs))
        for i in range(len(xs)):
            out[i] = math.log2(xs[i])
        return out

    xs = list(range(2, 5000)) + [10**6 + 7, 2**40 + 3]
    assert log2s(np.asarray(xs, np.int64)).tolist() == [math.log2(x) for x in xs]
    assert K.TAIL_FIRST == 2.0**38
