"""Slot primitives, moves in flight, pins and candidacy of single blocks (part of `BlockIndex`).

A mixin of `BlockIndex` (core/index.py). These are the mutations moves and resize are built
from (`set_slot`, `move_copy`, `clear_slot`, `remap`, `begin_move`/`end_move`, ...): each keeps
every count and the candidate sets exact, so callers never touch a field. `_refresh` is the one
place that decides candidacy (invariant 4).
"""

from __future__ import annotations

from tiered_cache.core.atomic import atomic
from tiered_cache.core.blocks import NO_BLOCK, NO_SLOT
from tiered_cache.core.readiness import LayerReadiness
from tiered_cache.core.tier import DEVICE
from tiered_cache.core.transfer import Transfer
from tiered_cache.errors import TransferError


class SlotOps:
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

    def set_slot(self, b: int, t: int, slot: int) -> None:
        """b gains a copy in `slot` of tier t (already allocated)."""
        self._slots[t][b] = slot
        tier = self.tiers[t]
        tier.owner[slot] = b
        if self._ref[b]:
            tier.pinned_blocks += 1
        p = self._parent[b]
        if self._key[b] is not None and p != NO_BLOCK:
            self._kids[t][p] += 1
            self._refresh(p)
        self._refresh(b)

    def move_copy(self, b: int, src: int, dst: int, slot: int) -> None:
        """b's copy leaves tier src for `slot` of tier dst: set_slot + clear_slot in one
        step, so b and its parent are re-derived once (the demotion hot path)."""
        s_tier, d_tier = self.tiers[src], self.tiers[dst]
        s_slots = self._slots[src]
        old = s_slots[b]
        self._give_back(s_tier, old)
        s_slots[b] = NO_SLOT
        self._slots[dst][b] = slot
        d_tier.owner[slot] = b
        if self._ref[b]:
            s_tier.pinned_blocks -= 1
            d_tier.pinned_blocks += 1
        p = self._parent[b]
        if self._key[b] is not None and p != NO_BLOCK:
            self._kids[src][p] -= 1
            self._kids[dst][p] += 1
            self._refresh(p)
        self._refresh(b)

    def clear_slot(self, b: int, t: int) -> None:
        """b's copy in tier t goes (its slot is freed)."""
        tier = self.tiers[t]
        mine = self._slots[t]
        self._give_back(tier, mine[b])
        mine[b] = NO_SLOT
        if self._ref[b]:
            tier.pinned_blocks -= 1
        p = self._parent[b]
        if self._key[b] is not None and p != NO_BLOCK:
            self._kids[t][p] -= 1
            self._refresh(p)
        self._refresh(b)

    def remap(self, b: int, t: int, slot: int) -> None:
        """b's copy in tier t moves to `slot` of the same tier (already reserved by the
        compactor); counts and candidacy are unchanged."""
        tier = self.tiers[t]
        mine = self._slots[t]
        self._give_back(tier, mine[b])
        mine[b] = slot
        tier.owner[slot] = b

    def _give_back(self, tier, slot: int) -> None:
        """A slot no block holds any more returns to its tier's allocator, or, in a persistent
        tier, waits (reserved) until the data plane has erased its record (`take_erasures`)."""
        tier.owner[slot] = NO_BLOCK
        if tier.persistent:
            tier.reserved += 1
            tier.erasing.append(slot)
        else:
            tier.allocator.free_one(slot)

    def take_erasures(self, t: int) -> list[int]:
        """Slots of tier t whose records must be erased before the slots are reused; hand
        them back with `erased` once done (or failed: they stay reserved until then)."""
        with atomic(), self.lock:
            tier = self.tiers[t]
            out, tier.erasing = tier.erasing, []
            return out

    def erased(self, t: int, slots: list[int], ok: bool = True) -> None:
        """The records of `slots` are erased (ok), or erasing failed: they are queued again."""
        with atomic(), self.lock:
            tier = self.tiers[t]
            if not ok:
                tier.erasing.extend(slots)
                return
            tier.reserved -= len(slots)
            tier.allocator.free(sorted(slots))

    def drop_if_uncached(self, b: int) -> None:
        """Unpublish b (and what hangs below it) once it holds no copy anywhere."""
        if self.blocks.fastest_tier(b) < 0 and self._key[b] is not None:
            self.counters.dropped_blocks += self.drop_subtree(b)

    def take_victims(self, t: int, n: int) -> list[int]:
        """Up to n candidates of tier t by its policy, no longer candidates (the caller moves
        or clears their copy in t before the lock is released)."""
        got = self.tiers[t].policy.victims(n)
        bit = ~(1 << t)
        cand = self._cand
        for v in got:
            cand[v] &= bit
        return got

    def recheck(self, b: int) -> None:
        """Re-derive b's candidacy (a victim taken by `take_victims` that stays after all)."""
        self._refresh(b)

    def note_evictions(self, t: int, n: int = 1) -> None:
        self.tiers[t].evictions += n

    def begin_move(self, b: int) -> None:
        """A copy that reads b's current copies starts: b is in flight (no policy offers it,
        nothing frees it) until `end_move`."""
        flight = self._flight
        flight[b] += 1
        busy = 0
        for tier, s in zip(self.tiers, self._slots):
            if s[b] != NO_SLOT:
                busy |= 1 << tier.index
                tier.busy += 1
        self.blocks.busy_tiers[b] = busy
        self._refresh(b)

    def end_move(self, b: int) -> None:
        busy = self.blocks.busy_tiers[b]
        for tier in self.tiers:
            if busy >> tier.index & 1:
                tier.busy -= 1
        self.blocks.busy_tiers[b] = 0
        self._flight[b] -= 1
        if self._key[b] is None and self._ref[b] == 0 and self._flight[b] == 0:
            self._release(b)            # dropped while in flight
        else:
            self._refresh(b)

    def _plan_promotion(self, blocks: list[int], slots: list[int],
                        readiness: LayerReadiness) -> list[Transfer]:
        """Device slots for blocks only in slower tiers; the data follows (commit_promotion).

        NOTE: a block whose fastest copy cannot be read in place (a disk record) is staged
        through a host slot: the record is read and verified whole into it, then copied to the
        device layer by layer like any host block. Its readers cannot read it zero-copy until
        then (`readiness.zero_copy` is False: they wait for their layer)."""
        plan = []
        fastest = self.blocks.fastest_tier
        tiers = self.tiers
        # Into a host-memory tier 0 (the node daemon's shared pool) a record is read directly.
        direct = tiers[DEVICE].stages_records
        staged = 0 if direct else sum(1 for b in blocks if tiers[fastest(b)].persistent)
        stage: list[int] = []
        if direct and any(tiers[fastest(b)].persistent for b in blocks):
            readiness.zero_copy = False
        if staged:
            # Everything that can fail comes first: a refused open leaves nothing half done.
            if len(tiers) < 2 or not tiers[1].stages_records:
                raise TransferError("a block on a disk tier needs a host tier to be promoted "
                                    "through")
            stage = self.reserve(1, staged)[::-1]
            readiness.zero_copy = False
        for b, s in zip(blocks, slots):
            src = fastest(b)
            src_slot = self._slots[src][b]
            if tiers[src].persistent and not direct:
                h = stage.pop()
                plan.append(Transfer(b, src, src_slot, 1, h))
                src, src_slot = 1, h
            plan.append(Transfer(b, src, src_slot, DEVICE, s))
            self.pending[b] = readiness
            self._flight[b] += 1
            self.set_slot(b, DEVICE, s)
        return plan

    def commit_promotion(self, plan: list[Transfer], ok: bool,
                         failed: frozenset[int] | set[int] = frozenset()) -> None:
        """A promotion's copy finished (ok) or was given up: the device copy stays, or is
        released (the slower copy stays valid). Blocks in `failed` could not be read from
        their source: a disk record that failed verification loses that copy and is counted;
        a keyed tier's value that was gone or corrupt is counted."""
        with atomic(), self.lock:
            n_slot = len(self.tiers)
            for p in plan:
                b = p.block
                if p.dst_tier != DEVICE:        # the host staging slot of a disk record
                    self.unreserve(p.dst_tier)
                    if ok and self._key[b] is not None:
                        self.set_slot(b, p.dst_tier, p.dst_slot)
                    else:
                        self.free_slot(p.dst_tier, p.dst_slot)
                    if b in failed:
                        if p.src_tier >= n_slot:
                            self.keyed[p.src_tier - n_slot].load_failures += 1
                        elif self._slots[p.src_tier][b] == p.src_slot:
                            self.counters.corrupt_blocks += 1
                            self.tiers[p.src_tier].corrupt += 1
                            self.clear_slot(b, p.src_tier)
                    continue
                self.pending.pop(b, None)
                if b in failed and p.src_tier >= n_slot:    # an unstaged keyed tier's load
                    self.keyed[p.src_tier - n_slot].load_failures += 1
                if ok:
                    self.counters.promotions += 1
                    self.counters.promotion_bytes += self.block_bytes
                elif self._slots[DEVICE][b] == p.dst_slot:
                    if self._flight[b] > 1:
                        # A reader holds the block (begin_read) and may read the slot: drop
                        # the block from the index; its slots go when the last holder ends.
                        self.drop_subtree(b)
                    else:
                        # The device slot never got valid data: release it; the slower copy
                        # stays valid.
                        self.clear_slot(b, DEVICE)
                self._flight[b] -= 1
                if self._key[b] is None and self._ref[b] == 0 and self._flight[b] == 0:
                    self._release(b)
                else:
                    self._refresh(b)
                    self.drop_if_uncached(b)

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
                self.clear_slot(b, t)
        self.blocks.free(b)

    def drop_subtree(self, top: int) -> int:
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
                if want & bit:
                    tier.policy.insert(b)
                else:
                    tier.policy.remove(b)

    def grow_tier(self, t: int, n: int) -> None:
        """Tier t's slots become [0, n) (n above the current count)."""
        with self.locked():
            tier = self.tiers[t]
            delta = n - tier.allocator.num_slots
            tier.allocator.grow(delta)
            tier.owner.extend([NO_BLOCK] * delta)
            tier.policy.resize(n)
            table = self.blocks
            need = sum(x.allocator.num_slots for x in self.tiers) + 1
            if table.capacity < need:
                table.grow(need)
                self._bind()


    def finish_shrink(self, t: int) -> None:
        """A drained shrink of tier t ends: the tail's slots are gone."""
        with self.locked():
            tier = self.tiers[t]
            tier.allocator.finish_shrink()
            del tier.owner[tier.allocator.num_slots:]


