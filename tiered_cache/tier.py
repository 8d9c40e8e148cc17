"""Runtime state of one tier: its slot allocator, its eviction policy, its storage, counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from tiered_cache.allocator import SlotAllocator
from tiered_cache.policies.base import CachePolicy


@dataclass(eq=False)
class Tier:
    name: str
    index: int                      # 0 is the fastest tier
    allocator: SlotAllocator
    policy: CachePolicy
    pool: object | None             # DevicePool / HostPool, or None with `storage: none`
    pinned_blocks: int = 0          # blocks with a copy here and ref_count > 0
    evictions: int = 0              # copies that left this tier to make room
    hit_tokens: int = 0             # prompt tokens served from this tier
    busy: int = 0                 # copies here of blocks in flight (not evictable meanwhile)
    reserved: int = 0               # destination slots of copies under way (not yet owned)
    owner: list = field(default_factory=list)   # slot -> Block holding it (the compactor's map)

    def __post_init__(self) -> None:
        # NOTE: sized by the allocator's slots, which exceed capacity_blocks while a shrink
        # drains the tail.
        self.owner = [None] * self.allocator.num_slots

    @property
    def capacity_blocks(self) -> int:
        return self.allocator.capacity

    @property
    def used_blocks(self) -> int:
        return self.allocator.num_used

    def stats(self) -> dict[str, int]:
        return {
            "capacity_blocks": self.capacity_blocks,
            "used_blocks": self.used_blocks,
            "pinned_blocks": self.pinned_blocks,
            "evictable_blocks": len(self.policy),
            "evictions": self.evictions,
            "fragmentation": self.allocator.fragmentation(),
        }
