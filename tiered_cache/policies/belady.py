"""Belady's MIN (offline): evict the candidate whose next use is farthest in the future.

Belady, "A study of replacement algorithms for a virtual-storage computer", IBM Systems Journal
5(2), 1966.

It needs the future, so it only runs where the whole request stream is known in advance: trace
replay (`tiered-cache replay --policy belady`). Every table the replay tool prints can then show
how far a real policy is from the clairvoyant one.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from tiered_cache.core.blocks import BlockTable
from tiered_cache.policies.base import PriorityPolicy

NEVER = math.inf
"""Next use of a block that is never requested again."""

_UNKNOWN = float(2**52)
"""Offset that ranks blocks with an unknown future (LRU among themselves, by `last_access`)
after the never-used-again ones and before every block with a known next use."""


def block_key(blocks: BlockTable, b: int) -> int | None:
    """The trace id of a replayed block: replay fills every token of block j with hash_ids[j], so
    the block's first token is its id. None for an unpublished block.

    NOTE: the key, not the token row, says whether b is published: a row's tokens are only
    meaningful once it is published (a private or recycled row holds zeros or stale ids).
    """
    if blocks.key[b] is None:
        return None
    return int(blocks.tokens[b, 0])


class NextUseOracle:
    """Next request index at which each trace id is requested again.

    Built from the whole trace (`requests[i]` = the ids of request i). The replay tool calls
    `advance(i)` just before it opens request i: from then on `next_use(x)` is the first request
    after i that asks for x (or NEVER), and every subscribed policy is told which ids changed so
    that it re-keys its candidates (a heap key is only right if it is updated the moment the
    future it encodes changes).

    NOTE: why no entry can go stale. `next_use(x)` only changes when the stream reaches a request
    that contains x, and `advance` announces exactly those ids. A block that was requested but not
    hit (its prefix was gone, or the trace is not prefix-chained) is therefore re-keyed all the
    same.
    """

    def __init__(self, requests: Iterable[Iterable[int]]) -> None:
        self.requests: list[list[int]] = [list(r) for r in requests]
        n = len(self.requests)
        # following[i][j]: next request after i that contains requests[i][j] (or n = never).
        following: list[list[int]] = [[] for _ in range(n)]
        seen: dict[int, int] = {}
        for i in range(n - 1, -1, -1):
            row = self.requests[i]
            nxt = [seen.get(x, n) for x in row]
            following[i] = nxt
            for x in row:
                seen[x] = i
        self._following = following
        self._first = seen                        # first request that asks for each id
        self._next: dict[int, int] = {}
        self.now = -1
        self._n = n
        self._subscribers: list[BeladyPolicy] = []

    def subscribe(self, policy: BeladyPolicy) -> None:
        self._subscribers.append(policy)

    def advance(self, i: int) -> None:
        """Request i is about to be served."""
        self.now = i
        row = self.requests[i]
        nxt = self._next
        for x, f in zip(row, self._following[i]):
            nxt[x] = f
        for policy in self._subscribers:
            policy.rekey(row)

    def next_use(self, key: int) -> float:
        """Request index of the next use of `key` after now; NEVER if none."""
        i = self._next.get(key)
        if i is None:                             # not requested yet
            i = self._first.get(key, self._n)
        return NEVER if i >= self._n else i


class BeladyPolicy(PriorityPolicy):
    """Evicts the candidate whose trace id is requested again farthest in the future.

    - Priority = `-next_use` (the heap pops the lowest): never-used-again blocks go first, then the
      farthest. Ties (e.g. several never-used-again blocks): deeper block first, then oldest entry.
    - The future comes from a `NextUseOracle` set with `set_oracle` (the replay tool does this on
      every tier's policy after building the cache). The oracle announces every change of a next
      use, and `rekey` re-keys those candidates: O(log n) per announced id that is a candidate.
    - Leaves-first is the cache's rule, so this is Belady among the blocks the cache lets go; that
      is what "the room left" means for a prefix cache (a simulator without that rule would cut
      prefixes in the middle).
    - Without an oracle (or for a block whose id is unknown) nothing is known about the future
      and the policy falls back to LRU order, so it still honours the policy contract anywhere;
      it is only meaningful in replay.
    """

    name = "belady"

    def __init__(self, capacity_blocks: int, **kw) -> None:
        super().__init__(capacity_blocks, **kw)
        self.oracle: NextUseOracle | None = None
        self._by_key: dict[int, dict[int, None]] = {}   # trace id -> ids of candidates with it
        self._key_of: dict[int, int] = {}                # candidate id -> its trace id

    def set_oracle(self, oracle: NextUseOracle) -> None:
        self.oracle = oracle
        oracle.subscribe(self)
        for e in self.entries():                # re-key what was inserted before
            PriorityPolicy.insert(self, e[3])

    def priority(self, b: int) -> float:
        key = block_key(self.blocks, b) if self.oracle is not None else None
        if key is None:
            return float(self.blocks.last_access[b]) - _UNKNOWN   # unknown future: LRU order
        return -self.oracle.next_use(key)

    def insert(self, b: int) -> None:
        super().insert(b)
        key = block_key(self.blocks, b)
        if key is not None:
            self._by_key.setdefault(key, {})[b] = None
            self._key_of[b] = key

    def remove(self, b: int) -> None:
        super().remove(b)
        self._forget(b)

    def _forget(self, b: int) -> None:
        # NOTE: by the trace id recorded at insert, not read again from the table: by the time
        # a block stops being a candidate its row may already be unpublished.
        key = self._key_of.pop(b, None)
        if key is not None:
            same = self._by_key.get(key)
            if same is not None:
                same.pop(b, None)
                if not same:
                    del self._by_key[key]

    def rekey(self, keys: Iterable[int]) -> None:
        """The oracle changed the next use of these ids: re-key the candidates that carry them."""
        by_key = self._by_key
        for key in keys:
            same = by_key.get(key)
            if same:
                for b in list(same):
                    PriorityPolicy.insert(self, b)

    def on_evict(self, priority: float, b: int) -> None:
        self._forget(b)
