"""Transfer plans: the control plane's decisions about copies, as plain data.

The control plane never copies; it emits `Transfer`s of ids (block id, tier numbers, slots), so
the same plan can drive one GPU, every rank of a tensor-parallel group, or a client of the node
daemon. The data plane (`tiered_cache.data.executor`) executes them.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import NamedTuple


class Transfer(NamedTuple):
    """One copy of one block between two tiers.

    NOTE: a NamedTuple (immutable, built in C), not a frozen dataclass, whose __init__ sets
    each of its nine fields through object.__setattr__: a plan holds one per block moved, and
    building them was a tenth of a promotion's open (1.5 us each against 0.4)."""

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


Groups = dict[tuple[int, int, "tuple[int, ...] | None"], list[Transfer]]


def group(transfers: Iterable[Transfer]) -> Groups:
    """Group by (src tier, dst tier, layers), each group sorted by source slot so that adjacent
    slots coalesce into one large copy downstream."""
    if isinstance(transfers, GroupedPlan):
        return transfers.groups
    out: dict = defaultdict(list)
    for t in sorted(transfers, key=lambda t: (t.src_tier, t.dst_tier, t.src_slot)):
        out[(t.src_tier, t.dst_tier, t.layers)].append(t)
    return dict(out)


class GroupedPlan(list):
    """A plan (a list of transfers, as any other) whose `group` is computed once.

    NOTE: the migrator copies one promotion batch once per layer group (up to a call per
    layer): grouping and sorting its few hundred transfers at every call cost about a sixth
    of each call. Never mutate one after it is made (`groups` would go stale)."""

    def __init__(self, transfers: Iterable[Transfer]) -> None:
        super().__init__(transfers)
        self.groups = group(list(self))
