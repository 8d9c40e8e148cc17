"""Online resize of a tier: `cache.resize(tier, num_blocks)`.

Growing backs new memory segments of the tier's pool (when the machine has the memory; see
`tiered_cache.segments`) and offers their slots at once. Shrinking is a drain:

1. the allocator stops handing out slots at and above the new size (`begin_shrink`);
2. until the tail is empty, each round evicts by the tier's policy while the blocks living in
   the tail outnumber the free slots below it, then moves movable tail blocks down: copy first,
   remap under the lock, exactly as the compactor does (`moves.plan_compaction` with a floor);
3. the allocator drops the tail (`finish_shrink`) and the pool frees the emptied segments.

Pinned blocks (read by open sequences) and blocks in flight are never moved; the drain waits for
them until `timeout`. On timeout or any error the shrink is cancelled: the tier keeps its old
size, and blocks already moved stay valid where they went. Nothing is lost either way.

NOTE: each lock hold covers one plan, one commit, or one eviction of a bounded batch, so a
resize never stops the world; resizes of a cache are serialised by their own lock.
"""

from __future__ import annotations

import logging
import operator
import time
from typing import TYPE_CHECKING

from tiered_cache import moves
from tiered_cache.errors import CapacityError, TransferError
from tiered_cache.transfer import execute

if TYPE_CHECKING:
    from tiered_cache.cache import TieredKVCache
    from tiered_cache.tier import Tier

log = logging.getLogger("tiered_cache.resize")

_MOVES_PER_ROUND = 64          # blocks copied per drain round (bounds each commit's lock hold)
_POLL_S = 0.002                # wait between rounds while only pinned blocks are left
_MAX_FAILURES = 3              # failed copy rounds in a row before the shrink gives up


def resize(cache: TieredKVCache, tier_name: str, num_blocks: int,
           timeout: float | None) -> int:
    tier = cache.tier(tier_name)
    if isinstance(num_blocks, bool):
        raise TypeError(f"num_blocks must be an int, got {num_blocks!r}")
    try:
        n = operator.index(num_blocks)
    except TypeError:
        raise TypeError(f"num_blocks must be an int, got {type(num_blocks).__name__}") from None
    if n < 1:
        raise ValueError(f"cannot resize tier {tier_name!r} to {n} blocks: at least 1")
    if timeout is not None and not timeout > 0:
        raise ValueError(f"timeout must be > 0 seconds or None, got {timeout!r}")
    with cache._resize_lock:
        old = tier.allocator.num_slots
        if tier.pool is not None:
            tier.pool.check_resize(n)   # fixed pool, max_num_blocks, memory: nothing changed
        elif n > _max_blocks(cache, tier):
            raise CapacityError(f"tiers.{tier.name}: {n:,} blocks exceed max_num_blocks "
                                f"{_max_blocks(cache, tier):,}")
        if n > old:
            _grow(cache, tier, n)
        elif n < old:
            _shrink(cache, tier, n, timeout)
        log.info("tier %s resized from %d to %d blocks", tier.name, old, n)
        return n


def _max_blocks(cache: TieredKVCache, tier: Tier) -> int:
    cfg = getattr(cache.config.tiers, tier.name)
    return cfg.max_num_blocks if cfg.max_num_blocks is not None else 1 << 62


def _grow(cache: TieredKVCache, tier: Tier, n: int) -> None:
    # NOTE: the pool grows first, outside the cache lock (backing memory takes time). Its new
    # slots are invisible until the allocator offers them under the lock.
    if tier.pool is not None:
        tier.pool.resize(n)
    with cache._lock:
        delta = n - tier.allocator.num_slots
        tier.allocator.grow(delta)
        tier.owner.extend([None] * delta)
        tier.policy.resize(n)


def _shrink(cache: TieredKVCache, tier: Tier, n: int, timeout: float | None) -> None:
    deadline = None if timeout is None else time.monotonic() + timeout
    alloc = tier.allocator
    with cache._lock:
        alloc.begin_shrink(n)
        tier.policy.resize(n)
    failures = 0
    try:
        while True:
            with cache._lock:
                if alloc.drained():
                    alloc.finish_shrink()
                    del tier.owner[n:]
                    break
                waiting = _make_room(cache, tier)
                plan = moves.plan_compaction(cache, tier.index, _MOVES_PER_ROUND, floor=n)
            if plan:
                failures = 0 if _run_moves(cache, plan) else failures + 1
                if failures > _MAX_FAILURES:
                    raise TransferError(f"tier {tier.name!r}: shrink to {n} blocks gave up "
                                        f"after {failures} failed copies in a row")
                continue
            if deadline is not None and time.monotonic() > deadline:
                raise CapacityError(
                    f"tier {tier.name!r} cannot shrink to {n} blocks within the timeout: "
                    f"{alloc.draining} blocks above slot {n} are {waiting}")
            time.sleep(_POLL_S)
    except BaseException:
        with cache._lock:
            alloc.cancel_shrink()
            tier.policy.resize(alloc.num_slots)
        raise
    if tier.pool is not None:
        tier.pool.resize(n)             # gives the emptied segments' memory back


def _make_room(cache: TieredKVCache, tier: Tier) -> str:
    """Evict (up to `_MOVES_PER_ROUND` blocks) while the tail's blocks outnumber the free
    slots below the limit. Returns what the remaining tail blocks wait for (for the timeout
    message)."""
    alloc = tier.allocator
    if alloc.num_free >= alloc.draining:
        return "pinned by open sequences or in flight"
    if tier.index == 0 and cache.migrator is not None and len(cache.tiers) > 1:
        # NOTE: the device tier's capacity is already the new size, so the migrator's
        # watermark demotes it (pipelined, copies outside the lock) whenever the tail does not
        # fit below: used > capacity >= high_watermark * capacity. No demotion copies under
        # the lock here.
        cache.migrator.poke()
        return "pinned by open sequences or in flight, or waiting for the migrator's demotions"
    free0, draining0 = alloc.num_free, alloc.draining

    def need() -> int:
        # A victim below the limit frees a slot there; one in the tail needs none. Either way
        # it counts against this round's budget.
        freed = (alloc.num_free - free0) + (draining0 - alloc.draining)
        return min(alloc.draining - alloc.num_free, _MOVES_PER_ROUND - freed)

    try:
        if need() > 0:
            cache._evict(tier.index, 0, need=need)
    except CapacityError:
        return "pinned by open sequences or in flight, and nothing else can be evicted"
    return "pinned by open sequences or in flight"


def _run_moves(cache: TieredKVCache, plan: list) -> bool:
    ok = True
    if cache.has_storage:
        try:
            execute(plan, [t.pool for t in cache.tiers])
        except (TransferError, RuntimeError, OSError):
            log.exception("resize: a copy failed; its blocks stay where they were")
            ok = False
    with cache._lock:
        moves.commit_compaction(cache, plan, ok)
    return ok
