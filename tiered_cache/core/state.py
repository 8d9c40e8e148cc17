"""`BlockState`: every field of the block state one `BlockIndex` owns, declared once.

`BlockIndex` (core/index.py) is a `BlockState`; its parts (core/copies.py, eviction.py, keyed.py,
persist.py, inflight.py) are objects the owner holds, each told the owner at construction and
reaching the shared state only through it (`self.ix`): `ix.blocks`, `ix.tiers`, `ix.prefix`, ...
Its mixins (core/tree.py, batch.py) are methods of the owner over the same fields.

NOTE: `slots=True`, and the owner, its mixins and its parts declare `__slots__` too (none has an
instance `__dict__`): an attribute that is not declared here, or in a part's own dataclass,
cannot be set, so no field is shared without being declared. `init=False`: `BlockIndex.__init__`
sets every field (tests/core/test_state.py checks that none is left unset).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from array import array

    from tiered_cache.core.blocks import BlockTable
    from tiered_cache.core.copies import Copies
    from tiered_cache.core.eviction import Space
    from tiered_cache.core.inflight import InFlight
    from tiered_cache.core.keyed import KeyedTiers
    from tiered_cache.core.persist import Persistence
    from tiered_cache.core.readiness import LayerReadiness
    from tiered_cache.core.sequence import Sequence
    from tiered_cache.core.tier import TierState
    from tiered_cache.core.wakeup import Wakeup
    from tiered_cache.hashing import BlockHasher
    from tiered_cache.locking import HoldStats, TimedLock

Worth = Callable[[int, int, int], bool]
"""worth(tier, nblocks, context_blocks): loading nblocks from that tier beats recomputing them
after context_blocks cached blocks (tiered_cache.costs)."""


@dataclass
class Counters:
    """Monotonic event counts of the control plane (exported as `tiered_cache_*_total`)."""

    query_tokens: int = 0
    hit_tokens: int = 0
    promotions: int = 0
    promotion_bytes: int = 0
    demotions: int = 0
    demotion_bytes: int = 0
    write_through_blocks: int = 0
    collisions: int = 0
    duplicates: int = 0
    invalidated_blocks: int = 0
    dropped_blocks: int = 0
    sync_evictions: int = 0
    transfer_failures: int = 0
    transfer_retries: int = 0
    compaction_moves: int = 0
    degraded_evictions: int = 0
    corrupt_blocks: int = 0
    recovered_blocks: int = 0
    skipped_loads: int = 0
    inflight_hit_tokens: int = 0
    inflight_aborts: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


COUNTERS = tuple(f.name for f in fields(Counters))


@dataclass(slots=True, init=False, eq=False, repr=False, weakref_slot=True)
class BlockState:
    # ---- fixed at construction
    block_size: int                 # tokens per block
    num_layers: int                 # layers every block holds KV for
    block_bytes: int                # bytes of one block's KV in a slot tier (counters only)
    hasher: BlockHasher             # chained block keys, root keys, tenant salt
    verify_tokens: bool             # a match also compares the stored token ids
    write_through: bool             # a published block gets a copy in tier 1 (the facade's)
    worth: Worth | None             # the cost model: load from a slow tier, or recompute?
    # ---- block state (only the owner and its parts write these)
    blocks: BlockTable              # per-block columns, indexed by block id
    tiers: list[TierState]          # the slot tiers, fastest first (DEVICE is tier 0)
    prefix: dict[bytes, int]        # key -> published block id: the prefix index
    root_keys: dict[int, bytes]     # root id -> root key (records and daemon clients name it)
    pending: dict[int, LayerReadiness]  # block -> its promotion (or load) into tier 0
    open_seqs: dict[int, Sequence]  # sequence id -> open sequence (invariants 2, 5, 6)
    clock: int                      # logical time: +1 per open and per close
    counters: Counters              # monotonic event counts
    # ---- the lock and what waits on it
    lock: TimedLock                 # re-entrant; public mutators take it (core/atomic.py)
    lookups: HoldStats              # open()'s prefix match + pin + reserve, timed per call
    readers_done: Wakeup            # end_read tells close() waiting for attention calls
    broken: str | None              # a commit section was torn (core/atomic.py): refuse calls
    # ---- the parts (each holds this owner as `ix`)
    copies: Copies                  # where blocks' copies are: set/move/clear/remap, moves
    space: Space                    # room, allocation, eviction, admission, erasure, resize
    keyed: KeyedTiers               # keyed tiers (remote, daemon): loads and puts
    persist: Persistence            # record identity, restart recovery, the daemon's lending
    inflight: InFlight              # in-flight prefix sharing: writers and waiters
    # ---- hot-path aliases of `blocks`' columns (BlockIndex._bind; rebound when it grows)
    _slots: list[array]             # blocks.slots: per tier, block -> slot or NO_SLOT
    _kids: list[array]              # blocks.resident_children: per tier, children with a copy
    _ref: array                     # blocks.ref_count: open sequences holding the block
    _flight: array                  # blocks.in_flight: copies reading or filling it
    _cand: array                    # blocks.candidate: bit t set iff tier t's policy holds it
    _parent: array                  # blocks.parent
    _key: list                      # blocks.key: key of a published block, None otherwise
