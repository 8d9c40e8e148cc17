"""The owner's own per-block operations, which every part builds on (a mixin of `BlockIndex`).

Pins (`_pin`/`_unpin`), tree links (`_link`/`_unlink`), freeing a block (`_release`) or a
subtree (`_drop_subtree`), candidacy (`_refresh`: the one place that decides it, invariant 4),
and promotions into the device tier (`_plan_promotion` / `commit_promotion`). Every method but
`commit_promotion` assumes the lock is held; the parts call them as `ix._refresh(b)` and so on.
"""

from __future__ import annotations

from itertools import repeat

import numpy as np

from tiered_cache.core.atomic import atomic
from tiered_cache.core.blocks import NO_BLOCK, NO_SLOT
from tiered_cache.core.readiness import LayerReadiness
from tiered_cache.core.state import BlockState
from tiered_cache.core.tier import DEVICE
from tiered_cache.core.transfer import Transfer
from tiered_cache.errors import TransferError
from tiered_cache.jit import LazyModule

chains = LazyModule("tiered_cache.core.chains")
"""core/chains.py, imported at first use (tiered_cache/jit.py LazyModule: no numba at import)."""


class BlockTree(BlockState):
    """NOTE: a `BlockState` so that the type checker sees the fields its methods use;
    `BlockIndex` is the one class that is instantiated."""

    __slots__ = ()


    def _link(self, p: int, c: int) -> None:
        t = self.blocks
        head = t.first_child[p]
        t.next_sibling[c] = head
        t.prev_sibling[c] = NO_BLOCK
        if head != NO_BLOCK:
            t.prev_sibling[head] = c
        t.first_child[p] = c

    def _unlink(self, p: int, c: int) -> None:
        t = self.blocks
        prev, nxt = t.prev_sibling[c], t.next_sibling[c]
        if prev == nxt == NO_BLOCK:             # an only child: the common case
            t.first_child[p] = NO_BLOCK
            return
        if prev != NO_BLOCK:
            t.next_sibling[prev] = nxt
        else:
            t.first_child[p] = nxt
        if nxt != NO_BLOCK:
            t.prev_sibling[nxt] = prev
        t.next_sibling[c] = t.prev_sibling[c] = NO_BLOCK

    def _plan_promotion(self, ids: np.ndarray, slots: list[int], sources: list[int],
                        source_slots: list[int], readiness: LayerReadiness) -> list[Transfer]:
        """Device slots for blocks only in slower tiers (`ids`: a chain's, root first, each
        once); the data follows (commit_promotion). `sources`, `source_slots`: the fastest
        tier holding each block and its slot there (`BlockTable.fastest_tier`, as the open's
        survey found them).

        NOTE: a block whose fastest copy cannot be read in place (a disk record) is staged
        through a host slot: the record is read and verified whole into it, then copied to the
        device layer by layer like any host block. Its readers cannot read it zero-copy until
        then (`readiness.zero_copy` is False: they wait for their layer)."""
        tiers = self.tiers
        persistent = [t.persistent for t in tiers]
        # Into a host-memory tier 0 (the node daemon's shared pool) a record is read directly.
        direct = tiers[DEVICE].stages_records
        on_disk = any(persistent[t] for t in set(sources))
        staged = sum(persistent[t] for t in sources) if on_disk and not direct else 0
        if on_disk:
            readiness.zero_copy = False
        blocks = ids.tolist()
        if staged:
            # Everything that can fail comes first: a refused open leaves nothing half done.
            if len(tiers) < 2 or not tiers[1].stages_records:
                raise TransferError("a block on a disk tier needs a host tier to be promoted "
                                    "through")
            stage = self.space.reserve(1, staged)[::-1]
            plan: list[Transfer] = []
            for b, s, src, src_slot in zip(blocks, slots, sources, source_slots):
                if persistent[src]:
                    h = stage.pop()
                    plan.append(Transfer(b, src, src_slot, 1, h))
                    src, src_slot = 1, h
                plan.append(Transfer(b, src, src_slot, DEVICE, s))
        else:
            plan = list(map(Transfer, blocks, sources, source_slots, repeat(DEVICE), slots))
        self.pending.update(dict.fromkeys(blocks, readiness))
        self.blocks.view("in_flight")[ids] += 1         # (each id once)
        self.copies.set_slots(blocks, DEVICE, slots, ids)
        return plan

    def commit_promotion(self, plan: list[Transfer], ok: bool,
                         failed: frozenset[int] | set[int] = frozenset()) -> None:
        """A promotion's copy finished (ok) or was given up: the device copy stays, or is
        released (the slower copy stays valid). Blocks in `failed` could not be read from
        their source: a disk record that failed verification loses that copy and is counted;
        a keyed tier's value that was gone or corrupt is counted."""
        with atomic(), self.lock:
            if self.broken is not None:
                return          # torn (core/atomic.py): nothing is committed any more
            if ok and not failed and self._landed(plan):
                self.space.copy_ended()
                return
            n_slot = len(self.tiers)
            copies, space, keyed = self.copies, self.space, self.keyed.tiers
            for p in plan:
                b = p.block
                if p.dst_tier != DEVICE:        # the host staging slot of a disk record
                    space.unreserve(p.dst_tier)
                    if ok and self._key[b] is not None:
                        copies.set_slot(b, p.dst_tier, p.dst_slot)
                    else:
                        space.free_slot(p.dst_tier, p.dst_slot)
                    if b in failed:
                        if p.src_tier >= n_slot:
                            keyed[p.src_tier - n_slot].load_failures += 1
                        elif self._slots[p.src_tier][b] == p.src_slot:
                            self.counters.corrupt_blocks += 1
                            self.tiers[p.src_tier].corrupt += 1
                            copies.clear_slot(b, p.src_tier)
                    continue
                self.pending.pop(b, None)
                if b in failed and p.src_tier >= n_slot:    # an unstaged keyed tier's load
                    keyed[p.src_tier - n_slot].load_failures += 1
                if ok:
                    self.counters.promotions += 1
                    self.counters.promotion_bytes += self.block_bytes
                elif self._slots[DEVICE][b] == p.dst_slot:
                    if self._flight[b] > 1:
                        # A reader holds the block (begin_read) and may read the slot: drop
                        # the block from the index; its slots go when the last holder ends.
                        self._drop_subtree(b)
                    else:
                        # The device slot never got valid data: release it; the slower copy
                        # stays valid.
                        copies.clear_slot(b, DEVICE)
                self._flight[b] -= 1
                if self._key[b] is None and self._ref[b] == 0 and self._flight[b] == 0:
                    self._release(b)
                else:
                    self._refresh(b)
                    copies.drop_if_uncached(b)
            space.copy_ended()          # requests waiting for room look again

    def _landed(self, plan: list[Transfer]) -> bool:
        """`commit_promotion` of a promotion that landed, in the common case (every block
        copied straight into the device slot it still holds, none staged, none unpublished
        since): the general pass's effects, candidacy derived in one compiled call and only
        the blocks whose candidacy changed re-derived here. False, with nothing done, for any
        other case."""
        if any(p.dst_tier for p in plan):       # staged through a host slot (DEVICE is 0)
            return False
        ids = np.fromiter([p.block for p in plan], np.intp, len(plan))
        dst = np.fromiter([p.dst_slot for p in plan], np.intp, len(plan))
        t = self.blocks
        refresh = np.empty(len(plan), dtype=np.intp)
        m = chains.landed(ids, dst, t.view("published"), t.view("in_flight"),
                          t.view("ref_count"), t.tier_views("slots"),
                          t.tier_views("resident_children"), t.view("candidate"), refresh)
        if m < 0:
            return False
        pop = self.pending.pop
        for p in plan:
            pop(p.block, None)
        c = self.counters
        c.promotions += len(plan)
        c.promotion_bytes += len(plan) * self.block_bytes
        for b in refresh[:m].tolist():
            self._refresh(b)
        return True

    def _pin(self, b: int) -> None:
        r = self._ref[b]
        self._ref[b] = r + 1
        if r == 0:
            for tier, s in zip(self.tiers, self._slots):
                if s[b] != NO_SLOT:
                    tier.pinned_blocks += 1
            if self._cand[b]:
                self._refresh(b)

    def _unpin(self, b: int) -> None:
        r = self._ref[b] - 1
        self._ref[b] = r
        if r == 0:
            for tier, s in zip(self.tiers, self._slots):
                if s[b] != NO_SLOT:
                    tier.pinned_blocks -= 1
            self._refresh(b)

    def _release(self, b: int) -> None:
        """Free every copy of an unpublished, unpinned block no copy is using, and its row."""
        for t, s in enumerate(self._slots):
            if s[b] != NO_SLOT:
                self.copies.clear_slot(b, t)
        self.blocks.free(b)

    def _drop_subtree(self, top: int) -> int:
        """Unpublish `top` and every published block below it; free the copies of those no
        open sequence reads (the rest are freed when their last reader closes)."""
        dropped = 0
        stack = [top]
        t = self.blocks
        key, parents, ref, flight, slots = self._key, self._parent, self._ref, self._flight, \
            self._slots
        while stack:
            b = stack.pop()
            stack.extend(t.children(b))
            if key[b] is None:
                continue
            parent = parents[b]
            del self.prefix[key[b]]
            key[b] = None
            t.published[b] = 0
            # Its children are unpublished next (they are on the stack): unlink them all.
            c = t.first_child[b]
            while c != NO_BLOCK:
                nxt = t.next_sibling[c]
                t.next_sibling[c] = t.prev_sibling[c] = NO_BLOCK
                c = nxt
            t.first_child[b] = NO_BLOCK
            held = [i for i, s in enumerate(slots) if s[b] != NO_SLOT]
            # A parent dropped earlier in this walk has already forgotten its children.
            if parent != NO_BLOCK and key[parent] is not None:
                self._unlink(parent, b)
                for i in held:
                    self._kids[i][parent] -= 1
                if held:
                    self._refresh(parent)
            parents[b] = NO_BLOCK
            for kids in self._kids:
                kids[b] = 0
            if held:                    # only a block with a copy can be a candidate
                self._refresh(b)
            # NOTE: an in-flight block's slots are being copied; the move's commit frees them.
            if ref[b] == 0 and flight[b] == 0:
                self._release(b)
            dropped += 1
        return dropped

    def _refresh(self, b: int) -> None:
        """Re-derive b's candidacy in every tier (invariant 4) and tell the policies."""
        eligible = self._key[b] is not None and self._flight[b] == 0
        unpinned = self._ref[b] == 0
        kids = self._kids
        want = 0
        faster = False
        for i, s in enumerate(self._slots):
            has = s[b] != NO_SLOT
            if eligible and has and kids[i][b] == 0 and (unpinned or faster):
                want |= 1 << i
            faster = faster or has
        cand = self._cand[b]
        if want == cand:
            return
        self._cand[b] = want
        diff = want ^ cand
        for tier in self.tiers:
            bit = 1 << tier.index
            if diff & bit:
                # NOTE: a policy that raises is replaced by LRU over the bits just set
                # (TierState.fail_over): the state above is already whole.
                if want & bit:
                    try:
                        tier.policy.insert(b)
                    except Exception as exc:
                        tier.fail_over(self.blocks, "insert", exc)
                else:
                    try:
                        tier.policy.remove(b)
                    except Exception as exc:
                        tier.fail_over(self.blocks, "remove", exc)
