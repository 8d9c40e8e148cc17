"""PageDisk: pages named by engine keys on a local disk, over the disk tier's DiskPool.

The DiskPool (`tiered_cache.data.disk`) keeps one self-verifying record per slot and knows
nothing of keys; this module adds the keyed index over it: page key -> (slot, verified header),
in LRU order, a free list, and eviction of the least recently used page when the pool is full.

- Recovery: at open the index is rebuilt from `DiskPool.scan()` (headers only, each verified):
  a record is restored when its stored engine key, page key, root and parent agree
  (`identity.stored_key`, `page_key`); anything else, and a second record of a key already
  restored, is erased.
- Reads verify every payload (DiskPool.read_many); a record that fails is a miss, and it is
  erased and dropped from the index at once, so the next put of that page rewrites it.
- Pins: a slot being read is never given to a write (an entry's `readers`); a slot being
  written is in neither the index nor the free list until its write is durable.

Thread-safe: the index is under one lock, held only for dictionary work, never over I/O.
"""

from __future__ import annotations

import logging
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tiered_cache.data.disk import CorruptSlots, DiskPool
from tiered_cache.errors import TierUnavailableError
from tiered_cache.pages import identity
from tiered_cache.pages.config import DISK
from tiered_cache.pages.identity import PageFormat
from tiered_cache.pages.payload import as_payload
from tiered_cache.records import RecordHeader

log = logging.getLogger(__name__)


@dataclass(eq=False)
class _Entry:
    slot: int
    header: RecordHeader
    readers: int = 0


@dataclass
class _Counts:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    present: int = 0            # puts of a page already held
    evicted: int = 0
    corrupt: int = 0
    failed: int = 0             # pages a failed disk I/O cost
    recovered: int = 0
    erased_at_open: int = 0


