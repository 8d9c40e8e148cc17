"""Room, allocation, eviction and admission: how a tier makes space (`BlockIndex.space`).

A part of `BlockIndex` (core/index.py), reaching the block state through its owner `ix` and
moving copies through `ix.copies`. Besides what `open` needs (`room`, `allocate`, `evict`), it
is the slot accounting background moves use: reservations for copies under way (`reserve`,
`unreserve`, `free_slot`), victims taken by policy (`take_victims`), admission to a tier below
(`admits`, `turned_away`), erasure of a persistent tier's freed slots (`take_erasures`,
`erased`) and a tier's size (`grow_tier`, `finish_shrink`, for core/resize.py). Methods that
take the lock say so; the others assume it is held.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from tiered_cache.core.atomic import atomic
from tiered_cache.core.blocks import NO_BLOCK, NO_SLOT
from tiered_cache.core.tier import DEVICE
from tiered_cache.core.transfer import Transfer
from tiered_cache.core.wakeup import Wakeup
from tiered_cache.errors import CapacityError, TransferError
from tiered_cache.jit import LazyModule

chains = LazyModule("tiered_cache.core.chains")
"""core/chains.py, imported at first use (tiered_cache/jit.py LazyModule: no numba at import)."""

if TYPE_CHECKING:
    from tiered_cache.core.index import BlockIndex

Run = Callable[[list[Transfer]], None]

_SEEN_MAX = 1 << 16
"""Keys of blocks turned away from a tier remembered for admission (a second sighting admits)."""

_BOOLS = (bool, np.bool_)
"""What a policy's `offer` may answer (checked: core/tier.py `TierState.fail_over`)."""


def no_copy(plan: list[Transfer]) -> None:
    """The copy executor of a metadata-only index: nothing to copy."""


