"""Transfer plans: the control plane's decisions about copies, as plain data.

The control plane never copies; it emits `Transfer`s of ids (block id, tier numbers, slots), so
the same plan can drive one GPU, every rank of a tensor-parallel group, or a client of the node
daemon. The data plane (`tiered_cache.data.executor`) executes them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Transfer:
    block: int                                  # block id (a row of the BlockTable)
    src_tier: int
    src_slot: int
    dst_tier: int
    dst_slot: int
    layers: tuple[int, ...] | None = None      # None: every layer


Groups = dict[tuple[int, int, tuple[int, ...] | None], tuple[list[int], list[int]]]


def group(transfers: Iterable[Transfer]) -> Groups:
    """Group by (src tier, dst tier, layers) into parallel slot lists, sorted by source slot so
    that adjacent slots coalesce into one large copy downstream."""
    out: dict = defaultdict(lambda: ([], []))
    for t in sorted(transfers, key=lambda t: (t.src_tier, t.dst_tier, t.src_slot)):
        src, dst = out[(t.src_tier, t.dst_tier, t.layers)]
        src.append(t.src_slot)
        dst.append(t.dst_slot)
    return dict(out)
