"""Metadata of one KV block: identity, where its copies live, who uses it.

A block is `block_size` tokens of one sequence, in every layer. It is *private* while a sequence
is still writing it and *published* (it has a `key` and sits in the prefix index) once it is full
and every layer has been written.

NOTE: per-block history that policies read (`hits`, `last_access`, `depth`) lives here rather than
in the policy so that it survives the block leaving and re-entering a policy's candidate set (a
block leaves it while pinned).

NOTE: a plain `__slots__` class, not a dataclass, and the cache recycles released blocks
(`reset`): a million-block cache allocates few new objects, so Python's cyclic GC, whose passes
grow with the number of live containers, stays out of the hot path. A recycled block gets a new
`id`, so anything keyed by id (policy state, ghost lists) never mistakes it for its old self.
"""

from __future__ import annotations

NO_SLOT = -1


class Block:
    __slots__ = ("id", "depth", "parent", "key", "tokens", "root_id", "slots",
                 "resident_children", "candidate", "children", "ref_count", "in_flight",
                 "busy_tiers", "pending", "hits", "last_access", "inserted_at")

    def __init__(self, id: int, depth: int, num_tiers: int, parent: Block | None = None,
                 key: bytes | None = None, ref_count: int = 0) -> None:
        self.slots: list[int] = [NO_SLOT] * num_tiers              # per tier
        self.resident_children: list[int] = [0] * num_tiers        # per tier: children with a copy
        self.candidate: list[bool] = [False] * num_tiers           # per tier: in its policy
        self.children: dict[int, Block] = {}                       # published children by id
        self.reset(id, depth, parent, key, ref_count)

    def reset(self, id: int, depth: int, parent: Block | None = None, key: bytes | None = None,
              ref_count: int = 0) -> None:
        """(Re)initialise every field; the per-tier lists are reused in place."""
        self.id = id
        self.depth = depth              # block `depth` covers tokens [depth*bs, (depth+1)*bs)
        self.parent = parent
        self.key = key                  # 128-bit chained key; None while private
        self.tokens = b""               # token ids as int32 bytes, set when published
        self.root_id = -1               # depth-0 blocks: namespace + salt they were made under
        n = len(self.slots)
        self.slots[:] = [NO_SLOT] * n
        self.resident_children[:] = [0] * n
        self.candidate[:] = [False] * n
        self.children.clear()
        self.ref_count = ref_count      # open sequences that use it (pinned while > 0)
        self.in_flight = 0              # copies under way that read or write it
        self.busy_tiers: tuple[int, ...] = ()   # tiers whose copy a move in flight reads
        self.pending = None             # LayerReadiness of an in-flight promotion into tier 0
        self.hits = 0                   # times a request reused it
        self.last_access = 0            # logical clock of the last use
        self.inserted_at = 0            # logical clock of publication

    @property
    def published(self) -> bool:
        return self.key is not None

    @property
    def cached(self) -> bool:
        """Has a copy in at least one tier."""
        return any(s != NO_SLOT for s in self.slots)

    def fastest_tier(self) -> int:
        """Index of the fastest tier holding a copy, or -1."""
        for t, s in enumerate(self.slots):
            if s != NO_SLOT:
                return t
        return -1

    def __repr__(self) -> str:
        state = "published" if self.key is not None else "private"
        return (f"Block(id={self.id}, depth={self.depth}, {state}, slots={self.slots}, "
                f"ref={self.ref_count}, hits={self.hits})")
