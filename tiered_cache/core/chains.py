"""The loops of a chain's hot path, compiled: verification, survey, pin, touch and unpin.

A request's matched chain (its block ids, root first) goes through a few passes over the
table's columns: `open` verifies and surveys it, pins it and records the reuse, `close`
unpins it. Written with numpy they cost some forty array calls per request, each about a
microsecond here, more than the hashing of a 64-block prompt; here each pass is one compiled
call (numba) over zero-copy views of the same columns (`BlockTable.view`), doing exactly what
the numpy passes of core/batch.py did (tests/core/test_chains.py checks them against plain
Python loops).

Arguments are the table's numpy views (never kept: `BlockTable.grow` must be able to resize
the arrays) and, for per-tier columns, a tuple with one view per tier. Nothing here raises
once it has written: every pass checks nothing and writes only cells of the ids it is given.

NOTE: numba compiles the kernels once per installation and source change (cached on disk
under `__pycache__`) and every process loads them; `warm_up(num_tiers)` does it when an index
is built, never inside a request under the lock.
"""

from __future__ import annotations

import numpy as np

from tiered_cache.jit import njit

NO_SLOT = -1
NO_BLOCK = -1


@njit(cache=True)
def verify(ids, parent, root_id, stored, want, bs, first_parent, rid, tokens):
    """How many leading blocks of a key match are the request's: each one's parent is the
    block before it (the first one's `first_parent`; NO_BLOCK: it is a root, of id `rid`)
    and, with `tokens`, its stored token ids (`stored[b]`) equal the request's (`want`,
    int32, at least n * bs)."""
    n = len(ids)
    for i in range(n):
        b = ids[i]
        if i == 0:
            if parent[b] != first_parent or (first_parent == NO_BLOCK and root_id[b] != rid):
                return 0
        elif parent[b] != ids[i - 1]:
            return i
        if tokens:
            off = i * bs
            for j in range(bs):
                if stored[b, j] != want[off + j]:
                    return i
    return n


@njit(cache=True)
def ancestors(parent, b, n, out):
    """out[:n]: block b's chain of n blocks ending at it, root first (out[n - 1] = b, each
    one before it the parent of the next). False, with out partly written, if b has fewer
    than n - 1 ancestors."""
    for i in range(n - 1, -1, -1):
        if b == NO_BLOCK:
            return False
        out[i] = b
        b = parent[b]
    return True


@njit(cache=True)
def survey(ids, ref, slots, copies, refs, away):
    """Per tier t, copies[t, i]: block ids[i] has a copy in tier t; refs[i]: its ref count.
    The blocks with no device copy, in chain order, into the columns of `away`: away[0, j]
    the block, away[1, j] the first tier holding a copy of it (-1: none;
    `BlockTable.fastest_tier`), away[2, j] its slot there. Returns (pinned: how many have ref
    > 0, on_dev: how many have a device copy (the rest are in `away`), pinning: how many are
    unpinned with a device copy)."""
    n = len(ids)
    pinned = 0
    on_dev = 0
    pinning = 0
    j = 0
    for i in range(n):
        b = ids[i]
        r = ref[b]
        refs[i] = r
        if r:
            pinned += 1
        first = -1
        where = NO_SLOT
        for t in range(len(slots)):
            at = slots[t][b]
            has = at != NO_SLOT
            copies[t, i] = has
            if has and first < 0:
                first = t
                where = at
        if copies[0, i]:
            on_dev += 1
            if r == 0:
                pinning += 1
        else:
            away[0, j] = b
            away[1, j] = first
            away[2, j] = where
            j += 1
    return pinned, on_dev, pinning


