"""Memory a tool is about to allocate, checked against what the machine has, before any of it
is allocated.

Why: `tiered-cache run` builds a model and caches from a config's geometry. The 70B config
asks for a ~100 GiB model and a 480 GiB host tier; without this check the job allocates until
the kernel's OOM killer ends it (or the whole machine stalls swapping), with no word on why.
With it, the job refuses at once, saying what it needs, where, and what is available.

Host memory available is psutil's `available` (free plus reclaimable caches); a CUDA device's
is `torch.cuda.mem_get_info`'s free bytes. The amounts are what the tool allocates; they are a
lower bound (allocator slack, Python objects and libraries come on top).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from tiered_cache.errors import InsufficientMemoryError
from tiered_cache.sizing import format_bytes

HOST = "host"

__all__ = ["Allocation", "InsufficientMemoryError", "available_bytes", "check_fits"]


@dataclass(frozen=True)
class Allocation:
    """`nbytes` of memory for `what`, in `where` (`"host"` or a torch device like `"cuda:0"`)."""

    what: str
    nbytes: int
    where: str = HOST


def available_bytes(where: str) -> int:
    """Bytes that can be allocated now in `where`: host memory, or a CUDA device's."""
    if where == HOST or where == "cpu":
        import psutil

        return int(psutil.virtual_memory().available)
    import torch

    free, _total = torch.cuda.mem_get_info(torch.device(where))
    return int(free)


def _place(where: str) -> str:
    return HOST if where in (HOST, "cpu") else where


def check_fits(allocations: Iterable[Allocation], *, source: str,
               available: Callable[[str], int] = available_bytes) -> None:
    """Raise InsufficientMemoryError (naming `source`, the config) when the allocations of any
    one place add up to more than is available there; the message lists them, largest first."""
    by_place: dict[str, list[Allocation]] = {}
    for a in allocations:
        by_place.setdefault(_place(a.where), []).append(a)
    for place, items in by_place.items():
        need = sum(a.nbytes for a in items)
        have = available(place)
        if need <= have:
            continue
        parts = ", ".join(f"{a.what} {format_bytes(a.nbytes)}"
                          for a in sorted(items, key=lambda a: -a.nbytes) if a.nbytes)
        memory = "host memory" if place == HOST else f"memory on {place}"
        raise InsufficientMemoryError(
            source, f"needs at least {format_bytes(need)} of {memory} ({parts}), but "
                    f"{format_bytes(have)} is available; refusing before allocating any of it")
