"""Memory admission: what a config's tiers will allocate, checked against what this machine can
give, before any of it is allocated.

Why: every slot tier is a pool allocated at start. `tiers.gpu.capacity: 40GiB` on a machine
without CUDA puts the device tier in CPU memory; a 480 GiB host tier (or a daemon partition per
tenant of it) on a 23 GiB machine is touched page by page until the kernel's OOM killer ends the
process, with no word on why. A disk tier larger than its filesystem fails later, part-way.

Places and what they can give:
- `host` (RAM): psutil's `available` (free plus reclaimable caches). The device tier lives here
  when there is no CUDA device, pinned and pageable host tiers always, the daemon's shared pools
  too (memfd pages, populated at creation, so pools that exist are no longer "available").
- a CUDA device: `torch.cuda.mem_get_info`'s free bytes (the device tier; a `managed` host tier,
  which must never ask more than the card has free).
- a filesystem: its free bytes at the disk tier's path, plus what the tier's own files from an
  earlier run already take there (reopening the pool reuses them).

The asks of one place add up (a device tier in CPU memory and the host tier share the RAM).
Refused: `InsufficientMemoryError`, a `ConfigError` because the config asks for what this
machine cannot give; its path names the key(s) that sized the tiers, its message the numbers
(asked, available). `overcommit: [gpu, host, disk]` (top-level key) lets the listed tiers
through: they are left out of the sums, and a warning says what they ask.

Only the slots a tier starts with count: `max_num_blocks` reserves address space, not memory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tiered_cache.errors import InsufficientMemoryError
from tiered_cache.sizing import (
    disk_free_bytes,
    disk_held_bytes,
    disk_pool_dir,
    format_bytes,
    tier_num_blocks,
    tier_slot_bytes,
)

if TYPE_CHECKING:
    from tiered_cache.config import CacheConfig

log = logging.getLogger(__name__)

HOST = "host"
OVERCOMMIT_TIERS = ("gpu", "host", "disk")
"""The names `overcommit` may list."""


@dataclass(frozen=True)
class Ask:
    """`nbytes` that tier `tier` (sized by config key `key`) will allocate in `place`: "host"
    (RAM), a CUDA device ("cuda", "cuda:N"), or "disk" at `path`. `held`: bytes of it that
    already exist (the disk tier's own files)."""

    tier: str
    key: str
    nbytes: int
    place: str
    what: str
    path: str | None = None
    held: int = 0

    @property
    def need(self) -> int:
        return max(0, self.nbytes - self.held)


def size_key(config: CacheConfig, tier: str) -> str:
    """The key that sized a tier: its `capacity`, else its `num_blocks`."""
    t = getattr(config.tiers, tier)
    return f"tiers.{tier}.capacity" if t.capacity is not None else f"tiers.{tier}.num_blocks"


def engine_asks(config: CacheConfig, device: str) -> list[Ask]:
    """What `TieredKVCache(config)` allocates for its slot tiers, `device` the resolved device
    of the gpu tier ("cpu" without CUDA)."""
    block = config.block_bytes
    n = tier_num_blocks(config, "gpu")
    where = HOST if device == "cpu" else device
    note = " (the device tier lives in CPU memory: no CUDA device)" if device == "cpu" else ""
    asks = [Ask("gpu", size_key(config, "gpu"), n * block, where,
                f"tiers.gpu {n:,} blocks of {format_bytes(block)}{note}")]
    if config.tiers.daemon is None:
        n = tier_num_blocks(config, "host")
        if n:
            memory = config.tiers.host.memory
            where = device if memory == "managed" and device != "cpu" else HOST
            asks.append(Ask("host", size_key(config, "host"), n * block, where,
                            f"tiers.host {n:,} blocks of {format_bytes(block)} ({memory})"))
    asks.extend(disk_asks(config))
    return asks


def disk_asks(config: CacheConfig, tenant: str | None = None) -> list[Ask]:
    """The disk tier's files (a daemon partition's: `tenant`), if one is configured."""
    disk = config.tiers.disk
    if disk is None or disk.path is None:
        return []
    n = tier_num_blocks(config, "disk", tenant=tenant)
    if not n:
        return []
    slot = tier_slot_bytes(config, "disk")
    held = disk_held_bytes(disk_pool_dir(config, tenant))
    owner = f" of tenant {tenant!r}" if tenant is not None else ""
    return [Ask("disk", size_key(config, "disk"), n * slot, "disk",
                f"tiers.disk{owner} {n:,} slots of {format_bytes(slot)} (header + payload, "
                f"4 KiB aligned)", path=disk.path, held=held)]


def available_bytes(place: str, path: str | None = None) -> int:
    """Bytes that can be had now in `place`."""
    if place == HOST:
        import psutil

        return int(psutil.virtual_memory().available)
    if place == "disk":
        return disk_free_bytes(path)
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(place))
    return int(free)


