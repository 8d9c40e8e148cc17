"""Blocks of a persistent tier: what a record names, and rebuilding the index from records.

A mixin of `BlockIndex` (core/index.py).

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

import numpy as np

from tiered_cache.core.atomic import atomic
from tiered_cache.core.blocks import NO_BLOCK
from tiered_cache.core.transfer import RecordMeta

log = logging.getLogger("tiered_cache.persist")


class Persistence:
    def record_meta(self, b: int) -> RecordMeta:
        """b's identity for a record (lock held): key, parent key, root key, depth, tokens,
        hits."""
        t = self.blocks
        root = self.root_keys[t.root_id[b]]
        p = t.parent[b]
        return RecordMeta(t.key[b], t.key[p] if p != NO_BLOCK else root, root, t.depth[b],
                          t.token_bytes(b), t.hits[b])

    def lend(self, tier: int, n: int) -> list[int]:
        """n free slots of `tier` (evicting by policy as needed) that the caller fills outside
        the lock and then `adopt`s or `unlend`s: the node daemon's destinations for blocks a
        client published. Raises CapacityError, changing nothing, when the tier is full of
        pinned blocks."""
        with atomic(), self.lock:
            return self.reserve(tier, n)

    def unlend(self, tier: int, slots: list[int]) -> None:
        """Give back slots of `lend` that no block took."""
        with atomic(), self.lock:
            for s in slots:
                self.free_slot(tier, s)
            self.unreserve(tier, len(slots))

    def blocks_in(self, tier: int) -> list[int]:
        """Published blocks with a copy in `tier`, parents before children."""
        with self.lock:
            t = self.blocks
            mine, owner = self._slots[tier], self.tiers[tier].owner
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
        with atomic(), self.lock:
            t = self.blocks
            root = self.root_keys[root_id]
            prefix, hasher = self.prefix, self.hasher
            taken: list[int] = []
            for slot, m in entries:
                parent = NO_BLOCK if m.depth == 0 else prefix.get(m.parent, NO_BLOCK)
                ok = (m.root == root and m.key not in prefix and len(m.tokens) == 4 *
                      self.block_size and hasher.key(m.parent, m.tokens) == m.key
                      and (m.parent == root if m.depth == 0 else
                           parent != NO_BLOCK and t.root_id[parent] == root_id
                           and t.depth[parent] == m.depth - 1))
                self.unreserve(tier)
                if not ok:
                    self.free_slot(tier, slot)
                    taken.append(NO_BLOCK)
                    continue
                b = t.new(m.depth, 0)
                t.key[b] = m.key
                t.published[b] = 1
                t.tokens[b] = np.frombuffer(m.tokens, dtype="<i4")
                t.parent[b] = parent
                t.root_id[b] = root_id
                t.hits[b] = m.hits
                t.last_access[b] = t.inserted_at[b] = self.clock
                prefix[m.key] = b
                if parent != NO_BLOCK:
                    self._link(parent, b)
                self.set_slot(b, tier, slot)
                taken.append(b)
            return taken

    def copies_with_hits(self, tier: int) -> tuple[list[int], list[int]]:
        """(slots, use counts) of every published block with a copy in `tier`."""
        with atomic(), self.lock:
            t = self.blocks
            mine, hits, owner = self._slots[tier], t.hits, self.tiers[tier].owner
            slots = [s for s in range(len(owner)) if owner[s] >= 0
                     and t.key[owner[s]] is not None and mine[owner[s]] == s]
            return slots, [hits[owner[s]] for s in slots]

    def restore(self, tier: int, records: list) -> list[int]:
        """Publish blocks whose only copy is a record in `tier`: `records` are (slot, header)
        pairs (header: key, parent, root, depth, tokens, hits). Returns the slots to erase."""
        with atomic(), self.lock:
            t = self.blocks
            bs = self.block_size
            state = self.tiers[tier]
            alloc, mine, kids = state.allocator, self._slots[tier], self._kids[tier]
            hasher, prefix = self.hasher, self.prefix
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
                            self.root_keys.get(t.root_id[parent]) != h.root:
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
                self.root_keys[root_id] = h.root
                if parent != NO_BLOCK:
                    self._link(parent, b)
                    kids[parent] += 1
                made.append(b)
            for b in made:
                self._refresh(b)
            self.counters.recovered_blocks += len(made)
            if reject:
                log.warning("tier %s: %d record(s) not restored (%s); they are erased",
                            state.name, len(reject),
                            "; ".join(f"{n} x {r}" for r, n in why.most_common()))
            return reject
