"""The daemon's page spaces: pages named by an engine's own keys, shared by the node's engines.

An engine that names pages by its own hashes (SGLang's HiCache, the vLLM secondary tier) asks
the daemon with the `page_*` ops (daemon/ops.py). A *page space* holds, for one tenant and one
page format (`pages.identity.PageFormat` digest + page size), a pool of whole pages in shared
memory (a sealed memfd, mapped read-only by the clients, like the block pool), a keyed index
over it (page key -> slot, LRU), and beneath it the page store's disk tier
(`daemon.page_disk_mib` under `<tiers.disk.path>/<tenant>/pages/`) and remote tier
(`tiers.remote`). Tenants never share a space: the root of every page is derived here from the
tenant the client's credentials name (`identity.page_root`), and a client is sent only its own
tenant's memfds.

- `page_exists`: leading pages present in the pool or on disk (index lookups), then the remote
  store for the rest, under the request's deadline. With several parts (every TP rank's), the
  count present for all of them.
- `page_get`: pins the leading pages found, loading those on disk or in the store into pool
  slots first (verified; a record that fails is a miss and is dropped there), and answers the
  slots under a handle; the client copies out of its read-only mapping, then `release`s.
- `page_put`: copies pages from the client's staging area (its own memfd) into pool slots, then
  writes them through to the disk (synchronously) and the store (queued).

NOTE: a pinned slot is never evicted or rewritten; a slot being filled is in neither the index
nor the free list, so no reader can be told about it before its bytes are whole.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tiered_cache.pages import identity
from tiered_cache.pages.payload import gather
from tiered_cache.wire.errors import DaemonError, register_error
from tiered_cache.wire.pages import PageGeometry
from tiered_cache.wire.shm import SharedPool

log = logging.getLogger(__name__)

MAX_SPACES = 8              # page spaces per tenant


@register_error
class PageSpaceError(DaemonError, ValueError):
    """A page op names a space this client did not attach, a staging slot outside its area or
    repeated, or a page format the daemon cannot hold (page ops off, too many formats)."""

    wire_type = "page_space"


@dataclass(eq=False)
class _Page:
    slot: int
    root: bytes
    engine_key: bytes
    pins: int = 0


class PageHold:
    """Pins on pool slots, given back once (`release`); a client's handle holds one."""

    def __init__(self, space: PageSpace, pages: list[_Page]) -> None:
        self.space = space
        self.pages = pages
        self.closed = False

    def release(self) -> None:
        if not self.closed:
            self.closed = True
            self.space._unpin(self.pages)


