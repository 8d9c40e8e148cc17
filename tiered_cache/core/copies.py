"""Where blocks' copies are: the slot mutations moves are built from (`BlockIndex.copies`).

A part of `BlockIndex` (core/index.py), reaching the block state through its owner `ix`. A
block gains a copy (`set_slot`), moves one to another tier (`move_copy`) or slot (`remap`),
loses one (`clear_slot`, `drop_if_uncached`); a copy that reads a block runs between
`begin_move` and `end_move`. Each keeps every count and the candidate sets exact, so callers
(core/moves.py, the owner's promotions and evictions) never touch a field. The lock is held by
the caller of every method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tiered_cache.core.blocks import NO_BLOCK, NO_SLOT
from tiered_cache.jit import LazyModule

if TYPE_CHECKING:
    from tiered_cache.core.index import BlockIndex

chains = LazyModule("tiered_cache.core.chains")
"""core/chains.py, imported at first use (tiered_cache/jit.py LazyModule: no numba at import)."""


@dataclass(slots=True, eq=False, repr=False)
class Copies:
    ix: BlockIndex                  # the owner: block state, `_refresh`, `_release`

    def set_slot(self, b: int, t: int, slot: int) -> None:
        """b gains a copy in `slot` of tier t (already allocated)."""
        ix = self.ix
        ix._slots[t][b] = slot
        tier = ix.tiers[t]
        tier.owner[slot] = b
        if ix.blocks.busy_tiers[b]:
            self._busy(b, t, True)
        if ix._ref[b]:
            tier.pinned_blocks += 1
        p = ix._parent[b]
        if ix._key[b] is not None and p != NO_BLOCK:
            ix._kids[t][p] += 1
            ix._refresh(p)
        ix._refresh(b)

    def set_slots(self, blocks: list[int], t: int, slots: list[int],
                  ids: np.ndarray | None = None) -> None:
        """Each of `blocks` gains a copy in the matching slot of tier t: `set_slot` for all
        of them, with each block and each parent re-derived once, after every copy is set
        (the promotion hot path: a chain's blocks are each other's parents). `ids`: `blocks`
        as an intp array, if the caller has one: a chain of published blocks none of which
        is busy is then done in one compiled call (`chains.gain_chain`).

        NOTE: candidacy depends only on the state it is derived from, so deriving once at the
        end gives what a derivation after every step ends with. The order policies hear of
        the changes in is each block's first appearance as (parent, block), the order
        `set_slot` one block at a time would first touch them in."""
        ix = self.ix
        if ids is not None and len(ids):
            tbl, tier = ix.blocks, ix.tiers[t]
            out = np.empty(len(ids) + 1, dtype=np.intp)
            m, pinned = chains.gain_chain(
                ids, np.asarray(slots, dtype=np.intp), tbl.view("slots", t),
                np.frombuffer(tier.owner, dtype=np.int32), tbl.view("busy_tiers"),
                tbl.view("ref_count"), tbl.view("parent"), tbl.view("published"),
                tbl.view("resident_children", t), tbl.view("in_flight"),
                tbl.view("candidate"), out)
            if m >= 0:
                tier.pinned_blocks += pinned
                for b in out[:m].tolist():
                    ix._refresh(b)
                return
        mine, tier = ix._slots[t], ix.tiers[t]
        owner, kids = tier.owner, ix._kids[t]
        busy, ref, parent, key = ix.blocks.busy_tiers, ix._ref, ix._parent, ix._key
        touched: dict[int, None] = {}       # insertion-ordered set
        pinned = 0
        for b, slot in zip(blocks, slots):
            mine[b] = slot
            owner[slot] = b
            if busy[b]:
                self._busy(b, t, True)
            if ref[b]:
                pinned += 1
            p = parent[b]
            if key[b] is not None and p != NO_BLOCK:
                kids[p] += 1
                touched[p] = None
            touched[b] = None
        tier.pinned_blocks += pinned
        refresh, flight, cand = ix._refresh, ix._flight, ix._cand
        for b in touched:
            if flight[b] and not cand[b]:
                continue        # in flight: a candidate nowhere, and it is none already
            refresh(b)

    def move_copy(self, b: int, src: int, dst: int, slot: int) -> None:
        """b's copy leaves tier src for `slot` of tier dst: set_slot + clear_slot in one
        step, so b and its parent are re-derived once (the demotion hot path)."""
        ix = self.ix
        s_tier, d_tier = ix.tiers[src], ix.tiers[dst]
        s_slots = ix._slots[src]
        s_tier.give_back(s_slots[b])
        s_slots[b] = NO_SLOT
        ix._slots[dst][b] = slot
        d_tier.owner[slot] = b
        if ix.blocks.busy_tiers[b]:
            self._busy(b, src, False)
            self._busy(b, dst, True)
        if ix._ref[b]:
            s_tier.pinned_blocks -= 1
            d_tier.pinned_blocks += 1
        p = ix._parent[b]
        if ix._key[b] is not None and p != NO_BLOCK:
            ix._kids[src][p] -= 1
            ix._kids[dst][p] += 1
            ix._refresh(p)
        ix._refresh(b)

    def clear_slot(self, b: int, t: int) -> None:
        """b's copy in tier t goes (its slot is freed)."""
        ix = self.ix
        tier = ix.tiers[t]
        mine = ix._slots[t]
        tier.give_back(mine[b])
        mine[b] = NO_SLOT
        if ix.blocks.busy_tiers[b]:
            self._busy(b, t, False)
        if ix._ref[b]:
            tier.pinned_blocks -= 1
        p = ix._parent[b]
        if ix._key[b] is not None and p != NO_BLOCK:
            ix._kids[t][p] -= 1
            ix._refresh(p)
        ix._refresh(b)

    def _busy(self, b: int, t: int, has: bool) -> None:
        """b is being copied (`begin_move`) and gains (`has`) or loses its copy in tier t:
        that tier's `busy` count follows, so room never counts a copy that cannot be evicted
        before the move ends (a block promoted to the device while a copy of it goes from host
        to disk is busy on the device too)."""
        bit = 1 << t
        table = self.ix.blocks
        if has and not table.busy_tiers[b] & bit:
            table.busy_tiers[b] |= bit
            self.ix.tiers[t].busy += 1
        elif not has and table.busy_tiers[b] & bit:
            table.busy_tiers[b] &= ~bit
            self.ix.tiers[t].busy -= 1

    def remap(self, b: int, t: int, slot: int) -> None:
        """b's copy in tier t moves to `slot` of the same tier (already reserved by the
        compactor); counts and candidacy are unchanged."""
        ix = self.ix
        tier = ix.tiers[t]
        mine = ix._slots[t]
        tier.give_back(mine[b])
        mine[b] = slot
        tier.owner[slot] = b

    def drop_if_uncached(self, b: int) -> None:
        """Unpublish b (and what hangs below it) once it holds no copy anywhere."""
        ix = self.ix
        if ix.blocks.fastest_tier(b) < 0 and ix._key[b] is not None:
            ix.counters.dropped_blocks += ix._drop_subtree(b)

    def begin_move(self, b: int) -> None:
        """A copy that reads b's current copies starts: b is in flight (no policy offers it,
        nothing frees it) until `end_move`."""
        ix = self.ix
        ix._flight[b] += 1
        busy = 0
        for tier, s in zip(ix.tiers, ix._slots):
            if s[b] != NO_SLOT:
                busy |= 1 << tier.index
                tier.busy += 1
        ix.blocks.busy_tiers[b] = busy
        ix._refresh(b)

    def end_move(self, b: int) -> None:
        ix = self.ix
        busy = ix.blocks.busy_tiers[b]
        for tier in ix.tiers:
            if busy >> tier.index & 1:
                tier.busy -= 1
        ix.blocks.busy_tiers[b] = 0
        ix._flight[b] -= 1
        if ix._key[b] is None and ix._ref[b] == 0 and ix._flight[b] == 0:
            ix._release(b)              # dropped while in flight
        else:
            ix._refresh(b)
        ix.space.copy_ended()
