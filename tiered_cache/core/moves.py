"""Background moves: planned under the lock, copied outside it, committed under it.

Each kind of move (demotion, write-through copy, compaction; promotion is planned by
`BlockIndex.open`) has a `plan_*` and a `commit_*`. Planning reserves destination slots and marks
the blocks in flight (`begin_move`), which takes them out of every policy's candidate set, so
nothing evicts, frees or re-plans them while the copy runs without the lock. Committing applies
the result, or rolls it back: a failed copy frees the destination and leaves the block valid
where it was. Tier numbers are parameters: gpu -> host and host -> disk demotion are the same
code.

Every function here takes the index's lock (re-entrant) and changes state only through the
index's parts (`idx.copies`: where copies are; `idx.space`: reservations, victims, admission;
`idx.persist.record_meta`); none writes a block or tier field itself.

NOTE: a block can change while its copy runs: an open() may pin it, an invalidate() may drop it.
Commits re-check: a dropped block's slots are freed here (drop defers them while in flight), a
pinned block is never remapped by the compactor, and a demoted block that got pinned keeps its
faster copy (the demotion then acted as a write-through copy).
"""

from __future__ import annotations

from tiered_cache.core.blocks import NO_BLOCK, NO_SLOT
from tiered_cache.core.index import BlockIndex
from tiered_cache.core.transfer import Transfer
from tiered_cache.errors import CapacityError


# ---------------------------------------------------------------- demotion (watermark)
def plan_demotion(idx: BlockIndex, src: int, dst: int | None, n: int,
                  after: list[Transfer] | None = None) -> list[Transfer]:
    """Pick up to n victims of tier `src` by policy. Those already held by a slower tier leave
    `src` at once; the rest get a slot in `dst` and a copy (or are dropped when `dst` has no
    room, is None, or does not admit them).

    Into a persistent tier (disk) a victim also takes along copies of its ancestors that have
    none there yet (see `_with_ancestors`), and every transfer carries the block's identity
    (`RecordMeta`) for its record.

    `after`: a demotion batch still copying. The parents it leaves behind come first (see
    `_chain_tops`): long chains keep moving while the previous batch is in flight."""
    with idx.locked():
        t = idx.blocks
        slots = t.slots
        victims = _chain_tops(idx, src, after, n) if after else []
        victims += idx.space.take_victims(src, n - len(victims))
        _extend_chains(idx, src, victims, n)
        plan: list[Transfer] = []
        if dst is not None:
            plan, victims = _copy_plan(idx, src, dst, victims)
        moving = {tr.block for tr in plan}
        for v in victims:                   # no copy needed, or no room: leave the tier now
            if v in moving or slots[src][v] == NO_SLOT:
                continue
            idx.copies.clear_slot(v, src)
            idx.space.note_evictions(src)
            idx.copies.drop_if_uncached(v)
        return plan


def _copy_plan(idx: BlockIndex, src: int, dst: int,
               victims: list[int]) -> tuple[list[Transfer], list[int]]:
    """The copies into `dst` of `plan_demotion`'s victims that need one (lock held): the plan,
    and the victims that leave `src` (those waiting for a busy parent or for room in `dst`
    are taken out of them: they stay for the next round)."""
    t = idx.blocks
    slots = t.slots
    below = range(src + 1, len(slots))
    target = idx.tiers[dst]
    need = [v for v in victims if all(slots[i][v] == NO_SLOT for i in below)]
    if target.admit_min_hits:
        admitted = [v for v in need if idx.space.admits(dst, v)]
        for v in set(need).difference(admitted):
            idx.space.turned_away(v)    # dropped below, remembered for next time
        need = admitted
    # Ascending source slots paired with ascending destination slots: adjacent blocks merge
    # into one large copy (transfer.group sorts by source slot).
    need.sort(key=lambda v: slots[src][v])
    persistent = target.persistent
    keep: list[int] = []                # ancestors persisted along (they stay above)
    if persistent:
        need, keep, later = _with_ancestors(idx, dst, need, idx.space.room(dst))
        for v in later:                 # a parent is busy: this victim waits its turn
            idx.space.recheck(v)
        victims = [v for v in victims if v not in set(later)]
    k = min(len(need) + len(keep), idx.space.room(dst))
    try:
        dest = idx.space.reserve(dst, k) if k else []
    except CapacityError:
        # Room counted blocks the lower tier cannot evict right now (in flight, or a
        # shrink draining it): keep these victims where they are for the next round.
        kept = set(need)
        for v in need:
            idx.space.recheck(v)
        victims = [v for v in victims if v not in kept]
        need, keep, dest = [], [], []
    plan = []
    # Ancestors first: a commit that lands only in part never leaves a child on disk
    # without its parent.
    ancestors = set(keep)
    for b, s in zip(keep + need, dest):
        src_b = t.fastest_tier(b) if b in ancestors else src
        if slots[src_b][b] == NO_SLOT:  # dropped by the lower tier's eviction just now
            idx.space.free_slot(dst, s)
            idx.space.unreserve(dst)
            continue
        meta = idx.persist.record_meta(b) if persistent else None
        plan.append(Transfer(b, src_b, slots[src_b][b], dst, s, keep=b in ancestors,
                             meta=meta))
        idx.copies.begin_move(b)
    return plan, victims


