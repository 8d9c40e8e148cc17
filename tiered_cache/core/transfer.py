"""Transfer plans: the control plane's decisions about copies, as plain data.

The control plane never copies; it emits `Transfer`s of ids (block id, tier numbers, slots), so
the same plan can drive one GPU, every rank of a tensor-parallel group, or a client of the node
daemon. The data plane (`tiered_cache.data.executor`) executes them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class Transfer:
    block: int                                  # block id (a row of the BlockTable)
    src_tier: int
    src_slot: int
    dst_tier: int
    dst_slot: int
    layers: tuple[int, ...] | None = None      # None: every layer
    keep: bool = False              # a copy: the source copy stays (else the block moves)
    meta: RecordMeta | None = None  # identity of the block, for tiers that persist records
    ticket: int = 0                 # the source tier's hold on what is read (the node daemon's
                                    # fetch handle), released by the handler once copied


class RecordMeta(NamedTuple):
    """What a persistent tier writes beside a block's KV (tiered_cache.records): its key, its
    parent's key (the root key at depth 0), the root key (namespace + adapter + tenant), depth,
    token ids (int32 bytes) and use count. Taken under the lock when the move is planned.

    NOTE: a NamedTuple (immutable, built in C): the daemon makes one per published block,
    and a frozen dataclass's __init__ sets each field through object.__setattr__."""

    key: bytes
    parent: bytes
    root: bytes
    depth: int
    tokens: bytes
    hits: int


def group(transfers: Iterable[Transfer]) -> dict[tuple[int, int, tuple[int, ...] | None],
                                                  list[Transfer]]:
    """Group by (src tier, dst tier, layers), each group sorted by source slot so that adjacent
    slots coalesce into one large copy downstream."""
    out: dict = defaultdict(list)
    for t in sorted(transfers, key=lambda t: (t.src_tier, t.dst_tier, t.src_slot)):
        out[(t.src_tier, t.dst_tier, t.layers)].append(t)
    return dict(out)
