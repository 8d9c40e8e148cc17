"""The eviction-policy interface.

A policy instance serves one tier and orders that tier's *candidates*: blocks that have a copy
in the tier, are not pinned by an open sequence (unless a faster tier also holds them), are not
in flight, and have no child with a copy in the same tier. The cache keeps that set exact and
tells the policy every change, so a policy never has to skip over ineligible blocks.

NOTE: "leaves first" falls out of the candidate rule: a parent only becomes a candidate once all
of its children have left the tier, so a prefix is never cut in the middle.

Blocks are plain int ids, rows of the control plane's `BlockTable` (core/blocks.py), which the
policy gets as `self.blocks` and reads (never writes): `blocks.last_access[b]`, `blocks.hits[b]`,
`blocks.depth[b]`, `blocks.inserted_at[b]`, `blocks.key[b]` (content key, None while private),
`blocks.slots[t][b]`, `blocks.parent[b]`, `blocks.has_children(b)`.

Hooks, all called with the control-plane lock held (keep them O(1) or O(log n)):

- `insert(b)`: block b became a candidate.
- `remove(b)`: b stopped being a candidate (pinned, gained a child, copy dropped).
- `access(b)`: a request reused b (it may or may not be a candidate right now).
  `blocks.hits[b]` and `blocks.last_access[b]` are already updated when this is called.
- `access_many(blocks)`: `access` of each block in order, for the blocks of one reused chain
  (an intp array, root first: the request's matched prefix, or its blocks with a copy in this
  tier); the cache calls this, once per chain and tier. The default calls `access`. A
  policy with `takes_chain_keys` may be handed `keys=`: the chain's keys joined (16 bytes
  each, `blocks.key` of each block in order), where the match already had them.
- `victims(n)`: remove and return up to `n` candidates, best victim first.
- `offer(b)`: b became a candidate and the caller takes a victim next: take b at once if it
  would be that victim (the default inserts it and says no; eviction then calls `victim`).

Per-block history that must outlive candidacy lives in the table (`hits`, `last_access`,
`depth`, `inserted_at`); per-policy state keyed by the id must be dropped in `remove`, or
bounded by the policy itself (ghost lists).

NOTE: ids are recycled once a block is gone. State kept past `remove` (a parked queue position)
stores `blocks.gen[b]` with it and ignores an entry whose generation differs; ghosts of evicted
content are keyed by `blocks.key[b]`, never by the id.
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod

from tiered_cache.core.blocks import BlockTable


class CachePolicy(ABC):
    name: str = "base"
    offers_runs: bool = False
    """Whether eviction may hand `offer_run` a whole run at once (see `offer_run`)."""
    hears_every_access: bool = True
    """Whether `access` must be called for every reuse of a block with a copy in the tier.
    False for policies whose `access` only re-keys current candidates: the index then skips
    the call for the others (most blocks of a reused chain are not candidates)."""
    takes_chain_keys: bool = False
    """Whether `access_many` accepts `keys=` (the chain's keys joined, see the module
    docstring); the index passes them only to a policy that says so."""

    def __init__(self, capacity_blocks: int, *, blocks: BlockTable, block_size: int = 16,
                 cost_context_tokens: float = 53_000.0) -> None:
        # capacity_blocks: slots in the tier (for policies that size queues or ghosts).
        # blocks: the table the ids index (read-only here).
        # cost_context_tokens: context length at which a token's attention FLOPs equal its
        # linear-layer FLOPs (P / (2 * layers * hidden)); used by cost-aware policies.
        self.capacity_blocks = capacity_blocks
        self.blocks = blocks
        self.block_size = block_size
        self.cost_context_tokens = cost_context_tokens

    @abstractmethod
    def insert(self, b: int) -> None: ...

    @abstractmethod
    def remove(self, b: int) -> None: ...

    def access(self, b: int) -> None:  # noqa: B027 - optional hook, default: no state
        """Most priority policies read `hits`/`last_access` at insert time instead."""

    def access_many(self, blocks, keys: bytes | None = None) -> None:
        """`access(b)` for each of `blocks` (an int array or list) in order: one reused chain,
        root first (see the module docstring). A policy overrides it to do per-chain work
        once. `keys` (the chain's keys joined, for a policy with `takes_chain_keys`) is not
        needed here."""
        access = self.access
        for b in (blocks.tolist() if hasattr(blocks, "tolist") else blocks):
            access(b)

    @abstractmethod
    def victims(self, n: int) -> list[int]: ...

    def victim(self) -> int:
        """The best victim, removed, or -1 when there is no candidate (`victims(1)` without
        the list; eviction takes victims one at a time)."""
        got = self.victims(1)
        return got[0] if got else -1

    def offer(self, b: int) -> bool:
        """b just became a candidate and the caller asks for a victim next (eviction: the
        parent of a victim became a leaf). True: b is that victim, taken now and not kept,
        exactly as `insert(b)` then `victim()` would have returned it; False: b was inserted.

        The default always inserts (eviction then calls `victim`); a policy that can compare
        b with its best candidate cheaply overrides it to spare the round trip."""
        self.insert(b)
        return False

    def offer_run(self, run: list[int]) -> int:
        """`offer` of each block of `run` in turn, while each is taken: a chain leaving the tier
        leaf by leaf (run[i + 1] is run[i]'s parent, and becomes a leaf once run[i] is gone).
        Returns how many were taken; the first one not taken (if any) was inserted.

        NOTE: with `offers_runs` set, eviction hands the policy a whole run at once and drops
        the blocks taken afterwards (core/eviction.py): each run[i] has already lost its child
        run[i - 1] when it is offered, as one at a time, but the blocks taken before it are
        still in the table, and the run's later blocks have lost their child too. So a policy
        sets it only if its `offer(b)` reads nothing of the table but b's own fields and its
        ancestors' fields other than their children. Otherwise (the default) eviction offers
        one block at a time and drops each taken block before offering the next."""
        offer = self.offer
        for i, b in enumerate(run):
            if not offer(b):
                return i
        return len(run)

    def resize(self, capacity_blocks: int) -> None:
        """The tier was resized. Policies that size queues or ghosts from the capacity read
        `capacity_blocks` again (or override this)."""
        self.capacity_blocks = capacity_blocks

    @abstractmethod
    def __len__(self) -> int: ...


class PriorityPolicy(CachePolicy):
    """Candidates in a binary heap keyed by `priority(block)`, lowest evicted first.

    O(log n) insert and pop; `remove` is O(1) by lazy deletion: the live entry of each block is
    remembered and stale entries are skipped on pop, which keeps pin/unpin churn cheap.

    NOTE: stale entries are shed without a stop-the-world rebuild. Once over half the heap is
    stale, it becomes `_old` and a fresh heap starts; every later call moves a bounded number
    of entries (`_DRAIN`) from the end of `_old` into the fresh heap, dropping stale ones.
    Taking from the end of a heap array leaves a valid heap, so `victims` simply pops the
    smaller of the two tops. Every call does O(_DRAIN log n) work at most, so no lock hold
    grows with the number of cached blocks.
    """

    _DRAIN = 256
    hears_every_access = False      # access() only re-keys live candidates
    offers_runs = True              # (set per subclass: __init_subclass__)
    _hooked_evict = False           # a subclass overrides on_evict (set per class)

    def __init_subclass__(cls, **kw) -> None:
        super().__init_subclass__(**kw)
        # A subclass with its own access() (state kept across pins, a clock) hears every
        # reuse unless it says otherwise.
        if "hears_every_access" not in cls.__dict__ and cls.access is not PriorityPolicy.access:
            cls.hears_every_access = True
        # NOTE: `offer` below compares with the heap's best entry, which is only what `insert`
        # then `victim` would do when neither is overridden (a policy that keeps more state
        # there gets the general default unless it defines its own `offer`).
        cls._hooked_evict = cls.on_evict is not PriorityPolicy.on_evict
        if "offer" not in cls.__dict__:
            # (the `offer` it inherits holds only for the hooks of the class that defined it)
            owner = next(k for k in cls.__mro__ if "offer" in k.__dict__)
            if owner is not CachePolicy and any(getattr(cls, m) is not getattr(owner, m)
                                                for m in ("insert", "remove", "victim")):
                cls.offer = CachePolicy.offer
        if "offers_runs" not in cls.__dict__:
            # (this class's `offer` reads only b's priority, depth and the heaps; a subclass
            # whose `priority(b)` reads other blocks' children sets it False)
            cls.offers_runs = cls.offer is PriorityPolicy.offer

    def __init__(self, capacity_blocks: int, **kw) -> None:
        super().__init__(capacity_blocks, **kw)
        # entries: (priority, -depth, entry number, block id)
        self._heap: list[tuple[float, int, int, int]] = []
        self._old: list[tuple[float, int, int, int]] = []     # being drained into _heap
        self._live: dict[int, int] = {}   # block id -> entry number of its live entry
        self._seq = itertools.count()

    @abstractmethod
    def priority(self, b: int) -> float:
        """The block's eviction priority when it becomes a candidate: lowest goes first."""

    def insert(self, b: int) -> None:
        n = next(self._seq)
        self._live[b] = n
        # Ties: deeper blocks first (they are leaves of their chain), then oldest entry.
        heapq.heappush(self._heap, (self.priority(b), -self.blocks.depth[b], n, b))
        if self._old or len(self._heap) > 1024:
            self._maybe_compact()

    def remove(self, b: int) -> None:
        popped = self._live.pop(b, None) is not None
        if self._old or (popped and len(self._heap) > 1024):
            self._maybe_compact()

    def _maybe_compact(self) -> None:
        # Checked on insert too, not only on remove: `access` re-keys a candidate by pushing a
        # fresh entry, so a tier whose candidates keep getting hits (a host copy of a block that
        # is pinned on the GPU) would otherwise grow stale entries until the next eviction.
        if self._old:
            self._drain()
        elif len(self._heap) > 1024 and len(self._heap) > 2 * len(self._live):
            self._old, self._heap = self._heap, []
            self._drain()

    def _drain(self) -> None:
        old, heap, live = self._old, self._heap, self._live
        for _ in range(min(self._DRAIN, len(old))):
            e = old.pop()
            if live.get(e[3]) == e[2]:
                heapq.heappush(heap, e)

    def entries(self) -> list[tuple[float, int, int, int]]:
        """Live heap entries (for subclasses that re-key in bulk)."""
        live = self._live
        return [e for e in self._heap + self._old if live.get(e[3]) == e[2]]

    def access(self, b: int) -> None:
        if b in self._live:             # re-key a candidate that was hit
            self.insert(b)

    def victims(self, n: int) -> list[int]:
        out: list[int] = []
        heap, old, live = self._heap, self._old, self._live
        while (heap or old) and len(out) < n:
            src = old if not heap or (old and old[0] < heap[0]) else heap
            prio, _, seq, b = heapq.heappop(src)
            if live.get(b) == seq:
                del live[b]
                self.on_evict(prio, b)
                out.append(b)
        if old:
            self._drain()
        return out

    def victim(self) -> int:
        heap, old, live = self._heap, self._old, self._live
        while heap or old:
            src = old if not heap or (old and old[0] < heap[0]) else heap
            prio, _, seq, b = heapq.heappop(src)
            if live.get(b) == seq:
                del live[b]
                self.on_evict(prio, b)
                if old:
                    self._drain()
                return b
        return -1

    def offer(self, b: int) -> bool:
        """`insert(b)` + `victim()` without the heap round trip when b is the best entry:
        stale tops are shed (as `victim` would pop them), then b is compared with the best
        live entry of each heap. A tie on (priority, -depth) goes to the heap's entry, as in
        the heap itself (b's entry number would be the newest)."""
        prio = self.priority(b)
        d = -self.blocks.depth[b]
        top = self._live_top()
        if top is not None and (top[0] < prio or (top[0] == prio and top[1] <= d)):
            return self._offer_lost(b, prio, d)
        if self._hooked_evict:
            self.on_evict(prio, b)
        if self._old:
            self._drain()
        return True

    def offer_run(self, run: list[int]) -> int:
        """`offer` of each block of `run` while each is taken (CachePolicy.offer_run), written
        out for the priority policies whose `offer` is this class's."""
        if type(self).offer is not PriorityPolicy.offer:
            return CachePolicy.offer_run(self, run)
        priority, depth, hooked = self.priority, self.blocks.depth, self._hooked_evict
        for i, b in enumerate(run):
            prio = priority(b)
            d = -depth[b]
            top = self._live_top()
            if top is not None and (top[0] < prio or (top[0] == prio and top[1] <= d)):
                self._offer_lost(b, prio, d)
                return i
            if hooked:
                self.on_evict(prio, b)
            if self._old:
                self._drain()
        return len(run)

    def _live_top(self) -> tuple[float, int, int, int] | None:
        """The entry `victim` would pop next, left in place (None: no candidate); stale tops
        of both heaps are shed on the way, as `victim` would drop them."""
        live, pop = self._live, heapq.heappop
        best = None
        for heap in (self._heap, self._old):
            while heap and live.get(heap[0][3]) != heap[0][2]:
                pop(heap)
            if heap and (best is None or heap[0] < best):
                best = heap[0]
        return best

    def _offer_lost(self, b: int, prio: float, d: int) -> bool:
        """`offer`: a live entry beats b, which is inserted (as `insert` would)."""
        n = next(self._seq)
        self._live[b] = n
        heapq.heappush(self._heap, (prio, d, n, b))
        if self._old or len(self._heap) > 1024:
            self._maybe_compact()
        return False

    def on_evict(self, priority: float, b: int) -> None:  # noqa: B027 - optional hook
        """Called for each victim (aging policies raise their clock here)."""

    def __len__(self) -> int:
        return len(self._live)
