"""Adaptive: the tier follows whichever eviction order its own miniature simulations say fits now.

No single order wins everywhere: frequency wins on Zipf document pools and at small
capacities, a little credit for per-content reuse on conversations whose turns come back after
several cache lifetimes, and plain recency where either would keep the wrong blocks
(docs/replay.md has the numbers). So each tier runs, beside its live candidates, a *duel*
(`duel.Duel`): mini caches of every candidate order (`shadow.EXPERTS`: LRU, `reuse`, `freq`)
over a fixed 1/R sample of the content keys, leaves first on the sampled prefix tree. The live
tier ranks its candidates by the expert the duel has chosen; the choice starts at LRU and moves
only when a challenger beats the incumbent by two standard errors of their paired outcomes, so
LRU is the floor it returns to.

What the live tier keeps, per expert `lifetimes`, `gaps` (`shadow.credit`):

    priority = last use + min(lifetimes * L * log2(uses), gaps * span / (uses - 1))
               - 2**38 for a dead tail (credit experts only) - 2**40 for a spare copy

- `uses` and `span` count the content's uses across evictions: a ghost maps the content keys
  of evicted blocks to (uses, first use), in two generations of 16 entries per slot each (a
  returning block resumes its count; `reuse_credit` argues the 32-per-slot memory). Entries
  stay when their content comes back (no per-block copy): a block reads its content's entry
  whenever it is ranked.
- L is the tier's measured turnover, as in `reuse_credit`.
- A dead tail is a request's last block, used once, while the duel measures tails reused less
  often than other blocks used once (`class_credit`'s rule).
- A spare copy (the block has a copy in every tier) goes first: dropping it loses no hit.

How the duel hears of uses, within the policy interface. A hit is an `access` (every tier
holding a copy hears it). A miss is a newly published chain, which the policy sees only when
its last block becomes a candidate as the request closes (the blocks before it have children):
that *fresh* insert walks up the chain through the blocks never hit and hands the sampled ones
to the duel. An insert that follows a victim is its parent becoming a leaf, not a fresh chain
(`_exposed`); any other insert of a never-hit block stops its walk at the first sampled block
the duel already heard of at that block's clock (its chain was announced with it).

NOTE: cost per hook, all under the control-plane lock. `insert`, `remove`, `access` and
`victim` are O(log n) heap work plus O(1) dict work, and in expectation O(R) parent steps to the
nearest sampled ancestor, taken only for a sampled block and once per walk (a key is sampled
with probability 1/R: R <= 8 below 2^17 blocks, sparser above, `duel.LARGE_MINI`). The walk
of a fresh chain is O(1) amortised per published block: a block is walked when its request
closes, and a later walk stops at the first announced sampled block, so a chain evicted leaf
by leaf is not walked again (O(depth^2) otherwise). The duel does O(experts * log n) work per
sampled use, plus amortised O(1) shedding of stale heap entries (`shadow.MiniCache.evict`). A
switch of expert snapshots the candidates (O(n)) and re-keys them 64 per later hook call;
switches are at most one per `capacity` hook calls (`_follow`), so that too is O(1) amortised.

NOTE: per-block state lives only in `_live` (dropped on `remove`, as for every heap policy);
the ghost and the duel are keyed by content key, bounded, and never by the recycled id. The
one id kept across calls, `_exposed`, carries the row's generation. A restart of a persistent
tier starts the policy empty, as for every policy: `restore` inserts the restored leaves, whose
use counts come back in `blocks.hits` (from the records), which is where `_uses` reads them.
"""

from __future__ import annotations

import heapq
import math

import numpy as np

from tiered_cache.core.blocks import NO_BLOCK, NO_SLOT
from tiered_cache.jit import LazyModule
from tiered_cache.policies import duel_arrays
from tiered_cache.policies.base import PriorityPolicy
from tiered_cache.policies.duel import MAX_RATE, MINI_SLOTS, Duel, Z
from tiered_cache.policies.duel_arrays import ArrayDuel
from tiered_cache.policies.reuse_credit import GHOST_PER_SLOT, REDUNDANT
from tiered_cache.policies.shadow import EXPERTS, TAIL_FIRST, Expert, Turnover, credit