class PageSpace:
    """One tenant's pages of one format. Thread-safe."""

    def __init__(self, tenant: str, digest: bytes, page_bytes: int, *, num_slots: int,
                 staging_slots: int, disk=None, remote=None) -> None:
        self.tenant = tenant
        self.digest = digest
        self.page_bytes = page_bytes
        self.staging_slots = staging_slots
        self.geometry = PageGeometry(num_slots, page_bytes)
        self.shared = SharedPool.create(self.geometry, name=f"pages-{tenant}",
                                        read_only_clients=True)
        self._buf = self.shared.buffer()
        self.disk = disk            # pages.disk.PageDisk or None
        self.remote = remote        # pages.remote.PageRemote or None
        self._tenant_salt = b"tenant\0" + tenant.encode()
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, _Page] = OrderedDict()      # LRU first
        self._free = list(range(num_slots - 1, -1, -1))
        self.counts = {"exists": 0, "gets": 0, "pages_served": 0, "pages_put": 0,
                       "pages_present": 0, "pages_refused": 0, "evicted": 0,
                       "disk_loads": 0, "remote_loads": 0, "write_through_failed": 0}

    def root(self, part: bytes) -> bytes:
        return identity.page_root(self.digest, self._tenant_salt, part)

    def slot_view(self, slot: int) -> memoryview:
        return self.geometry.slot(self._buf, slot)

    # lookups ----------------------------------------------------------------------------------

    def exists(self, parts: Sequence[bytes], keys: Sequence[bytes], deadline_s: float) -> int:
        """Leading keys present for every part (pool, disk, then the store under the
        deadline: a store that does not answer in time answers "absent")."""
        self._count("exists")
        count = len(keys)
        for part in parts:
            count = min(count, self._leading(self.root(part), keys[:count], deadline_s))
            if count == 0:
                break
        return count

    def _leading(self, root: bytes, keys: Sequence[bytes], deadline_s: float) -> int:
        with self._lock:
            here = [identity.page_key(root, k) in self._index for k in keys]
        if self.disk is not None and not all(here):
            for i, hit in enumerate(self.disk.contains(root, keys)):
                here[i] = here[i] or hit
        n = here.index(False) if False in here else len(keys)
        if n < len(keys) and self.remote is not None and deadline_s > 0:
            rest = self.remote.exists(root, keys[n:], deadline_s)
            for i, hit in enumerate(rest):
                here[n + i] = here[n + i] or hit
            n = here.index(False) if False in here else len(keys)
        return n

    # reads ------------------------------------------------------------------------------------

    def get(self, part: bytes, keys: Sequence[bytes],
            deadline_s: float) -> tuple[PageHold | None, list[int]]:
        """Pin the leading pages of `keys` (loading those on disk or in the store into the
        pool; the store's lookup under `deadline_s`); (hold, their slots), or (None, []) when
        the first is missing."""
        self._count("gets")
        root = self.root(part)
        pinned: list[_Page] = []
        try:
            i, n = 0, len(keys)
            while i < n:
                got = self._pin_resident(root, keys[i:], pinned)
                if got == 0:
                    got = self._load(root, keys[i:], pinned, deadline_s)
                if got == 0:
                    break
                i += got
        except BaseException:
            self._unpin(pinned)
            raise
        if not pinned:
            return None, []
        self._count("pages_served", len(pinned))
        return PageHold(self, pinned), [p.slot for p in pinned]

    def _pin_resident(self, root: bytes, keys: Sequence[bytes], pinned: list[_Page]) -> int:
        got = 0
        with self._lock:
            for k in keys:
                page = self._index.get(identity.page_key(root, k))
                if page is None or page.root != root or page.engine_key != k:
                    break
                page.pins += 1
                self._index.move_to_end(identity.page_key(root, k))
                pinned.append(page)
                got += 1
        return got

    def _load(self, root: bytes, keys: Sequence[bytes], pinned: list[_Page],
              deadline_s: float) -> int:
        """Load the leading run of `keys` that the disk (else the store) holds into new pool
        slots, verified; pin what landed. Returns how many."""
        for tier, counter in ((self.disk, "disk_loads"), (self.remote, "remote_loads")):
            if tier is None:
                continue
            window = keys[:self.geometry.num_slots]
            has = (tier.contains(root, window) if tier is self.disk
                   else tier.exists(root, window, deadline_s))
            run = has.index(False) if False in has else len(has)
            if run == 0:
                continue
            slots = self._take(run)
            if not slots:
                return 0
            ok = tier.get(root, keys[:len(slots)], [(self.slot_view(s),) for s in slots])
            got = ok.index(False) if False in ok else len(ok)
            with self._lock:
                for j, slot in enumerate(slots):
                    if j < got:
                        page = _Page(slot, root, keys[j], pins=1)
                        self._index[identity.page_key(root, keys[j])] = page
                        pinned.append(page)
                    else:
                        self._free.append(slot)
            self._count(counter, got)
            if got:
                return got
        return 0

    def _take(self, n: int) -> list[int]:
        """Up to `n` slots taken out of use: free ones first, then the least recently used
        unpinned pages' (evicted). Their pages' copies below (disk, store) stay."""
        out: list[int] = []
        with self._lock:
            while len(out) < n and self._free:
                out.append(self._free.pop())
            if len(out) < n:
                for key in [k for k, p in self._index.items() if p.pins == 0][:n - len(out)]:
                    out.append(self._index.pop(key).slot)
                    self.counts["evicted"] += 1
        return out

    def _unpin(self, pages: list[_Page]) -> None:
        with self._lock:
            for p in pages:
                p.pins -= 1

    # writes -----------------------------------------------------------------------------------

    def put(self, part: bytes, entries: Sequence[dict], staging: SharedPool) -> list[bool]:
        """Copy staged pages into the pool and write them through to disk and store. True per
        page the pool holds afterwards (taken now, or already here)."""
        seen: set[int] = set()
        for i, e in enumerate(entries):
            if e["slot"] >= self.staging_slots or e["slot"] in seen:
                raise PageSpaceError(f"page_put.entries[{i}].slot: {e['slot']} is outside the "
                                     f"staging area of {self.staging_slots} pages or repeated")
            seen.add(e["slot"])
        root = self.root(part)
        keys = [e["key"] for e in entries]
        if len(set(keys)) != len(keys):
            raise PageSpaceError("page_put.entries: a key appears twice")
        stored = [False] * len(entries)
        with self._lock:
            new = []
            for i, k in enumerate(keys):
                page = self._index.get(identity.page_key(root, k))
                if page is not None and page.engine_key == k and page.root == root:
                    stored[i] = True
                    self._index.move_to_end(identity.page_key(root, k))
                elif page is None:
                    new.append(i)
        self._count("pages_present", sum(stored))
        slots = self._take(len(new))
        if len(slots) < len(new):
            self._count("pages_refused", len(new) - len(slots))
        new = new[:len(slots)]
        try:
            src = staging.buffer()
            sgeo = PageGeometry(self.staging_slots, self.page_bytes)
            for i, slot in zip(new, slots):
                self.slot_view(slot)[:] = sgeo.slot(src, entries[i]["slot"])
        except BaseException:
            # NOTE: the slots are out of use (`_take`) and in no page yet: given back, or the
            # pool would shrink by them for good (their bytes are half copied: indexed by none)
            with self._lock:
                self._free.extend(slots)
            raise
        with self._lock:
            for i, slot in zip(new, slots):
                key = identity.page_key(root, keys[i])
                if key in self._index:          # another client put it meanwhile
                    self._free.append(slot)
                else:
                    self._index[key] = _Page(slot, root, keys[i])
                stored[i] = True
        self._count("pages_put", len(new))
        if new:
            self._write_through(root, [keys[i] for i in new], slots)
        return stored

    def _write_through(self, root: bytes, keys: list[bytes], slots: list[int]) -> None:
        """The new pages to disk (now) and to the store (queued). NOTE: from the client's
        staging copy would race with its next put; from the pool slots, pinned meanwhile."""
        pages = self._pin_slots(root, keys)
        try:
            views = [(self.slot_view(p.slot),) for p in pages]
            if self.disk is not None:
                ok = self.disk.put(root, [p.engine_key for p in pages], views)
                self._count("write_through_failed", len(ok) - sum(ok))
            if self.remote is not None:
                items = []
                for p, v in zip(pages, views):
                    body = gather(v)
                    head = identity.encode_header(self.digest, root, p.engine_key, body)
                    items.append((identity.page_key(root, p.engine_key), head + body))
                self.remote.store.put_async(root, items)
        except Exception:
            log.exception("page space %s: writing %d page(s) through failed", self.tenant,
                          len(pages))
            self._count("write_through_failed", len(pages))
        finally:
            self._unpin(pages)

    def _pin_slots(self, root: bytes, keys: list[bytes]) -> list[_Page]:
        out = []
        with self._lock:
            for k in keys:
                page = self._index.get(identity.page_key(root, k))
                if page is not None:
                    page.pins += 1
                    out.append(page)
        return out

    # lifetime ---------------------------------------------------------------------------------

    def stats(self) -> dict:
        with self._lock:
            out = {"pages": len(self._index), "slots": self.geometry.num_slots,
                   "pinned": sum(1 for p in self._index.values() if p.pins),
                   "page_bytes": self.page_bytes, **self.counts}
        if self.disk is not None:
            out[self.disk.name] = self.disk.stats()
        if self.remote is not None:
            out[self.remote.name] = self.remote.stats()
        return out

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counts[key] += n

    def close(self) -> None:
        if self.remote is not None:
            self.remote.store.flush(5.0)
            self.remote.close()
        if self.disk is not None:
            self.disk.close()
        try:
            self._buf.release()
        except BufferError:         # pragma: no cover - a view still alive: goes with it
            log.debug("page space %s: pool views still alive", self.tenant)
        self.shared.close()