@njit(cache=True)
def pin(ids, refs, ref, cand, copies, pinned_by_tier, refresh):
    """ref += 1 for the chain (from `refs`, the counts surveyed); pinned_by_tier[t] (t >= 1)
    += the newly pinned blocks with a copy in tier t; the newly pinned blocks that are
    candidates go to `refresh`, in chain order. Returns how many."""
    m = 0
    for i in range(len(ids)):
        b = ids[i]
        r = refs[i]
        ref[b] = r + 1
        if r == 0:
            for t in range(1, copies.shape[0]):
                if copies[t, i]:
                    pinned_by_tier[t] += 1
            if cand[b]:
                refresh[m] = b
                m += 1
    return m


@njit(cache=True)
def touch(ids, hits, last, clock, copies, served):
    """A request reused the chain: hits += 1, last use = clock; served[t] (t >= 1) = the blocks
    whose fastest copy is in tier t (copies before any promotion)."""
    k = copies.shape[0]
    for i in range(len(ids)):
        b = ids[i]
        hits[b] += 1
        last[b] = clock
        if k > 1 and not copies[0, i]:
            for t in range(1, k):
                if copies[t, i]:
                    served[t] += 1
                    break


@njit(cache=True)
def unpin(ids, rev, ref, slots, kids, unpinned_by_tier, zero, refresh):
    """ref -= 1 for every block of `ids` (each once; from the last when `rev`); zero[:z] = the
    blocks unpinned now, in that order, unpinned_by_tier[t] = how many of them have a copy in
    tier t, refresh[:r] = those that may have become candidates (a copy in some tier where no
    child has one). Returns (z, r)."""
    z = 0
    r = 0
    n = len(ids)
    for j in range(n):
        b = ids[n - 1 - j] if rev else ids[j]
        left = ref[b] - 1
        ref[b] = left
        if left:
            continue
        zero[z] = b
        z += 1
        maybe = False
        for t in range(len(slots)):
            if slots[t][b] != NO_SLOT:
                unpinned_by_tier[t] += 1
                if kids[t][b] == 0:
                    maybe = True
        if maybe:
            refresh[r] = b
            r += 1
    return z, r


@njit(cache=True)
def stamp(ids, published, last, clock):
    """last use = clock for the published blocks of `ids`; returns how many are published."""
    n = 0
    for i in range(len(ids)):
        b = ids[i]
        if published[b]:
            last[b] = clock
            n += 1
    return n


@njit(cache=True)
def releasable(zero, z, published, flight, out):
    """Of zero[:z], the private blocks no copy is using (published 0, in flight 0), into
    `out`; returns how many."""
    m = 0
    for i in range(z):
        b = zero[i]
        if published[b] == 0 and flight[b] == 0:
            out[m] = b
            m += 1
    return m


@njit(cache=True)
def gain_chain(ids, new, mine, owner, busy, ref, parent, published, kids, flight, cand, out):
    """`Copies.set_slots` of a chain (each block published, the child of the one before):
    mine[ids[i]] = new[i], owner[new[i]] = ids[i], each block's parent gains a resident
    child (the first one's too, if it has one); out[:m] = the blocks to re-derive, in the
    order `set_slot` one block at a time first touches them (the chain's parent first),
    less those in flight that are candidates nowhere (they stay none). Returns (m, how many
    are pinned), or (-1, 0), having written nothing, if any block is busy (a copy under way
    reads it) or the blocks are no such chain: the caller takes the general path."""
    n = len(ids)
    for i in range(n):
        b = ids[i]
        if busy[b] != 0 or published[b] == 0 or (i > 0 and parent[b] != ids[i - 1]):
            return -1, 0
    m = 0
    pinned = 0
    p = parent[ids[0]] if n else NO_BLOCK
    if p != NO_BLOCK:
        kids[p] += 1
        if flight[p] == 0 or cand[p] != 0:
            out[m] = p
            m += 1
    for i in range(n):
        b = ids[i]
        mine[b] = new[i]
        owner[new[i]] = b
        if ref[b]:
            pinned += 1
        if i > 0:
            kids[ids[i - 1]] += 1
        if flight[b] == 0 or cand[b] != 0:
            out[m] = b
            m += 1
    return m, pinned


