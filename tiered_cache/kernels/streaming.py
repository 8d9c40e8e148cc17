"""Streaming (non-temporal) stores for big CPU copies, as a numba intrinsic.

A plain store first reads the destination's cache line (read-for-ownership), so a copy far
larger than the cache moves three bytes through memory for every byte copied. A non-temporal
store writes the line without reading it: two bytes. glibc's `memcpy` switches to these stores
for one copy above ~3/4 of the shared cache; a block copy is hundreds of chunks of 16-64 KiB,
each below that threshold, so it never does. `copy_vectors` gives the compiled chunk loop the
same stores. Measured on a 2-core AVX2 VM (16 MiB L3), 32 MiB in 32 KiB chunks, two threads:
1.30-1.38x torch's contiguous `copy_`; in the cache (8 MiB and less) it is 2-3x *slower*, so
callers stream only copies larger than `STREAM_MIN_BYTES`.

NOTE: x86-64 only (`STREAMING`): elsewhere `copy_vectors` is a plain slice copy. The stores need
32-byte aligned destinations (`vmovntdq` faults otherwise): callers check `aligned` first. Each
call ends with an `sfence`, so the stores are visible before the parallel loop's threads join.
"""

from __future__ import annotations

import glob
import platform

from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

VECTOR = 32
"""Bytes per store (four uint64 words); destinations must be aligned to it."""

STREAMING = platform.machine().lower() in ("x86_64", "amd64")


_PER_CPU_MAX = 8 << 20
"""The most of a shared cache one CPU can count on (the largest per-core L3 of current parts
is 12 MiB, most give 1.5-4 MiB)."""


def _cpus(listing: str) -> int:
    """How many CPUs a sysfs CPU list names ("0-3,8,10-11": 7)."""
    n = 0
    for part in listing.strip().split(","):
        lo, _, hi = part.partition("-")
        if lo.isdigit():
            n += int(hi) - int(lo) + 1 if hi.isdigit() else 1
    return max(1, n)


def _shared_cache_bytes(root: str = "/sys/devices/system/cpu/cpu0/cache") -> int:
    """Size of the largest CPU cache (Linux sysfs, e.g. "16384K"), at most `_PER_CPU_MAX` for
    each CPU that shares it; 32 MiB if unknown.

    NOTE: capped because a VM reports its host's whole L3 (480 MiB on a 2-vCPU VM of a
    large Xeon) while it gets a sliver of it: glibc's rule over the reported size kept every
    demotion batch (32 MiB) on cached stores there, at 0.53-0.68 of `copy_` end to end
    against 0.73-0.85 streamed (benchmarks/migration.py, e2e rows)."""
    sizes = []
    for entry in glob.glob(f"{root}/index*"):
        try:
            text = open(f"{entry}/size").read().strip()
        except OSError:
            continue
        try:
            sharing = _cpus(open(f"{entry}/shared_cpu_list").read())
        except OSError:
            sharing = 1
        unit = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text.rstrip("KkMmGg")
        if digits.isdigit():
            sizes.append(min(int(digits) * unit, sharing * _PER_CPU_MAX))
    return max(sizes) if sizes else 32 << 20


STREAM_MIN_BYTES = max(4 << 20, _shared_cache_bytes() * 3 // 4)
"""Copies at least this large stream (glibc's rule for one memcpy: 3/4 of the shared cache, as
`_shared_cache_bytes` counts it)."""


def aligned(*values: int) -> bool:
    """Whether every address / offset / stride in `values` is a multiple of VECTOR."""
    return not any(v % VECTOR for v in values)


if STREAMING:
    from llvmlite import ir

    @intrinsic
    def _stream(typingctx, dst, src, nvec):
        """Copy `nvec` 32-byte vectors from src to dst (uint64 arrays) with non-temporal
        stores, then sfence. dst's data must be 32-byte aligned; src may be unaligned."""
        sig = types.void(dst, src, types.int64)

        def codegen(context, builder, signature, args):
            dst_arr, src_arr, n = args
            d = context.make_array(signature.args[0])(context, builder, dst_arr)
            s = context.make_array(signature.args[1])(context, builder, src_arr)
            vec = ir.VectorType(ir.IntType(64), 4).as_pointer()
            dptr = builder.bitcast(d.data, vec)
            sptr = builder.bitcast(s.data, vec)
            nontemporal = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
            with cgutils.for_range(builder, n) as loop:
                v = builder.load(builder.gep(sptr, [loop.index]), align=8)
                store = builder.store(v, builder.gep(dptr, [loop.index]), align=VECTOR)
                store.set_metadata("nontemporal", nontemporal)
            sfence = builder.module.declare_intrinsic(
                "llvm.x86.sse.sfence", fnty=ir.FunctionType(ir.VoidType(), []))
            builder.call(sfence, [])
            return context.get_dummy_value()

        return sig, codegen

    @njit(inline="always")
    def copy_vectors(dst, src, words):  # pragma: no cover - compiled
        """dst[:words] = src[:words] (uint64 arrays, words a multiple of 4), streaming."""
        _stream(dst, src, words >> 2)
else:                                   # pragma: no cover - not x86-64
    @njit(inline="always")
    def copy_vectors(dst, src, words):
        dst[:words] = src[:words]
