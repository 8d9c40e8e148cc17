"""Resizable pool memory: one address range reserved up front, backed segment by segment.

A tier's pool is a tensor over a range of addresses reserved for the tier's largest size
(`max_num_blocks`); only the slots of its current size are backed by memory. Growing backs more
segments, shrinking gives the memory of whole segments back. The tensor never moves, so the
kernels keep one base pointer per layer, views taken before a resize stay valid, and a resize
copies nothing.

- Host memory (and the device tier on a machine without CUDA): an anonymous `mmap` with
  `MAP_NORESERVE`. Reserving costs address space only; pages get memory when first touched, and
  `madvise(MADV_DONTNEED)` returns them (they read as zeros afterwards). With CUDA and
  `memory: pinned`, each segment is page-locked with `cudaHostRegister` when it is backed and
  unregistered before its memory goes back.
- The device tier on CUDA with `tiers.gpu.resizable: true`: the driver's virtual memory API
  (`cuda_vmm.CudaReservation`: `cuMemAddressReserve` once, then `cuMemCreate` + `cuMemMap` per
  segment and plane, `cuMemUnmap` + `cuMemRelease` to give it back). Ranges must then be
  multiples of the allocation granularity (2 MiB), which sizes the segments.

A segment is a run of slots in every *plane* of the pool's layout: one range per layer and K/V
for a layer-major device pool, one range for a block-major host pool.
"""

from __future__ import annotations

import math
import mmap
import sys
from collections.abc import Callable

import psutil
import torch

from tiered_cache.errors import CapacityError, TierUnavailableError

PAGE = mmap.PAGESIZE
MAP_NORESERVE = getattr(mmap, "MAP_NORESERVE", 0x4000 if sys.platform == "linux" else 0)
"""NOTE: Python's mmap module only exports MAP_NORESERVE from 3.13 on; without it the reserved
address space is committed memory, and a process holding a few pools can no longer fork()
(ENOMEM under the kernel's default heuristic overcommit). 0x4000 is its value on Linux."""


