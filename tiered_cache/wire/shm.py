"""The shared host pool's memory: one memfd that the daemon creates and every client maps.

Layout: block-major like `tiered_cache.data.pools.HostPool`: slot i is `[num_layers, 2, block_size,
num_kv_heads, head_dim]` contiguous, and slots start on page boundaries (`slot_stride` is
`slot_bytes` rounded up to a page), so a run of slots is one large copy, a slot's memory can be
registered or released by whole pages, and no two slots share a page. A client maps it and gets
the tensor view `[num_slots, L, 2, bs, H, D]` over the mapping itself (`torch.frombuffer`): KV is
copied straight in and out of the shared pages, never through the socket or a staging buffer.

memfd + SCM_RIGHTS, not a file in /dev/shm
------------------------------------------
- Nothing to find: a memfd has no name in any directory. Only a process the daemon hands the fd
  to (over its socket, after the SO_PEERCRED allowlist) can map it; a file in /dev/shm can be
  opened by anyone its mode admits, and its mode is one umask or chmod away from wrong.
- Nothing to leave behind: the kernel frees a memfd when its last fd and mapping are gone. A
  daemon killed with SIGKILL leaves no file for its successor to trip over (or, worse, to map
  and serve stale KV from without its index); its memory lives on only while clients still map
  it, and they drop it when they see the daemon go.
- Sealed: the size is sealed (F_SEAL_SHRINK | F_SEAL_GROW, then F_SEAL_SEAL), so no client can
  truncate the pool under the others' mappings (which would SIGBUS every process touching the
  cut-off pages) or add seals of its own.
- Read-only clients: `client_fd(writable=False)` reopens the memfd O_RDONLY, so that client can
  only map it PROT_READ. NOTE: that alone is not enough: the memfd's owner (every client of the
  daemon's uid, the default allowlist) can reopen `/proc/self/fd/N` O_RDWR. A pool that only the
  daemon writes (`create(read_only_clients=True)`) is therefore also sealed against future
  writes (F_SEAL_FUTURE_WRITE, Linux 5.1+) once the daemon holds its own writable mapping: no
  descriptor, however opened, can then be mapped writable, written, or have holes punched in
  it; the daemon's existing mapping still writes. (F_SEAL_WRITE would forbid that mapping too.)

The pages are allocated when the pool is created (`posix_fallocate`), so running out of memory
is an error at start, never a SIGBUS at the first write of a client.

Prefaulted: allocating pages does not map them. Each process's first touch of each 4 KiB page
of its mapping takes a page fault, and a copy into slots never touched before ran at 0.15-0.2x
the speed of the same copy into touched ones here (a 4 MiB publish: 0.6-5.4 ms against 0.13;
the slow end while other processes ran, the kernel's page reclaim scanning). A fresh pool hands
out untouched slots until it has filled once, so every publish paid that. Each mapping is
therefore prefaulted on a background thread (`tc-prefault`, MADV_POPULATE_WRITE or _READ,
Linux 5.14+; 64 MiB at a time under `retain`, so a close meanwhile stops it): about 0.26 s of
one core per GiB writable, 0.11 s read-only, and a page table of 1/512 of the mapping, which
every process that touches the whole pool ends up holding anyway. Only files whose pages are
all allocated are prefaulted (pools; staging areas are allocated as they are written, and a
prefault would allocate their never-used slots). Copies meanwhile are right
either way (populating maps pages, it never changes them); a kernel without the advice is
logged once and left to fault as before. A CUDA-registered mapping is pinned (so mapped) whole.

NOTE: the pool is shared memory. Every client given a writable fd can write every slot, and
every client given any fd can read every slot: the daemon's index decides which slots a client
is told about, not which it can touch. Clients that must not see each other's KV (tenants that
do not trust each other) need separate pools; a pool per tenant is one SharedPool each.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import stat
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tiered_cache.wire.protocol import Int, Str

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# NOTE: torch is imported only when a tensor view is taken. The daemon that creates the pool
# hands out its fd and never touches its bytes, so it starts without paying torch's import.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1}
"""The pool dtypes (tiered_cache.data.pools.TORCH_DTYPES's names) and their widths."""
TORCH_NAMES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16",
               "fp8_e4m3": "float8_e4m3fn"}
"""The torch dtype of each pool dtype, by name (torch is imported only for a tensor view)."""

PAGE = mmap.PAGESIZE
SIZE_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
F_SEAL_FUTURE_WRITE = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x0010)   # Python 3.11 lacks it
CUDA_HOST_REGISTER_READ_ONLY = 8        # cudaHostRegisterReadOnly
MADV_POPULATE_READ, MADV_POPULATE_WRITE = 22, 23   # Linux 5.14+; Python 3.11 lacks both names
PREFAULT_CHUNK = 64 << 20
_PREFAULT_UNSUPPORTED: list[str] = []   # set (once) when the kernel refuses the advice

