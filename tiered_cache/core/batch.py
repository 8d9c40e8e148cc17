"""Pins, unpins and reuse bookkeeping of whole chains: the hot loops of open() and close().

A mixin of `BlockIndex`: methods of the owner over its declared state (core/state.py), called
only by the owner, lock held. A chain is handled with a few numpy operations over zero-copy
views of the table's arrays rather than one trip through the interpreter per block: a hit on a
64-block prompt costs about as much as hashing it, and a 1M-token prompt (62,500 blocks) pins
in milliseconds.

NOTE: the vectorised updates rely on a chain holding each block once (`ref[ids] += 1` with a
repeated id would count it once), which holds: blocks of one sequence cover distinct positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tiered_cache.core.blocks import NO_BLOCK
from tiered_cache.core.tree import BlockTree
from tiered_cache.jit import LazyModule

chains = LazyModule("tiered_cache.core.chains")
"""core/chains.py, imported at first use (tiered_cache/jit.py LazyModule: no numba at import)."""


@dataclass
class Survey:
    """What an open of a matched chain needs to know before it changes anything."""

    ids: np.ndarray                 # the chain's block ids (intp)
    copies: np.ndarray | list       # row t: has a copy in tier t (before any promotion)
    unpinned: np.ndarray | None     # ref_count == 0 before the open (None: all of them)
    promote: list[int]              # blocks with no device copy
    sources: list[int]              # the fastest tier holding each of `promote`
    source_slots: list[int]         # and its slot there
    promote_ids: np.ndarray         # `promote` as an intp array
    pinning: int                    # unpinned blocks with a device copy (room they take)
    refs: np.ndarray                # ref_count before the open


_NO_IDS = np.zeros(0, dtype=np.intp)
_NO_FLAGS = np.zeros(0, dtype=bool)


class BatchOps(BlockTree):
    """NOTE: a `BlockTree` (so a `BlockState`) only so that the type checker sees the fields
    and the tree's methods it uses; `BlockIndex` is the one class that is instantiated."""

    __slots__ = ()

    def _survey(self, blocks: list[int], ids: np.ndarray | None = None) -> Survey:
        """`ids`: `blocks` as an intp array, if the caller has one."""
        if not blocks:              # a miss: nothing to look at (no numpy call at all)
            return Survey(_NO_IDS, [_NO_FLAGS] * len(self.tiers), _NO_FLAGS, [], [], [],
                          _NO_IDS, 0, _NO_IDS)
        t = self.blocks
        if ids is None:
            ids = np.asarray(blocks, dtype=np.intp)
        n = len(ids)
        copies = np.empty((len(self.tiers), n), dtype=bool)
        refs = np.empty(n, dtype=np.int32)
        away = np.empty((3, n), dtype=np.intp)
        pinned, on_dev, pinning = chains.survey(ids, t.view("ref_count"),
                                                t.tier_views("slots"), copies, refs, away)
        # NOTE: no mask for a chain no other sequence pins (nearly always).
        unpinned = None if pinned == 0 else refs == 0
        if on_dev == n:
            return Survey(ids, copies, unpinned, [], [], [], _NO_IDS, pinning, refs)
        move = away[:, :n - on_dev]
        promote, src, at = move.tolist()
        return Survey(ids, copies, unpinned, promote, src, at, move[0], pinning, refs)

    def _busy_pinning(self, s: Survey) -> int:
        """How many of the blocks `_pin_all` would newly pin in the device tier are busy there
        (a copy of them is under way)."""
        t = self.blocks
        busy = (t.view("busy_tiers")[s.ids] & 1).astype(bool) & s.copies[0]
        return int(np.count_nonzero(busy if s.unpinned is None else busy & s.unpinned))

    def _pin_all(self, s: Survey) -> None:
        """ref_count += 1 for the chain; newly pinned blocks leave the candidate sets they no
        longer belong to."""
        t, ids = self.blocks, s.ids
        if not len(ids):
            return
        tiers = self.tiers
        counts = np.zeros(len(tiers), dtype=np.int64)
        refresh = np.empty(len(ids), dtype=np.intp)
        m = chains.pin(ids, s.refs, t.view("ref_count"), t.view("candidate"), s.copies,
                       counts, refresh)
        tiers[0].pinned_blocks += s.pinning         # unpinned with a device copy, counted
        for tier in tiers[1:]:
            tier.pinned_blocks += int(counts[tier.index])
        if m:
            for b in refresh[:m].tolist():
                self._refresh(b)

    def _unpin_survey(self, s: Survey) -> None:
        """Undo `_pin_all` (an open that failed after pinning)."""
        self._unpin_all(s.ids.tolist())

    def _unpin_all(self, blocks: list[int]) -> list[int]:
        """ref_count -= 1 for every block; blocks no longer pinned join the candidate sets
        they now belong to. Returns the blocks that are unpinned now."""
        if not blocks:
            return []
        return self._unpin_ids(np.asarray(blocks, dtype=np.intp)).tolist()

    def _unpin_ids(self, ids: np.ndarray, rev: bool = False) -> np.ndarray:
        """`_unpin_all` of an id array (each id once; taken from the last when `rev`); returns
        the ids unpinned now, in that order."""
        t = self.blocks
        tiers = self.tiers
        n = len(ids)
        counts = np.zeros(len(tiers), dtype=np.int64)
        zero = np.empty(n, dtype=np.intp)
        refresh = np.empty(n, dtype=np.intp)
        # Unpinning can only make a block a candidate, and only of a tier where it has a
        # copy and no child with one: the kernel finds those, and _refresh decides.
        z, r = chains.unpin(ids, rev, t.view("ref_count"), t.tier_views("slots"),
                            t.tier_views("resident_children"), counts, zero, refresh)
        if not z:
            return _NO_IDS
        for tier in tiers:
            tier.pinned_blocks -= int(counts[tier.index])
        if r:
            for b in refresh[:r].tolist():
                self._refresh(b)
        return zero[:z]

    def _touch(self, s: Survey, clock: int, keys: bytes | None = None) -> list[int]:
        """A request reused the chain: hits, last use, and every policy holding a copy hears
        of it. Returns the number of blocks served from each tier (its fastest copy). `keys`:
        the chain's keys joined, if the caller has them (for the policies that take them)."""
        tiers = self.tiers
        served = [0] * len(tiers)
        ids = s.ids
        if not len(ids):
            return served
        t = self.blocks
        counts = np.zeros(len(tiers), dtype=np.int64)
        chains.touch(ids, t.view("hits"), t.view("last_access"), clock, s.copies, counts)
        served[0] = len(ids) - len(s.promote)
        for tier in tiers[1:]:
            served[tier.index] = int(counts[tier.index])
        if s.promote:
            # promoted blocks now have a (landing) device copy too
            s.copies[0] = True
        cand = None
        for tier, has in zip(tiers, s.copies):
            # NOTE: every tier holding a copy hears of the reuse, candidate or not (the block
            # is pinned by now), unless its policy only keys candidates (policies/base.py).
            if tier.policy.hears_every_access:
                hear = ids if tier.index == 0 else ids[has]     # all on the device by now
            elif tier.index == 0:
                # NOTE: a pinned block is no device candidate (no tier is faster: invariant
                # 4), and the whole chain is pinned by now.
                continue
            else:
                if cand is None:
                    cand = t.view("candidate")[ids]
                if not np.count_nonzero(cand):
                    continue
                hear = ids[has & ((cand >> tier.index) & 1).astype(bool)]
            # one call per chain (policies/base.py)
            # NOTE: this runs after the pins, where nothing may fail: a policy that raises
            # is replaced by LRU (TierState.fail_over), which hears the chain instead.
            try:
                if keys is not None and hear is ids and tier.policy.takes_chain_keys:
                    tier.policy.access_many(hear, keys=keys)
                else:
                    tier.policy.access_many(hear)
            except Exception as exc:
                tier.fail_over(t, "access_many", exc).access_many(hear)
        return served

    def _publish_chain(self, seq, first: int, ready: int, parent: int) -> list[int]:
        """Publish blocks [first, ready) of `seq` at once: the common case of a run of the
        sequence's own blocks whose keys are all new, under a published parent (or at the
        root). Each becomes the only child of the one before it.

        NOTE: they are the sequence's private blocks: pinned by it, with a device copy and no
        other, never linked; so none is or becomes a candidate, and only the run's parent can
        stop being one (it gains a resident child)."""
        t = self.blocks
        bs = self.block_size
        blocks = seq.blocks[first:ready]
        keys = seq.keys[first:ready]
        ids = np.asarray(blocks, dtype=np.intp)
        key_of = t.key
        for b, k in zip(blocks, keys):
            key_of[b] = k
        self.prefix.update(zip(keys, blocks))
        t.view("published")[ids] = 1
        par = t.view("parent")
        par[ids[1:]] = ids[:-1]
        par[ids[0]] = parent
        t.view("root_id")[ids] = seq.root_id
        t.view("inserted_at")[ids] = self.clock
        t.view("last_access")[ids] = self.clock
        t.tokens[ids] = seq.token_ids[first * bs:ready * bs].reshape(-1, bs)
        t.view("first_child")[ids[:-1]] = ids[1:]
        t.view("resident_children", 0)[ids[:-1]] = 1
        if parent != NO_BLOCK:
            self._link(parent, blocks[0])
            self._kids[0][parent] += 1
            if self._cand[parent]:
                self._refresh(parent)
        seq.chain = blocks[-1]
        seq.num_published = ready
        return blocks
