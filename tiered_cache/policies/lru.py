"""Least recently used: the baseline every engine ships."""

from __future__ import annotations

from tiered_cache.policies.base import PriorityPolicy


class LRUPolicy(PriorityPolicy):
    """Evicts the candidate whose last use is oldest.

    NOTE: a heap keyed on `last_access` rather than an ordered dict: a parent becomes a candidate
    only when its last child leaves, and must then rank by its own (old) last use, not by the
    moment it became eligible.
    """

    name = "lru"

    def priority(self, b: int) -> float:
        return float(self.blocks.last_access[b])