ghost = LazyModule("tiered_cache.policies.ghost")
"""policies/ghost.py, imported at first use (no numba at import: tiered_cache/jit.py)."""

REKEY = 64
"""Candidates re-keyed per hook call after a switch of expert."""

WALK = 64
"""Blocks a walk takes in its first segment, in Python (see `_walk`): a request's new chain of
up to WALK blocks costs one call of the duel; a walk that stops at an announced block (a chain
evicted leaf by leaf) steps through at most WALK blocks more than it must."""

PROBE = 8
"""Each later segment of a walk is PROBE times the one before."""

SPARE = -REDUNDANT / 2
"""Priorities below this were keyed as spare copies."""


class AdaptivePolicy(PriorityPolicy):
    """The live order of the expert the tier's duel chose; see the module docstring."""

    name = "adaptive"
    hears_every_access = True           # the duel must hear every sampled hit
    offers_runs = True                  # `offer(b)` reads b, and its ancestors' parents/hits
    experts: tuple[Expert, ...] = EXPERTS
    z: float = Z
    mini_slots: int = MINI_SLOTS
    max_rate: int = MAX_RATE
    pinned: str | None = None
    """An expert to follow whatever the duel says (evaluation only: the duel still runs)."""
    duel_class: type[ArrayDuel] | type[Duel] = ArrayDuel
    """The duel's implementation: `ArrayDuel` (compiled), or `duel.Duel`, the reference."""

    def __init__(self, capacity_blocks: int, **kw) -> None:
        super().__init__(capacity_blocks, **kw)
        self._cap = max(1, capacity_blocks)
        self.duel = self.duel_class(self._cap, self.experts, self.z, self.mini_slots,
                                    self.max_rate)
        self._choice = 0
        self._m, self._k = self.experts[0].lifetimes, self.experts[0].gaps
        # content key -> (uses, first use, publication and hits of the block that filed it)
        # of blocks evicted here, in two generations (see `_uses`; in arrays: ghost.py)
        self._ghost = ghost.Ghost(GHOST_PER_SLOT * self._cap // 2)
        self._turnover = Turnover(self._cap)
        self._evictions = 0                 # not yet reported to `_turnover`
        self._now = 0                       # latest clock seen (a request's close)
        self._exposed = NO_BLOCK            # parent of the last victim, and its generation
        self._exposed_gen = -1
        self._rekey: list[int] = []
        self._calls = 0                     # access and insert calls (paces switches)
        self._switched_at = -1              # `_calls` at the last switch (-1: none yet)
        self._single = len(self.blocks.slots) == 1
        self._out = np.empty(2 * WALK * PROBE + 1, np.int64)   # the compiled loops' scratch
        if self.pinned is not None:
            self.duel.fixed = [e.name for e in self.experts].index(self.pinned)
            self.duel.choice = self.duel.fixed
            self._follow()

    def resize(self, capacity_blocks: int) -> None:
        # The duel keeps its sample and mini caches: they rank orders, whose ranking moves
        # slowly with the capacity; the live side re-measures its turnover.
        super().resize(capacity_blocks)
        self._cap = max(1, capacity_blocks)
        self._ghost.resize(GHOST_PER_SLOT * self._cap // 2)
        self._turnover.cap = self._cap

    @property
    def expert(self) -> Expert:
        """The expert the live tier follows now."""
        return self.experts[self._choice]

    @property
    def lifetime(self) -> float:
        """The tier's turnover time in clock ticks (0 before the first evictions)."""
        return self._turnover.lifetime

    # -- priority ---------------------------------------------------------------------------
    def _uses(self, b: int) -> tuple[int, int]:
        """(uses, first use) of block b's content: its own, plus what the ghost remembers.

        NOTE: an entry filed by block b itself (a copy evicted here that came back: demoted and
        promoted again, same block, same hit counter) already holds b's hits of then, which
        its counter still holds: they are replaced, not added. Ids are recycled, so "b itself"
        is told by its publication clock, never by the id."""
        t = self.blocks
        key = t.key[b]
        hits = t.hits[b]
        prev = None
        if key is not None:
            prev = self._ghost.get(key)
        if prev is None:
            return hits + 1, t.inserted_at[b]
        if prev[2] == t.inserted_at[b]:
            return prev[0] - prev[3] + hits, prev[1]
        return prev[0] + hits + 1, prev[1]

    def priority(self, b: int) -> float:
        """Block b's priority under the current expert (a re-key; `insert` inlines it)."""
        t = self.blocks
        p = float(t.last_access[b])
        if self._m != 0.0:
            uses, first = self._uses(b)
            p += credit(self._m, self._k, self._turnover.lifetime, uses, p - first)
        if not self._single:
            for tier in t.slots:
                if tier[b] == NO_SLOT:
                    return p
            return p - REDUNDANT
        return p

    # -- hooks ------------------------------------------------------------------------------
    def insert(self, b: int) -> None:
        self._push(b, self._prepare(b)[0])

    def _prepare(self, b: int) -> tuple[float, int, int]:
        """What `insert(b)` does before b enters the heap (the duel hears of a fresh chain, the
        exposed parent is recognised); returns b's priority and `_uses(b)`.

        NOTE: written out in one function (priority inlined): it runs for every published
        block, and replay speed is a target."""
        t = self.blocks
        last = t.last_access[b]
        live = self._live
        hits = t.hits[b]
        self._calls += 1
        fresh = hits == 0 and b not in live
        if fresh and b == self._exposed and t.gen[b] == self._exposed_gen:
            fresh = False               # the parent of a victim became a leaf
            self._exposed = NO_BLOCK
        if fresh:                       # the last block of a request that just closed
            self._walk(b)
        # b's uses (its content's, across evictions), also when the current expert does not
        # rank by them: `offer` hands them on to the ghost if b is evicted at once.
        key = t.key[b]
        prev = None
        if key is not None:
            prev = self._ghost.get(key)
        if prev is None:                                # self._uses(b), inlined
            uses, first = hits + 1, t.inserted_at[b]
        elif prev[2] == t.inserted_at[b]:
            uses, first = prev[0] - prev[3] + hits, prev[1]
        else:
            uses, first = prev[0] + hits + 1, prev[1]
        m = self._m
        p = float(last)
        if m != 0.0:
            if uses > 1:
                if last > first:
                    c = m * self._turnover.lifetime * math.log2(uses)
                    cap = self._k * (last - first) / (uses - 1)
                    p += c if c < cap else cap
            elif fresh and self.duel.tails_dead:
                p -= TAIL_FIRST
        if not self._single:
            for tier in t.slots:
                if tier[b] == NO_SLOT:
                    break
            else:
                p -= REDUNDANT
        return p, uses, first

    def _push(self, b: int, p: float) -> None:
        n = next(self._seq)
        self._live[b] = n
        heapq.heappush(self._heap, (p, -self.blocks.depth[b], n, b))
        if self._old or len(self._heap) > 1024:
            self._maybe_compact()
        if self._rekey:
            self._rekey_some()

    def offer(self, b: int) -> bool:
        """`insert(b)` + `victim()` without the heap round trip when b is the one `victim`
        would pop: b, keyed now, is strictly below every live entry (ties go to the entry
        already there, as in the heap: b's entry number would be the newest). Anything else,
        an entry keyed as a spare copy on top (`victim` may re-key it) included, inserts b:
        always allowed (the eviction loop then asks `victim`).

        NOTE: the common case, a chain leaving leaf by leaf from a single tier, is written
        out here: b is the parent the last victim exposed, so it is no fresh chain (no walk,
        no dead-tail rule) and no spare copy; it does what `_prepare`, `_live_top` and
        `_evicted` do for it, reading its uses from the ghost once."""
        t = self.blocks
        if b != self._exposed or self._rekey or not self._single or \
                t.gen[b] != self._exposed_gen:
            return self._offer(b)
        self._calls += 1
        live = self._live
        hits = t.hits[b]
        if hits == 0 and b not in live:
            self._exposed = NO_BLOCK        # (`_prepare`: the parent of a victim, not fresh)
        key = t.key[b]
        born = t.inserted_at[b]
        prev = None
        if key is not None:
            prev = self._ghost.get(key)
        if prev is None:                # self._uses(b), inlined
            uses, first = hits + 1, born
        elif prev[2] == born:
            uses, first = prev[0] - prev[3] + hits, prev[1]
        else:
            uses, first = prev[0] + hits + 1, prev[1]
        last = t.last_access[b]
        p = float(last)
        m = self._m
        if m != 0.0 and uses > 1 and last > first:
            c = m * self._turnover.lifetime * math.log2(uses)
            cap = self._k * (last - first) / (uses - 1)
            p += c if c < cap else cap
        if self._old:
            top = self._live_top()
        else:
            heap, pop = self._heap, heapq.heappop
            while heap and live.get(heap[0][3]) != heap[0][2]:
                pop(heap)
            top = heap[0] if heap else None
        if top is not None:
            d = -t.depth[b]
            if top[0] < p or (top[0] == p and top[1] <= d) or top[0] < SPARE:
                self._push(b, p)
                return False
        # `_evicted(b, uses, first)`, inlined (nothing to re-key here)
        parent = t.parent[b]
        self._exposed = parent
        if parent != NO_BLOCK:
            self._exposed_gen = t.gen[parent]
        if key is not None:
            self._ghost.put(key, uses, first, born, hits)
        n = self._evictions + 1
        if n >= self._turnover.batch:
            self._turnover.evicted(self._now, n)
            n = 0
        self._evictions = n
        if self._old:
            self._drain()
        return True

    def offer_run(self, run: list[int]) -> int:
        """`offer` of each block of `run` while each is taken (CachePolicy.offer_run): the
        common case of `offer` for the whole run in one compiled call (`ghost.take_run`),
        then `offer` itself for the block it stops before (one that is kept, or whose
        eviction completes a turnover batch), and so on."""
        t = self.blocks
        n = len(run)
        done = 0
        while done < n:
            b = run[done]
            if b != self._exposed or self._rekey or not self._single or self._old or \
                    t.gen[b] != self._exposed_gen:
                if not self.offer(b):
                    return done
                done += 1
                continue
            heap, live, pop = self._heap, self._live, heapq.heappop
            while heap and live.get(heap[0][3]) != heap[0][2]:
                pop(heap)
            top = heap[0] if heap else None
            left = self._turnover.batch - 1 - self._evictions
            rest = run[done:]
            try:
                kb = b"".join(map(t.key.__getitem__, rest))
            except TypeError:           # (published blocks have keys: never, but stay exact)
                kb = None
            k = 0
            if kb is not None and left > 0:
                out = self._out[:2]
                g = self._ghost
                k = ghost.take_run(g.G, g.K, g.S, g.V, g.W, kb, np.asarray(rest, np.intp),
                             len(rest), t.view("hits"), t.view("inserted_at"),
                             t.view("last_access"), t.view("parent"), t.view("gen"),
                             self._m, self._k, self._turnover.lifetime, top is not None,
                             top[0] if top is not None else 0.0,
                             top[1] if top is not None else 0, SPARE, t.view("depth"),
                             left, out)
                if k:
                    self._calls += k
                    self._evictions += k
                    self._exposed = int(out[0])
                    if self._exposed != NO_BLOCK:
                        self._exposed_gen = int(out[1])
                    done += k
            if done < n:                # kept, or its eviction completes a batch: as ever
                if not self.offer(run[done]):
                    return done
                done += 1
        return n

    def _offer(self, b: int) -> bool:
        """`offer` in general."""
        p, uses, first = self._prepare(b)
        if self._rekey:
            self._rekey_some()          # (insert does this before victim looks at the heap)
        d = -self.blocks.depth[b]
        top = self._live_top()
        if top is not None and (top[0] < p or (top[0] == p and top[1] <= d) or top[0] < SPARE):
            self._push(b, p)
            return False
        self._evicted(b, uses, first)
        return True

    def _walk(self, b: int) -> None:
        """Block b, never hit, closed its request: hand the sampled blocks of its new chain
        (up to the first block that was hit before, or announced to the duel already) to the
        duel, root first.

        NOTE: the first WALK blocks are walked here (a request's new chain is short, and a
        compiled call costs as much as a few dozen steps); a longer chain by a compiled loop
        over the table (`duel_kernels.walk_up`) in segments of WALK * PROBE, WALK * PROBE**2,
        ... blocks, each segment checked for announced blocks before the next (so a chain
        evicted leaf by leaf is not walked again); the duel takes the sampled ones in one
        call (`walk_publish`)."""
        t = self.blocks
        duel = self.duel
        la = t.last_access
        if la[b] > self._now:
            self._now = la[b]
        key, hits, parent = t.key, t.hits, t.parent
        start = b
        ids: list[int] = []
        n = 0
        while b != NO_BLOCK and hits[b] == 0 and n < WALK:
            ids.append(b)
            b = parent[b]
            n += 1
        keys = [key[x] for x in ids]
        if None in keys:                # (published blocks have keys: never, but stay exact)
            return self._walk_each(start)
        mask = duel.mask
        lav = t.view("last_access")
        if b != NO_BLOCK and hits[b] == 0:      # a long chain
            par, hv = t.view("parent"), t.view("hits")
            limit, seg, seg_keys = WALK, np.asarray(ids, np.int64), keys
            while True:
                i = duel.deepest_announced(seg_keys, seg, lav, mask)
                if i >= 0:              # announced with its chain: so is the rest above it
                    cut = len(ids) - len(seg_keys) + i
                    if cut:
                        duel.walk_publish(keys[:cut], np.asarray(ids[:cut], np.int64), lav,
                                          t.view("inserted_at"), t.view("depth"), mask,
                                          keys[cut])
                        if duel.choice != self._choice:
                            self._follow()
                    return
                limit *= PROBE
                out = self._out
                if len(out) <= limit:
                    out = self._out = np.empty(2 * limit + 1, np.int64)
                m = duel_arrays.K.walk_up(par, hv, b, limit, out)
                seg = out[:m]
                seg_keys = [key[x] for x in seg.tolist()]
                if None in seg_keys:
                    return self._walk_each(start)
                ids += seg.tolist()
                keys += seg_keys
                b = int(out[limit])
                if b == NO_BLOCK or hits[b]:    # reached a block that was hit, or the root
                    break
        while b != NO_BLOCK:            # the chain's nearest sampled ancestor
            k = key[b]
            if k is not None and not (k[0] & mask):
                break
            b = parent[b]
        duel.walk_publish(keys, np.asarray(ids, np.int64), lav, t.view("inserted_at"),
                          t.view("depth"), mask, key[b] if b != NO_BLOCK else None)
        if duel.choice != self._choice:
            self._follow()

    def _walk_each(self, b: int) -> None:
        """`_walk` block by block in Python, asking the duel at each sampled block (the
        plain loop `_walk` compiles: the tests check that both hand the duel the same
        chains)."""
        t = self.blocks
        duel = self.duel
        mask = duel.mask
        key, hits, parent, seen = t.key, t.hits, t.parent, t.last_access
        if seen[b] > self._now:
            self._now = seen[b]
        tail = b
        chain: list[int] = []           # sampled, never hit, deepest first
        while b != NO_BLOCK and hits[b] == 0:
            k = key[b]
            if k is not None and not (k[0] & mask):
                if duel.first_announced([k], [seen[b]]) == 0:
                    break               # announced with its chain: so is the rest above it
                chain.append(b)
            b = parent[b]
        if not chain:
            return
        while b != NO_BLOCK:            # the chain's nearest sampled ancestor
            k = key[b]
            if k is not None and not (k[0] & mask):
                break
            b = parent[b]
        chain.reverse()                 # root first
        duel.publish_keys([key[x] for x in chain], [t.inserted_at[x] for x in chain],
                          [t.depth[x] for x in chain], key[b] if b != NO_BLOCK else None,
                          chain[-1] == tail)
        if duel.choice != self._choice:
            self._follow()

    def _sampled_above(self, b: int) -> bytes | None:
        """The key of the nearest sampled ancestor of block b (b excluded), or None."""
        t = self.blocks
        key, parent, mask = t.key, t.parent, self.duel.mask
        b = parent[b]
        while b != NO_BLOCK:
            k = key[b]
            if k is not None and not (k[0] & mask):
                return k
            b = parent[b]
        return None

    def access(self, b: int) -> None:
        self._calls += 1
        t = self.blocks
        last = t.last_access[b]
        if last > self._now:
            self._now = last
        k = t.key[b]
        duel = self.duel
        if k is not None and not (k[0] & duel.mask):
            # (the parent names the structural ancestor: the duel keeps the first one it got)
            duel.hits([k], [last], [t.depth[b]], self._sampled_above(b))
            if duel.choice != self._choice:
                self._follow()
        if b in self._live:             # re-key a candidate that was hit
            PriorityPolicy.insert(self, b)

    takes_chain_keys = True

    def access_many(self, blocks, keys: bytes | None = None) -> None:
        """`access` of each block of one reused chain, root first (an int array or list),
        the duel's part in one compiled call (`hit_chain`) per run of blocks that are no
        candidates. `keys`: the chain's keys joined, if the caller has them
        (CachePolicy.access_many).

        Exactly `access` block by block: `_calls` is what it would be at the block whose hit
        moves the duel's choice where `_follow` acts on it; a current candidate of the chain
        goes through `access` (its re-key must see the expert of its moment), and a chain
        that is not one contiguous run goes block by block."""
        ids = blocks.tolist() if isinstance(blocks, np.ndarray) else list(blocks)
        n = len(ids)
        depth = self.blocks.depth
        if n < 2 or depth[ids[-1]] - depth[ids[0]] != n - 1:
            for b in ids:
                self.access(b)
            return
        live = self._live
        if not live or live.keys().isdisjoint(ids):
            self._hit_run(blocks, ids, 0, n, keys)
            return
        # NOTE: a chain with candidates in it (a slower tier's leaf: its last block, as a
        # rule) goes in the runs between them; hearing of a hit never changes who is one.
        start = 0
        for i, b in enumerate(ids):
            if b in live:
                self._hit_run(blocks, ids, start, i, keys)
                self.access(b)
                start = i + 1
        self._hit_run(blocks, ids, start, n, keys)

    def _hit_run(self, blocks, ids: list[int], lo: int, hi: int, keys: bytes | None) -> None:
        """`access` of ids[lo:hi], a contiguous run of blocks that are no candidates: the
        duel's part in one compiled call. `blocks`, `keys`: as `access_many` got them."""
        n = hi - lo
        if n < 2:
            for b in ids[lo:hi]:
                self.access(b)
            return
        t = self.blocks
        if keys is not None and len(keys) == 16 * len(ids):
            kb = keys if n == len(ids) else keys[16 * lo:16 * hi]
        else:
            try:
                # (the run's keys in one buffer, as the duel takes them)
                kb = b"".join(map(t.key.__getitem__, ids[lo:hi]))
            except TypeError:           # an unpublished block (no key): nothing was done
                for b in ids[lo:hi]:
                    self.access(b)
                return
        if isinstance(blocks, np.ndarray):
            arr = blocks if n == len(ids) else blocks[lo:hi]
        else:
            arr = np.asarray(ids[lo:hi], np.int64)
        la, dep = t.view("last_access"), t.view("depth")
        duel, mask = self.duel, self.duel.mask
        parent = self._sampled_above(ids[lo])
        calls, start = self._calls, 0
        while True:
            pos, latest = duel.hit_chain(kb, arr, la, dep, start, parent, mask, self._choice,
                                         calls, self._switched_at, self._cap)
            if pos >= n:
                break
            self._calls = calls + pos + 1  # the duel moved where `_follow` acts on it
            self._follow()
            parent, start = kb[16 * pos:16 * pos + 16], pos + 1
        self._calls = calls + n
        if latest > self._now:
            self._now = latest

    def _follow(self) -> None:
        """The duel switched expert: rank by it, re-keying the candidates a few per call.

        NOTE: at most one switch per `capacity` hook calls (`_calls`): the snapshot of the
        candidates below is O(candidates) <= O(capacity), so it costs O(1) amortised per call.
        A switch the duel made sooner waits (the duel's choice is checked again on its next
        sampled use)."""
        if self._calls - self._switched_at < self._cap and self._switched_at >= 0:
            return
        self._switched_at = self._calls
        c = self.duel.choice
        self._choice = c
        e = self.experts[c]
        self._m, self._k = e.lifetimes, e.gaps
        self._rekey = list(self._live)

    def _rekey_some(self) -> None:
        rk, live = self._rekey, self._live
        for _ in range(min(REKEY, len(rk))):
            b = rk.pop()
            if b in live:
                PriorityPolicy.insert(self, b)

    def victim(self) -> int:
        heap, live, pop = self._heap, self._live, heapq.heappop
        while True:
            old = self._old
            if old:
                if not heap or old[0] < heap[0]:
                    prio, _, seq, b = pop(old)
                else:
                    prio, _, seq, b = pop(heap)
            elif heap:
                prio, _, seq, b = pop(heap)
            else:
                return -1
            if live.get(b) != seq:
                continue
            del live[b]
            if prio < SPARE and self.priority(b) > SPARE:
                PriorityPolicy.insert(self, b)      # keyed as a spare copy, now the only one
                continue
            self._evicted(b)
            return b

    def _evicted(self, b: int, uses: int = -1, first: int = 0) -> None:
        """b, taken off the live candidates, is this tier's victim: its parent is exposed,
        its content filed in the ghost (as (uses, first use, publication, hits), where (uses,
        first use) is `_uses(b)`, passed in when the caller has it), the turnover counted."""
        t = self.blocks
        parent = t.parent[b]
        self._exposed = parent
        if parent != NO_BLOCK:
            self._exposed_gen = t.gen[parent]
        key = t.key[b]
        if key is not None:
            # NOTE: filed under LRU too, which never reads it: when the duel switches to a
            # credit expert, content that returns must already count its earlier uses
            # (filing only under credit experts cost rag 4-5% on the tuning seeds).
            ghost = self._ghost
            hits, born = t.hits[b], t.inserted_at[b]
            if uses < 0:
                prev = ghost.get(key)
                if prev is None:                    # self._uses(b), inlined
                    uses, first = hits + 1, born
                elif prev[2] == born:
                    uses, first = prev[0] - prev[3] + hits, prev[1]
                else:
                    uses, first = prev[0] + hits + 1, prev[1]
            ghost.put(key, uses, first, born, hits)
        n = self._evictions + 1
        if n >= self._turnover.batch:
            self._turnover.evicted(self._now, n)
            n = 0
        self._evictions = n
        if self._old:
            self._drain()
        if self._rekey:
            self._rekey_some()

    def victims(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            b = self.victim()
            if b < 0:
                break
            out.append(b)
        return out
