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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tiered_cache.core.atomic import atomic
from tiered_cache.core.blocks import NO_BLOCK
from tiered_cache.core.transfer import RecordMeta

if TYPE_CHECKING:
    from tiered_cache.core.index import BlockIndex

log = logging.getLogger("tiered_cache.persist")


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
            prefix, hasher = ix.prefix, ix.hasher
            taken: list[int] = []
            for slot, m in entries:
                parent = NO_BLOCK if m.depth == 0 else prefix.get(m.parent, NO_BLOCK)
                ok = (m.root == root and m.key not in prefix and len(m.tokens) == 4 *
                      ix.block_size and hasher.key(m.parent, m.tokens) == m.key
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
