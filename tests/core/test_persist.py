"""core/persist.py `adopt` (the node daemon's publish): the batched version does what adopting
entry by entry did (the reference below: the code it replaced, with copies set in chain order),
on random batches of good and bad entries (chains, forks, duplicates, wrong keys, roots, depths
and token lengths, parents in the index or earlier in the batch): the same blocks taken, the
same ids, the same index state, candidates included; with the default policy too (its walk
then hears each chain once)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tiered_cache import CacheConfig, TieredKVCache
from tiered_cache.core import persist
from tiered_cache.core.atomic import atomic
from tiered_cache.core.blocks import NO_BLOCK
from tiered_cache.core.invariants import check_invariants
from tiered_cache.core.transfer import RecordMeta

BS = 4


def cache(policy: str) -> TieredKVCache:
    return TieredKVCache(CacheConfig.from_dict({
        "model": {"name": "m", "num_layers": 2, "num_kv_heads": 1, "head_dim": 4,
                  "dtype": "float16"},
        "block_size": BS, "storage": "none", "policy": policy,
        "tiers": {"gpu": {"device": "cpu", "num_blocks": 400}, "host": {"num_blocks": 0}},
        "migrator": {"enabled": False}, "compactor": {"enabled": False}}))


def reference_adopt(ix, tier: int, root_id: int, entries: list) -> list[int]:
    """`adopt` entry by entry (before batching)."""
    with atomic(), ix.lock:
        t = ix.blocks
        root = ix.root_keys[root_id]
        prefix, hasher = ix.prefix, ix.hasher
        taken = []
        for slot, m in entries:
            parent = NO_BLOCK if m.depth == 0 else prefix.get(m.parent, NO_BLOCK)
            ok = (m.root == root and m.key not in prefix and len(m.tokens) == 4 * BS
                  and hasher.key(m.parent, m.tokens) == m.key
                  and (m.parent == root if m.depth == 0 else
                       parent != NO_BLOCK and t.root_id[parent] == root_id
                       and t.depth[parent] == m.depth - 1))
            ix.space.unreserve(tier)
            if not ok:
                ix.space.free_slot(tier, slot)
                taken.append(NO_BLOCK)
                continue
            b = t.new(m.depth, 0)
            t.key[b] = m.key
            t.published[b] = 1
            t.tokens[b] = np.frombuffer(m.tokens, dtype="<i4")
            t.parent[b] = parent
            t.root_id[b] = root_id
            t.hits[b] = m.hits
            t.last_access[b] = t.inserted_at[b] = ix.clock
            prefix[m.key] = b
            if parent != NO_BLOCK:
                ix._link(parent, b)
            ix.copies.set_slot(b, tier, slot)
            taken.append(b)
        return taken


def batch(rng: random.Random, ix, root: bytes, other_root: bytes, known: list[RecordMeta]):
    """Entries parents first: chains off the root or off known blocks, with forks and faults."""
    h = ix.hasher
    out: list[RecordMeta] = []
    tips = [(root, -1)] + [(m.key, m.depth) for m in known]
    for _ in range(rng.randrange(1, 5)):
        parent, depth = rng.choice(tips + [(m.key, m.depth) for m in out] or tips)
        for _ in range(rng.randrange(1, 12)):
            toks = np.asarray([rng.randrange(50) for _ in range(BS)], "<i4").tobytes()
            m = RecordMeta(h.key(parent, toks), parent, root, depth + 1, toks, rng.randrange(3))
            r = rng.random()
            if r < 0.04:
                m = RecordMeta(bytes(16), m.parent, m.root, m.depth, m.tokens, m.hits)
            elif r < 0.07:
                m = RecordMeta(m.key, m.parent, other_root, m.depth, m.tokens, m.hits)
            elif r < 0.10:
                m = RecordMeta(m.key, m.parent, m.root, m.depth + 1, m.tokens, m.hits)
            elif r < 0.12:
                m = RecordMeta(m.key, m.parent, m.root, m.depth, m.tokens[:-4], m.hits)
            elif r < 0.15 and (out or known):
                m = rng.choice(out or known)            # a duplicate
            out.append(m)
            parent, depth = m.key, m.depth
    out.sort(key=lambda m: m.depth)                     # parents first
    return out


def state(c: TieredKVCache) -> tuple:
    ix = c.index
    t = ix.blocks
    live = sorted(t.live_ids())
    return (dict(ix.prefix), live, [list(s) for s in t.slots],
            [list(k) for k in t.resident_children], list(t.candidate), list(t.parent),
            list(t.root_id), list(t.hits), t.tokens[live].tolist(),
            [(x.reserved, x.allocator.num_free) for x in c.tiers],
            sorted(c.tiers[0].policy._live), list(t.first_child), list(t.next_sibling),
            list(t.prev_sibling), [list(x.owner) for x in c.tiers])


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
@pytest.mark.parametrize("seed", range(25))
def test_batched_adopt_is_adopt_entry_by_entry(policy, seed):
    rng = random.Random(seed)
    caches = [cache(policy), cache(policy)]
    roots = [c.index.register_root("t", None) for c in caches]
    other = caches[0].index.register_root("u", None)[0]
    assert roots[0] == roots[1]
    root, rid = roots[0]
    known: list[RecordMeta] = []
    for _ in range(6):
        entries = batch(rng, caches[0].index, root, other, known)
        got = []
        for i, c in enumerate(caches):
            slots = c.index.persist.lend(0, len(entries))
            pairs = list(zip(slots, entries))
            got.append(c.index.persist.adopt(0, rid, pairs) if i == 0 else
                       reference_adopt(c.index, 0, rid, pairs))
        assert got[0] == got[1]
        known += [m for m, b in zip(entries, got[0]) if b != NO_BLOCK]
        if policy == "lru":
            assert state(caches[0]) == state(caches[1])
        else:                       # (the duel hears chains whole now: compare the rest)
            a, b = state(caches[0]), state(caches[1])
            assert a[:-1] == b[:-1]
        for c in caches:
            check_invariants(c)
    assert any(b == NO_BLOCK for b in got[0]) or len(known) > 10


def chain(rng: random.Random, ix, root: bytes, other_root: bytes, known: list[RecordMeta],
          fault: str | None) -> list[RecordMeta]:
    """One chain of CHAIN_MIN..40 blocks off the root or a known block (`adopt`'s bulk path),
    with at most one fault at a random position (the general path then takes over)."""
    h = ix.hasher
    parent, depth = rng.choice([(root, -1)] + [(m.key, m.depth) for m in known])
    out: list[RecordMeta] = []
    n = rng.randrange(persist.CHAIN_MIN, 40)
    at = rng.randrange(n)
    for i in range(n):
        toks = np.asarray([rng.randrange(50) for _ in range(BS)], "<i4").tobytes()
        m = RecordMeta(h.key(parent, toks), parent, root, depth + 1, toks, rng.randrange(3))
        if i == at and fault == "key":
            m = m._replace(key=bytes(16)) if hasattr(m, "_replace") else \
                RecordMeta(bytes(16), m.parent, m.root, m.depth, m.tokens, m.hits)
        elif i == at and fault == "root":
            m = RecordMeta(m.key, m.parent, other_root, m.depth, m.tokens, m.hits)
        elif i == at and fault == "depth":
            m = RecordMeta(m.key, m.parent, m.root, m.depth + 1, m.tokens, m.hits)
        elif i == at and fault == "tokens":
            m = RecordMeta(m.key, m.parent, m.root, m.depth, m.tokens[:-4], m.hits)
        elif i == at and fault == "short key":
            m = RecordMeta(m.key[:15], m.parent, m.root, m.depth, m.tokens, m.hits)
        elif i == at and fault == "duplicate" and known:
            m = rng.choice(known)
        out.append(m)
        parent, depth = m.key, m.depth
    if fault == "split key":
        # two keys of 15 and 17 bytes that join into the right 32, the links following them:
        # every joined comparison passes, and neither is a key
        j = min(at, n - 2)
        k, k2 = out[j].key, out[j + 1].key
        out[j] = out[j]._replace(key=k[:15])
        out[j + 1] = out[j + 1]._replace(key=k[15:] + k2, parent=k[:15])
        if j + 2 < n:
            out[j + 2] = out[j + 2]._replace(parent=k[15:] + k2)
    return out


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
@pytest.mark.parametrize("seed", range(10))
def test_bulk_chain_adopt_is_adopt_entry_by_entry(policy, seed, monkeypatch):
    """Whole chains take the bulk path (`_adopt_chain`) and leave what the reference leaves,
    links and owners included; a chain with a fault anywhere falls back to the general path
    with nothing changed by the bulk one."""
    rng = random.Random(1000 + seed)
    bulk: list[bool] = []
    real = persist.Persistence._adopt_chain

    def spy(self, *a):
        out = real(self, *a)
        bulk.append(out is not None)
        return out

    monkeypatch.setattr(persist.Persistence, "_adopt_chain", spy)
    caches = [cache(policy), cache(policy)]
    roots = [c.index.register_root("t", None) for c in caches]
    other = caches[0].index.register_root("u", None)[0]
    root, rid = roots[0]
    known: list[RecordMeta] = []
    faults = [None, None, "key", "root", "depth", "tokens", "short key", "split key",
              "duplicate"]
    rng.shuffle(faults)
    for fault in [None] + faults:
        entries = chain(rng, caches[0].index, root, other, known, fault)
        got = []
        for i, c in enumerate(caches):
            slots = c.index.persist.lend(0, len(entries))
            pairs = list(zip(slots, entries))
            got.append(c.index.persist.adopt(0, rid, pairs) if i == 0 else
                       reference_adopt(c.index, 0, rid, pairs))
        assert got[0] == got[1]
        assert bulk[-1] == (fault is None), (fault, bulk)
        known += [m for m, b in zip(entries, got[0]) if b != NO_BLOCK]
        a, b = state(caches[0]), state(caches[1])
        if policy == "lru":
            assert a == b
        else:                       # (the duel hears chains whole: compare the rest)
            assert a[:-5] == b[:-5] and a[-4:] == b[-4:]
        for c in caches:
            check_invariants(c)
    assert any(bulk)