def _with_ancestors(idx: BlockIndex, dst: int, need: list[int],
                    room: int) -> tuple[list[int], list[int], list[int]]:
    """Split victims bound for persistent tier `dst` into (go now, ancestors to persist with
    them, wait): a victim goes only together with every ancestor that has no copy in `dst`
    yet, so that each block there can be reached from its root after a restart.

    NOTE: a chain leaves faster tiers leaf first, so without this the deepest blocks of a hot
    prefix would be on disk and their ancestors only in memory: after a restart they could
    never be matched again. A victim whose ancestor is in flight (moving between faster
    tiers right now) waits for the next round; ancestors keep their faster copies."""
    t = idx.blocks
    slots = t.slots
    go: list[int] = []
    up: list[int] = []
    wait: list[int] = []
    taken: set[int] = set(need)
    for v in need:
        chain: list[int] = []
        p = t.parent[v]
        ok = True
        while p != NO_BLOCK and slots[dst][p] == NO_SLOT and p not in taken:
            if t.key[p] is None or t.in_flight[p] or t.fastest_tier(p) < 0:
                ok = False
                break
            chain.append(p)
            p = t.parent[p]
        if not ok or len(go) + len(up) + len(chain) + 1 > room:
            wait.append(v)
            continue
        go.append(v)
        up.extend(reversed(chain))          # root side first
        taken.update(chain)
    return go, up, wait


def _chain_tops(idx: BlockIndex, src: int, batch: list[Transfer], n: int) -> list[int]:
    """Parents that a demotion batch in flight leaves as the bottom of their chain: published,
    unpinned, not in flight, in `src`, and every child with a copy in `src` in that batch.

    NOTE: they are not candidates yet (their children still hold slots until the batch
    commits), so the policy cannot offer them; the next batch would wait for the commit and
    pipelining would stall on long chains. Taking them is `_extend_chains` across batches: a
    parent used only through the chain was last used with it. Commits run in batch order, so
    the children still leave the tier first.
    """
    t = idx.blocks
    mine = t.slots[src]
    moving = {tr.block for tr in batch}
    tops: list[int] = []
    seen: set[int] = set()
    for tr in batch:
        p = t.parent[tr.block]
        if p == NO_BLOCK or p in moving or p in seen or len(tops) >= n:
            continue
        seen.add(p)
        if t.key[p] is None or t.ref_count[p] or t.in_flight[p] or t.candidate[p] >> src & 1 \
                or mine[p] == NO_SLOT:
            continue
        if all(mine[c] == NO_SLOT or c in moving for c in t.children(p)):
            tops.append(p)
    return tops


