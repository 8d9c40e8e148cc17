"""One-pass block copies between two pools in CPU memory: the CPU path of the copy kernels.

Both pool layouts hold each (slot, layer, K|V) as one contiguous chunk of
``block_size * H * D`` elements; only where the chunk sits differs (see ``copy.py``). torch
moves scattered slots with a gather, a permute and a scatter (three passes over the bytes) and
a run of slots with a permuted strided copy. Here a numba parallel loop copies chunk by chunk
straight from source to destination: one pass, every core, the GIL released, the same for runs
and for scattered slots.

NOTE: chunks move as 8-byte words (a numba slice assignment over uint64 views, which LLVM turns
into a vectorised loop) whenever every offset and the chunk length are multiples of 8, as they
are for any pool whose chunk is a multiple of 8 bytes. Measured on a 2-core AVX2 VM, 32 KiB
chunks, two threads: 0.92-0.98 of torch's contiguous `copy_`, against 0.66-0.70 for a libc
`memcpy` per chunk (which stays the fallback for odd sizes). Copies larger than the cache
stream (non-temporal stores, see ``streaming.py``): 1.3x that `copy_` there.

NOTE: numba's default threading layer (workqueue) must not be entered by two threads at once,
and the migrator runs several copy workers, so calls are serialised by a lock. Each call
already uses every core.
"""

from __future__ import annotations

import ctypes
import math
import threading
import weakref

import numpy as np
import torch
from numba import prange

from tiered_cache.jit import njit

from . import streaming
from .streaming import copy_vectors

_lock = threading.Lock()
_SIGNATURE = "void(uint8[::1], uint8[::1], int64[::1], int64[::1], int64)"
_WORDS = ("void(uint64[::1], uint64[::1], int64[::1], int64[::1], int64[::1], int64[::1], "
          "int64[::1], int64, boolean, boolean)")


@njit(_WORDS, parallel=True, nogil=True, cache=True)
def _copy_words(src, dst, src_slots, dst_slots, layers, src_geo, dst_geo, words,
                slot_major, stream):  # pragma: no cover - compiled
    """dst[dst chunk (d_i, l, kv)] = src[src chunk (s_i, l, kv)], `words` 8-byte words each.

    `*_geo`: (base, slot stride, layer stride, kv stride) in words. Chunks go in the source's
    memory order: slot by slot when `slot_major`, else layer by layer (see copy_blocks).
    `stream`: non-temporal stores (destination chunks 32-byte aligned, `words` % 4 == 0)."""
    n = src_slots.shape[0]
    per_slot = layers.shape[0] * 2
    for i in prange(n * per_slot):
        if slot_major:
            j = i // per_slot
            r = i - j * per_slot
        else:
            r = i // n
            j = i - r * n
        layer = layers[r >> 1]
        kv = r & 1
        s = src_geo[0] + src_slots[j] * src_geo[1] + layer * src_geo[2] + kv * src_geo[3]
        d = dst_geo[0] + dst_slots[j] * dst_geo[1] + layer * dst_geo[2] + kv * dst_geo[3]
        if stream:
            copy_vectors(dst[d:d + words], src[s:s + words], words)
        else:
            dst[d:d + words] = src[s:s + words]


def _libc_memcpy():
    try:
        fn = ctypes.CDLL(None).memcpy
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    fn.restype = ctypes.c_void_p
    return fn


_memcpy = _libc_memcpy()

if _memcpy is not None:
    # NOTE: libc's memcpy moves a 32-64 KiB chunk at the speed of torch's contiguous copy_; a
    # numba slice assignment is an element loop that reaches ~0.7 of it. Compiled eagerly
    # (~0.3 s, once per process: a function that calls ctypes cannot be cached on disk).
    @njit(_SIGNATURE, parallel=True, nogil=True)
    def _copy_chunks(src, dst, src_off, dst_off, chunk):  # pragma: no cover - compiled
        sp = src.ctypes.data
        dp = dst.ctypes.data
        for i in prange(src_off.shape[0]):
            _memcpy(dp + dst_off[i], sp + src_off[i], chunk)
