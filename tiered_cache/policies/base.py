"""The eviction-policy interface.

A policy instance serves one tier and orders that tier's *candidates*: blocks that have a copy
in the tier, are not pinned by an open sequence (unless a faster tier also holds them), are not
in flight, and have no child with a copy in the same tier. The cache keeps that set exact and
tells the policy every change, so a policy never has to skip over ineligible blocks.

NOTE: "leaves first" falls out of the candidate rule: a parent only becomes a candidate once all
of its children have left the tier, so a prefix is never cut in the middle.

Hooks, all called with the cache lock held (keep them O(1) or O(log n)):

- `insert(block)`: the block became a candidate.
- `remove(block)`: the block stopped being a candidate (pinned, gained a child, copy dropped).
- `access(block)`: a request reused the block (it may or may not be a candidate right now).
  `block.hits` and `block.last_access` are already updated when this is called.
- `victims(n)`: remove and return up to `n` candidates, best victim first.

Per-block history that must outlive candidacy lives on the `Block` (`hits`, `last_access`,
`depth`, `inserted_at`); per-policy state keyed by `block.id` must be dropped in `remove`, or
bounded by the policy itself (ghost lists).
"""

from __future__ import annotations

import heapq
import itertools
from abc import ABC, abstractmethod

from tiered_cache.block import Block


class CachePolicy(ABC):
    name: str = "base"

    def __init__(self, capacity_blocks: int, *, block_size: int = 16,
                 cost_context_tokens: float = 53_000.0) -> None:
        # capacity_blocks: slots in the tier (for policies that size queues or ghosts).
        # cost_context_tokens: context length at which a token's attention FLOPs equal its
        # linear-layer FLOPs (P / (2 * layers * hidden)); used by cost-aware policies.
        self.capacity_blocks = capacity_blocks
        self.block_size = block_size
        self.cost_context_tokens = cost_context_tokens

    @abstractmethod
    def insert(self, block: Block) -> None: ...

    @abstractmethod
    def remove(self, block: Block) -> None: ...

    def access(self, block: Block) -> None:  # noqa: B027 - optional hook, default: no state
        """Most priority policies read `block.hits`/`last_access` at insert time instead."""

    @abstractmethod
    def victims(self, n: int) -> list[Block]: ...

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

    def __init__(self, capacity_blocks: int, **kw) -> None:
        super().__init__(capacity_blocks, **kw)
        self._heap: list[tuple[float, int, int, Block]] = []
        self._old: list[tuple[float, int, int, Block]] = []   # being drained into _heap
        self._live: dict[int, int] = {}   # block.id -> sequence number of its live entry
        self._seq = itertools.count()

    def priority(self, block: Block) -> float:
        raise NotImplementedError

    def insert(self, block: Block) -> None:
        n = next(self._seq)
        self._live[block.id] = n
        # Ties: deeper blocks first (they are leaves of their chain), then oldest entry.
        heapq.heappush(self._heap, (self.priority(block), -block.depth, n, block))
        self._maybe_compact()

    def remove(self, block: Block) -> None:
        self._live.pop(block.id, None)
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
            if live.get(e[3].id) == e[2]:
                heapq.heappush(heap, e)

    def entries(self) -> list[tuple[float, int, int, Block]]:
        """Live heap entries (for subclasses that re-key in bulk)."""
        live = self._live
        return [e for e in self._heap + self._old if live.get(e[3].id) == e[2]]

    def access(self, block: Block) -> None:
        if block.id in self._live:      # re-key a candidate that was hit
            self.insert(block)

    def victims(self, n: int) -> list[Block]:
        out: list[Block] = []
        heap, old, live = self._heap, self._old, self._live
        while (heap or old) and len(out) < n:
            src = old if not heap or (old and old[0] < heap[0]) else heap
            prio, _, seq, block = heapq.heappop(src)
            if live.get(block.id) == seq:
                del live[block.id]
                self.on_evict(prio, block)
                out.append(block)
        if old:
            self._drain()
        return out

    def on_evict(self, priority: float, block: Block) -> None:  # noqa: B027 - optional hook
        """Called for each victim (aging policies raise their clock here)."""

    def __len__(self) -> int:
        return len(self._live)