@njit(cache=True)
def adopt_chain(ids, parent, root, hits, clock, tokens, slots, parent_v, root_v, hits_v, la_v,
                born_v, stored, published, first_child, next_sib, prev_sib, mine, owner, kids):
    """The rows of a chain `adopt` takes in bulk (core/persist.py `_adopt_chain`): block ids[i]
    the only child of ids[i - 1] (ids[0] of `parent`, NO_BLOCK at the root), of root `root`,
    with use count hits[i] and token ids tokens[i], used and published at `clock`, its copy in
    slot slots[i] of the tier whose slot and resident-children columns are `mine` and `kids`
    (every block but the leaf has its child's copy there); `owner` is that tier's slot owners.
    The keys, the prefix index and the links into `parent` are the caller's."""
    n = len(ids)
    for i in range(n):
        b = ids[i]
        parent_v[b] = ids[i - 1] if i else parent
        root_v[b] = root
        hits_v[b] = hits[i]
        la_v[b] = clock
        born_v[b] = clock
        stored[b, :] = tokens[i, :]
        published[b] = 1
        first_child[b] = ids[i + 1] if i + 1 < n else NO_BLOCK
        next_sib[b] = NO_BLOCK
        prev_sib[b] = NO_BLOCK
        mine[b] = slots[i]
        owner[slots[i]] = b
        if i + 1 < n:
            kids[b] = 1


@njit(cache=True)
def landed(ids, dst, published, flight, ref, slots, kids, cand, refresh):
    """A promotion of the blocks `ids` into device slots `dst` landed, the commit's common
    case: each is published, in flight, and holds device slot `dst[i]` still. Then in flight
    -= 1 for each, and refresh[:m] = those whose candidacy (as `BlockTree._refresh` derives
    it) differs from `cand` now, in order; returns m. Returns -1, having written nothing,
    if any block is not that case: the caller takes the general path.

    NOTE: each id once (a promotion plans each block once)."""
    n = len(ids)
    dev = slots[0]
    for i in range(n):
        b = ids[i]
        if published[b] == 0 or dev[b] != dst[i] or flight[b] < 1:
            return -1
    m = 0
    for i in range(n):
        b = ids[i]
        f = flight[b] - 1
        flight[b] = f
        want = 0
        if f == 0:
            unpinned = ref[b] == 0
            faster = False
            for t in range(len(slots)):
                has = slots[t][b] != NO_SLOT
                if has and kids[t][b] == 0 and (unpinned or faster):
                    want |= 1 << t
                faster = faster or has
        if want != cand[b]:
            refresh[m] = b
            m += 1
    return m


@njit(cache=True)
def leaving(v, t, limit, parent, prev_sib, next_sib, kids, published, flight, ref, cand, slots,
            out):
    """The ancestors of leaf v (being dropped from tier t, its only copy) that would each, once
    the block below it has left, be a simple leaf of tier t: v's chain above it, as far as
    each block has the one below as its only child and only resident child in t, is published,
    unpinned, not in flight, not a candidate yet, and has its only copy in a slot of t below
    `limit`. Into `out` (v's parent first); returns how many."""
    bit = 1 << t
    mine = slots[t]
    m = 0
    c = v
    while m < len(out):
        p = parent[c]
        if p == NO_BLOCK or prev_sib[c] != NO_BLOCK or next_sib[c] != NO_BLOCK:
            break
        if kids[p] != 1 or published[p] == 0 or flight[p] != 0 or ref[p] != 0 or \
                cand[p] & bit:
            break
        s = mine[p]
        if s == NO_SLOT or s >= limit:
            break
        alone = True
        for u in range(len(slots)):
            if u != t and slots[u][p] != NO_SLOT:
                alone = False
        if not alone:
            break
        out[m] = p
        m += 1
        c = p
    return m


