"""Control-plane state of one tier: its slot allocator, its eviction policy, who owns each slot,
and its counters. No storage here: the pool that holds the tier's bytes is the data plane's.
"""

from __future__ import annotations

import logging
from array import array
from dataclasses import dataclass, field

import numpy as np

from tiered_cache.core.allocator import SlotAllocator
from tiered_cache.core.blocks import NO_BLOCK, BlockTable
from tiered_cache.policies import LRUPolicy
from tiered_cache.policies.base import CachePolicy

log = logging.getLogger("tiered_cache.policy")

DEVICE = 0
"""The device tier is always tier 0 (attention reads it); slower tiers follow in speed order."""


@dataclass(frozen=True)
class TierSpec:
    """What the control plane needs to know of a tier: its name (stats, metrics, config), its
    kind (the pool type; copy handlers are registered per pair of kinds) and its size."""

    name: str
    kind: str
    num_slots: int
    persistent: bool = False
    """Its slots outlive the process (disk): a freed slot is erased (by the data plane, outside
    the lock) before it can be reused, so a dropped block never comes back after a restart."""
    admit_min_hits: int = 0
    """Demotion into this tier writes only blocks reused at least this often (the others are
    dropped): one-shot traffic does not wear an SSD."""
    sync_target: bool = True
    """Synchronous eviction (under the lock) may copy victims of the tier above into it. False
    for tiers whose writes are I/O (disk): only the background migrator demotes into them."""
    staged: bool = True
    """(Keyed tiers.) A load lands in a host staging slot first (a record fetched over the
    network is verified there); False: straight into the device slot (the node daemon's
    shared pool is host memory the device copies from)."""
    put_from: int | None = 1
    """(Keyed tiers.) The slot tier whose copies are put: the host tier (a store is written
    from host memory), or the device tier (the daemon's pool is written as blocks are
    computed, so that other engine processes find them at once); None: read only."""
    stages_records: bool = False
    """Whole records (a persistent tier's, a staged keyed tier's) are read and verified into
    its slots: promotions from a persistent tier and staged keyed loads pass through the first
    such tier (host memory). Tier 0 with it reads records straight in (the daemon's pool)."""
    zero_copy: bool = False
    """The attention kernels read its slots in place while a promotion out of it lands (the
    kernels' host view, a block-major pool at tier 1); other tiers' readers wait per layer."""
    whole_records: bool = False
    """A copy out of it moves whole records, never layer by layer (a disk record, a store's
    value, the daemon's pool): the migrator copies those first, then memory layer by layer."""