class PageDisk:
    """`num_pages` pages of `format.page_bytes` in `path/<format digest hex>/` (one owner)."""

    name = DISK
    shared = False              # only this process sees it

    def __init__(self, path: str | os.PathLike, *, num_pages: int, format: PageFormat,
                 o_direct: bool = False) -> None:
        if type(num_pages) is not int or num_pages < 1:
            raise ValueError(f"num_pages: expected a positive int, got {num_pages!r}")
        self.format = format
        self.digest = format.digest()
        self.pool = DiskPool(path, num_slots=num_pages, payload_bytes=format.page_bytes,
                             num_tokens=identity.IDENT_TOKENS, namespace=self.digest,
                             o_direct=o_direct)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, _Entry] = OrderedDict()     # LRU first
        self._free: list[int] = []
        self._writing: set[bytes] = set()
        self.counts = _Counts()
        try:
            self._recover()
        except BaseException:
            self.pool.close()
            raise

    # ------------------------------------------------------------------ recovery
    def _recover(self) -> None:
        bad: list[int] = []
        used: set[int] = set()
        for slot, header in self.pool.scan():
            engine_key = identity.stored_key(header)
            ok = (engine_key is not None and header.depth == 0 and header.parent == header.root
                  and header.key == identity.page_key(header.root, engine_key)
                  and header.key not in self._index)
            if not ok:
                bad.append(slot)
                continue
            self._index[header.key] = _Entry(slot, header)
            used.add(slot)
        if bad:
            log.warning("pages on disk at %s: %d record(s) that name no page of their own (or "
                        "repeat one) erased", self.pool.dir, len(bad))
            self.pool.erase(bad)
        self._free = [s for s in range(self.pool.num_slots - 1, -1, -1) if s not in used]
        self.counts.recovered = len(self._index)
        self.counts.erased_at_open = len(bad)

    # ------------------------------------------------------------------ lookups
    def contains(self, root: bytes, engine_keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            return [identity.page_key(root, k) in self._index for k in engine_keys]

    def exists(self, root: bytes, engine_keys: Sequence[bytes], deadline_s: float) -> list[bool]:
        return self.contains(root, engine_keys)     # an index lookup: no I/O, no deadline

    def __len__(self) -> int:
        with self._lock:
            return len(self._index)

    # ------------------------------------------------------------------ reads
    def get(self, root: bytes, engine_keys: Sequence[bytes],
            outs: Sequence[tuple[memoryview, ...]]) -> list[bool]:
        """Fill `outs[i]` with page i where this disk holds it (verified); True per page read."""
        n = len(engine_keys)
        found: list[tuple[int, _Entry]] = []
        with self._lock:
            for i, k in enumerate(engine_keys):
                entry = self._index.get(identity.page_key(root, k))
                if entry is not None and identity.matches(entry.header, root, k):
                    entry.readers += 1
                    self._index.move_to_end(entry.header.key)
                    found.append((i, entry))
        ok = [False] * n
        if not found:
            with self._lock:
                self.counts.misses += n
            return ok
        bad: set[int] = set()
        try:
            self.pool.read_many([e.slot for _, e in found], [e.header for _, e in found],
                                [as_payload(outs[i]) for i, _ in found])
        except CorruptSlots as exc:
            bad = set(exc.reasons)
        except TierUnavailableError as exc:
            log.error("pages on disk at %s: a read of %d page(s) failed: %s", self.pool.dir,
                      len(found), exc)
            bad = {e.slot for _, e in found}
            with self._lock:
                self.counts.failed += len(found)
        corrupt = []
        with self._lock:
            for i, e in found:
                e.readers -= 1
                if e.slot in bad:
                    if self._index.get(e.header.key) is e:
                        del self._index[e.header.key]
                        corrupt.append(e.slot)
                else:
                    ok[i] = True
            hits = sum(ok)
            self.counts.hits += hits
            self.counts.misses += n - hits
        if corrupt:
            self._drop(corrupt)
        return ok

    def _drop(self, slots: list[int]) -> None:
        """Erase records that failed verification (durably: a restart never restores them),
        then give their slots back."""
        with self._lock:
            self.counts.corrupt += len(slots)
        try:
            self.pool.erase(slots)
        except (TierUnavailableError, OSError) as exc:
            log.error("pages on disk at %s: erasing %d corrupt record(s) failed: %s",
                      self.pool.dir, len(slots), exc)
            return          # NOTE: the slots stay out of use: their records may still be there
        with self._lock:
            self._free.extend(slots)

    # ------------------------------------------------------------------ writes
    def put(self, root: bytes, engine_keys: Sequence[bytes],
            payloads: Sequence[tuple[memoryview, ...]]) -> list[bool]:
        """Write the pages this disk does not hold yet, evicting the least recently used ones
        when it is full; True per page held afterwards (written now or already there)."""
        n = len(engine_keys)
        ok = [False] * n
        todo: list[int] = []
        slots: list[int] = []
        with self._lock:
            for i, k in enumerate(engine_keys):
                key = identity.page_key(root, k)
                entry = self._index.get(key)
                if entry is not None and identity.matches(entry.header, root, k):
                    ok[i] = True
                    self._index.move_to_end(key)
                    self.counts.present += 1
                    continue
                if key in self._writing or entry is not None:
                    # being written by another thread right now; or (entry of another engine
                    # key under a colliding page key) held by that page: a miss for this one
                    continue
                slot = self._take_slot()
                if slot is None:
                    break               # every slot is being read or written
                self._writing.add(key)
                todo.append(i)
                slots.append(slot)
        if not todo:
            return ok
        headers = [identity.encode_header(self.digest, root, engine_keys[i],
                                          as_payload(payloads[i])) for i in todo]
        written: list[RecordHeader] | None = None
        try:
            written = self.pool.write(slots, headers, [as_payload(payloads[i]) for i in todo])
        except TierUnavailableError as exc:
            log.error("pages on disk at %s: writing %d page(s) failed: %s", self.pool.dir,
                      len(todo), exc)
            with self._lock:
                self.counts.failed += len(todo)
        finally:
            with self._lock:
                for j, i in enumerate(todo):
                    key = identity.page_key(root, engine_keys[i])
                    self._writing.discard(key)
                    if written is None:
                        self._free.append(slots[j])
                    else:
                        self._index[key] = _Entry(slots[j], written[j])
                        ok[i] = True
                if written is not None:
                    self.counts.puts += len(todo)
        return ok

    def _take_slot(self) -> int | None:
        """A free slot, or the slot of the least recently used page no one reads (lock held).
        NOTE: the evicted record stays on disk until the write overwrites it (DiskPool
        tombstones a slot before its new payload goes in), and it is a whole, valid record of
        its own page meanwhile: a crash in between can only bring that page back."""
        if self._free:
            return self._free.pop()
        for key, entry in self._index.items():
            if entry.readers == 0:
                del self._index[key]
                self.counts.evicted += 1
                return entry.slot
        return None

    def delete(self, root: bytes, engine_keys: Sequence[bytes]) -> int:
        """Drop pages (durably); returns how many were held."""
        slots = []
        with self._lock:
            for k in engine_keys:
                key = identity.page_key(root, k)
                entry = self._index.get(key)
                if entry is not None and entry.readers == 0:
                    del self._index[key]
                    slots.append(entry.slot)
        if slots:
            self.pool.erase(slots)
            with self._lock:
                self._free.extend(slots)
        return len(slots)

    def clear(self) -> int:
        """Drop every page no one is reading (durably); returns how many."""
        with self._lock:
            keys = [k for k, e in self._index.items() if e.readers == 0]
            slots = [self._index.pop(k).slot for k in keys]
        if slots:
            self.pool.erase(slots)
            with self._lock:
                self._free.extend(slots)
        return len(slots)

    # ------------------------------------------------------------------ lifetime
    def stats(self) -> dict:
        c = self.counts
        with self._lock:
            held = len(self._index)
        return {"pages": held, "num_pages": self.pool.num_slots, "hits": c.hits,
                "misses": c.misses, "puts": c.puts, "present": c.present,
                "evicted": c.evicted, "corrupt": c.corrupt, "failed": c.failed,
                "recovered": c.recovered, "erased_at_open": c.erased_at_open,
                "path": str(self.pool.dir)}

    def close(self) -> None:
        self.pool.close()
