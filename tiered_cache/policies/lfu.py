"""Least frequently used with dynamic aging (LFU-DA).

Arlitt, Cherkasova, Dilley, Friedrich and Jin, "Evaluating content management techniques for Web
proxy caches", ACM SIGMETRICS Performance Evaluation Review 27(4), 2000.
"""

from __future__ import annotations

import heapq

from tiered_cache.policies.base import PriorityPolicy


class LFUPolicy(PriorityPolicy):
    """Evicts the candidate with the lowest `clock + hits`; the clock ages out stale favourites.

    Plain LFU never forgets: a system prompt that was hot yesterday keeps its high count and
    outlives everything that is hot today. LFU-DA adds an inflation value `clock` that rises to
    the priority of each victim, and a block's priority `clock + hits` is fixed when it becomes a
    candidate or is hit. A block that stops being used keeps its old priority while newcomers
    enter at the raised clock, so after enough evictions it ranks below a fresh block with fewer
    hits and leaves.

    Ties on priority go to the older `last_access` first (recency tie-break), then the deeper
    block, then the older entry.
    """

    name = "lfu"

    def __init__(self, capacity_blocks: int, **kw) -> None:
        super().__init__(capacity_blocks, **kw)
        self.clock = 0.0

    def priority(self, b: int) -> float:
        return self.clock + self.blocks.hits[b]

    def insert(self, b: int) -> None:
        # Same as PriorityPolicy.insert, with `last_access` ahead of depth in the tie-break: among
        # equally frequent blocks the least recently used goes first. The key is a tuple here so
        # recency never has to be squeezed into the float priority (it would perturb the clock).
        t = self.blocks
        n = next(self._seq)
        self._live[b] = n
        heapq.heappush(self._heap, (self.priority(b), (t.last_access[b], -t.depth[b]), n, b))
        if self._old or len(self._heap) > 1024:
            self._maybe_compact()

    def on_evict(self, priority: float, b: int) -> None:
        # max(): a victim's priority is never below the clock (every live entry was keyed at a
        # clock no higher than now and the heap pops the minimum), but never let the clock fall.
        self.clock = max(self.clock, priority)
