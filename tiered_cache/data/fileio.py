"""Whole-buffer positional file I/O and the few filesystem calls the disk tier needs.

Python's `os.pwritev` / `os.preadv` may move fewer bytes than asked (a signal, a file size limit,
end of file) and refuse more than IOV_MAX buffers or ~2 GiB per call; these helpers loop until
every byte has moved (or raise the kernel's error), so callers can reason in whole buffers.
Buffers are flat byte memoryviews (`byte_view`): payloads are written straight from the caller's
memory and read straight into it, without a copy.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
MAX_IO = 1 << 30            # bytes per syscall; Linux moves at most 0x7ffff000 per call
PAGE = mmap.PAGESIZE

_memory_view = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view.restype = ctypes.py_object
_memory_view.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int]
_PyBUF_WRITE = 0x200


def byte_view(obj) -> memoryview:
    """A flat, C-contiguous byte view of `obj` (any buffer-protocol object, or a CPU torch
    tensor, e.g. a host-tier slot), sharing its memory."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        if not obj.is_cpu:
            raise TypeError(f"expected a CPU tensor, got one on {obj.device}")
        if not obj.is_contiguous():
            raise ValueError("expected a contiguous tensor")
        if not obj.nbytes:
            return memoryview(b"")
        # NOTE: straight from the data pointer (~3 us; `.view(torch.uint8).numpy()` costs ~20 us,
        # a sixth of the time a 512 KiB block takes to copy). The view does not keep the tensor
        # alive: callers use it only while they hold the tensor (for the call that got it).
        return _memory_view(obj.data_ptr(), obj.nbytes, _PyBUF_WRITE)
    view = memoryview(obj)
    if not view.c_contiguous:
        raise ValueError("expected a C-contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def address(view: memoryview) -> int:
    """The address of a byte view's first byte."""
    if not view.nbytes:
        return 0
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))    # 5x faster than numpy
    return np.frombuffer(view, dtype=np.uint8).ctypes.data


def is_aligned(view: memoryview, align: int) -> bool:
    """Whether `view` may be handed to O_DIRECT I/O as is (address and length aligned)."""
    return view.nbytes % align == 0 and address(view) % align == 0


def aligned_buffer(nbytes: int) -> memoryview:
    """Zeroed, page-aligned anonymous memory (what O_DIRECT needs for a bounce buffer)."""
    return memoryview(mmap.mmap(-1, max(nbytes, PAGE)))[:nbytes]


def _batches(bufs: Sequence[memoryview]) -> Iterator[list[memoryview]]:
    """`bufs` cut into lists a single preadv/pwritev accepts (<= IOV_MAX entries, <= MAX_IO
    bytes); a buffer larger than MAX_IO is split."""
    batch: list[memoryview] = []
    size = 0
    for buf in bufs:
        while buf.nbytes:
            piece = buf[:MAX_IO - size]
            batch.append(piece)
            size += piece.nbytes
            buf = buf[piece.nbytes:]
            if size >= MAX_IO or len(batch) >= IOV_MAX:
                yield batch
                batch, size = [], 0
    if batch:
        yield batch


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """`bufs` without their first `n` bytes."""
    i = 0
    while i < len(bufs) and n >= bufs[i].nbytes:
        n -= bufs[i].nbytes
        i += 1
    rest = bufs[i:]
    if rest and n:
        rest[0] = rest[0][n:]
    return rest


def pwritev_all(fd: int, bufs: Sequence[memoryview], offset: int, *,
                buffered_fd: int | None = None) -> int:
    """Write every byte of `bufs`, back to back, at `offset`. Returns the bytes written; raises
    OSError (ENOSPC, EFBIG, EIO, ...) as soon as the kernel refuses a byte.

    `buffered_fd`: for an O_DIRECT `fd`, the same file opened without O_DIRECT. NOTE: near a
    limit (a filesystem filling up, a file size limit) the kernel cuts an O_DIRECT write to an
    unaligned length, which it then refuses with EINVAL, or completes it short, leaving an
    unaligned offset where O_DIRECT can only fail. The rest then goes through the page cache,
    so the caller gets the kernel's real answer (ENOSPC, EFBIG) or a complete write."""
    total = 0
    for batch in _batches(bufs):
        while batch:
            try:
                n = os.pwritev(fd, batch, offset)
            except OSError as exc:
                if exc.errno != errno.EINVAL or buffered_fd is None or fd == buffered_fd:
                    raise
                fd = buffered_fd
                continue
            if n <= 0:                  # pragma: no cover - the kernel raises instead
                raise OSError(5, "pwritev wrote nothing")
            offset += n
            total += n
            batch = _advance(batch, n)
            if batch and buffered_fd is not None and offset % PAGE:
                fd = buffered_fd
    return total


def preadv_all(fd: int, bufs: Sequence[memoryview], offset: int) -> int:
    """Fill `bufs`, back to back, from `offset`. Returns the bytes read, which is less than
    their total only at end of file."""
    total = 0
    for batch in _batches(bufs):
        while batch:
            n = os.preadv(fd, batch, offset)
            if n == 0:
                return total
            offset += n
            total += n
            batch = _advance(batch, n)
    return total


def fsync_dir(path: Path) -> None:
    """Make a directory's entries (files created, renamed, removed) durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves either the old file or the new one,
    whole (temp file + fsync + rename + fsync of the directory)."""
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        pwritev_all(fd, [memoryview(data)], 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    fsync_dir(path.parent)


def allocated_bytes(fd: int) -> int:
    """Bytes the filesystem has allocated to a file (holes excluded)."""
    return os.fstat(fd).st_blocks * 512


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still allocate on the filesystem holding `path`."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize
