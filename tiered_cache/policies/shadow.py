"""Candidate eviction orders (*experts*) and the miniature caches that simulate them.

Every expert ranks a block by `last use + credit` in clock ticks, lowest evicted first:

    credit = min(lifetimes * L * log2(uses), gaps * span / (uses - 1))      (0 for uses == 1)

where L is the cache's turnover time (capacity / evictions per tick, measured), `uses` the
times its content was requested and `span / (uses - 1)` the content's own mean interval
between uses. So the same function ranks the live tier's candidates (`adaptive`) and the mini
caches' keys here, and a mini cache predicts what its expert would do in the tier.

A mini cache holds a sample of the content keys (`duel.Duel` picks it) in capacity/R slots,
leaves first on the *projected* tree: a sampled key's parent is its nearest sampled ancestor,
and a key can be evicted only once no sampled child of it is resident, as in the real cache.

NOTE: why the tree. A prefix cache holds only prefix-closed sets and hits a block only if its
whole prefix is cached. Simulated as independent items, the sampled keys rank the experts
wrongly: on agent loops at 1,500 blocks (tuning seed 1) independent items put an expert of 16
lifetimes per doubling capped at 2 gaps at 0.83x LRU where the real cache gets 1.10x; with the
projected tree the mini caches give 1.07-1.09x.

NOTE: cost. A mini cache's hooks are O(log cap) heap work; stale entries are shed by one
rebuild once the heap passes 4x its capacity, O(1) amortised per push (at most capacity/R
entries survive a rebuild, and 3x that many pushes come before the next).
"""

from __future__ import annotations

import heapq
import math
from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from tiered_cache.policies.duel import Duel


class Expert(NamedTuple):
    """An eviction order: `last use + min(lifetimes * L * log2(uses), gaps * mean gap)`."""

    name: str
    lifetimes: float
    """Credit per doubling of uses, in tier lifetimes; 0 is LRU."""
    gaps: float
    """Cap on the credit, in the content's mean reuse intervals (inf: no cap)."""


EXPERTS: tuple[Expert, ...] = (
    Expert("lru", 0.0, math.inf),
    Expert("reuse", 1.0, 2.0),
    Expert("freq", 16.0, math.inf),
)
"""The candidates. `lru` comes first: it is where the choice starts and the floor it returns
to. `reuse` is `reuse_credit`'s order: one lifetime of credit per doubling of uses, capped at
twice the content's own mean reuse interval (86% of the gaps of a Poisson stream are
shorter), so content used often and then dropped does not linger: recency with a little
memory. `freq` keeps a block 16 lifetimes per doubling of uses with no overdue cap:
frequency first, which wins at small capacities and on Zipf pools and loses when finished
sessions linger on their counts.

Chosen on the tuning seeds among credits of 1-64 lifetimes per doubling and caps of 2-16 gaps
or none, then checked on the shared trace (docs/replay.md): a first set with `gap` (16
lifetimes, 2 gaps) in place of `reuse` won more on the generated tuning seeds but fell to
0.90x LRU on the shared trace at 500 blocks, where `gap` alone gives 0.89x and 0.67x at 1,500
(and its mini cache, at R = 8, overrates `freq` there: 1.11x LRU's mini against 0.97x in the
real tier)."""

TAIL_FIRST = 2.0**38
"""Subtracted from a dead tail's priority in the credit experts: before every other only copy,
after the spare copies (-2**40), as in `class_credit`."""

# A history entry, shared by the mini caches of a duel:
# [uses, first use, last use, parent key, depth, tail (1: its request's last block, used once)]
USES, FIRST, LAST, PARENT, DEPTH, TAIL = range(6)


def credit(lifetimes: float, gaps: float, lifetime: float, uses: int, span: float) -> float:
    """An expert's credit in clock ticks; `span` is last use - first use."""
    if uses < 2 or span <= 0 or lifetimes == 0.0:
        return 0.0
    c = lifetimes * lifetime * math.log2(uses)
    cap = gaps * span / (uses - 1)
    return c if c < cap else cap