def _extend_chains(idx: BlockIndex, src: int, victims: list[int], n: int) -> None:
    """Add to the batch, up to n blocks, each parent whose children in `src` all leave in it
    (published, unpinned, not in flight).

    NOTE: only leaves are candidates, so a batch would hold one block per chain and every
    copy would be a single block. A parent used only through this chain was last used with
    it, so taking it along keeps the policy's order while long chains move as long runs.
    """
    t = idx.blocks
    mine, kids = t.slots[src], t.resident_children[src]
    leaving: dict[int, int] = {}
    i = 0
    while i < len(victims) and len(victims) < n:
        p = t.parent[victims[i]]
        i += 1
        if p == NO_BLOCK or t.key[p] is None or t.ref_count[p] or t.in_flight[p] \
                or t.candidate[p] >> src & 1:
            continue
        leaving[p] = leaving.get(p, 0) + 1
        if leaving[p] == kids[p] and mine[p] != NO_SLOT:
            victims.append(p)


def commit_demotion(idx: BlockIndex, plan: list[Transfer], ok: bool) -> None:
    """Apply a demotion batch's copy (ok) or give its destinations back.

    NOTE: deepest blocks first. A block whose child in the batch has landed below already
    has a resident child there, so it never becomes a candidate of the tier below just to
    stop being one when that child lands (in plan order, by source slot, a chain's blocks
    came root first: each was inserted into the lower tier's policy and removed again, and
    each insert of a never-used block walked its chain for the duel)."""
    with idx.locked():
        t = idx.blocks
        depth = t.depth
        done = 0
        for tr in sorted(plan, key=lambda tr: -depth[tr.block]):
            b = tr.block
            idx.space.unreserve(tr.dst_tier)
            if ok and t.key[b] is not None:
                done += 1
                if tr.keep:                 # a persisted ancestor keeps its faster copies
                    idx.copies.set_slot(b, tr.dst_tier, tr.dst_slot)
                elif t.ref_count[b] == 0:
                    idx.copies.move_copy(b, tr.src_tier, tr.dst_tier, tr.dst_slot)
                    idx.space.note_evictions(tr.src_tier)
                else:                   # pinned meanwhile: it keeps its faster copy too
                    idx.copies.set_slot(b, tr.dst_tier, tr.dst_slot)
            else:
                idx.space.free_slot(tr.dst_tier, tr.dst_slot)
            idx.copies.end_move(b)
        if done:
            idx.count("demotions", done)
            idx.count("demotion_bytes", done * idx.block_bytes)


# ---------------------------------------------------------------- write-through
def plan_copy_down(idx: BlockIndex, blocks: list[int], src: int = 0,
                   dst: int = 1) -> list[Transfer]:
    """A copy in `dst` for published blocks that have one in `src` and none in `dst` (with
    each block's identity when `dst` persists records)."""
    with idx.locked():
        persistent = dst < len(idx.tiers) and idx.tiers[dst].persistent
        slots = idx.blocks.slots
        if dst >= len(slots):
            return []
        todo = sorted((b for b in blocks if slots[dst][b] == NO_SLOT and slots[src][b] != NO_SLOT
                       and idx.blocks.key[b] is not None), key=lambda b: slots[src][b])
        n = min(len(todo), idx.space.room(dst))
        if n == 0:
            return []
        dest = idx.space.reserve(dst, n)
        plan = []
        for b, s in zip(todo[:n], dest):
            if slots[src][b] == NO_SLOT:
                idx.space.free_slot(dst, s)
                idx.space.unreserve(dst)
                continue
            meta = idx.persist.record_meta(b) if persistent else None
            plan.append(Transfer(b, src, slots[src][b], dst, s, meta=meta))
            idx.copies.begin_move(b)
        return plan


def commit_copy_down(idx: BlockIndex, plan: list[Transfer], ok: bool,
                     counter: str | None = "write_through_blocks") -> None:
    """Commit a plan of extra copies (`plan_copy_down`, `plan_drain`): each block gets its new
    copy if `ok`, else the reserved slot is given back; `counter` counts the copies made.
    Deepest blocks first, as `commit_demotion` (no candidacy of the tier below that a
    child landing right after would take back)."""
    with idx.locked():
        depth = idx.blocks.depth
        done = 0
        for tr in sorted(plan, key=lambda tr: -depth[tr.block]):
            b = tr.block
            idx.space.unreserve(tr.dst_tier)
            if ok and idx.blocks.key[b] is not None:
                idx.copies.set_slot(b, tr.dst_tier, tr.dst_slot)
                done += 1
            else:
                idx.space.free_slot(tr.dst_tier, tr.dst_slot)
            idx.copies.end_move(b)
        if done and counter is not None:
            idx.count(counter, done)