GEOMETRY_FIELDS = {
    "num_slots": Int(1, 2**31 - 1), "num_layers": Int(1, 4096), "block_size": Int(1, 1 << 16),
    "num_kv_heads": Int(1, 4096), "head_dim": Int(1, 1 << 16),
    "dtype": Str(16, choices=tuple(DTYPE_BYTES)), "slot_stride": Int(PAGE, 2**40),
}
"""The protocol fields that describe a pool (for the reply of the op that hands out its fd)."""


@dataclass(frozen=True)
class PoolGeometry:
    num_slots: int
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype {self.dtype!r} is not one of {sorted(DTYPE_BYTES)}")
        for name in ("num_slots", "num_layers", "block_size", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @property
    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, TORCH_NAMES[self.dtype])

    @property
    def slot_shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.num_slots, *self.slot_shape)

    @property
    def slot_bytes(self) -> int:
        n = DTYPE_BYTES[self.dtype]
        for d in self.slot_shape:
            n *= d
        return n

    @property
    def slot_stride(self) -> int:
        """Bytes from one slot's start to the next: slot_bytes rounded up to a whole page."""
        return -(-self.slot_bytes // PAGE) * PAGE

    @property
    def nbytes(self) -> int:
        return self.num_slots * self.slot_stride

    def fields(self) -> dict[str, Any]:
        """The geometry as protocol fields (GEOMETRY_FIELDS)."""
        return {"num_slots": self.num_slots, "num_layers": self.num_layers,
                "block_size": self.block_size, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "dtype": self.dtype, "slot_stride": self.slot_stride}

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> PoolGeometry:
        geo = cls(fields["num_slots"], fields["num_layers"], fields["block_size"],
                  fields["num_kv_heads"], fields["head_dim"], fields["dtype"])
        if "slot_stride" in fields and fields["slot_stride"] != geo.slot_stride:
            # The daemon's page size differs from ours: the two sides would disagree on where a
            # slot starts, and read each other's KV at the wrong offsets.
            raise ValueError(f"the daemon's slot stride {fields['slot_stride']} differs from "
                             f"ours ({geo.slot_stride})")
        return geo


class SharedPool:
    """A mapping of the pool, in the daemon (`create`) or a client (`attach`). `kv` is the
    `[num_slots, L, 2, bs, H, D]` tensor over the shared pages."""

    def __init__(self, fd: int | None, geometry: PoolGeometry, mm: mmap.mmap,
                 writable: bool, *, write_sealed: bool = False) -> None:
        self.fd = fd
        self.geometry = geometry
        self.writable = writable
        self.write_sealed = write_sealed    # no new writable mapping of it can be made
        self._mmap: mmap.mmap | None = mm
        self._kv: torch.Tensor | None = None
        self.cuda_registered = False
        self._users_lock = threading.Lock()
        self._users = 0                     # copies under way through the mapping (retain)
        self._closing = False
        self.prefaulted = 0                 # bytes of the mapping prefaulted so far
        self.prefault_error: str | None = None
        self._prefault: threading.Thread | None = None

    @property
    def kv(self) -> torch.Tensor:
        """The `[num_slots, L, 2, bs, H, D]` view over the shared pages (no copy)."""
        if self._kv is None:
            if self._mmap is None:
                raise RuntimeError("the pool is closed")
            self._kv = _view(self._mmap, self.geometry)
        return self._kv

    @classmethod
    def create(cls, geometry: PoolGeometry, *, name: str = "pool", populate: bool = True,
               read_only_clients: bool = False) -> SharedPool:
        """A new, zeroed pool in a sealed memfd (mode 0600, close-on-exec). With
        `read_only_clients` only this mapping ever writes it: it is sealed against new writable
        mappings and writes (see the module's note), and `client_fd` hands out read-only fds.
        `populate`: its pages allocated now, and this mapping prefaulted in the background."""
        fd = os.memfd_create(f"tiered-cache-{name}",
                             os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, geometry.nbytes)
            if populate:
                os.posix_fallocate(fd, 0, geometry.nbytes)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SIZE_SEALS)
            mm = _map(fd, geometry.nbytes, writable=True)
            sealed = read_only_clients and _seal_future_writes(fd, name)
            fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SEAL)
        except BaseException:
            os.close(fd)
            raise
        log.info("shared pool %r: %d slots of %d bytes (%d MiB) in a memfd", name,
                 geometry.num_slots, geometry.slot_stride, geometry.nbytes >> 20)
        pool = cls(fd, geometry, mm, writable=True, write_sealed=sealed)
        if populate:
            pool.start_prefault()
        return pool

    @classmethod
    def attach(cls, fd: int, geometry: PoolGeometry, *, writable: bool = True,
               prefault: bool = True) -> SharedPool:
        """Map a pool from an fd the daemon sent. Takes ownership of `fd` (closed here: the
        mapping keeps the memory). Checks that the fd is a sealed file of the right size first:
        mapping past its end would fault on first touch. `prefault`: in the background, if the
        file's pages are all allocated (a pool; not a staging area, whose pages are allocated
        as they are first written: prefaulting it would allocate slots that may never be
        used)."""
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise ValueError("the pool's fd is not a regular file (memfd)")
            if st.st_size != geometry.nbytes:
                raise ValueError(f"the pool's file has {st.st_size:,} bytes, its geometry says "
                                 f"{geometry.nbytes:,}")
            seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
            if seals & SIZE_SEALS != SIZE_SEALS:
                raise ValueError("the pool's file is not size-sealed: another process could "
                                 "truncate it under this mapping")
            mm = _map(fd, geometry.nbytes, writable=writable)
        finally:
            os.close(fd)
        pool = cls(None, geometry, mm, writable=writable)
        if prefault and st.st_blocks * 512 >= st.st_size:
            pool.start_prefault()
        return pool

    def client_fd(self, *, writable: bool = True) -> int:
        """A new fd of the pool for one client (the caller sends and closes it). A read-only
        one is a fresh O_RDONLY open of the memfd: its holder cannot map it writable."""
        if self.fd is None:
            raise RuntimeError("only the pool's creator hands out its fd")
        if writable and self.write_sealed:
            raise RuntimeError("this pool is sealed against writes: only read-only fds of it")
        if writable:
            return os.dup(self.fd)
        return os.open(f"/proc/self/fd/{self.fd}", os.O_RDONLY | os.O_CLOEXEC)

    def slots(self, start: int, stop: int) -> torch.Tensor:
        return self.kv[start:stop]

    def buffer(self) -> memoryview:
        """The whole mapping as bytes (no copy): for pools of raw pages (daemon/pages.py), whose
        geometry is not a KV shape. Read-only for a client given a read-only fd."""
        if self._mmap is None:
            raise RuntimeError("the pool is closed")
        view = memoryview(self._mmap)
        return view.toreadonly() if not self.writable else view

    # CUDA -------------------------------------------------------------------------------------

    def register_cuda(self, flags: int = 0) -> bool:
        """Page-lock the mapping with cudaHostRegister, so copies between it and a GPU are DMA
        (and kernels can read it through its device-visible address). False, doing nothing,
        when CUDA is not available."""
        if self.cuda_registered:
            return True
        import torch
        if not torch.cuda.is_available():
            return False
        if not self.writable:
            flags |= CUDA_HOST_REGISTER_READ_ONLY
        import torch
        err = torch.cuda.cudart().cudaHostRegister(self.kv.data_ptr(), self.geometry.nbytes,
                                                   flags)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister of the shared pool ({self.geometry.nbytes:,} "
                               f"bytes) failed: {err}")
        self.cuda_registered = True
        return True

    def unregister_cuda(self) -> None:
        if self.cuda_registered:
            import torch
            torch.cuda.cudart().cudaHostUnregister(self.kv.data_ptr())
            self.cuda_registered = False

    # prefaulting ------------------------------------------------------------------------------

    def start_prefault(self) -> None:
        """Map every page of this mapping on the `tc-prefault` thread (see the module's note)."""
        if self._prefault is not None or _PREFAULT_UNSUPPORTED:
            return
        self._prefault = threading.Thread(target=self._run_prefault, name="tc-prefault",
                                          daemon=True)
        self._prefault.start()

    def wait_prefault(self, timeout: float | None = None) -> bool:
        """Whether the prefault thread has ended (within `timeout`); True if none was started."""
        t = self._prefault
        if t is not None:
            t.join(timeout)
        return t is None or not t.is_alive()

    def prefault(self) -> int:
        """Prefault the mapping now, chunk by chunk; the bytes done. Stops at a close."""
        advice = MADV_POPULATE_WRITE if self.writable else MADV_POPULATE_READ
        total = self.geometry.nbytes
        while self.prefaulted < total and not self.cuda_registered:
            try:
                held = self.retain()
            except RuntimeError:
                break                       # closed: nothing left to map
            with held:
                mm = self._mmap
                if mm is None:
                    break
                n = min(PREFAULT_CHUNK, total - self.prefaulted)
                mm.madvise(advice, self.prefaulted, n)
                self.prefaulted += n
        return self.prefaulted

    def _run_prefault(self) -> None:
        try:
            self.prefault()
        except OSError as exc:
            if exc.errno in (errno.EINVAL, errno.ENOSYS):
                if not _PREFAULT_UNSUPPORTED:
                    _PREFAULT_UNSUPPORTED.append(str(exc))
                    log.info("this kernel cannot prefault shared pools (%s): their first "
                             "copies take page faults", exc)
                return
            self._prefault_failed(exc)
        except Exception as exc:            # noqa: BLE001 - logged and kept: copies still work
            self._prefault_failed(exc)

    def _prefault_failed(self, exc: BaseException) -> None:
        self.prefault_error = f"{type(exc).__name__}: {exc}"
        log.warning("prefaulting a shared pool stopped after %d of %d bytes: %s",
                    self.prefaulted, self.geometry.nbytes, self.prefault_error)

    # lifetime ---------------------------------------------------------------------------------

    def retain(self) -> _Retained:
        """Keep the mapping until the returned context exits, whoever calls `close` meanwhile:
        for a copy through it on one thread while another may close it. Raises RuntimeError
        once `close` was called.

        NOTE: torch views do not hold the mapping (torch.frombuffer lets go of the buffer
        export), so a close under a copy would unmap the pages the copy reads: SIGSEGV, or the
        bytes of whatever is mapped there next. `close` therefore leaves the unmap to the
        last retainer."""
        with self._users_lock:
            if self._closing:
                raise RuntimeError("the shared pool is closed")
            self._users += 1
        return _Retained(self)

    def _unretain(self) -> None:
        with self._users_lock:
            self._users -= 1
            last = self._closing and self._users == 0
        if last:
            self._release()

    def close(self) -> None:
        """Release the fd and the mapping: now, or when the last copy that retained it ends.

        NOTE: views taken from `kv` keep the mapping (and the shared memory) alive until they
        are dropped; a client whose daemon is gone must drop them to give the memory back.
        """
        with self._users_lock:
            self._closing = True
            busy = self._users > 0
        if busy:
            log.debug("shared pool closed while copies use it: unmapped after the last")
            return
        self._release()

    def _release(self) -> None:
        self.unregister_cuda()
        self._kv = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                log.debug("shared pool views are still alive; the mapping goes with them")
            self._mmap = None
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None

    def __enter__(self) -> SharedPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Retained:
    """`SharedPool.retain()`'s context: exiting it lets a pending close unmap."""

    __slots__ = ("pool", "_done")

    def __init__(self, pool: SharedPool) -> None:
        self.pool, self._done = pool, False

    def __enter__(self) -> SharedPool:
        return self.pool

    def __exit__(self, *exc: object) -> None:
        if not self._done:
            self._done = True
            self.pool._unretain()