else:                                   # pragma: no cover - platforms without dlopen(NULL)
    @njit(_SIGNATURE, parallel=True, nogil=True, cache=True)
    def _copy_chunks(src, dst, src_off, dst_off, chunk):
        for i in prange(src_off.shape[0]):
            s = src_off[i]
            d = dst_off[i]
            dst[d:d + chunk] = src[s:s + chunk]


def warm_up() -> None:
    """Start numba's thread pool now: the first parallel call pays ~20 ms for it."""
    buf = np.zeros(64, dtype=np.uint8)
    off = np.zeros(2, dtype=np.int64)
    with _lock:
        _copy_chunks(buf, buf, off, off, 8)
        geo = np.zeros(4, dtype=np.int64)
        _copy_words(buf.view(np.uint64), buf.view(np.uint64), off, off, off, geo, geo, 1, True,
                    False)


def copy_blocks(src: torch.Tensor, src_dims: tuple[int, int, int], src_slots: np.ndarray,
                dst: torch.Tensor, dst_dims: tuple[int, int, int], dst_slots: np.ndarray,
                layers: np.ndarray) -> None:
    """``dst[slot d_i, layer l, kv] = src[slot s_i, layer l, kv]`` for every pair i, layer in
    `layers` and kv in (0, 1). `*_dims` name each tensor's (slot, layer, kv) dimensions, so
    one function serves both directions; chunks are the dims from 3 on (contiguous)."""
    if not len(src_slots) or not len(layers):
        return
    r = _route(src, src_dims, dst, dst_dims)
    chunk = r.chunk
    # The copy checks nothing: prove every chunk lies inside its storage first. Strides are
    # non-negative, so the lowest and highest chunk come from the extreme slots and layers.
    lay_lo, lay_hi = int(_min(layers)), int(_max(layers))
    for geo, slots, size in ((r.src_geo, src_slots, r.src_bytes.size),
                             (r.dst_geo, dst_slots, r.dst_bytes.size)):
        lo = geo[0] + int(_min(slots)) * geo[1] + lay_lo * geo[2]
        hi = geo[0] + int(_max(slots)) * geo[1] + lay_hi * geo[2] + geo[3] + chunk
        if lo < 0 or hi > size:
            raise IndexError("block copy: a chunk falls outside its pool's storage")
    if r.words:
        stream = (streaming.STREAMING and r.dst_streams
                  and len(src_slots) * len(layers) * 2 * chunk >= streaming.STREAM_MIN_BYTES)
        with _lock:
            _copy_words(r.src_words, r.dst_words, _int64(src_slots), _int64(dst_slots),
                        _int64(layers), r.src_geo_words, r.dst_geo_words, chunk >> 3,
                        r.slot_major, stream)
        return
    src_off = _offsets(src, src_dims, src_slots, layers, r.slot_major)
    dst_off = _offsets(dst, dst_dims, dst_slots, layers, r.slot_major)
    with _lock:
        _copy_chunks(r.src_bytes, r.dst_bytes, src_off, dst_off, chunk)


# (the ufuncs' reductions directly: `a.min()` adds a Python wrapper)
_min, _max = np.minimum.reduce, np.maximum.reduce


