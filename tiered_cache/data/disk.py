"""The disk tier's data plane: a preallocated pool of fixed-size slots on a local filesystem, one
self-verifying block record (`tiered_cache.records`) per slot, kept across restarts and crashes.

The control plane owns the index and every decision: which block goes to which slot, what to
drop, when to grow or shrink. It calls `write`, `read` / `read_many`, `erase`, `scan` (after a
restart, to rebuild its index) and `resize`; the pool only moves and verifies bytes. Files and
byte layout: `tiered_cache.data.disk_layout`.

The one rule: a read returns the KV of the record's tokens or raises; a miss is allowed, wrong
data never is. What makes that hold:

- Verification. `scan` lists a slot only if its header verifies (header hash, this namespace,
  this geometry); `read` fills `out` and then checks the payload against the header's payload
  hash, raising CorruptRecord on any mismatch or short read. A torn, truncated, bit-flipped or
  foreign record can only be a miss.
- Crash-safe ordering. A header is what makes a record visible, so `write` puts it on disk last,
  in three durable steps: (1) zero the headers of slots that may still hold a record (tombstones)
  and fdatasync the header table; (2) write the payloads and fdatasync them; (3) write the headers
  and fdatasync. A crash at any moment leaves each slot of the batch empty, holding its old
  record untouched (step 1 had not reached it, so step 2 had not either), or holding its new
  record complete (its header was written after its payload was durable).
- Durable erase. `erase` zeroes headers and syncs before it returns, so a dropped block is
  never resurrected by a restart.
- One owner. A directory is locked by one pool at a time (`dirlock`), so two processes never
  interleave those steps on the same slots.

Threads: `write`, `read_many`, `erase` and `update_hits` may run concurrently from several threads
on different slots (positional I/O, no shared file offset); `scan`, `resize` and `close` wait for
them and run alone (`gate`). No call takes the control plane's lock, and none is made under it.
"""

from __future__ import annotations

import errno
import logging
import os
import threading
from collections import Counter
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from tiered_cache.data.dirlock import DirLock, LockHeldError
from tiered_cache.data.disk_layout import (
    ALIGN,
    HEADERS,
    PAYLOADS,
    SUPERBLOCK,
    FormatVersionError,
    Layout,
    SuperblockError,
)
from tiered_cache.data.fileio import (
    aligned_buffer,
    allocated_bytes,
    byte_view,
    free_bytes,
    fsync_dir,
    is_aligned,
    preadv_all,
    pwritev_all,
    write_file_atomic,
)
from tiered_cache.data.gate import Gate
from tiered_cache.errors import CapacityError, TierUnavailableError
from tiered_cache.records import CorruptRecord, RecordHeader, decode_header, payload_hash

__all__ = ["CorruptSlots", "DiskFullError", "DiskIOError", "DiskPool", "FormatVersionError",
           "LockHeldError"]

log = logging.getLogger(__name__)

# Slot states, one byte per slot. NOTE: "might hold a record" is the safe default: a slot in it
# is tombstoned before reuse. Only a durable tombstone, a fresh file or a scan makes it EMPTY.
_EMPTY, _MAYBE, _CUT = 0, 1, 2      # _CUT: its payload area was cut off by a truncated file
_SCAN_BYTES = 8 << 20               # header table read per scan step
_BOUNCE_BYTES = 16 << 20            # per-thread bounce buffer for O_DIRECT of unaligned memory
_CACHED_CHUNK = 2 << 20             # chunk of a buffered batch read (hashed while cache-hot)
_DIRECT_CHUNK = 8 << 20             # chunk of an O_DIRECT batch read
_FULL_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class DiskFullError(TierUnavailableError):
    """The filesystem is out of space (ENOSPC, EDQUOT) or refuses a file this large (EFBIG).
    The caller should stop demoting to disk; every record written before is intact."""


class DiskIOError(TierUnavailableError):
    """The filesystem or device failed an I/O (EIO, EROFS, ...): treat the tier as gone. Records
    already on disk still verify or are misses."""


