"""Blocks of a persistent tier: what a record names, and rebuilding the index from records.

A part of `BlockIndex` (`index.persist`, core/index.py), reaching the block state through its
owner `ix`. Besides a persistent tier's records (`record_meta`, `restore`, `copies_with_hits`),
it is how the node daemon lends its pool's slots to clients and adopts what they publish
(`lend`, `unlend`, `adopt`, `blocks_in`). `record_meta` assumes the lock is held; the others
take it.

NOTE: a restart rebuilds only what can be reached: a record is restored when its parent is
(depth-0 records hang off their root key), its key is the chained hash of its parent's key and
its tokens, and no block with that key exists yet. Anything else (an orphan whose ancestors were
never persisted, a duplicate, a record under another hash function) is returned for erasure.
Demotion into a persistent tier therefore persists a block's ancestors with it
(core/moves.py), so chains survive a restart whole.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tiered_cache.core.atomic import atomic
from tiered_cache.core.blocks import NO_BLOCK
from tiered_cache.core.transfer import RecordMeta
from tiered_cache.jit import LazyModule

if TYPE_CHECKING:
    from tiered_cache.core.index import BlockIndex

chains = LazyModule("tiered_cache.core.chains")
"""core/chains.py, imported at first use (tiered_cache/jit.py LazyModule: no numba at import)."""

log = logging.getLogger("tiered_cache.persist")

CHAIN_MIN = 8
"""Chains at least this long take `adopt`'s bulk path (below it the arrays cost more than they
save)."""


@dataclass(slots=True, eq=False, repr=False)
class Persistence:
    ix: BlockIndex                  # the owner: block state, `space`, `copies`

    def record_meta(self, b: int) -> RecordMeta:
        """b's identity for a record (lock held): key, parent key, root key, depth, tokens,
        hits."""
        ix = self.ix
        t = ix.blocks
        root = ix.root_keys[t.root_id[b]]
        p = t.parent[b]
        key, parent = t.key[b], t.key[p] if p != NO_BLOCK else root
        assert key is not None and parent is not None       # (b is published, so is p)
        return RecordMeta(key, parent, root, t.depth[b], t.token_bytes(b), t.hits[b])

    def lend(self, tier: int, n: int) -> list[int]:
        """n free slots of `tier` (evicting by policy as needed) that the caller fills outside
        the lock and then `adopt`s or `unlend`s: the node daemon's destinations for blocks a
        client published. Raises CapacityError, changing nothing, when the tier is full of
        pinned blocks."""
        ix = self.ix
        with atomic(), ix.lock:
            return ix.space.reserve(tier, n)

    def unlend(self, tier: int, slots: list[int]) -> None:
        """Give back slots of `lend` that no block took."""
        ix = self.ix
        with atomic(), ix.lock:
            for s in slots:
                ix.space.free_slot(tier, s)
            ix.space.unreserve(tier, len(slots))

    def blocks_in(self, tier: int) -> list[int]:
        """Published blocks with a copy in `tier`, parents before children."""
        ix = self.ix
        with atomic(), ix.lock:
            t = ix.blocks
            mine, owner = ix._slots[tier], ix.tiers[tier].owner
            out = [b for s, b in enumerate(owner) if b >= 0 and t.key[b] is not None
                   and mine[b] == s]
            return sorted(out, key=t.depth.__getitem__)

    def adopt(self, tier: int, root_id: int, entries: list) -> list[int]:
        """Publish blocks whose KV a client process copied into reserved slots of `tier` (the
        node daemon's shared pool): `entries` are (slot, RecordMeta) in chain order. A block is
        taken only if its key is the chained hash of its parent's key and its tokens, its root
        is `root_id`'s, its parent is published here (or it hangs off the root) and its key is
        new; its slot is given back otherwise. Returns, per entry, the block it became (NO_BLOCK:
        not taken).

        NOTE: the KV itself cannot be checked here: a client can only ever publish into its
        own tenant (`root_id` is the daemon's, not the client's word), where it is the source
        of those tokens' KV anyway."""
        ix = self.ix
        with atomic(), ix.lock:
            t = ix.blocks
            root = ix.root_keys[root_id]
            prefix, key_of = ix.prefix, ix.hasher.key
            nbytes = 4 * ix.block_size
            ix.space.unreserve(tier, len(entries))
            rows = self._adopt_chain(tier, root_id, entries)
            if rows is not None:
                return rows
            taken: list[int] = []
            made: list[tuple[int, RecordMeta]] = []     # (slot, meta) of those taken
            up: list[int] = []      # per taken: its parent's id here, or -2 - (its index)
            fresh: dict[bytes, int] = {}    # key -> index in `made` (parents of later ones)
            root_of, depth_of = t.root_id, t.depth
            for slot, m in entries:
                ok = (m.root == root and m.key not in prefix and m.key not in fresh
                      and len(m.tokens) == nbytes and key_of(m.parent, m.tokens) == m.key)
                parent = NO_BLOCK
                if ok and m.depth:
                    j = fresh.get(m.parent)
                    if j is not None:
                        ok = made[j][1].depth == m.depth - 1
                        parent = -2 - j
                    else:
                        parent = prefix.get(m.parent, NO_BLOCK)
                        ok = parent != NO_BLOCK and root_of[parent] == root_id and \
                            depth_of[parent] == m.depth - 1
                elif ok:
                    ok = m.parent == root
                if not ok:
                    ix.space.free_slot(tier, slot)
                    taken.append(NO_BLOCK)
                    continue
                fresh[m.key] = len(made)
                taken.append(len(made))
                made.append((slot, m))
                up.append(parent)
            if not made:
                return taken
            n = len(made)
            d0 = made[0][1].depth
            if made[-1][1].depth == d0 + n - 1 and \
                    all(m.depth == d0 + i for i, (_, m) in enumerate(made)):
                rows, _ = t.new_run_ids(d0, n)        # a chain: in one pass
            else:
                rows = [t.new(m.depth, 0) for _, m in made]
            parents = [p if p >= NO_BLOCK else rows[-2 - p] for p in up]
            ids = np.asarray(rows, dtype=np.intp)
            t.view("parent")[ids] = parents
            t.view("root_id")[ids] = root_id
            t.view("hits")[ids] = [m.hits for _, m in made]
            t.view("last_access")[ids] = ix.clock
            t.view("inserted_at")[ids] = ix.clock
            t.tokens[ids] = np.frombuffer(b"".join(m.tokens for _, m in made),
                                          dtype="<i4").reshape(n, ix.block_size)
            key, published, link = t.key, t.published, ix._link
            for b, p, (_, m) in zip(rows, parents, made):     # the tokens are in: publish
                key[b] = m.key
                published[b] = 1
                prefix[m.key] = b
                if p != NO_BLOCK:
                    link(p, b)
            # NOTE: copies deepest first: a block whose child in the batch has its copy already
            # never becomes a candidate only to stop being one a moment later (each candidacy
            # is a policy insert, and a never-used block's insert walks its chain for the
            # duel); the batch's leaves alone become candidates.
            if all(up[i] == -1 - i for i in range(1, n)):
                # A chain (each block the child of the one before): what set_slot does for
                # each, deepest first, in one pass: only the leaf becomes a candidate, and
                # the chain's parent may stop being one.
                mine, owner = ix._slots[tier], ix.tiers[tier].owner
                for b, (slot, _) in zip(rows, made):
                    mine[b] = slot
                    owner[slot] = b
                t.view("resident_children", tier)[ids[:-1]] = 1
                ix._refresh(rows[-1])
                if parents[0] != NO_BLOCK:
                    ix._kids[tier][parents[0]] += 1
                    ix._refresh(parents[0])
                return [b if b == NO_BLOCK else rows[b] for b in taken]
            set_slot = ix.copies.set_slot
            order: Sequence[int] = range(n - 1, -1, -1)    # (chain order: parents first)
            if any(made[i][1].depth < made[i - 1][1].depth for i in range(1, n)):
                order = sorted(range(n), key=lambda i: -made[i][1].depth)
            for i in order:
                set_slot(rows[i], tier, made[i][0])
            return [b if b == NO_BLOCK else rows[b] for b in taken]

    def _adopt_chain(self, tier: int, root_id: int, entries: list) -> list[int] | None:
        """`adopt`'s common case in bulk (lock held, the slots unreserved): `entries` are one
        chain (each block the child of the one before) of at least CHAIN_MIN blocks, and every
        block passes the checks. Returns the new blocks, or None, having changed nothing, when
        anything differs (the general path then finds which entries to refuse).

        NOTE: the keys are checked in one compiled call (`hasher.keys`, from the chain's
        parent key) and compared joined, once every key is known to be 16 bytes (else keys of
        wrong lengths could join into the right bytes); the new blocks' rows, links and copies
        are set in one compiled pass (`chains.adopt_chain`), as the general path sets them one
        by one: tests/core/test_persist.py compares the two."""
        n = len(entries)
        if n < CHAIN_MIN:
            return None
        ix = self.ix
        t = ix.blocks
        prefix = ix.prefix
        # (the entries' columns, transposed in C: RecordMeta's fields in order)
        at_slots, metas = zip(*entries)
        keys, parents, roots, depths, toks, hits = zip(*metas)
        m0 = metas[0]
        d0, root, bs = m0.depth, ix.root_keys[root_id], ix.block_size
        if (parents[1:] != keys[:-1] or depths != tuple(range(d0, d0 + n))
                or roots.count(root) != n or set(map(len, toks)) != {4 * bs}
                or set(map(len, keys)) != {16}
                or len(set(keys)) != n or not prefix.keys().isdisjoint(keys)):
            return None
        if d0 == 0:
            if m0.parent != root:
                return None
            parent = NO_BLOCK
        else:
            parent = prefix.get(m0.parent, NO_BLOCK)
            if parent == NO_BLOCK or t.root_id[parent] != root_id or \
                    t.depth[parent] != d0 - 1:
                return None
        tokens = np.frombuffer(bytearray(b"".join(toks)), dtype="<i4")    # (writable: the
        # compiled kernel is warmed up for writable arrays)
        got = ix.hasher.keys(m0.parent, tokens, 0, n)
        if got != b"".join(keys):                   # (every key is 16 bytes: checked above)
            return None
        # (converted before anything changes: a use count past int64 raises here)
        slots, uses = np.array(at_slots, dtype=np.intp), np.array(hits, dtype=np.int64)
        rows, at = t.new_run_ids(d0, n)
        ids = at if at is not None else np.asarray(rows, dtype=np.intp)
        # rows, links (each block the only child of the one before) and copies in one pass
        chains.adopt_chain(
            ids, parent, root_id, uses, ix.clock, tokens.reshape(n, bs), slots,
            t.view("parent"), t.view("root_id"), t.view("hits"), t.view("last_access"),
            t.view("inserted_at"), t.tokens, t.view("published"), t.view("first_child"),
            t.view("next_sibling"), t.view("prev_sibling"), t.view("slots", tier),
            np.frombuffer(ix.tiers[tier].owner, dtype=np.int32),
            t.view("resident_children", tier))
        key = t.key
        for b, k in zip(rows, keys):                # the tokens are in: publish
            key[b] = k
        prefix.update(zip(keys, rows))
        if parent != NO_BLOCK:
            ix._link(parent, rows[0])
        # as in `adopt`'s chain case: only the leaf becomes a candidate, the chain's parent
        # may stop being one
        ix._refresh(rows[-1])
        if parent != NO_BLOCK:
            ix._kids[tier][parent] += 1
            ix._refresh(parent)
        return rows

    def copies_with_hits(self, tier: int) -> tuple[list[int], list[int]]:
        """(slots, use counts) of every published block with a copy in `tier`."""
        ix = self.ix
        with atomic(), ix.lock:
            t = ix.blocks
            mine, hits, owner = ix._slots[tier], t.hits, ix.tiers[tier].owner
            slots = [s for s in range(len(owner)) if owner[s] >= 0
                     and t.key[owner[s]] is not None and mine[owner[s]] == s]
            return slots, [hits[owner[s]] for s in slots]

    def restore(self, tier: int, records: list) -> list[int]:
        """Publish blocks whose only copy is a record in `tier`: `records` are (slot, header)
        pairs (header: key, parent, root, depth, tokens, hits). Returns the slots to erase."""
        ix = self.ix
        with atomic(), ix.lock:
            t = ix.blocks
            bs = ix.block_size
            state = ix.tiers[tier]
            alloc, mine, kids = state.allocator, ix._slots[tier], ix._kids[tier]
            hasher, prefix = ix.hasher, ix.prefix
            reject: list[int] = []
            why: Counter[str] = Counter()
            made: list[int] = []
            for slot, h in sorted(records, key=lambda r: r[1].depth):
                bad = None
                if len(h.tokens) != 4 * bs:
                    bad = "another block size"
                elif h.key in prefix:
                    bad = "a duplicate key"
                elif not 0 <= slot < alloc.num_slots or not alloc.is_free(slot):
                    bad = "a slot outside the tier"
                elif hasher.key(h.parent, h.tokens) != h.key:
                    bad = "a key that is not the chained hash of its parent and tokens"
                elif h.depth == 0:
                    if h.parent != h.root:
                        bad = "a depth-0 record whose parent is not its root"
                    parent, root_id = NO_BLOCK, hasher.root_id_for_key(h.root)
                else:
                    parent = prefix.get(h.parent, NO_BLOCK)
                    if parent == NO_BLOCK or t.depth[parent] != h.depth - 1 or \
                            ix.root_keys.get(t.root_id[parent]) != h.root:
                        bad = "an orphan (its parent was not persisted)"
                    else:
                        root_id = t.root_id[parent]
                if bad is not None:
                    reject.append(slot)
                    why[bad] += 1
                    continue
                b = t.new(h.depth, 0)
                alloc.allocate_at(slot)
                mine[b] = slot
                state.owner[slot] = b
                t.key[b] = h.key
                t.published[b] = 1
                t.tokens[b] = np.frombuffer(h.tokens, dtype="<i4")
                t.parent[b] = parent
                t.root_id[b] = root_id
                t.hits[b] = h.hits
                t.last_access[b] = t.inserted_at[b] = 0     # older than anything served since
                prefix[h.key] = b
                ix.root_keys[root_id] = h.root
                if parent != NO_BLOCK:
                    ix._link(parent, b)
                    kids[parent] += 1
                made.append(b)
            for b in made:
                ix._refresh(b)
            ix.counters.recovered_blocks += len(made)
            if reject:
                log.warning("tier %s: %d record(s) not restored (%s); they are erased",
                            state.name, len(reject),
                            "; ".join(f"{n} x {r}" for r, n in why.most_common()))
            return reject