class _Route:
    """What a copy between two tensors needs besides its slots and layers, worked out once per
    (source, destination, dims): each storage as bytes and as words, the geometry, the chunk,
    whether the word path applies and whether its stores may stream.

    NOTE: a migrator's copies are a few MiB each, and working this out cost ~50 us a call
    (two storage views, strides, alignment), a tenth of a 16-block promotion's layer group.
    A route is reused only for views of the same two tensor objects (`_owner`) with the same
    storage pointer, shape and strides (`_fingerprint`); it holds those tensors weakly (a pool
    replaced on resize drops its routes) and its storage views keep the storages alive, so no
    other storage can take the same address while the route exists."""

    __slots__ = ("refs", "prints", "chunk", "slot_major", "src_geo", "dst_geo", "src_bytes",
                 "dst_bytes", "words", "src_words", "dst_words", "src_geo_words",
                 "dst_geo_words", "dst_streams", "__weakref__")

    def __init__(self, src: torch.Tensor, src_dims: tuple[int, int, int], dst: torch.Tensor,
                 dst_dims: tuple[int, int, int], key: tuple) -> None:
        def forget(_ref, key=key):
            _routes.pop(key, None)

        self.refs = (weakref.ref(_owner(src), forget), weakref.ref(_owner(dst), forget))
        self.prints = (_fingerprint(src), _fingerprint(dst))
        self.chunk = chunk = math.prod(src.shape[3:]) * src.element_size()
        # NOTE: chunks go in the source's memory order (slot-major out of a block-major pool,
        # layer-major out of a layer-major one): reads stream, writes scatter. Measured ~8%
        # faster for promotion than the other way round, the same for demotion.
        self.slot_major = src.stride(src_dims[0]) > src.stride(src_dims[1])
        self.src_geo, self.dst_geo = _geometry(src, src_dims), _geometry(dst, dst_dims)
        self.src_bytes, self.dst_bytes = _storage_bytes(src), _storage_bytes(dst)
        self.words = chunk % 8 == 0 and not any(g % 8 for g in (
            *self.src_geo, *self.dst_geo, self.src_bytes.ctypes.data,
            self.dst_bytes.ctypes.data))
        if self.words:
            self.src_words, self.dst_words = _words(self.src_bytes), _words(self.dst_bytes)
            self.src_geo_words = np.array(self.src_geo, dtype=np.int64) >> 3
            self.dst_geo_words = np.array(self.dst_geo, dtype=np.int64) >> 3
            self.dst_streams = streaming.aligned(chunk, self.dst_bytes.ctypes.data
                                                 + self.dst_geo[0], *self.dst_geo[1:])

    def serves(self, src: torch.Tensor, dst: torch.Tensor) -> bool:
        return (self.refs[0]() is _owner(src) and self.refs[1]() is _owner(dst)
                and self.prints == (_fingerprint(src), _fingerprint(dst)))


_routes: dict[tuple, _Route] = {}
_MAX_ROUTES = 64


def _fingerprint(t: torch.Tensor) -> tuple:
    return t.data_ptr(), t.shape, t.stride(), t.dtype


def _owner(t: torch.Tensor) -> torch.Tensor:
    """The tensor a view was made of (t itself if none): a route is kept per owner, so a view
    made afresh for each call (the daemon's permuted staging pool) finds its route again."""
    base = t._base
    return t if base is None else base


def _route(src: torch.Tensor, src_dims: tuple[int, int, int], dst: torch.Tensor,
           dst_dims: tuple[int, int, int]) -> _Route:
    key = (id(_owner(src)), id(_owner(dst)), src_dims, dst_dims)
    r = _routes.get(key)
    if r is None or not r.serves(src, dst):
        if len(_routes) >= _MAX_ROUTES:
            _routes.clear()
        r = _routes[key] = _Route(src, src_dims, dst, dst_dims, key)
    return r


def _geometry(t: torch.Tensor, dims: tuple[int, int, int]) -> tuple[int, int, int, int]:
    """(storage offset, slot stride, layer stride, kv stride) of t, in bytes."""
    e = t.element_size()
    st = t.stride()
    return (t.storage_offset() * e, st[dims[0]] * e, st[dims[1]] * e, st[dims[2]] * e)


def _int64(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.int64)


def _offsets(t: torch.Tensor, dims: tuple[int, int, int], slots: np.ndarray,
             layers: np.ndarray, slot_major: bool) -> np.ndarray:
    """Byte offset in t's storage of every (layer, kv, slot) chunk, in that order, or in
    (slot, layer, kv) order when `slot_major`."""
    stride = t.stride()
    off = (t.storage_offset() + layers[:, None, None] * stride[dims[1]]
           + np.arange(2)[None, :, None] * stride[dims[2]]
           + slots.astype(np.int64)[None, None, :] * stride[dims[0]])
    if slot_major:
        off = off.transpose(2, 0, 1)
    return np.ascontiguousarray((off * t.element_size()).reshape(-1), dtype=np.int64)


def _words(buf: np.ndarray) -> np.ndarray:
    """The whole 8-byte words of a flat uint8 array, as uint64 (offsets stay byte / 8)."""
    return buf[:buf.size & ~7].view(np.uint64)


def _storage_bytes(t: torch.Tensor) -> np.ndarray:
    """The whole storage under t as a flat uint8 array (offsets come from t's strides)."""
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).numpy()