@dataclass(eq=False)
class TierState:
    name: str
    kind: str
    index: int                      # 0 is the fastest tier
    allocator: SlotAllocator
    policy: CachePolicy
    pinned_blocks: int = 0          # blocks with a copy here and ref_count > 0
    evictions: int = 0              # copies that left this tier to make room
    hit_tokens: int = 0             # prompt tokens served from this tier
    busy: int = 0                   # copies here of blocks in flight (not evictable meanwhile)
    reserved: int = 0               # destination slots of copies under way (not yet owned)
    owner: array = field(default_factory=lambda: array("i"))   # slot -> block id or NO_BLOCK
    persistent: bool = False        # see TierSpec
    sync_target: bool = True
    admit_min_hits: int = 0
    stages_records: bool = False    # see TierSpec
    zero_copy: bool = False
    whole_records: bool = False
    erasing: list = field(default_factory=list)     # freed slots awaiting erasure (persistent)
    corrupt: int = 0                # records found corrupt (and dropped)
    policy_failures: int = 0        # hooks that raised or answered wrong (`fail_over`)
    failed_policy: str | None = None    # the class of the policy that failed first

    def __post_init__(self) -> None:
        # NOTE: sized by the allocator's slots, which exceed capacity_blocks while a shrink
        # drains the tail.
        self.owner = array("i", [NO_BLOCK]) * self.allocator.num_slots

    def fail_over(self, blocks: BlockTable, hook: str, exc: BaseException) -> CachePolicy:
        """The tier's policy raised `exc` in `hook`, or answered what the index cannot use
        (`exc` says what): the failure is counted, the first one logged with its traceback,
        and an LRUPolicy over exactly the tier's candidates takes its place; returned for
        the caller to ask again. Lock held.

        NOTE: the candidate bits are the index's own (invariant 4), set before `insert(b)`,
        cleared before `remove(b)`, unset for an offered block; so the bits read here are the
        set the policy was meant to hold once the call returned, whatever the failed policy
        did to its own state first."""
        self.policy_failures += 1
        old = self.policy
        if self.failed_policy is None:
            self.failed_policy = type(old).__qualname__
            log.error("tier %s: eviction policy %s failed in %s (%s: %s); the tier uses LRU "
                      "from now on", self.name, self.failed_policy, hook, type(exc).__name__,
                      exc, exc_info=(type(exc), exc, exc.__traceback__))
        lru = LRUPolicy(self.capacity_blocks, blocks=blocks,
                        block_size=int(getattr(old, "block_size", 16)),
                        cost_context_tokens=float(getattr(old, "cost_context_tokens",
                                                          53_000.0)))
        for b in np.flatnonzero(blocks.view("candidate") & (1 << self.index)).tolist():
            lru.insert(b)
        self.policy = lru
        return lru

    def has_candidates(self, blocks: BlockTable) -> bool:
        """Whether any block is a candidate here by the index's bits (O(rows): asked only
        when a policy says there is none)."""
        return bool(np.any(blocks.view("candidate") & (1 << self.index)))

    def give_back(self, slot: int) -> None:
        """A slot no block holds any more returns to the allocator, or, in a persistent tier,
        waits (reserved) until the data plane has erased its record (`Space.take_erasures`).
        Lock held."""
        self.owner[slot] = NO_BLOCK
        if self.persistent:
            self.reserved += 1
            self.erasing.append(slot)
        else:
            self.allocator.free_one(slot)

    def resize_policy(self, blocks: BlockTable, capacity: int) -> None:
        """Tell the policy the tier's new capacity (replaced by LRU if it raises)."""
        try:
            self.policy.resize(capacity)
        except Exception as exc:
            self.fail_over(blocks, "resize", exc).resize(capacity)

    def num_candidates(self) -> int:
        """len(policy): blocks evictable from this tier now."""
        try:
            return len(self.policy)
        except Exception as exc:
            return len(self.fail_over(self.policy.blocks, "__len__", exc))

    @property
    def capacity_blocks(self) -> int:
        return self.allocator.capacity

    @property
    def used_blocks(self) -> int:
        return self.allocator.num_used

    def stats(self) -> dict[str, int | float]:
        return {
            "capacity_blocks": self.capacity_blocks,
            "used_blocks": self.used_blocks,
            "pinned_blocks": self.pinned_blocks,
            "evictable_blocks": self.num_candidates(),
            "evictions": self.evictions,
            "fragmentation": self.allocator.fragmentation(),
            "corrupt_blocks": self.corrupt,
            "policy_failures": self.policy_failures,    # (the tier uses LRU after the first)
        }


@dataclass(eq=False)
class KeyedState:
    """A keyed tier (a shared store beneath the slot tiers: remote): no slots, no policy (the
    store evicts on its own); the index only counts what it served and records what it put.
    `index` is its position among all tiers (after the slot tiers): transfers name it."""

    name: str
    kind: str
    index: int
    position: int                   # k: the bit of BlockTable.stored that says "put here"
    staged: bool = True             # see TierSpec
    put_from: int | None = 1        # see TierSpec
    whole_records: bool = True
    hit_tokens: int = 0
    loads: int = 0                  # blocks loaded from it
    load_failures: int = 0          # blocks it was asked for that it could not return
    skipped: int = 0                # lookups skipped: recomputing was cheaper than loading
    puts: int = 0                   # blocks handed to it

    def stats(self) -> dict[str, int]:
        return {"hit_tokens": self.hit_tokens, "loaded_blocks": self.loads,
                "load_failures": self.load_failures, "skipped_loads": self.skipped,
                "put_blocks": self.puts}