def _seal_future_writes(fd: int, name: str) -> bool:
    """F_SEAL_FUTURE_WRITE on `fd` (after the creator's writable mapping exists); False, with an
    error logged, on a kernel without it (before 5.1): then a client of the pool's uid could
    reopen its fd writable."""
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, F_SEAL_FUTURE_WRITE)
    except OSError as exc:
        log.error("shared pool %r: this kernel cannot seal it against writes (%s): a client of "
                  "the daemon's uid could write it through /proc/self/fd; run the daemon under "
                  "its own uid (daemon.allow_uids) or on Linux 5.1+", name, exc)
        return False
    return True


def _view(mm: mmap.mmap, geometry: PoolGeometry) -> torch.Tensor:
    import warnings

    import torch
    with warnings.catch_warnings():
        # NOTE: torch warns that a read-only buffer gives a tensor it cannot protect;
        # writing through a read-only pool's view faults (SIGSEGV) instead of corrupting.
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(mm, dtype=torch.uint8, count=geometry.nbytes)
    typed = raw.view(geometry.torch_dtype)
    if geometry.slot_stride == geometry.slot_bytes:
        return typed.view(geometry.shape)
    inner = torch.empty(geometry.slot_shape, device="meta").stride()
    step = geometry.slot_stride // DTYPE_BYTES[geometry.dtype]
    return typed.as_strided(geometry.shape, (step, *inner))


def _map(fd: int, nbytes: int, *, writable: bool) -> mmap.mmap:
    prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
    mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=prot)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        # Huge pages for shared memory where the kernel allows them (shmem_enabled=advise).
        with contextlib.suppress(OSError):
            mm.madvise(mmap.MADV_HUGEPAGE)
    return mm
