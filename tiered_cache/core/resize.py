"""Online resize of a tier's slots: the control-plane half of `cache.resize(tier, num_blocks)`.

Growing: the data plane backs the new slots first (outside the lock), then
`BlockIndex.space.grow_tier` offers them. Shrinking is a drain:

1. the allocator stops handing out slots at and above the new size (`begin_shrink`);
2. until the tail is empty, each round evicts by the tier's policy while the blocks living in
   the tail outnumber the free slots below it, then moves movable tail blocks down: copy first,
   remap under the lock, exactly as the compactor does (`moves.plan_compaction` with a floor);
3. the allocator drops the tail (`finish_shrink`) and the data plane frees the emptied memory.

Pinned blocks (read by open sequences) and blocks in flight are never moved; the drain waits for
them until `timeout`. On timeout or any error the shrink is cancelled: the tier keeps its old
size, and blocks already moved stay valid where they went. Nothing is lost either way.

NOTE: each lock hold covers one plan, one commit, or one eviction of a bounded batch, so a
resize never stops the world; resizes of an index are serialised by the caller.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Protocol

from tiered_cache.core import moves
from tiered_cache.core.index import DEVICE, BlockIndex
from tiered_cache.core.transfer import Transfer
from tiered_cache.errors import CapacityError, TransferError

log = logging.getLogger("tiered_cache.resize")

_MOVES_PER_ROUND = 64          # blocks copied per drain round (bounds each commit's lock hold)
_POLL_S = 0.002                # wait between rounds while only pinned blocks are left
_MAX_FAILURES = 3              # failed copy rounds in a row before the shrink gives up


class Backing(Protocol):
    """The data plane's side of a resize (a tier's pool)."""

    def check_resize(self, num_slots: int) -> None: ...

    def resize(self, num_slots: int) -> None: ...


def grow(idx: BlockIndex, t: int, n: int, backing: Backing | None) -> None:
    # NOTE: the pool grows first, outside the lock (backing memory takes time). Its new slots
    # are invisible until the allocator offers them under the lock.
    if backing is not None:
        backing.resize(n)
    idx.space.grow_tier(t, n)


def shrink(idx: BlockIndex, t: int, n: int, timeout: float | None, *,
           backing: Backing | None, run: Callable[[list[Transfer]], None],
           poke: Callable[[], None] | None) -> None:
    """Drain tier t down to n slots. `run` copies a plan (raises on failure); `poke` asks the
    background demoter to make room (device tier with a migrator), or None."""
    deadline = None if timeout is None else time.monotonic() + timeout
    tier = idx.tiers[t]
    alloc = tier.allocator
    with idx.locked():
        alloc.begin_shrink(n)
        tier.resize_policy(idx.blocks, n)
    failures = 0
    try:
        while True:
            with idx.locked():
                if alloc.drained():
                    idx.space.finish_shrink(t)
                    break
                waiting = _make_room(idx, t, poke)
                plan = moves.plan_compaction(idx, t, _MOVES_PER_ROUND, floor=n)
            if plan:
                failures = 0 if _run_moves(idx, plan, run) else failures + 1
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
        with idx.locked():
            alloc.cancel_shrink()
            tier.resize_policy(idx.blocks, alloc.num_slots)
        raise
    if backing is not None:
        backing.resize(n)               # gives the emptied segments' memory back


def _make_room(idx: BlockIndex, t: int, poke: Callable[[], None] | None) -> str:
    """Evict (up to `_MOVES_PER_ROUND` blocks) while the tail's blocks outnumber the free
    slots below the limit. Returns what the remaining tail blocks wait for (for the timeout
    message)."""
    alloc = idx.tiers[t].allocator
    if alloc.num_free >= alloc.draining:
        return "pinned by open sequences or in flight"
    if t == DEVICE and poke is not None and len(idx.tiers) > 1:
        # NOTE: the device tier's capacity is already the new size, so the migrator's
        # watermark demotes it (pipelined, copies outside the lock) whenever the tail does not
        # fit below: used > capacity >= high_watermark * capacity. No demotion copies under
        # the lock here.
        poke()
        return "pinned by open sequences or in flight, or waiting for the migrator's demotions"
    free0, draining0 = alloc.num_free, alloc.draining

    def need() -> int:
        # A victim below the limit frees a slot there; one in the tail needs none. Either way
        # it counts against this round's budget.
        freed = (alloc.num_free - free0) + (draining0 - alloc.draining)
        return min(alloc.draining - alloc.num_free, _MOVES_PER_ROUND - freed)

    try:
        if need() > 0:
            idx.space.evict(t, 0, need=need)
    except CapacityError:
        return "pinned by open sequences or in flight, and nothing else can be evicted"
    return "pinned by open sequences or in flight"


def _run_moves(idx: BlockIndex, plan: list[Transfer], run) -> bool:
    ok = True
    try:
        run(plan)
    except Exception:  # noqa: BLE001 - a failed move leaves its blocks where they were
        log.exception("resize: a copy failed; its blocks stay where they were")
        ok = False
    moves.commit_compaction(idx, plan, ok)
    return ok