def _group(ask: Ask) -> tuple[str, object]:
    """Asks that draw on the same thing: one RAM, one device, one filesystem."""
    if ask.place != "disk":
        return (ask.place, None)
    p = os.path.abspath(ask.path or ".")
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return ("disk", os.stat(p).st_dev)


def _where(place: str, path: str | None) -> str:
    if place == HOST:
        return "host memory (RAM)"
    if place == "disk":
        return f"disk space on the filesystem of {path}"
    return f"memory on {place}"


def check(asks: Iterable[Ask], overcommit: Iterable[str] = (), *, context: str = "",
          available: Callable[[str, str | None], int] = available_bytes) -> None:
    """Raise InsufficientMemoryError when the asks of one place (tiers not in `overcommit`)
    add up to more than that place can give. `context` ends the message (e.g. the partitions
    that exist already). Overcommitted asks that would not fit are logged."""
    allowed = set(overcommit)
    groups: dict[tuple[str, object], list[Ask]] = {}
    for a in asks:
        if a.nbytes:
            groups.setdefault(_group(a), []).append(a)
    for items in groups.values():
        first = items[0]
        have = available(first.place, first.path)
        counted = [a for a in items if a.tier not in allowed]
        need = sum(a.need for a in counted)
        where = _where(first.place, first.path)
        if need > have:
            keys = ", ".join(dict.fromkeys(a.key for a in counted))
            parts = "; ".join(_part(a, len(counted) > 1)
                              for a in sorted(counted, key=lambda a: -a.need))
            names = ", ".join(dict.fromkeys(a.tier for a in counted))
            raise InsufficientMemoryError(
                keys, f"asks for {format_bytes(need)} ({need:,} bytes) of {where}, but "
                      f"{format_bytes(have)} ({have:,} bytes) is available: {parts}"
                      f"{context}. Refusing before allocating any of it: lower the size, or "
                      f"list the tier in `overcommit` ({names}) to proceed anyway")
        total = sum(a.need for a in items)
        if total > have:
            log.warning("overcommit: %s ask for %s of %s, %s is available; proceeding because "
                        "overcommit lists %s", ", ".join(a.key for a in items),
                        format_bytes(total), where, format_bytes(have),
                        sorted({a.tier for a in items} & allowed))


def _part(a: Ask, keyed: bool) -> str:
    held = f", {format_bytes(a.held)} of it already on disk" if a.held else ""
    return f"{a.key + ': ' if keyed else ''}{a.what} = {format_bytes(a.nbytes)}{held}"


def check_engine(config: CacheConfig, device: str) -> None:
    """The check `TieredKVCache` runs before it builds a tier."""
    check(engine_asks(config, device), config.overcommit)


def partition_asks(config: CacheConfig, tenant: str, pool_bytes: int,
                   num_slots: int) -> list[Ask]:
    """One daemon partition: its shared host pool and its disk directory."""
    asks = [Ask("host", size_key(config, "host"), pool_bytes, HOST,
                f"the shared pool of tenant {tenant!r}, {num_slots:,} slots "
                f"({format_bytes(pool_bytes // max(1, num_slots))} each, page aligned)")]
    return asks + disk_asks(config, tenant)


def check_partitions(config: CacheConfig, tenants: list[str], pool_bytes: int,
                     num_slots: int, *, existing: int = 0) -> None:
    """Before the daemon builds the partitions of `tenants` (at start: every tenant known in
    advance; later: one new tenant). `existing`: partitions already built, whose pools no
    longer count as available memory."""
    asks = [a for t in tenants for a in partition_asks(config, t, pool_bytes, num_slots)]
    context = ""
    if existing:
        context = (f" ({existing} partition{'s' if existing != 1 else ''} already hold "
                   f"{format_bytes(existing * pool_bytes)} of shared memory)")
    elif len(tenants) > 1:
        context = f" ({len(tenants)} tenant partitions at start, one pool each)"
    check(asks, config.overcommit, context=context)