# ---------------------------------------------------------------- drain (a graceful stop)
def plan_drain(idx: BlockIndex, dst: int, limit: int) -> list[Transfer]:
    """Copies into persistent tier `dst` of up to `limit` published blocks that only memory
    tiers hold (no persistent tier has a copy), each from the fastest tier that has it,
    parents before children, into free slots of `dst` only.

    NOTE: admission (`admit_min_hits`) is not asked: it keeps one-shot traffic off the SSD
    while serving, but at a graceful stop the memory tiers are about to be lost and what they
    hold is the freshest working set, written once. Only free slots are taken: a record already
    on disk is not evicted for one that was in memory (and a persistent tier's evicted slot
    must be erased first). Depth order keeps every cut whole: a block's parent is either on
    disk already or, having a smaller depth, in the plan before it, so every record written
    can be reached from its root after the restart."""
    with idx.locked():
        t = idx.blocks
        slots = t.slots
        persistent = [i for i, tier in enumerate(idx.tiers) if tier.persistent]
        memory = [i for i in range(len(idx.tiers)) if i not in persistent]
        todo = sorted((b for b in idx.prefix.values()
                       if t.in_flight[b] == 0 and all(slots[p][b] == NO_SLOT for p in persistent)
                       and any(slots[m][b] != NO_SLOT for m in memory)),
                      key=t.depth.__getitem__)
        n = min(len(todo), limit, idx.tiers[dst].allocator.num_free)
        if n <= 0:
            return []
        dest = idx.space.reserve(dst, n)
        plan = []
        for b, s in zip(todo[:n], dest):
            src = next(m for m in memory if slots[m][b] != NO_SLOT)
            plan.append(Transfer(b, src, slots[src][b], dst, s, keep=True,
                                 meta=idx.persist.record_meta(b)))
            idx.copies.begin_move(b)
        return plan


# ---------------------------------------------------------------- compaction
def movable(idx: BlockIndex, b: int) -> bool:
    """The compactor moves only published, unpinned blocks with no copy under way."""
    t = idx.blocks
    return b != NO_BLOCK and t.key[b] is not None and t.ref_count[b] == 0 \
        and t.in_flight[b] == 0


def plan_compaction(idx: BlockIndex, t: int, max_moves: int, floor: int = 0) -> list[Transfer]:
    """Pair the highest movable blocks (at or above `floor`) with the lowest free slots below
    them. A shrink passes its new size as the floor: only the tail is emptied."""
    with idx.locked():
        tier = idx.tiers[t]
        alloc, owner = tier.allocator, tier.owner
        plan: list[Transfer] = []
        slot = alloc.highest_used()
        low = alloc.lowest_free()
        # Two cursors: `slot` walks down over used slots, `low` up over free ones; each flag
        # is looked at once per step, so a step is O(slots scanned) at memchr speed.
        while slot is not None and slot >= floor and low is not None and low < slot \
                and len(plan) < max_moves:
            b = owner[slot]
            if movable(idx, b):
                idx.space.reserve_at(t, low)
                plan.append(Transfer(b, t, slot, t, low))
                idx.copies.begin_move(b)
                low = alloc.lowest_free(low + 1)
            slot = alloc.highest_used_below(slot)
        return plan


def commit_compaction(idx: BlockIndex, plan: list[Transfer], ok: bool) -> int:
    """Returns the number of blocks moved."""
    moved = 0
    with idx.locked():
        t = idx.blocks
        for tr in plan:
            b, tier = tr.block, tr.src_tier
            idx.space.unreserve(tier)
            if ok and t.key[b] is not None and t.ref_count[b] == 0 \
                    and t.slots[tier][b] == tr.src_slot:
                idx.copies.remap(b, tier, tr.dst_slot)
                moved += 1
            else:
                idx.space.free_slot(tier, tr.dst_slot)
            idx.copies.end_move(b)
        idx.count("compaction_moves", moved)
    return moved
