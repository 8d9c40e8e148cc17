"""Background moves: planned under the lock, copied outside it, committed under it.

Each kind of move (demotion, promotion, write-through copy, compaction) has a `plan_*` and a
`commit_*`. Planning reserves destination slots and marks the blocks in flight, which takes
them out of every policy's candidate set, so nothing evicts, frees or re-plans them while the
copy runs without the lock. Committing applies the result, or rolls it back: a failed copy
frees the destination and leaves the block valid where it was.

NOTE: a block can change while its copy runs: an open() may pin it, an invalidate() may drop it.
Commits re-check: a dropped block's slots are freed here (drop defers them while in flight), a
pinned block is never remapped by the compactor, and a demoted block that got pinned keeps its
device copy (the demotion then acted as a write-through copy).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from tiered_cache.block import NO_SLOT, Block
from tiered_cache.transfer import Transfer

if TYPE_CHECKING:
    from tiered_cache.cache import TieredKVCache

GPU, HOST = 0, 1


def _begin(b: Block, cache: TieredKVCache) -> None:
    b.in_flight += 1
    b.busy_tiers = tuple(t for t, s in enumerate(b.slots) if s != NO_SLOT)
    for t in b.busy_tiers:
        cache.tiers[t].busy += 1
    cache._refresh(b)


def _end(b: Block, cache: TieredKVCache) -> None:
    for t in b.busy_tiers:
        cache.tiers[t].busy -= 1
    b.busy_tiers = ()
    b.in_flight -= 1
    if b.key is None and b.ref_count == 0 and b.in_flight == 0:
        cache._release(b)           # dropped while in flight
    else:
        cache._refresh(b)


# ---------------------------------------------------------------- demotion (watermark)
def plan_demotion(cache: TieredKVCache, n: int,
                  after: list[Transfer] | None = None) -> list[Transfer]:
    """Pick up to n device victims by policy. Those already held by host are released at once;
    the rest get a host slot and a copy (or are dropped when host has no room left).

    `after`: a demotion batch still copying. The parents it leaves behind come first (see
    `_chain_tops`): long chains keep moving while the previous batch is in flight."""
    gpu = cache.tiers[GPU]
    victims = _chain_tops(after, n) if after else []
    victims += gpu.policy.victims(n - len(victims))
    for v in victims:
        v.candidate[GPU] = False
    _extend_chains(victims, n)
    has_host = len(cache.tiers) > 1
    # Ascending device slots paired with ascending host slots: adjacent blocks merge into one
    # large copy (transfer.group sorts by source slot).
    need = sorted((v for v in victims if has_host and v.slots[HOST] == NO_SLOT),
                  key=lambda v: v.slots[GPU])
    k = min(len(need), cache._room(HOST)) if has_host else 0
    dst = cache._allocate(HOST, k) if k else []
    plan: list[Transfer] = []
    for v, s in zip(need[:k], dst):
        if v.slots[GPU] == NO_SLOT:     # dropped by a host eviction's cascade just now
            cache.tiers[HOST].allocator.free((s,))
            continue
        plan.append(Transfer(v, GPU, v.slots[GPU], HOST, s))
        cache.tiers[HOST].reserved += 1
        _begin(v, cache)
    moving = {t.block.id for t in plan}
    for v in victims:                   # no copy needed, or no room: leave the device now
        if v.id in moving or v.slots[GPU] == NO_SLOT:
            continue
        cache._clear_slot(v, GPU)
        gpu.evictions += 1
        if v.fastest_tier() < 0:
            cache.counters["dropped_blocks"] += cache._drop_subtree(v)
    return plan


def _chain_tops(batch: list[Transfer], n: int) -> list[Block]:
    """Parents that a demotion batch in flight leaves as the bottom of their chain: published,
    unpinned, not in flight, on the device, and every device-resident child in that batch.

    NOTE: they are not candidates yet (their children still hold device slots until the batch
    commits), so the policy cannot offer them; the next batch would wait for the commit and
    pipelining would stall on long chains. Taking them is `_extend_chains` across batches: a
    parent used only through the chain was last used with it. Commits run in batch order, so
    the children still leave the device first.
    """
    moving = {t.block.id for t in batch}
    tops: list[Block] = []
    seen: set[int] = set()
    for t in batch:
        p = t.block.parent
        if p is None or p.id in moving or p.id in seen or len(tops) >= n:
            continue
        seen.add(p.id)
        if p.key is None or p.ref_count or p.in_flight or p.candidate[GPU] \
                or p.slots[GPU] == NO_SLOT:
            continue
        if all(c.slots[GPU] == NO_SLOT or c.id in moving for c in p.children.values()):
            tops.append(p)
    return tops


def _extend_chains(victims: list[Block], n: int) -> None:
    """Add to the batch, up to n blocks, each parent whose device-resident children all leave
    in it (published, unpinned, not in flight).

    NOTE: only leaves are candidates, so a batch would hold one block per chain and every
    copy would be a single block. A parent used only through this chain was last used with
    it, so taking it along keeps the policy's order while long chains move as long runs.
    """
    leaving: dict[int, int] = {}
    i = 0
    while i < len(victims) and len(victims) < n:
        p = victims[i].parent
        i += 1
        if p is None or p.key is None or p.ref_count or p.in_flight or p.candidate[GPU]:
            continue
        leaving[p.id] = leaving.get(p.id, 0) + 1
        if leaving[p.id] == p.resident_children[GPU] and p.slots[GPU] != NO_SLOT:
            victims.append(p)


def commit_demotion(cache: TieredKVCache, plan: list[Transfer], ok: bool) -> None:
    gpu = cache.tiers[GPU]
    for t in plan:
        b = t.block
        cache.tiers[HOST].reserved -= 1
        if ok and b.key is not None:
            cache.counters["demotions"] += 1
            cache.counters["demotion_bytes"] += cache.block_bytes
            if b.ref_count == 0:
                cache._move_copy(b, GPU, HOST, t.dst_slot)
                gpu.evictions += 1
            else:                       # pinned meanwhile: it keeps its device copy too
                cache._set_slot(b, HOST, t.dst_slot)
        else:
            cache.tiers[HOST].allocator.free((t.dst_slot,))
        _end(b, cache)


# ---------------------------------------------------------------- promotion (open)
def plan_promotion(cache: TieredKVCache, blocks: list[Block], slots: list[int],
                   readiness) -> list[Transfer]:
    """Reserve device slots for host-resident blocks an open() matched; the data follows."""
    plan = []
    for b, s in zip(blocks, slots):
        src = b.fastest_tier()
        plan.append(Transfer(b, src, b.slots[src], GPU, s))
        b.pending = readiness
        b.in_flight += 1
        cache._set_slot(b, GPU, s)
    return plan


def commit_promotion(cache: TieredKVCache, plan: list[Transfer], ok: bool) -> None:
    for t in plan:
        b = t.block
        b.pending = None
        if ok:
            cache.counters["promotions"] += 1
            cache.counters["promotion_bytes"] += cache.block_bytes
        elif b.slots[GPU] == t.dst_slot:
            # The device slot never got valid data: release it; the host copy stays valid.
            cache._clear_slot(b, GPU)
        _end(b, cache)


# ---------------------------------------------------------------- write-through
def plan_copy_down(cache: TieredKVCache, blocks: list[Block]) -> list[Transfer]:
    blocks = sorted((b for b in blocks if b.slots[HOST] == NO_SLOT and b.slots[GPU] != NO_SLOT),
                    key=lambda b: b.slots[GPU])
    n = min(len(blocks), cache._room(HOST))
    if n == 0:
        return []
    dst = cache._allocate(HOST, n)
    plan = []
    for b, s in zip(blocks[:n], dst):
        if b.slots[GPU] == NO_SLOT:
            cache.tiers[HOST].allocator.free((s,))
            continue
        plan.append(Transfer(b, GPU, b.slots[GPU], HOST, s))
        cache.tiers[HOST].reserved += 1
        _begin(b, cache)
    return plan


def commit_copy_down(cache: TieredKVCache, plan: list[Transfer], ok: bool) -> None:
    for t in plan:
        b = t.block
        cache.tiers[HOST].reserved -= 1
        if ok and b.key is not None:
            cache._set_slot(b, HOST, t.dst_slot)
            cache.counters["write_through_blocks"] += 1
        else:
            cache.tiers[HOST].allocator.free((t.dst_slot,))
        _end(b, cache)


# ---------------------------------------------------------------- compaction
def movable(b: Block | None) -> bool:
    """The compactor moves only published, unpinned blocks with no copy under way."""
    return b is not None and b.key is not None and b.ref_count == 0 and b.in_flight == 0


def plan_compaction(cache: TieredKVCache, t: int, max_moves: int,
                    floor: int = 0) -> list[Transfer]:
    """Pair the highest movable blocks (at or above `floor`) with the lowest free slots below
    them. A shrink passes its new size as the floor: only the tail is emptied."""
    tier = cache.tiers[t]
    alloc, owner = tier.allocator, tier.owner
    plan: list[Transfer] = []
    slot = alloc.highest_used()
    low = alloc.lowest_free()
    # Two cursors: `slot` walks down over used slots, `low` up over free ones; each flag is
    # looked at once per step, so a step is O(slots scanned) at memchr speed.
    while slot is not None and slot >= floor and low is not None and low < slot \
            and len(plan) < max_moves:
        b = owner[slot]
        if movable(b):
            alloc.allocate_at(low)
            owner[low] = b
            tier.reserved += 1
            plan.append(Transfer(b, t, slot, t, low))
            _begin(b, cache)
            low = alloc.lowest_free(low + 1)
        slot = alloc.highest_used_below(slot)
    return plan


def commit_compaction(cache: TieredKVCache, plan: list[Transfer], ok: bool) -> None:
    for tr in plan:
        b, t = tr.block, tr.src_tier
        tier = cache.tiers[t]
        tier.reserved -= 1
        if ok and b.key is not None and b.ref_count == 0 and b.slots[t] == tr.src_slot:
            tier.allocator.free((tr.src_slot,))
            tier.owner[tr.src_slot] = None
            b.slots[t] = tr.dst_slot     # same tier: counts and candidacy are unchanged
            cache.counters["compaction_moves"] += 1
        else:
            tier.allocator.free((tr.dst_slot,))
            tier.owner[tr.dst_slot] = None
        _end(b, cache)