@njit(cache=True)
def unlink_run(run, lo, hi, first_child, kids, undo):
    """Each of run[lo:hi] loses its only child, the block before it in the chain: no first
    child, no resident child in the tier (`undo`: given back, run[lo - 1] the first's)."""
    for i in range(lo, hi):
        b = run[i]
        if undo:
            first_child[b] = run[i - 1]
            kids[b] = 1
        else:
            first_child[b] = NO_BLOCK
            kids[b] = 0


@njit(cache=True)
def free_run(run, n, mine, owner, gen, slots_out):
    """run[:n] leave the tier and their rows are freed (the table's part of dropping them):
    their slots into `slots_out`, in order."""
    for i in range(n):
        b = run[i]
        s = mine[b]
        owner[s] = NO_BLOCK
        mine[b] = NO_SLOT
        slots_out[i] = s
        gen[b] = (gen[b] + 1) & 0xFFFFFFFF


_warm: set[int] = set()


def warm_up(num_tiers: int) -> None:
    """Compile (or load from numba's disk cache) every kernel for `num_tiers` slot tiers, once
    per process: the first request must not stall under the lock."""
    if num_tiers in _warm:
        return
    _warm.add(num_tiers)
    from tiered_cache.core.blocks import BlockTable

    t = BlockTable(num_tiers, 2, 4)
    ids = np.arange(2, dtype=np.intp)
    slots = tuple(t.view("slots", i) for i in range(num_tiers))
    kids = tuple(t.view("resident_children", i) for i in range(num_tiers))
    want = np.zeros(4, np.int32)
    verify(ids, t.view("parent"), t.view("root_id"), t.tokens, want, 2, -1, 0, True)
    ancestors(t.view("parent"), 0, 1, np.zeros(1, np.intp))
    copies = np.zeros((num_tiers, 2), np.bool_)
    refs = np.zeros(2, np.int32)
    survey(ids, t.view("ref_count"), slots, copies, refs, np.zeros((3, 2), np.intp))
    counts = np.zeros(num_tiers, np.int64)
    out = np.zeros(2, np.intp)
    pin(ids, refs, t.view("ref_count"), t.view("candidate"), copies, counts, out)
    touch(ids, t.view("hits"), t.view("last_access"), 1, copies, counts)
    t.view("ref_count")[:] = 2
    for rev in (True, False):
        unpin(ids, rev, t.view("ref_count"), slots, kids, counts, out, out.copy())
    stamp(ids, t.view("published"), t.view("last_access"), 1)
    releasable(out, 0, t.view("published"), t.view("in_flight"), out.copy())
    gain_chain(ids[:0], out[:0], slots[0], np.zeros(4, np.int32), t.view("busy_tiers"),
               t.view("ref_count"), t.view("parent"), t.view("published"), kids[0],
               t.view("in_flight"), t.view("candidate"), out.copy())
    adopt_chain(ids[:0], -1, 0, np.zeros(0, np.int64), 1, t.tokens[:0], ids[:0],
                t.view("parent"), t.view("root_id"), t.view("hits"), t.view("last_access"),
                t.view("inserted_at"), t.tokens, t.view("published"), t.view("first_child"),
                t.view("next_sibling"), t.view("prev_sibling"), slots[0], np.zeros(4, np.int32),
                kids[0])
    landed(ids[:0], out[:0], t.view("published"), t.view("in_flight"), t.view("ref_count"),
           slots, kids, t.view("candidate"), out.copy())
    cand = t.view("candidate")
    leaving(0, 0, 4, t.view("parent"), t.view("prev_sibling"), t.view("next_sibling"),
            kids[0], t.view("published"), t.view("in_flight"), t.view("ref_count"), cand,
            slots, out)
    for undo in (True, False):
        unlink_run(out, 1, 1, t.view("first_child"), kids[0], undo)
    owner = np.zeros(4, np.int32)
    free_run(out, 0, slots[0], owner, t.view("gen"), out.copy())
