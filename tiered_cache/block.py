"""Metadata of one KV block: identity, where its copies live, who uses it.

A block is `block_size` tokens of one sequence, in every layer. It is *private* while a sequence
is still writing it and *published* (it has a `key` and sits in the prefix index) once it is full
and every layer has been written.

NOTE: per-block history that policies read (`hits`, `last_access`, `depth`) lives here rather than
in the policy so that it survives the block leaving and re-entering a policy's candidate set (a
block leaves it while pinned).
"""

from __future__ import annotations

from dataclasses import dataclass, field

NO_SLOT = -1


@dataclass(eq=False, slots=True)
class Block:
    id: int
    depth: int                      # position in its prefix chain: block `depth` covers tokens
                                    # [depth * block_size, (depth + 1) * block_size)
    num_tiers: int
    parent: Block | None = None
    key: bytes | None = None        # 128-bit chained key; None while private
    tokens: bytes = b""             # the block's token ids as int32 bytes, set when published
    root_id: int = -1               # depth-0 blocks: which namespace + salt they were made under
    slots: list[int] = field(default_factory=list)           # per tier; NO_SLOT when absent
    resident_children: list[int] = field(default_factory=list)  # per tier: children with a copy
    candidate: list[bool] = field(default_factory=list)      # per tier: in that tier's policy
    children: dict[int, Block] = field(default_factory=dict)    # published children by id
    ref_count: int = 0              # open sequences that use it (pinned while > 0)
    in_flight: int = 0              # copies under way that read or write it
    busy_tiers: tuple = ()       # tiers whose copy a move in flight reads (see moves.py)
    pending: object | None = None   # LayerReadiness of an in-flight promotion into tier 0
    hits: int = 0                   # times a request reused it
    last_access: int = 0            # logical clock of the last use
    inserted_at: int = 0            # logical clock of publication

    def __post_init__(self) -> None:
        if not self.slots:
            self.slots = [NO_SLOT] * self.num_tiers
            self.resident_children = [0] * self.num_tiers
            self.candidate = [False] * self.num_tiers

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
