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

from tiered_cache.core.blocks import NO_BLOCK, NO_SLOT
from tiered_cache.core.tree import BlockTree


@dataclass
class Survey:
    """What an open of a matched chain needs to know before it changes anything."""

    ids: np.ndarray                 # the chain's block ids (intp)
    copies: list[np.ndarray]        # per tier: has a copy there (before any promotion)
    unpinned: np.ndarray | None     # ref_count == 0 before the open (None: all of them)
    promote: list[int]              # blocks with no device copy
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
            return Survey(_NO_IDS, [_NO_FLAGS] * len(self.tiers), _NO_FLAGS, [], 0, _NO_IDS)
        t = self.blocks
        if ids is None:
            ids = np.asarray(blocks, dtype=np.intp)
        n = len(ids)
        copies = [t.view("slots", i)[ids] != NO_SLOT for i in range(len(self.tiers))]
        refs = t.view("ref_count")[ids]
        pinned = int(np.count_nonzero(refs))
        # NOTE: no mask for a chain no other sequence pins (nearly always): each numpy call
        # costs about a microsecond here, as much as the hashing of a few blocks.
        unpinned = None if pinned == 0 else refs == 0
        on_dev = copies[0]
        # NOTE: count_nonzero rather than .all()/.any() here and below: a numpy reduction
        # costs several times a count on a chain of a few dozen blocks.
        if np.count_nonzero(on_dev) == n:
            promote: list[int] = []
            pinning = n - pinned
        else:
            promote = ids[~on_dev].tolist()
            pinning = int(np.count_nonzero(on_dev if unpinned is None else unpinned & on_dev))
        return Survey(ids, copies, unpinned, promote, pinning, refs)

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
        t.view("ref_count")[ids] = s.refs + 1       # (the chain holds each block once)
        first = s.unpinned
        self.tiers[0].pinned_blocks += s.pinning    # unpinned with a device copy, counted
        for tier, has in zip(self.tiers[1:], s.copies[1:]):
            tier.pinned_blocks += int(np.count_nonzero(has if first is None else has & first))
        cand = t.view("candidate")[ids]
        if np.count_nonzero(cand):
            was = cand != 0
            for b in ids[was if first is None else first & was].tolist():
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

    def _unpin_ids(self, ids: np.ndarray) -> np.ndarray:
        """`_unpin_all` of an id array (each id once); returns the ids unpinned now."""
        t = self.blocks
        ref = t.view("ref_count")
        left = ref[ids] - 1
        ref[ids] = left
        still = np.count_nonzero(left)
        if still == len(left):
            return _NO_IDS
        zero = ids if still == 0 else ids[left == 0]
        # Unpinning can only make a block a candidate, and only of a tier where it has a
        # copy and no child with one: find those, and let _refresh decide.
        maybe = None
        for tier in self.tiers:
            has = t.view("slots", tier.index)[zero] != NO_SLOT
            tier.pinned_blocks -= int(np.count_nonzero(has))
            leaf = has & (t.view("resident_children", tier.index)[zero] == 0)
            maybe = leaf if maybe is None else maybe | leaf
        for b in zero[maybe].tolist():
            self._refresh(b)
        return zero

    def _touch(self, s: Survey, clock: int) -> list[int]:
        """A request reused the chain: hits, last use, and every policy holding a copy hears
        of it. Returns the number of blocks served from each tier (its fastest copy)."""
        tiers = self.tiers
        served = [0] * len(tiers)
        ids = s.ids
        if not len(ids):
            return served
        t = self.blocks
        t.view("hits")[ids] += 1
        t.view("last_access")[ids] = clock
        served[0] = len(ids) - len(s.promote)
        if len(tiers) > 1:
            unserved = ~s.copies[0]
            for tier, has in zip(tiers[1:], s.copies[1:]):
                served[tier.index] = int(np.count_nonzero(has & unserved))
                unserved &= ~has
        if s.promote:
            # promoted blocks now have a (landing) device copy too
            s.copies[0] = np.ones(len(ids), dtype=bool)
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
            tier.policy.access_many(hear)           # one call per chain (policies/base.py)
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