class Turnover:
    """A cache's lifetime: capacity / (evictions per clock tick), a moving average over about
    `capacity` evictions (as `reuse_credit` measures it); 0 until evictions start.

    Evictions are reported in batches of at least `batch` (1 until the first one, which
    starts the clock), so a hot path only counts."""

    __slots__ = ("cap", "lifetime", "batch", "_since")

    def __init__(self, cap: int) -> None:
        self.cap = max(1, cap)
        self.lifetime = 0.0
        self.batch = 1
        self._since = -1

    def evicted(self, now: int, n: int = 1) -> None:
        """`n` evictions, the last at clock `now`."""
        if self._since < 0:             # the cache just filled up: start the clock
            self._since = now
            self.batch = max(16, self.cap // 8)
            return
        sample = self.cap * max(1, now - self._since) / n
        w = min(1.0, n / self.cap)
        self.lifetime = sample if self.lifetime == 0.0 else (
            (1 - w) * self.lifetime + w * sample)
        self._since = now


class MiniCache:
    """A credit expert's cache over the sampled keys, leaves first on the projected tree.

    `res`: resident key -> serial of its live heap entry (older entries are stale and skipped
    when popped; -1: none, while it has a child); `kids`: resident key -> resident children,
    only while it has some (not evictable then; it gets an entry when its last child leaves).

    NOTE: the resident set is prefix-closed (a key is inserted right after its parent was used,
    and a parent never leaves before its children), so of a chain of keys a mini cache holds a
    prefix: `publish` finds the first miss and knows the rest miss too.
    """

    __slots__ = ("lifetimes", "gaps", "cap", "res", "kids", "heap", "n", "turnover", "_duel",
                 "_gone")
    kind = "credit"

    def __init__(self, expert: Expert, cap: int, duel: Duel) -> None:
        self.lifetimes, self.gaps = expert.lifetimes, expert.gaps
        self.cap = max(1, cap)
        self._duel = duel               # the shared history and clock
        self.res: dict[bytes, int] = {}
        self.kids: dict[bytes, int] = {}
        # (priority, -depth, serial, key, parent key): lowest first, the deeper on ties
        self.heap: list[tuple[float, int, int, bytes, bytes | None]] = []
        self.n = 0
        self.turnover = Turnover(self.cap)
        self._gone = 0                  # evictions not yet reported to `turnover`

    def push(self, h: bytes, e: list) -> None:
        """Key h is a candidate, ranked by its history e."""
        self.n = n = self.n + 1
        self.res[h] = n
        p = e[LAST]
        uses = e[USES]
        if uses > 1:
            span = p - e[FIRST]
            if span > 0:
                c = self.lifetimes * self.turnover.lifetime * math.log2(uses)
                cap = self.gaps * span / (uses - 1)
                p += c if c < cap else cap
        elif e[TAIL] and self._duel.tails_dead:
            p -= TAIL_FIRST
        heapq.heappush(self.heap, (p, -e[DEPTH], n, h, e[PARENT]))

    def hit(self, h: bytes, e: list) -> bool:
        """A use of one key (a hit in the live tier, as a request opens); True if this cache
        held it."""
        res = self.res
        if h in res:
            if h not in self.kids:      # a candidate: re-key it
                self.push(h, e)
            return True
        parent = e[PARENT]
        if parent in res:
            kids = self.kids
            kids[parent] = kids.get(parent, 0) + 1
        self.push(h, e)
        if len(res) > self.cap:
            self.evict(e[LAST])
        return False

    def publish(self, keys: list[bytes], entries: list[list], parent: bytes | None) -> int:
        """Uses of a chain of keys, root first, each one's parent the one before it (the first
        one's `parent`); returns how many of them this cache held."""
        res = self.res
        n = len(keys)
        j = 0
        while j < n and keys[j] in res:
            j += 1
        if j == n:
            h = keys[-1]
            if h not in self.kids:
                self.push(h, entries[-1])
            return j
        kids = self.kids
        if j:
            parent = keys[j - 1]
        if parent in res:
            kids[parent] = kids.get(parent, 0) + 1
        for i in range(j, n - 1):       # each one's child follows: not evictable
            res[keys[i]] = -1
            kids[keys[i]] = 1
        self.push(keys[-1], entries[-1])
        if len(res) > self.cap:
            self.evict()
        return j

    def evict(self, pinned: int | None = None) -> None:
        """Down to capacity: lowest priority first, only keys without a resident child, and
        none last used at clock `pinned` (the request being opened holds them).

        NOTE: a publish pins nothing: the request holds its prefix (each key has a resident
        child) and its new chain (likewise but for its last key), so only its last key can go,
        as the real cache's next allocation would take it first. A hit at open must pin: its
        key is a leaf until the rest of the request arrives."""
        res, kids, heap, pop = self.res, self.kids, self.heap, heapq.heappop
        hist = self._duel.hist
        cap = self.cap
        gone = 0
        aside = None
        while len(res) > cap and heap:
            x = pop(heap)
            _, _, s, v, parent = x
            if res.get(v) != s or v in kids:
                continue                # stale, or it has a resident child
            if pinned is not None and hist[v][LAST] == pinned:
                if aside is None:
                    aside = [x]
                else:
                    aside.append(x)
                continue
            del res[v]
            gone += 1
            c = kids.get(parent)
            if c is not None:
                if c > 1:
                    kids[parent] = c - 1
                else:                   # its last resident child left: evictable again
                    del kids[parent]
                    self.push(parent, hist[parent])
        if aside is not None:
            for x in aside:
                heapq.heappush(heap, x)
        self._gone += gone
        if self._gone >= self.turnover.batch:
            self.turnover.evicted(self._duel.now, self._gone)
            self._gone = 0
        if len(heap) > 4 * cap + 64:    # shed stale entries (amortised O(1) per push)
            self.heap = [x for x in heap if res.get(x[3]) == x[2] and x[3] not in kids]
            heapq.heapify(self.heap)

    def __len__(self) -> int:
        return len(self.res)


class LruMini:
    """LRU over the sampled keys (the floor's mini cache), without child counts.

    A request uses a block's whole prefix at the same clock, so a parent's last use is never
    older than its children's, and LRU with ties to the deeper key is leaves first by itself.
    A hit only moves the shared history; a popped entry older than its key's last use goes
    back in with that use (lazy re-keying, exact because an LRU key only grows), so the heap
    holds one entry per resident key.
    """

    __slots__ = ("cap", "res", "heap", "turnover", "_duel", "_gone")
    kind = "lru"

    def __init__(self, cap: int, duel: Duel) -> None:
        self.cap = max(1, cap)
        self._duel = duel
        self.res: set[bytes] = set()
        self.heap: list[tuple[int, int, bytes]] = []    # (last use when pushed, -depth, key)
        self.turnover = Turnover(self.cap)
        self._gone = 0

    def hit(self, h: bytes, e: list) -> bool:
        res = self.res
        if h in res:
            return True
        res.add(h)
        heapq.heappush(self.heap, (e[LAST], -e[DEPTH], h))
        if len(res) > self.cap:
            self.evict()
        return False

    def publish(self, keys: list[bytes], entries: list[list], parent: bytes | None) -> int:
        res = self.res
        n = len(keys)
        j = 0
        while j < n and keys[j] in res:
            j += 1
        heap, push = self.heap, heapq.heappush
        for i in range(j, n):
            e = entries[i]
            res.add(keys[i])
            push(heap, (e[LAST], -e[DEPTH], keys[i]))
        if len(res) > self.cap:
            self.evict()
        return j

    def evict(self) -> None:
        res, heap, hist = self.res, self.heap, self._duel.hist
        cap = self.cap
        gone = 0
        while len(res) > cap and heap:
            last, d, h = heap[0]
            e = hist.get(h)
            if e is not None and e[LAST] > last:
                heapq.heapreplace(heap, (e[LAST], d, h))     # used since it was pushed
                continue
            heapq.heappop(heap)
            res.discard(h)
            gone += 1
        self._gone += gone
        if self._gone >= self.turnover.batch:
            self.turnover.evicted(self._duel.now, self._gone)
            self._gone = 0

    def __len__(self) -> int:
        return len(self.res)