class CorruptSlots(CorruptRecord):
    """Records of a batch read that failed verification (`reasons`: slot -> why). Every `out`
    of a slot not named here holds verified KV; the named ones hold garbage."""

    def __init__(self, reasons: dict[int, str]) -> None:
        self.reasons = reasons
        shown = ", ".join(f"{s}: {r}" for s, r in list(reasons.items())[:4])
        more = f" and {len(reasons) - 4} more" if len(reasons) > 4 else ""
        super().__init__(f"{len(reasons)} corrupt record(s) (slot {shown}{more})")

    @property
    def slots(self) -> list[int]:
        return list(self.reasons)


def _runs(slots: Sequence[int]) -> Iterator[tuple[int, int, int]]:
    """(first slot, start, end) of each run of consecutive slots in sorted `slots`."""
    i, n = 0, len(slots)
    while i < n:
        j = i + 1
        while j < n and slots[j] == slots[j - 1] + 1:
            j += 1
        yield slots[i], i, j
        i = j


class DiskPool:
    """`num_slots` slots of `payload_bytes` KV each, with one record header per slot, in
    `path/<namespace hex>/`.

    path: a directory (created if missing). Caches of other namespaces may share it; each lives
        in its own subdirectory and never reads another's records.
    num_slots: slots to preallocate; may differ from the files on reopen (they are grown or cut
        to it; records in slots cut off are gone).
    payload_bytes: KV bytes per block (the host tier's slot size).
    num_tokens: tokens per block (the cache's block_size).
    namespace: the 16-byte cache namespace digest, the records' `namespace` field.
    o_direct: payload I/O bypasses the page cache (falls back, with a warning, where the
        filesystem refuses it). Headers always go through the page cache.
    max_slots: the most slots `resize` may grow to (None: as many as the disk holds).

    Raises LockHeldError when another pool owns the directory, FormatVersionError when it was
    written by another format version, DiskFullError when the filesystem cannot hold num_slots.
    """

    where = "tiers.disk"

    def __init__(self, path: str | os.PathLike, *, num_slots: int, payload_bytes: int,
                 num_tokens: int, namespace: bytes, o_direct: bool = False,
                 max_slots: int | None = None) -> None:
        if not isinstance(namespace, (bytes, bytearray)) or len(namespace) != 16:
            raise ValueError("namespace: expected the 16-byte namespace digest")
        if payload_bytes <= 0 or num_tokens <= 0:
            raise ValueError(f"payload_bytes ({payload_bytes}) and num_tokens ({num_tokens}) "
                             "must be positive")
        if num_slots < 0 or (max_slots is not None and max_slots < num_slots):
            raise ValueError(f"num_slots {num_slots} must be in [0, max_slots {max_slots}]")
        self.layout = Layout(bytes(namespace), num_tokens, payload_bytes)
        self.root = Path(path)
        self.dir = self.root / bytes(namespace).hex()
        self.max_slots = max_slots
        self.o_direct = False
        self.o_direct_refused: str | None = None
        self.reset_reason: str | None = None    # why existing files were discarded at open
        self.corrupt = 0                        # records found corrupt (scan and read)
        self.last_scan: dict[str, int] | None = None
        self._counts = Counter[str]()
        self._counts_lock = threading.Lock()
        self._gate = Gate(f"tiers.disk: the disk pool at {self.dir} is closed")
        self._local = threading.local()
        self._hfd = self._pfd = -1
        self._pfd_buffered: int | None = None   # the payload file without O_DIRECT
        self._verify_pool: ThreadPoolExecutor | None = None
        self._cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
            os.cpu_count() or 1)
        self._num_slots = 0
        self._state = bytearray()
        lay = self.layout
        self._zero_header = memoryview(bytes(lay.header_stride))
        # pads after each payload in buffered I/O, so a run of slots is one pwritev/preadv
        self._pad_out = memoryview(bytes(lay.payload_stride - payload_bytes))
        self._pad_in = memoryview(bytearray(lay.payload_stride - payload_bytes))
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TierUnavailableError(f"{self.where}.path: cannot create {self.dir}: "
                                       f"{exc.strerror}") from exc
        self._lock = DirLock(self.dir)
        try:
            self._open(num_slots, o_direct)
        except BaseException as exc:
            self._close_files()
            if isinstance(exc, OSError):
                raise self._error(exc, "opening the pool") from exc
            raise

    # ------------------------------------------------------------------ opening and sizing
    def _open(self, num_slots: int, o_direct: bool) -> None:
        fresh = self._check_superblock()
        if fresh:
            # NOTE: the superblock goes first and comes back last: a crash anywhere in between
            # leaves a directory without one, which the next open resets again.
            for name in (SUPERBLOCK, HEADERS, PAYLOADS):
                try:
                    os.unlink(self.dir / name)
                except FileNotFoundError:
                    pass
            fsync_dir(self.dir)
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        self._hfd = os.open(self.dir / HEADERS, flags, 0o644)
        self._open_payloads(o_direct)
        old_h, old_p = os.fstat(self._hfd).st_size, os.fstat(self._pfd).st_size
        self._set_size(num_slots)
        lay = self.layout
        # Slots whose header area existed may hold records; those whose payload area the file
        # no longer covered (it was truncated) are suspect even if their header verifies.
        known = min(num_slots, -(-old_h // lay.header_stride))
        cut_from = min(known, old_p // lay.payload_stride)
        self._state = bytearray(num_slots)
        self._state[:cut_from] = bytes([_MAYBE]) * cut_from
        self._state[cut_from:known] = bytes([_CUT]) * (known - cut_from)
        if fresh:
            os.fsync(self._hfd)
            os.fsync(self._pfd)
            fsync_dir(self.dir)
            fsync_dir(self.root)                # the namespace directory's own entry
            write_file_atomic(self.dir / SUPERBLOCK, lay.encode_superblock())
        if self.o_direct:
            self._probe_o_direct()

    def _check_superblock(self) -> bool:
        """Whether the directory must start empty (no superblock, or an unusable one)."""
        try:
            data = (self.dir / SUPERBLOCK).read_bytes()
        except FileNotFoundError:
            return True
        try:
            self.layout.check_superblock(data, self.dir)
        except SuperblockError as exc:
            self.reset_reason = str(exc)
            log.warning("%s: %s: discarding the records in %s and starting empty", self.where,
                        exc, self.dir)
            return True
        return False

    def _open_payloads(self, o_direct: bool) -> None:
        flags = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC
        if o_direct:
            try:
                self._pfd = os.open(self.dir / PAYLOADS, flags | os.O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._refuse_o_direct(exc)
            else:
                self.o_direct = True
                self._pfd_buffered = os.open(self.dir / PAYLOADS, os.O_RDWR | os.O_CLOEXEC)
                return
        self._pfd = os.open(self.dir / PAYLOADS, flags, 0o644)

    def _probe_o_direct(self) -> None:
        """Some filesystems accept O_DIRECT at open and refuse the I/O: find out now."""
        if os.fstat(self._pfd).st_size < ALIGN:
            return
        try:
            os.preadv(self._pfd, [aligned_buffer(ALIGN)], 0)
        except OSError as exc:
            if exc.errno != errno.EINVAL:
                raise
            os.close(self._pfd)
            self._pfd = -1
            os.close(self._pfd_buffered)
            self._pfd_buffered = None
            self._refuse_o_direct(exc)
            self._pfd = os.open(self.dir / PAYLOADS, os.O_RDWR | os.O_CLOEXEC)

    def _refuse_o_direct(self, exc: OSError) -> None:
        self.o_direct = False
        self.o_direct_refused = f"{exc.strerror} ({errno.errorcode.get(exc.errno, exc.errno)})"
        log.warning("%s.o_direct: the filesystem at %s refuses O_DIRECT (%s); payload I/O goes "
                    "through the page cache", self.where, self.dir, self.o_direct_refused)

    def _need_bytes(self, num_slots: int) -> int:
        """Bytes the filesystem must still allocate for the files to hold `num_slots`."""
        lay = self.layout
        have = allocated_bytes(self._hfd) + allocated_bytes(self._pfd)
        return max(0, lay.headers_size(num_slots) + lay.payloads_size(num_slots) - have)

    def _set_size(self, num_slots: int) -> None:
        """Cut or preallocate both files to `num_slots` slots (posix_fallocate, so that space
        accounting matches the disk and a write into a slot never needs new space)."""
        lay = self.layout
        want = ((self._hfd, lay.headers_size(num_slots)),
                (self._pfd, lay.payloads_size(num_slots)))
        # NOTE: cut the header table first, durably: a crash between the two leaves headers
        # only where payloads are still whole.
        for fd, size in want:
            if os.fstat(fd).st_size > size:
                os.ftruncate(fd, size)
                os.fsync(fd)
        need, free = self._need_bytes(num_slots), free_bytes(self.dir)
        if need > free:
            raise DiskFullError(
                f"{self.where}: {num_slots:,} slots at {self.dir} need {need:,} more bytes on "
                f"disk ({lay.header_stride + lay.payload_stride:,} per slot), but only "
                f"{free:,} are free")
        before = [(fd, os.fstat(fd).st_size) for fd, _ in want]
        try:
            for fd, size in reversed(want):
                if size:
                    os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            for fd, size in before:             # a failed grow leaves the old size
                os.ftruncate(fd, size)
            raise self._error(exc, f"preallocating {num_slots:,} slots") from exc
        self._num_slots = num_slots

    def check_resize(self, num_slots: int) -> None:
        """Raise unless `resize(num_slots)` can succeed: within max_slots and the disk."""
        if num_slots < 0:
            raise ValueError(f"num_slots must be non-negative, got {num_slots}")
        if self.max_slots is not None and num_slots > self.max_slots:
            raise CapacityError(f"{self.where}: {num_slots:,} slots exceed max_slots "
                                f"{self.max_slots:,}")
        need, free = self._need_bytes(num_slots), free_bytes(self.dir)
        if need > free:
            raise DiskFullError(f"{self.where}: growing to {num_slots:,} slots at {self.dir} "
                                f"needs {need:,} more bytes on disk, but only {free:,} are free")

    def resize(self, num_slots: int) -> None:
        """Grow (preallocate new, empty slots) or shrink (records in slots cut off are gone).
        The caller guarantees nothing reads or writes the slots cut off. On DiskFullError the
        pool keeps its size and every record."""
        with self._gate.exclusive():
            self.check_resize(num_slots)
            old = self._num_slots
            try:
                self._set_size(num_slots)
            except OSError as exc:
                raise self._error(exc, f"resizing to {num_slots:,} slots") from exc
            if num_slots < old:
                del self._state[num_slots:]
            else:
                self._state.extend(bytes(num_slots - old))

    # ------------------------------------------------------------------ the data path
    def write(self, slots: Sequence[int], headers: Sequence[bytes],
              payloads: Sequence[object]) -> list[RecordHeader]:
        """Write one record per slot (`headers[i]` from `records.encode_header`, `payloads[i]`
        a buffer of payload_bytes: a host slot as a tensor, numpy view or memoryview, written
        from where it lies; or a list of buffers of payload_bytes in all, taken back to back).
        Durable on return; returns the decoded headers (what `read`
        takes). Adjacent slots go out as one pwritev.

        On DiskFullError / DiskIOError each slot of the batch is empty, holds its old record, or
        holds its new one, whole: the caller should treat them all as not holding the block."""
        n = len(slots)
        if not n == len(headers) == len(payloads):
            raise ValueError(f"{n} slots, {len(headers)} headers and {len(payloads)} payloads")
        slots = [int(s) for s in slots]
        if len(set(slots)) != n:
            raise ValueError("slots: a slot appears twice in one write")
        lay = self.layout
        views = [self._payload_view(p, f"payloads[{i}]") for i, p in enumerate(payloads)]
        decoded, heads = [], []
        for i, h in enumerate(headers):
            raw = byte_view(h)
            try:
                rec = decode_header(raw, namespace=lay.namespace, num_tokens=lay.num_tokens,
                                    payload_len=lay.payload_bytes)
            except CorruptRecord as exc:
                raise ValueError(f"headers[{i}]: {exc}") from None
            decoded.append(rec)
            heads.append(raw[:rec.header_len])
        # NOTE: the payload hash is not recomputed here: the caller hashed these bytes to make
        # the header, and a payload that changed since then fails verification on read anyway.
        order = sorted(range(n), key=slots.__getitem__)
        in_order = [slots[i] for i in order]
        with self._gate.shared():
            self._check_slots(in_order)
            try:
                stale = [s for s in in_order if self._state[s] != _EMPTY]
                if stale:
                    self._put_headers(stale, None)
                    os.fdatasync(self._hfd)
                    for s in stale:
                        self._state[s] = _EMPTY
                self._put_payloads(in_order, [views[i] for i in order])
                os.fdatasync(self._pfd)
                # NOTE: marked before the headers go out: if writing them fails part way, some
                # may have landed, and the slot must be tombstoned before its next reuse.
                for s in in_order:
                    self._state[s] = _MAYBE
                self._put_headers(in_order, [heads[i] for i in order])
                os.fdatasync(self._hfd)
            except OSError as exc:
                raise self._error(exc, f"writing {n} record(s)") from exc
        self._count(records_written=n, bytes_written=n * lay.payload_bytes)
        return decoded

    def read(self, slot: int, header: RecordHeader, out: object) -> None:
        """Fill `out` (a writable buffer of payload_bytes) with the slot's KV, verified against
        `header` (from `scan` or `write`). Raises CorruptRecord (a miss) when it does not
        verify: `out` then holds garbage."""
        self.read_many([slot], [header], [out])

    def read_many(self, slots: Sequence[int], headers: Sequence[RecordHeader],
                  outs: Sequence[object]) -> None:
        """`read` for many slots (an out may be a list of buffers, filled back to back);
        adjacent slots come in as one preadv. Raises CorruptSlots
        (a CorruptRecord) naming the slots that failed, after filling and verifying the rest."""
        n = len(slots)
        if not n == len(headers) == len(outs):
            raise ValueError(f"{n} slots, {len(headers)} headers and {len(outs)} outs")
        lay = self.layout
        slots = [int(s) for s in slots]
        views = [self._payload_view(o, f"outs[{i}]", writable=True) for i, o in enumerate(outs)]
        bad: dict[int, str] = {}
        todo = []
        for i, h in enumerate(headers):
            if not isinstance(h, RecordHeader):
                raise TypeError(f"headers[{i}]: expected a RecordHeader, got {type(h).__name__}")
            if (h.namespace != lay.namespace or h.payload_len != lay.payload_bytes
                    or h.num_tokens != lay.num_tokens):
                bad[slots[i]] = "the header is of another namespace or geometry"
            else:
                todo.append(i)
        todo.sort(key=slots.__getitem__)
        in_order = [slots[i] for i in todo]
        stride, pb = lay.payload_stride, lay.payload_bytes
        # NOTE: the payload hash is a second pass over every byte read, as costly as the read
        # itself when the page cache holds the data. So a batch is read in chunks and chunk i
        # is hashed on the verifier thread while chunk i + 1 is read (preadv and xxh3 both
        # release the GIL); through the page cache the chunks are small, so a chunk is hashed
        # while it is still in the CPU cache. With one CPU there is nothing to overlap with:
        # each chunk is hashed inline, right after it lands.
        per = max(1, (_DIRECT_CHUNK if self.o_direct else _CACHED_CHUNK) // stride)
        pipelined = self._cpus > 1 and len(todo) > per

        def verify(idx: list[int]) -> list[int]:
            return [i for i in idx if payload_hash(views[i]) != headers[i].payload_hash]

        checks: list = []
        with self._gate.shared():
            self._check_slots(in_order)
            try:
                for first, a, b in _runs(in_order):
                    for c in range(a, b, per):
                        idx = todo[c:min(b, c + per)]
                        try:
                            got = self._payload_io((first + c - a) * stride,
                                                   [views[i] for i in idx], write=False)
                        except OSError as exc:
                            raise self._error(exc, f"reading {len(idx)} record(s)") from exc
                        whole = [i for k, i in enumerate(idx) if got >= k * stride + pb]
                        for i in idx[len(whole):]:
                            bad[slots[i]] = "short read: the payload file ends inside the slot"
                        checks.append(self._verifier().submit(verify, whole) if pipelined
                                      else verify(whole))
            finally:
                failed = [i for check in checks
                          for i in (check.result() if pipelined else check)]
        for i in failed:
            bad[slots[i]] = "payload hash mismatch (torn, truncated or corrupted)"
        self._count(records_read=n - len(bad), bytes_read=(n - len(bad)) * pb)
        if bad:
            self._count(corrupt=len(bad))
            err = CorruptSlots(bad)
            log.warning("%s: %s at %s: dropped, never returned", self.where, err, self.dir)
            raise err

    def erase(self, slots: Sequence[int]) -> None:
        """Drop the records in `slots`, durably: a dropped block never comes back on restart."""
        slots = sorted({int(s) for s in slots})
        with self._gate.shared():
            self._check_slots(slots)
            stale = [s for s in slots if self._state[s] != _EMPTY]
            if not stale:
                return
            try:
                self._put_headers(stale, None)
                os.fdatasync(self._hfd)
            except OSError as exc:
                raise self._error(exc, f"erasing {len(stale)} record(s)") from exc
            for s in stale:
                self._state[s] = _EMPTY
        self._count(records_erased=len(stale))

    def update_hits(self, slots: Sequence[int], hits: Sequence[int]) -> None:
        """Rewrite the use counts in the headers of `slots` (what eviction policies read after
        a restart); nothing else about the records changes. The header is re-read from disk
        and must verify first. NOTE: rewritten in place, so a crash during it can make a
        record a miss (its header torn), never another record. Raises CorruptSlots for slots
        whose header did not verify (they are left as they were)."""
        if len(slots) != len(hits):
            raise ValueError(f"{len(slots)} slots and {len(hits)} hit counts")
        lay = self.layout
        pairs = sorted({int(s): int(h) for s, h in zip(slots, hits)}.items())
        bad: dict[int, str] = {}
        with self._gate.shared():
            self._check_slots([s for s, _ in pairs])
            new: list[tuple[int, bytes]] = []
            try:
                for s, h in pairs:
                    raw = os.pread(self._hfd, lay.header_bytes, s * lay.header_stride)
                    try:
                        rec = decode_header(raw, namespace=lay.namespace,
                                            num_tokens=lay.num_tokens,
                                            payload_len=lay.payload_bytes)
                    except CorruptRecord as exc:
                        bad[s] = str(exc)
                        continue
                    new.append((s, rec.encode(hits=h)))
                if new:
                    self._put_headers([s for s, _ in new], [memoryview(h) for _, h in new])
                    os.fdatasync(self._hfd)
            except OSError as exc:
                raise self._error(exc, f"updating {len(pairs)} header(s)") from exc
        if bad:
            raise CorruptSlots(bad)

    def scan(self) -> list[tuple[int, RecordHeader]]:
        """(slot, header) of every slot holding a valid record, in slot order: what the control
        plane rebuilds its index from after a restart. Reads only the header table, in large
        sequential steps. Corrupt, torn and foreign headers are skipped, counted (`corrupt`)
        and logged once, in summary."""
        lay = self.layout
        stride = lay.header_stride
        per = max(1, _SCAN_BYTES // stride)
        found: list[tuple[int, RecordHeader]] = []
        reasons = Counter[str]()
        # NOTE: alone (exclusive): a header being written while it is read could look corrupt,
        # and marking its slot empty would skip the tombstone before its next reuse.
        with self._gate.exclusive():
            n = self._num_slots
            for start in range(0, n, per):
                k = min(per, n - start)
                buf, unreadable = self._read_header_rows(start, k)
                rows = np.frombuffer(buf, dtype=np.uint8).reshape(k, stride)
                old = self._state[start:start + k]
                self._state[start:start + k] = bytes(k)
                hb = lay.header_bytes
                for i in np.flatnonzero(rows.any(axis=1)).tolist():
                    slot = start + i
                    if i in unreadable:
                        self._state[slot] = _MAYBE
                        reasons["unreadable (I/O error)"] += 1
                        continue
                    try:
                        rec = decode_header(buf[i * stride:i * stride + hb],
                                            namespace=lay.namespace, num_tokens=lay.num_tokens,
                                            payload_len=lay.payload_bytes)
                    except CorruptRecord as exc:
                        reasons[str(exc)] += 1
                        continue
                    if old[i] == _CUT:
                        self._state[slot] = _CUT
                        reasons["the payload file was truncated inside the slot"] += 1
                        continue
                    self._state[slot] = _MAYBE
                    found.append((slot, rec))
        bad = sum(reasons.values())
        self.last_scan = {"slots": n, "records": len(found), "corrupt": bad}
        self._count(corrupt=bad)
        if bad:
            summary = "; ".join(f"{c} x {r}" for r, c in reasons.most_common(4))
            log.warning("%s: scan of %s skipped %d corrupt record(s) of %d slots (%s)",
                        self.where, self.dir, bad, n, summary)
        log.info("%s: scan of %s found %d record(s) in %d slots", self.where, self.dir,
                 len(found), n)
        return found

    def _read_header_rows(self, start: int, k: int) -> tuple[bytes | bytearray, set[int]]:
        """Header areas of slots [start, start + k); a file that ends early reads as empty. On
        an I/O error the rows are read one by one and the unreadable ones named."""
        stride = self.layout.header_stride
        try:
            buf = os.pread(self._hfd, k * stride, start * stride)
            if len(buf) < k * stride:
                buf += bytes(k * stride - len(buf))
            return buf, set()
        except OSError as exc:
            if exc.errno != errno.EIO:
                raise self._error(exc, "reading the header table") from exc
        out, unreadable = bytearray(k * stride), set()
        for i in range(k):
            try:
                row = os.pread(self._hfd, stride, (start + i) * stride)
                out[i * stride:i * stride + len(row)] = row
            except OSError:
                out[i * stride] = 0xFF
                unreadable.add(i)
        return out, unreadable

    # ------------------------------------------------------------------ I/O helpers
    def _payload_view(self, obj: object, what: str, *,
                      writable: bool = False) -> memoryview | tuple[memoryview, ...]:
        """A payload as one byte view, or, for a list/tuple of buffers (the pieces of a page
        that lies in several places of an engine's pool, taken back to back), a tuple of them:
        written and read with one pwritev/preadv, no gathering copy."""
        if isinstance(obj, (list, tuple)):
            views = tuple(byte_view(p) for p in obj)
            nbytes = sum(v.nbytes for v in views)
            readonly = any(v.readonly for v in views)
        else:
            views = byte_view(obj)
            nbytes, readonly = views.nbytes, views.readonly
        if nbytes != self.layout.payload_bytes:
            raise ValueError(f"{what}: {nbytes} bytes, a slot holds "
                             f"{self.layout.payload_bytes}")
        if writable and readonly:
            raise ValueError(f"{what}: the buffer is read-only")
        return views

    def _check_slots(self, slots: Sequence[int]) -> None:
        """Slots must be sorted (or one) and inside the pool."""
        if slots and (slots[0] < 0 or slots[-1] >= self._num_slots):
            bad = next(s for s in slots if not 0 <= s < self._num_slots)
            raise IndexError(f"{self.where}: slot {bad} outside [0, {self._num_slots})")

    def _put_headers(self, slots: Sequence[int], heads: Sequence[memoryview] | None) -> None:
        """Header areas of sorted `slots`: `heads` padded with zeros, or zeros (tombstones)."""
        stride = self.layout.header_stride
        zero = self._zero_header
        for first, a, b in _runs(slots):
            if heads is None:
                iov = [zero] * (b - a)
            else:
                iov = []
                for h in heads[a:b]:
                    iov.append(h)
                    iov.append(zero[:stride - h.nbytes])
            pwritev_all(self._hfd, iov, first * stride)

    def _put_payloads(self, slots: Sequence[int], views: Sequence[memoryview]) -> None:
        stride = self.layout.payload_stride
        for first, a, b in _runs(slots):
            self._payload_io(first * stride, views[a:b], write=True)

    def _payload_io(self, offset: int, views: Sequence[memoryview], *, write: bool) -> int:
        """Write `views` to (or read them from) consecutive payload areas from `offset`; returns
        the bytes moved, strides included (less than asked only at end of file on a read)."""
        if not self.o_direct:
            pad = self._pad_out if write else self._pad_in
            iov = []
            for view in views:
                if isinstance(view, tuple):
                    iov.extend(view)
                else:
                    iov.append(view)
                if pad.nbytes:
                    iov.append(pad)
            if write:
                return pwritev_all(self._pfd, iov, offset)
            return preadv_all(self._pfd, iov, offset)
        return self._direct_io(offset, views, write=write)

    def _direct_io(self, offset: int, views: Sequence[memoryview], *, write: bool) -> int:
        """O_DIRECT needs aligned memory, offsets and lengths: aligned whole-stride buffers go
        straight to the disk, the rest through this thread's bounce buffer."""
        lay = self.layout
        stride, pb = lay.payload_stride, lay.payload_bytes
        bounce = self._bounce()
        cap = bounce.nbytes // stride
        moved = 0
        iov: list[memoryview] = []
        copies: list[tuple[memoryview, memoryview]] = []
        used = 0

        def flush() -> bool:
            nonlocal moved, offset
            want = sum(v.nbytes for v in iov)
            if write:
                got = pwritev_all(self._pfd, iov, offset, buffered_fd=self._pfd_buffered)
            else:
                got = preadv_all(self._pfd, iov, offset)
            for seg, out in copies:
                out[:] = seg
            moved += got
            offset += got
            return got == want

        for view in views:
            if not isinstance(view, tuple) and view.nbytes == stride and is_aligned(view, ALIGN):
                iov.append(view)
                continue
            if used == cap:
                if not flush():
                    return moved
                iov, copies, used = [], [], 0
            seg = bounce[used * stride:(used + 1) * stride]
            used += 1
            if write:
                at = 0
                for piece in view if isinstance(view, tuple) else (view,):
                    seg[at:at + piece.nbytes] = piece
                    at += piece.nbytes
                seg[pb:] = self._pad_out
            elif isinstance(view, tuple):
                at = 0
                for piece in view:
                    copies.append((seg[at:at + piece.nbytes], piece))
                    at += piece.nbytes
            else:
                copies.append((seg[:pb], view))
            iov.append(seg)
        if iov:
            flush()
        return moved

    def _verifier(self) -> ThreadPoolExecutor:
        with self._counts_lock:
            if self._verify_pool is None:
                self._verify_pool = ThreadPoolExecutor(1, thread_name_prefix="tc-disk-verify")
            return self._verify_pool

    def _bounce(self) -> memoryview:
        buf = getattr(self._local, "bounce", None)
        if buf is None:
            stride = self.layout.payload_stride
            buf = aligned_buffer(max(1, _BOUNCE_BYTES // stride) * stride)
            self._local.bounce = buf
        return buf

    def _error(self, exc: OSError, what: str) -> TierUnavailableError:
        cls = DiskFullError if exc.errno in _FULL_ERRNOS else DiskIOError
        hint = ("no more demotion to disk" if cls is DiskFullError
                else "the disk tier should be taken out of use")
        err = cls(f"{self.where}: {what} at {self.dir} failed: {exc.strerror} "
                  f"({errno.errorcode.get(exc.errno, exc.errno)}); {hint}")
        err.errno = exc.errno
        return err

    def _count(self, **deltas: int) -> None:
        with self._counts_lock:
            self._counts.update(deltas)
            self.corrupt += deltas.get("corrupt", 0)

    # ------------------------------------------------------------------ lifecycle, stats
    @property
    def num_slots(self) -> int:
        return self._num_slots

    @property
    def closed(self) -> bool:
        return self._gate.closed

    def stats(self) -> dict:
        """Sizes, space on disk, and what the pool has done (counters since open)."""
        lay = self.layout
        out: dict = {
            "path": str(self.dir), "num_slots": self._num_slots, "max_slots": self.max_slots,
            "payload_bytes": lay.payload_bytes, "payload_stride": lay.payload_stride,
            "header_stride": lay.header_stride, "o_direct": self.o_direct,
            "o_direct_refused": self.o_direct_refused, "reset": self.reset_reason,
            # slots that may hold a record: exact after scan(), an upper bound before
            "occupied_slots": self._num_slots - self._state.count(_EMPTY),
            "corrupt": self.corrupt, "last_scan": self.last_scan, "closed": self.closed,
        }
        with self._counts_lock:
            for k in ("records_written", "bytes_written", "records_read", "bytes_read",
                      "records_erased"):
                out[k] = self._counts[k]
        if not self.closed:
            out["bytes_reserved"] = lay.headers_size(self._num_slots) + lay.payloads_size(
                self._num_slots)
            out["bytes_on_disk"] = allocated_bytes(self._hfd) + allocated_bytes(self._pfd)
            out["free_bytes"] = free_bytes(self.dir)
        return out

    def close(self) -> None:
        """Wait for I/O under way, close the files and release the directory (idempotent)."""
        with self._gate.exclusive(closing=True) as open_:
            if open_:
                self._close_files()
                self._gate.closed = True

    def _close_files(self) -> None:
        if self._verify_pool is not None:
            self._verify_pool.shutdown(wait=True)
            self._verify_pool = None
        for name in ("_hfd", "_pfd", "_pfd_buffered"):
            fd = getattr(self, name)
            if fd is not None and fd >= 0:
                setattr(self, name, -1)
                os.close(fd)
        self._lock.release()

    def __enter__(self) -> DiskPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"DiskPool({str(self.dir)!r}, num_slots={self._num_slots}, "
                f"payload_bytes={self.layout.payload_bytes}, o_direct={self.o_direct})")
