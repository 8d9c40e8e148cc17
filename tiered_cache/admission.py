"""Memory admission: what a config's tiers will allocate, checked against what this machine can
give, before any of it is allocated.

Why: every slot tier is a pool allocated at start. `tiers.gpu.capacity: 40GiB` on a machine
without CUDA puts the device tier in CPU memory; a 480 GiB host tier (or a daemon partition per
tenant of it) on a 23 GiB machine is touched page by page until the kernel's OOM killer ends the
process, with no word on why. A disk tier larger than its filesystem fails later, part-way.

Each slot tier kind says what it will take and where (`TierKind.asks`, tiered_cache/tiers/):
- `RAM`: psutil's `available` (free plus reclaimable caches). A device tier lives here when
  there is no CUDA device; pinned and pageable host tiers always; the daemon's shared pools too
  (memfd pages, populated at creation, so pools that exist are no longer "available").
- a CUDA device ("cuda", "cuda:N"): `torch.cuda.mem_get_info`'s free bytes (a device tier; a
  `managed` host tier, which must never ask more than the card has free).
- `FILESYSTEM` at a path: its free bytes, plus what the tier's own files from an earlier run
  already take there (reopening the pool reuses them).

The asks of one place add up (a device tier in CPU memory and the host tier share the RAM).
Refused: `InsufficientMemoryError`, a `ConfigError` because the config asks for what this
machine cannot give; its path names the key(s) that sized the tiers, its message the numbers
(asked, available). `overcommit: [<tier>, ...]` (top-level key) lets the listed tiers through:
they are left out of the sums, and a warning says what they ask.

Only the slots a tier starts with count: `max_num_blocks` reserves address space, not memory.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from tiered_cache.errors import InsufficientMemoryError
from tiered_cache.sizing import disk_free_bytes, format_bytes

log = logging.getLogger(__name__)

RAM = "ram"
"""The place host memory is asked of."""
FILESYSTEM = "filesystem"
"""The place a persistent tier's files are asked of (at the ask's `path`)."""


@dataclass(frozen=True)
class Ask:
    """`nbytes` that tier `tier` (sized by config key `key`) will allocate in `place`: `RAM`, a
    CUDA device ("cuda", "cuda:N"), or `FILESYSTEM` at `path`. `held`: bytes of it that already
    exist (a persistent tier's own files)."""

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


def size_key(section: Any, name: str) -> str:
    """The key that sized tier `name`: its `capacity`, else its `num_blocks`."""
    return (f"tiers.{name}.capacity" if section.capacity is not None
            else f"tiers.{name}.num_blocks")


def available_bytes(place: str, path: str | None = None) -> int:
    """Bytes that can be had now in `place`."""
    if place == RAM:
        import psutil

        return int(psutil.virtual_memory().available)
    if place == FILESYSTEM:
        return disk_free_bytes(path)
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(place))
    return int(free)


def _group(ask: Ask) -> tuple[str, object]:
    """Asks that draw on the same thing: one RAM, one device, one filesystem."""
    if ask.place != FILESYSTEM:
        return (ask.place, None)
    p = os.path.abspath(ask.path or ".")
    while not os.path.exists(p) and os.path.dirname(p) != p:
        p = os.path.dirname(p)
    return (FILESYSTEM, os.stat(p).st_dev)


def _where(place: str, path: str | None) -> str:
    if place == RAM:
        return "host memory (RAM)"
    if place == FILESYSTEM:
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


def partitions_context(tenants: int, existing: int, pool_bytes: int) -> str:
    """How the daemon's message counts its partitions: those that exist (their pools are no
    longer available memory), or those it builds together at start."""
    if existing:
        return (f" ({existing} partition{'s' if existing != 1 else ''} already hold "
                f"{format_bytes(existing * pool_bytes)} of shared memory)")
    if tenants > 1:
        return f" ({tenants} tenant partitions at start, one pool each)"
    return ""