class HostReservation:
    """`nbytes` of reserved host address space as a flat uint8 tensor."""

    def __init__(self, nbytes: int, *, pinned: bool = False) -> None:
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE
        self._map = mmap.mmap(-1, max(PAGE, nbytes), flags=flags)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            # Transparent huge pages where the kernel allows them: fewer TLB misses in copies.
            self._map.madvise(mmap.MADV_HUGEPAGE)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)[:nbytes]
        self.pinned = pinned
        self._registered: dict[int, int] = {}      # start -> length of page-locked ranges

    def back(self, start: int, length: int) -> None:
        """Back [start, start + length) with memory (pinned memory is page-locked, so a copy
        engine can read it)."""
        if length == 0:
            return
        if not self.pinned:
            # Touch the pages now, as an eager allocation would: the memory is really there
            # when grow returns, and the first copies into it pay no page faults.
            self.bytes[start:start + length].zero_()
            return
        ptr = self.bytes.data_ptr() + start
        err = torch.cuda.cudart().cudaHostRegister(ptr, length, 0)
        if int(err) != 0:
            raise TierUnavailableError(f"cudaHostRegister of {length:,} bytes failed ({err})")
        self._registered[start] = length

    def release(self, start: int, length: int) -> None:
        """Give the memory of [start, start + length) back; it reads as zeros afterwards."""
        if length == 0:
            return
        if self._registered.pop(start, None) is not None:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr() + start)
        # madvise works on whole pages: the partial pages at either end stay backed.
        lo = -(-start // PAGE) * PAGE
        hi = (start + length) // PAGE * PAGE
        if hi > lo:
            self._map.madvise(mmap.MADV_DONTNEED, lo, hi - lo)

    def __del__(self) -> None:
        # Page-locked ranges are unregistered before the mapping can go away.
        registered = getattr(self, "_registered", None)
        if not registered:
            return
        try:
            cudart = torch.cuda.cudart()
            base = self.bytes.data_ptr()
            for start in list(registered):
                cudart.cudaHostUnregister(base + start)
            registered.clear()
        except Exception:  # noqa: BLE001 - interpreter shutdown: CUDA may be gone
            pass


class SegmentedTensor:
    """A tensor `[*outer, max_slots, *inner]` over reserved memory, backed for its first
    `backed_slots` slots in segments of `segment_slots`.

    Slot s of plane p (an index into `outer`) is at byte `p * plane_stride + s * slot_bytes`,
    so a segment is one range per plane: `prod(outer)` ranges for a layer-major pool, one for
    a block-major pool. `view(n)` is the tensor cut to its first n slots: the pool's `kv`.
    """

    def __init__(self, outer: tuple[int, ...], inner: tuple[int, ...], dtype: torch.dtype, *,
                 num_slots: int, max_slots: int, segment_slots: int, where: str,
                 pinned: bool = False, reserve: Callable[[int], object] | None = None,
                 align: int = 1) -> None:
        if max_slots < num_slots:
            raise CapacityError(f"{where}: max_num_blocks {max_slots:,} is below num_blocks "
                                f"{num_slots:,}")
        elt = torch.empty((), dtype=dtype).element_size()
        self.outer, self.inner, self.dtype = outer, inner, dtype
        self.planes = _prod(outer)
        self.slot_bytes = _prod(inner) * elt
        # Every range backed or freed is a whole number of `align` bytes: segments hold a
        # multiple of `unit` slots, and planes start on a segment boundary.
        unit = align // math.gcd(align, self.slot_bytes)
        self.segment_slots = -(-max(1, segment_slots) // unit) * unit
        if align > 1:
            max_slots = -(-max_slots // self.segment_slots) * self.segment_slots
        self.max_slots = max_slots
        self.plane_stride = max_slots * self.slot_bytes
        self.where = where               # for error messages: "tiers.host"
        nbytes = self.planes * self.plane_stride
        self.reservation = (reserve(nbytes) if reserve is not None
                            else HostReservation(nbytes, pinned=pinned))
        self.backed_segments = 0
        self.grow(num_slots)
        # NOTE: the view is taken once the first segment is backed (a CUDA array interface
        # over an address with nothing mapped yet is refused).
        self.full = (self.reservation.bytes.view(dtype)
                     .view(*outer, max_slots, *inner))

    def view(self, slots: int) -> torch.Tensor:
        return self.full[(slice(None),) * len(self.outer) + (slice(0, slots),)]

    @property
    def backed_slots(self) -> int:
        return min(self.max_slots, self.backed_segments * self.segment_slots)

    def segments_for(self, slots: int) -> int:
        return -(-slots // self.segment_slots)

    def bytes_for(self, slots: int) -> int:
        """Memory that backing `slots` slots adds beyond what is backed now."""
        extra = max(0, self.segments_for(slots) - self.backed_segments)
        return extra * self.segment_slots * self.slot_bytes * self.planes

    def grow(self, slots: int) -> None:
        """Back segments until `slots` slots are usable. Atomic: a failure backs nothing."""
        if slots > self.max_slots:
            raise CapacityError(f"{self.where}: {slots:,} blocks exceed max_num_blocks "
                                f"{self.max_slots:,}")
        first, target = self.backed_segments, self.segments_for(slots)
        done: list[tuple[int, int]] = []
        try:
            for seg in range(first, target):
                for start, length in self._ranges(seg):
                    self.reservation.back(start, length)
                    done.append((start, length))
        except BaseException:
            for start, length in done:
                self.reservation.release(start, length)
            raise
        self.backed_segments = max(first, target)

    def shrink(self, slots: int) -> None:
        """Give back the memory of the segments wholly above `slots` (their slots must hold
        nothing anyone reads)."""
        target = self.segments_for(slots)
        for seg in range(self.backed_segments - 1, target - 1, -1):
            for start, length in self._ranges(seg):
                self.reservation.release(start, length)
        self.backed_segments = min(self.backed_segments, target)

    def _ranges(self, seg: int) -> list[tuple[int, int]]:
        lo = seg * self.segment_slots
        hi = min(self.max_slots, lo + self.segment_slots)
        length = (hi - lo) * self.slot_bytes
        return [(p * self.plane_stride + lo * self.slot_bytes, length)
                for p in range(self.planes)]


def _prod(xs: tuple[int, ...]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def default_segment_slots(slot_bytes_total: int, num_slots: int,
                          target_bytes: int = 64 << 20) -> int:
    """Slots per segment: about `target_bytes` of KV (64 MiB: a few dozen madvise or
    cudaHostRegister calls per GiB resized, and shrinking frees memory in useful steps), but
    never more than the pool's starting size, so a small pool backs no more than it holds."""
    return max(1, min(num_slots, target_bytes // max(1, slot_bytes_total)))


def default_max_slots(slot_bytes_total: int, num_slots: int) -> int:
    """The largest a host-memory pool may grow: all of the machine's RAM in blocks (address
    space only is reserved), and never less than its starting size."""
    return max(num_slots, psutil.virtual_memory().total // max(1, slot_bytes_total))