@dataclass(slots=True, eq=False, repr=False)
class Space:
    ix: BlockIndex                  # the owner: block state, `_refresh`, `copies`
    run: Run = no_copy              # runs a synchronous eviction's demotion copies (lock held)
    on_pressure: Callable[[], None] | None = None
    """Told (lock held) when the device tier is used above `high_watermark` (the migrator)."""
    high_watermark: float = 1.0     # fraction of the device tier that triggers on_pressure
    on_copied: Callable[[int, list[int]], None] | None = None
    """Told (lock held) of blocks a synchronous eviction demoted into a tier, so the data
    plane can follow up (a put to a shared store)."""
    seen: OrderedDict[int, None] = field(default_factory=OrderedDict)
    """hash(key) of blocks turned away from a tier (admission), oldest first, bounded."""
    ended: int = 0
    """Copies under way that ended (or reservations given back): a request waiting for room
    that such copies hold waits until this moves (`wait_for_copies`)."""
    waiting: int = 0
    """Requests waiting for copies under way to end: the demoters start no new batch meanwhile
    (migrator/worker.py), so the copies they wait for are the last ones."""
    copies_ended: Wakeup = field(default_factory=Wakeup)
    demand: int = 0
    """Device slots one request allocated recently (the largest, decaying): the demoter keeps
    room for two in a small tier (migrator/worker.py `_headroom`)."""

    def admits(self, t: int, b: int) -> bool:
        """Whether demotion into tier t takes block b: reused at least `admit_min_hits` times,
        or seen before (its content was turned away once already and came back).

        NOTE: a block's own hit count restarts when its content comes back after an eviction,
        so in a tier too small to see reuse, counting hits alone would admit nothing; the
        bounded memory of rejected keys (TinyLFU's doorkeeper, in spirit) admits a second
        sighting. Lock held."""
        ix = self.ix
        need = ix.tiers[t].admit_min_hits
        if not need or ix.blocks.hits[b] >= need:
            return True
        key = ix._key[b]
        return key is not None and hash(key) in self.seen

    def turned_away(self, b: int) -> None:
        """Block b was not admitted below: remember its content (bounded, oldest first out)."""
        ix = self.ix
        key = ix._key[b]
        if key is None:
            return
        seen = self.seen
        seen[hash(key)] = None
        seen.move_to_end(hash(key))
        if len(seen) > _SEEN_MAX:
            seen.popitem(last=False)

    def room(self, t: int) -> int:
        """Slots tier t can provide: free ones plus those eviction can free.

        NOTE: not just the current candidates: evicting a leaf makes its parent a candidate,
        and an open sequence pins whole chains, so every unpinned block can be reached by
        evicting leaves first. Pinned copies and the destinations of copies under way cannot.
        (In slower tiers this is conservative: a copy of a pinned block that also has a device
        copy is evictable but not counted.) During a shrink, evicting a block of the tail being
        drained frees no slot anyone can have (the allocator retires it), so those blocks are
        not room either (conservative again: a pinned tail block is subtracted twice).
        """
        tier = self.ix.tiers[t]
        a = tier.allocator
        return (a.num_free + a.num_used - a.draining - tier.pinned_blocks - tier.reserved
                - tier.busy)

    def check_room(self, t: int, n: int, extra_pinned: int = 0, busy_pinned: int = 0) -> None:
        """Raise CapacityError unless tier t can provide n slots with `extra_pinned` more of
        its blocks pinned (`busy_pinned` of them busy: `room` already left them out).

        The error is transient (`exc.transient`: waiting helps) iff the slots would be there
        once every copy under way has ended: busy copies become evictable, reserved slots
        become blocks' or free again; pinned blocks stay pinned. Otherwise the shortage is
        real and the message says by how much."""
        tier = self.ix.tiers[t]
        room = self.room(t) - extra_pinned + busy_pinned
        if room < n:
            held = tier.busy + tier.reserved
            exc = CapacityError(
                f"tier {tier.name!r} cannot provide {n} blocks: {tier.allocator.num_free} "
                f"free, {tier.pinned_blocks + extra_pinned} pinned, "
                f"{held} held by copies under way, of {tier.capacity_blocks}")
            exc.transient = room - busy_pinned + held >= n
            raise exc

    def copies_hold(self, t: int) -> bool:
        """Whether copies under way hold slots of tier t that their end makes evictable: busy
        or reserved slots, or (the device tier) promotions whose sequence closed meanwhile."""
        ix = self.ix
        tier = ix.tiers[t]
        if tier.busy or tier.reserved:
            return True
        return t == DEVICE and any(ix._ref[b] == 0 for b in ix.pending)

    def allocate(self, t: int, n: int, hint: int | None = None) -> list[int]:
        """n free slots of tier t, evicting by policy when needed (lock held by the caller).
        Raises CapacityError, changing nothing, when the tier cannot provide them."""
        if n <= 0:
            return []
        ix = self.ix
        tier = ix.tiers[t]
        if tier.allocator.num_free < n:
            self.check_room(t, n)
            if t == DEVICE:
                # The migrator's watermark keeps free slots; reaching here means it fell behind.
                ix.counters.sync_evictions += 1
            self.evict(t, n - tier.allocator.num_free)
        slots = tier.allocator.allocate(n, hint)
        if t == DEVICE:
            # NOTE: what one request takes, decaying by 1/8 per allocation: the demoter keeps
            # room for two of them in a small tier (migrator/worker.py `_headroom`).
            d = self.demand
            self.demand = d = n if n > d - (d >> 3) else d - (d >> 3)
            a = tier.allocator
            if self.on_pressure is not None and (
                    a.num_used > self.high_watermark * tier.capacity_blocks
                    or a.num_free < 2 * d <= tier.capacity_blocks >> 1):
                self.on_pressure()
        return slots

    def reserve(self, t: int, n: int) -> list[int]:
        """Allocate n slots of tier t as destinations of copies under way (not yet owned);
        each is later given to a block (`set_slot`/`move_copy`) or freed (`free_slot`), and
        `unreserve` called once per slot either way."""
        slots = self.allocate(t, n)
        self.ix.tiers[t].reserved += len(slots)
        return slots

    def reserve_at(self, t: int, slot: int) -> None:
        """`reserve` of one given free slot (the compactor picks its destinations)."""
        tier = self.ix.tiers[t]
        tier.allocator.allocate_at(slot)
        tier.reserved += 1

    def unreserve(self, t: int, n: int = 1) -> None:
        self.ix.tiers[t].reserved -= n
        self.copy_ended()

    def copy_ended(self) -> None:
        """A copy under way ended, or gave back what it held (lock held): room may have grown,
        so requests waiting for it look again."""
        self.ended += 1
        self.copies_ended.notify_all()

    def wait_for_copies(self, since: int, timeout: float) -> bool:
        """Wait (lock not held, outside commit sections) until a copy under way ends after
        `ended` was `since`, or `timeout` seconds pass; True if one did. While it waits the
        demoters start no new batch (`waiting`)."""
        ix = self.ix
        with atomic(), ix.lock:
            self.waiting += 1
        try:
            return self.copies_ended.wait_for(lambda: self.ended != since, timeout)
        finally:
            with atomic(), ix.lock:
                self.waiting -= 1

    def free_slot(self, t: int, slot: int) -> None:
        """Return a slot no block owns (a reservation that was not used: in a persistent tier
        it may hold part of a record, so it is erased first)."""
        self.ix.tiers[t].give_back(slot)

    def evict(self, t: int, n: int, need: Callable[[], int] | None = None) -> None:
        """Free `n` slots of tier t by the tier's policy (or, with `need`, evict until
        `need()`, the slots still missing, drops to 0). Victims with no copy in a slower tier
        are demoted to the next tier when it has room, and dropped otherwise.

        NOTE: victims are taken one at a time, and each leaves the tier (in the metadata)
        before the next is chosen, so a parent whose last child just left competes at once by
        its own priority: a stale chain goes before fresher leaves of other chains. The copies
        are batched and run before the lock is released; the source slots they read are free
        in the allocator but nothing can take them meanwhile (only lower tiers allocate here).
        A copy that fails is not an error for the request: the victims are dropped instead
        (their only copy goes; a miss later, never wrong data) and counted.
        """
        ix = self.ix
        tier = ix.tiers[t]
        # NOTE: no copy into a tier whose writes are I/O under the lock: its victims drop.
        below = t + 1 if t + 1 < len(ix.tiers) and ix.tiers[t + 1].sync_target else None
        if need is None:
            alloc, target = tier.allocator, tier.allocator.num_free + n

            def need() -> int:
                return target - alloc.num_free
        plan: list[Transfer] = []
        try:
            self._pick_victims(t, below, need, plan)
        finally:
            # Even if the loop stopped early, every metadata move above must get its data.
            # A block demoted above may have been dropped again by a later eviction in this
            # loop (and its slot reused): its copy is void.
            slots = ix._slots
            plan = self._coalesce([p for p in plan if slots[p.dst_tier][p.block] == p.dst_slot])
            if plan:
                try:
                    self.run(plan)
                except TransferError:
                    ix.counters.transfer_failures += 1
                    self._drop_demoted(plan)
                else:
                    ix.counters.demotions += len(plan)
                    ix.counters.demotion_bytes += len(plan) * ix.block_bytes
                    if self.on_copied is not None:
                        self.on_copied(plan[0].dst_tier, [p.block for p in plan])

    def _pick_victims(self, t: int, below: int | None, need: Callable[[], int],
                      plan: list[Transfer]) -> None:
        ix = self.ix
        tier = ix.tiers[t]
        slots = ix._slots
        mine = slots[t]
        cand, ref, flight = ix._cand, ix._ref, ix._flight
        first_child = ix.blocks.first_child
        others = [s for i, s in enumerate(slots) if i != t]
        later = slots[t + 1:]
        bit = 1 << t
        clear = ~bit
        admit = ix.tiers[below].admit_min_hits if below is not None else 0
        # NOTE: the slots of dropped leaves are freed in one sorted batch at the end (a chain
        # leaves as one run: one merge in the allocator instead of one per block), so what is
        # still missing is need() minus the slots already set aside.
        freed: list[int] = []
        # Lower-tier slots reserved in batches: one lower-tier eviction pass serves many
        # demotions instead of one per victim. Unused ones are given back at the end.
        reserve: list[int] = []
        nxt = -1            # the policy's next victim, handed over already by `offer`
        try:
            while need() - len(freed) > 0:
                if nxt >= 0:
                    v, nxt = nxt, -1
                else:
                    # NOTE: `tier.policy` is read at every step, never kept: a policy that
                    # fails anywhere in this loop (here, or in a refresh) is replaced.
                    # NOTE: every policy's answer is checked before it is acted on: a
                    # victim that is not a candidate (pinned, in flight, a parent) would be
                    # evicted under its reader and its slot given to other KV; "none left"
                    # while candidates remain would fail the request for nothing.
                    try:
                        v = tier.policy.victim()
                        if v >= 0 and not cand[v] & bit:
                            raise ValueError(f"victim() returned {v}, not a candidate")
                        if v < 0 and tier.has_candidates(ix.blocks):
                            raise ValueError("victim() returned -1 with candidates left")
                    except Exception as failure:
                        v = tier.fail_over(ix.blocks, "victim", failure).victim()
                if v < 0:
                    # Room counted blocks that are not candidates yet (a parent whose child
                    # is in flight): transient when copies under way will change that.
                    exc = CapacityError(
                        f"tier {tier.name!r}: no evictable block left ({need() - len(freed)} "
                        f"more needed; {tier.allocator.num_free} free, {tier.pinned_blocks} "
                        f"pinned, {tier.busy + tier.reserved} held by copies under way, of "
                        f"{tier.capacity_blocks})")
                    exc.transient = self.copies_hold(t)
                    raise exc
                cand[v] &= clear
                demote = below is not None and later[0][v] == NO_SLOT and (
                    not later[1:] or all(s[v] == NO_SLOT for s in later))
                if demote and admit and below is not None and not self.admits(below, v):
                    self.turned_away(v)             # dropped below, remembered for next time
                    demote = False
                if demote and below is not None:
                    if not reserve:
                        k = min(need() - len(freed), self.room(below))
                        try:
                            reserve = self.allocate(below, k)[::-1] if k > 0 else []
                        except CapacityError:
                            # NOTE: the tier below cannot make room right now (its copies
                            # are in flight): v stays where it is, a candidate again, and
                            # this eviction stops here (the caller's error is transient).
                            ix._refresh(v)
                            raise
                    if reserve and mine[v] != NO_SLOT:
                        dst = reserve.pop()
                        plan.append(Transfer(v, t, mine[v], below, dst))
                        tier.evictions += 1
                        ix.copies.move_copy(v, t, below, dst)
                        continue
                if mine[v] == NO_SLOT:          # dropped by the lower tier's eviction
                    continue
                tier.evictions += 1
                if first_child[v] == NO_BLOCK and ref[v] == 0 and flight[v] == 0 and \
                        (not others or all(s[v] == NO_SLOT for s in others)):
                    # the common case, in one step (and its chain with it)
                    nxt = self._drop_leaves(v, t, need, freed, chain=below is None)
                    continue
                ix.copies.clear_slot(v, t)
                if ix.blocks.fastest_tier(v) < 0:
                    ix.counters.dropped_blocks += ix._drop_subtree(v)
        finally:
            if nxt >= 0:                # taken from the policy but not evicted: give it back
                cand[nxt] &= clear
                ix._refresh(nxt)
            if freed:
                freed.sort()
                tier.allocator.free(freed)
            if reserve and below is not None:
                ix.tiers[below].allocator.free(reserve)

    def _drop_leaves(self, v: int, t: int, need: Callable[[], int], freed: list[int],
                     chain: bool) -> int:
        """Drop leaf v, a published, unpinned, childless block whose only copy is in tier t:
        what clear_slot + drop_subtree + _release do, without their general bookkeeping. Its
        slot goes to `freed` (the caller frees them in one batch), is retired (a shrink's
        tail) or waits to be erased (a persistent tier).

        Then, while slots are still missing and the parent v leaves behind becomes a candidate
        that the policy says is its very next victim (`offer`), that parent is the next
        victim: dropped here too when `chain` (nothing is demoted) and it is such a leaf, else
        returned for the caller to evict as it would `victim()`'s. Returns -1 otherwise.

        NOTE: a chain leaves leaf first, one block per turn, exactly as victims taken one at a
        time would (the policy decides each step); only the heap round trip and the per-block
        calls are spared. `missing` tracks need() - len(freed) without calling need() per
        block: setting a slot aside only grows `freed`, and only retiring a tail slot changes
        the allocator (need() is asked again then)."""
        ix = self.ix
        tier = ix.tiers[t]
        table = ix.blocks
        mine, owner, prefix, key, parent = ix._slots[t], tier.owner, ix.prefix, ix._key, \
            ix._parent
        kids, cand, ref, flight = ix._kids[t], ix._cand, ix._ref, ix._flight
        first_child, prev_sib, next_sib = table.first_child, table.prev_sibling, \
            table.next_sibling
        gen, rows = table.gen, table._free
        others = [s for i, s in enumerate(ix._slots) if i != t]
        faster = ix._slots[:t]
        limit = tier.allocator.capacity
        persistent = tier.persistent
        bit = 1 << t
        missing = need() - len(freed)
        start = len(rows)
        nxt = -1
        runs = chain and not persistent and tier.policy.offers_runs
        dropped = False                 # v left already (a run's last block)
        while True:
            if not dropped:
                slot = mine[v]
                owner[slot] = NO_BLOCK
                mine[v] = NO_SLOT
                if persistent:              # its record is erased before the slot is reused
                    tier.reserved += 1
                    tier.erasing.append(slot)
                elif slot >= limit:
                    # NOTE: a slot in a shrink's tail is retired, not freed: no room for
                    # anyone, so it must not count as set aside (need() sees the rest).
                    tier.allocator.free_one(slot)
                    missing = need() - len(freed)
                else:
                    freed.append(slot)
                    missing -= 1
                del prefix[key[v]]
                gen[v] = (gen[v] + 1) & 0xFFFFFFFF     # BlockTable.free, inlined: the hot path
                rows.append(v)
            dropped = False
            p = parent[v]
            if p == NO_BLOCK:
                break
            if runs and missing > 0:
                last = self._leave_run(v, t, missing, freed)
                if last == -1:          # stopped inside the run: the policy kept one
                    break
                if last >= 0:           # the whole run left: go on above its last block
                    missing = need() - len(freed)
                    v = last
                    dropped = True
                    continue
            if prev_sib[v] == NO_BLOCK and next_sib[v] == NO_BLOCK:
                first_child[p] = NO_BLOCK           # an only child (_unlink's common case)
            else:
                ix._unlink(p, v)
            kids[p] -= 1
            # _leaf_again, inlined: p's last child with a copy in tier t left; only tier t's
            # candidacy of p can change.
            if (kids[p] or key[p] is None or flight[p] or mine[p] == NO_SLOT
                    or cand[p] & bit
                    or (ref[p] and not any(s[p] != NO_SLOT for s in faster))):
                break
            if missing <= 0:
                cand[p] |= bit
                try:
                    tier.policy.insert(p)
                except Exception as exc:
                    tier.fail_over(table, "insert", exc)
                break
            # NOTE: `tier.policy` read at each use: one that failed in `_leave_run` or a
            # refresh meanwhile has been replaced.
            try:
                took = tier.policy.offer(p)
                if type(took) not in _BOOLS:
                    raise ValueError(f"offer({p}) returned {took!r}, not a bool")
            except Exception as exc:
                took = tier.fail_over(table, "offer", exc).offer(p)
            if not took:
                cand[p] |= bit          # inserted
                break
            # p is the policy's victim now (taken: its candidate bit stays clear)
            if not chain or first_child[p] != NO_BLOCK or ref[p] or \
                    (others and any(s[p] != NO_SLOT for s in others)):
                nxt = p
                break
            tier.evictions += 1
            v = p
        n_dropped = len(rows) - start
        ix.counters.dropped_blocks += n_dropped
        table.num_live -= n_dropped
        return nxt

    def _leave_run(self, v: int, t: int, missing: int, freed: list[int]) -> int:
        """`_drop_leaves`' steps above leaf v (just dropped from tier t) in one pass, as far
        as they are simple (`chains.leaving`: each block is its child's parent, its only
        copy in t, unpinned, a leaf once its child is gone): the policy is offered the run
        at once (`offer_run`, as many blocks as are `missing`), those it takes are dropped as
        the loop would have dropped them, and the first it keeps is its candidate. Returns
        the run's last block when all of the run offered left (the loop goes on above it),
        -1 when the policy kept one (the loop stops), -2 when there is no simple step.

        NOTE: exact only for a policy with `offers_runs` (policies/base.py): when run[i] is
        offered, it has lost its child as in the loop, but the blocks taken before it are
        dropped only after the call, and the run's later blocks have lost their child too
        (given back to those not reached)."""
        ix = self.ix
        tier = ix.tiers[t]
        table = ix.blocks
        out = np.empty(min(missing, table.capacity), dtype=np.intp)
        kids = table.view("resident_children", t)
        m = chains.leaving(v, t, tier.allocator.capacity, table.view("parent"),
                           table.view("prev_sibling"), table.view("next_sibling"), kids,
                           table.view("published"), table.view("in_flight"),
                           table.view("ref_count"), table.view("candidate"),
                           table.tier_views("slots"), out)
        if not m:
            return -2
        first_child = table.view("first_child")
        chains.unlink_run(out, 0, m, first_child, kids, False)
        run = out[:m].tolist()
        try:
            k = tier.policy.offer_run(run)
            if type(k) is not int or not 0 <= k <= m:
                raise ValueError(f"offer_run of {m} blocks returned {k!r}")
        except Exception as exc:
            k = tier.fail_over(table, "offer_run", exc).offer_run(run)
        if k + 1 < m:                   # not reached: they keep their child
            chains.unlink_run(out, k + 1, m, first_child, kids, True)
        if k:
            slots = np.empty(k, dtype=np.intp)
            chains.free_run(out, k, table.view("slots", t),
                            np.frombuffer(tier.owner, dtype=np.int32), table.view("gen"),
                            slots)
            freed += slots.tolist()
            prefix, key = ix.prefix, ix._key
            for b in run[:k]:
                del prefix[key[b]]
            table._free += run[:k]
            tier.evictions += k
        if k < m:
            ix._cand[run[k]] |= 1 << t          # inserted by the policy
            return -1
        return run[-1]

    def _coalesce(self, plan: list[Transfer]) -> list[Transfer]:
        """Pair ascending source slots with ascending destination slots (a permutation of the
        destinations among the plan's blocks, none of which anyone has read yet), so adjacent
        slots on both sides merge into one large copy."""
        ix = self.ix
        if len(plan) < 2:
            return plan
        plan = sorted(plan, key=lambda p: p.src_slot)
        out = []
        for p, d in zip(plan, sorted(p.dst_slot for p in plan)):
            if p.dst_slot != d:
                ix._slots[p.dst_tier][p.block] = d
                ix.tiers[p.dst_tier].owner[d] = p.block
                p = Transfer(p.block, p.src_tier, p.src_slot, p.dst_tier, d, p.layers)
            out.append(p)
        return out

    def _drop_demoted(self, plan: list[Transfer]) -> None:
        """A synchronous demotion copy failed: the victims' lower copies never got their data.
        Drop those copies (the device slots were already handed on): the blocks become misses,
        counted as degraded evictions, rather than the request failing.

        NOTE: a chain is demoted in one plan. Dropping a parent drops the blocks below it
        with it (their lower copies are freed, their rows recycled), so a later entry whose
        destination slot is no longer its block's is already gone: clearing it again would
        free a slot twice."""
        ix = self.ix
        slots = ix._slots
        for p in plan:
            v = p.block
            ix.counters.degraded_evictions += 1
            if slots[p.dst_tier][v] != p.dst_slot:
                continue
            ix.copies.clear_slot(v, p.dst_tier)
            if ix.blocks.fastest_tier(v) < 0:
                ix.counters.dropped_blocks += ix._drop_subtree(v)

    # ------------------------------------------------------------------ background moves
    def take_victims(self, t: int, n: int) -> list[int]:
        """Up to n candidates of tier t by its policy, no longer candidates (the caller moves
        or clears their copy in t before the lock is released)."""
        tier = self.ix.tiers[t]
        cand = self.ix._cand
        bit = 1 << t
        try:
            got = list(tier.policy.victims(n))
            if len(got) > n or len(set(got)) != len(got) or \
                    not all(cand[v] & bit for v in got) or \
                    (not got and n > 0 and tier.has_candidates(self.ix.blocks)):
                raise ValueError(f"victims({n}) returned {got[:8]}: not {n} or fewer "
                                 "distinct candidates")
        except Exception as exc:
            got = tier.fail_over(self.ix.blocks, "victims", exc).victims(n)
        for v in got:
            cand[v] &= ~bit
        return got

    def recheck(self, b: int) -> None:
        """Re-derive b's candidacy (a victim taken by `take_victims` that stays after all)."""
        self.ix._refresh(b)

    def note_evictions(self, t: int, n: int = 1) -> None:
        self.ix.tiers[t].evictions += n

    # ------------------------------------------------------------------ erasure (lock taken)
    def take_erasures(self, t: int) -> list[int]:
        """Slots of tier t whose records must be erased before the slots are reused; hand
        them back with `erased` once done (or failed: they stay reserved until then)."""
        with self.ix.locked():
            tier = self.ix.tiers[t]
            out, tier.erasing = tier.erasing, []
            return out

    def erased(self, t: int, slots: list[int], ok: bool = True) -> None:
        """The records of `slots` are erased (ok), or erasing failed: they are queued again."""
        with self.ix.locked():
            tier = self.ix.tiers[t]
            if not ok:
                tier.erasing.extend(slots)
                return
            tier.reserved -= len(slots)
            tier.allocator.free(sorted(slots))
            self.copy_ended()

    # ------------------------------------------------------------------ resize (lock taken)
    def grow_tier(self, t: int, n: int) -> None:
        """Tier t's slots become [0, n) (n above the current count)."""
        ix = self.ix
        with ix.locked():
            tier = ix.tiers[t]
            delta = n - tier.allocator.num_slots
            tier.allocator.grow(delta)
            tier.owner.extend([NO_BLOCK] * delta)
            tier.resize_policy(ix.blocks, n)
            table = ix.blocks
            need = sum(x.allocator.num_slots for x in ix.tiers) + 1
            if table.capacity < need:
                table.grow(need)
                ix._bind()

    def finish_shrink(self, t: int) -> None:
        """A drained shrink of tier t ends: the tail's slots are gone."""
        with self.ix.locked():
            tier = self.ix.tiers[t]
            tier.allocator.finish_shrink()
            del tier.owner[tier.allocator.num_slots:]
