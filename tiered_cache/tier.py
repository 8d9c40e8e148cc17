"""Runtime state of one tier: its slot allocator, its eviction policy, its storage, counters."""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def capacity_blocks(self) -> int:
        return self.allocator.num_slots

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
        }
