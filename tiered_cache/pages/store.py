"""PageStore: put / get / exists of an engine's fixed-size pages, by the engine's own keys.

Beneath an engine's host pool, either this process's own tiers, in order (a local disk, then the
remote store), or the node daemon (whose own pool, disk and remote store serve every engine of
the node). Each call names a *part*: a TP rank's own pages (`"tp3/8"`), or the one copy every
rank reads when the KV is replicated (MLA). A page is stored under its part's root
(`identity.page_root`: format digest, tenant salt, part), so ranks and tenants never read each
other's pages.

- `exists(keys, part, other_parts)`: how many leading keys are present, under the lookup
  deadline (keys the remote store has not answered by then are "absent"). With `other_parts`,
  the count present for every part where a shared tier (remote, daemon) can see them: a page
  set is a hit only when every rank's part is there.
- `get(keys, outs, part)`: fills `outs[i]` (a buffer or a list of pieces) with page i where
  a tier holds it, verified; True per page. A page that fails verification is a miss, and its
  record is dropped in that tier, so the next put writes it again. Through the daemon only the
  leading run is read (its reply is one pinned run: what an engine loads is a prefix).
- `put(keys, payloads, part)`: writes the pages to every tier (disk synchronously, remote as
  one pipeline); True per page some tier holds afterwards.

Bad input raises before any tier is touched: `PageKeyError` (a key that is not 1..124 bytes of
str/bytes, or repeated), `PageSizeError` (a buffer that is not exactly one page). Tier failures
never raise: they are misses, counted in `stats()`.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Sequence

from tiered_cache.errors import ConfigError
from tiered_cache.pages import identity
from tiered_cache.pages.config import PageStoreConfig
from tiered_cache.pages.identity import PageFormat, PageKeyError, PageSizeError
from tiered_cache.pages.payload import views

log = logging.getLogger(__name__)

__all__ = ["PageKeyError", "PageSizeError", "PageStore", "part_name"]


def part_name(rank: int, size: int, replicated: bool) -> bytes:
    """The part a TP rank stores: its own (`tp<rank>/<size>`), or the replicated copy."""
    if replicated:
        return b"replicated"
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} outside [0, {size})")
    return f"tp{rank}/{size}".encode()


def _leading(flags: Sequence[bool]) -> int:
    for i, f in enumerate(flags):
        if not f:
            return i
    return len(flags)


class PageStore:
    def __init__(self, format: PageFormat, *, disk=None, remote=None, daemon=None,
                 tenant: bytes = b"", lookup_deadline_s: float = 0.005, fill_disk: bool = True,
                 write_remote: bool = True, write_daemon: bool = True) -> None:
        if daemon is not None and (disk is not None or remote is not None):
            raise ValueError("a page store has either its own tiers or the daemon's")
        if disk is None and remote is None and daemon is None:
            raise ValueError("a page store needs a tier")
        self.format = format
        self.digest = format.digest()
        self.page_bytes = format.page_bytes
        self.disk, self.remote, self.daemon = disk, remote, daemon
        self.tenant = tenant
        self.lookup_deadline_s = lookup_deadline_s
        self.fill_disk = fill_disk
        self.write_remote = write_remote
        self.write_daemon = write_daemon
        self._roots: dict[bytes, bytes] = {}
        self.counts = {"exists": 0, "gets": 0, "pages_read": 0, "pages_missed": 0,
                       "puts": 0, "pages_written": 0, "pages_not_written": 0,
                       "disk_fills": 0}

    # building ---------------------------------------------------------------------------------

    @classmethod
    def from_config(cls, config: PageStoreConfig, format: PageFormat, *, disk_dir: str,
                    use_disk: bool = True, client: str = "engine") -> PageStore:
        """The tiers `config` names. `disk_dir`: this process's own directory under
        `tiers.disk.path` (a disk directory has one owner, so two TP ranks need two);
        `use_disk=False` leaves the disk out (a rank that can never write, for instance)."""
        disk = remote = daemon = None
        try:
            if config.daemon is not None:
                from tiered_cache.pages.daemon import DaemonPages

                daemon = DaemonPages(config.daemon.socket, format,
                                     timeout_s=config.daemon.timeout_s)
            if config.disk is not None and use_disk:
                from tiered_cache.pages.disk import PageDisk

                path = os.path.join(config.disk.path, disk_dir)
                disk = PageDisk(path, num_pages=disk_pages(config, format, path),
                                format=format, o_direct=config.disk.o_direct)
            if config.remote is not None:
                from tiered_cache.pages.remote import PageRemote
                from tiered_cache.tiers.remote import connect

                store = connect(config.remote, namespace=format.digest(),
                                num_tokens=identity.IDENT_TOKENS,
                                payload_bytes=format.page_bytes, delete_corrupt=True)
                remote = PageRemote(store, format)
        except BaseException:
            for tier in (disk, remote, daemon):
                if tier is not None:
                    tier.close()
            raise
        salt = (config.tenant_salt or "").encode()
        return cls(format, disk=disk, remote=remote, daemon=daemon, tenant=salt,
                   lookup_deadline_s=config.lookup_deadline_ms / 1000,
                   fill_disk=config.fill_disk,
                   write_remote=config.remote is None or config.remote.write != "off",
                   write_daemon=config.daemon is None or config.daemon.write != "off")

    def root(self, part: bytes) -> bytes:
        found = self._roots.get(part)
        if found is None:
            found = self._roots[part] = identity.page_root(self.digest, self.tenant, part)
        return found

    @property
    def tiers(self) -> list:
        return [t for t in (self.disk, self.remote, self.daemon) if t is not None]

    @property
    def shared(self) -> bool:
        """Whether another process could find what this store holds."""
        return self.remote is not None or self.daemon is not None

    # the calls --------------------------------------------------------------------------------

    def exists(self, keys: Sequence[object], part: bytes, other_parts: Sequence[bytes] = (),
               deadline_s: float | None = None) -> int:
        ekeys = identity.check_keys(keys)
        self.counts["exists"] += 1
        if not ekeys:
            return 0
        budget = self.lookup_deadline_s if deadline_s is None else deadline_s
        if self.daemon is not None:
            return self.daemon.exists_parts([part, *other_parts], ekeys, budget)
        end = time.monotonic() + budget
        root = self.root(part)
        here = self.disk.contains(root, ekeys) if self.disk is not None else [False] * len(ekeys)
        n = _leading(here)
        if n < len(ekeys) and self.remote is not None:
            rest = self.remote.exists(root, ekeys[n:], max(0.0, end - time.monotonic()))
            n += _leading(rest)
        if self.remote is not None:
            for other in other_parts:
                if n == 0:
                    break
                n = min(n, _leading(self.remote.exists(self.root(other), ekeys[:n],
                                                       max(0.0, end - time.monotonic()))))
        return n

    def get(self, keys: Sequence[object], outs: Sequence[object], part: bytes) -> list[bool]:
        ekeys = identity.check_keys(keys)
        if len(outs) != len(ekeys):
            raise PageSizeError(f"{len(ekeys)} keys and {len(outs)} page buffers")
        pieces = [views(o, self.page_bytes, f"outs[{i}]", writable=True)
                  for i, o in enumerate(outs)]
        self.counts["gets"] += 1
        ok = [False] * len(ekeys)
        if not ekeys:
            return ok
        if self.daemon is not None:
            ok = self.daemon.get(part, ekeys, pieces, max(self.lookup_deadline_s, 0.5))
        else:
            root = self.root(part)
            if self.disk is not None:
                ok = self.disk.get(root, ekeys, pieces)
            todo = [i for i, hit in enumerate(ok) if not hit]
            if todo and self.remote is not None:
                got = self.remote.get(root, [ekeys[i] for i in todo], [pieces[i] for i in todo])
                filled = [i for i, hit in zip(todo, got) if hit]
                for i in filled:
                    ok[i] = True
                if filled and self.disk is not None and self.fill_disk:
                    self.disk.put(root, [ekeys[i] for i in filled], [pieces[i] for i in filled])
                    self.counts["disk_fills"] += len(filled)
        hits = sum(ok)
        self.counts["pages_read"] += hits
        self.counts["pages_missed"] += len(ok) - hits
        return ok

    def put(self, keys: Sequence[object], payloads: Sequence[object], part: bytes) -> list[bool]:
        ekeys = identity.check_keys(keys)
        if len(payloads) != len(ekeys):
            raise PageSizeError(f"{len(ekeys)} keys and {len(payloads)} pages")
        pieces = [views(p, self.page_bytes, f"payloads[{i}]") for i, p in enumerate(payloads)]
        self.counts["puts"] += 1
        ok = [False] * len(ekeys)
        if not ekeys:
            return ok
        if self.daemon is not None:
            if self.write_daemon:
                ok = self.daemon.put(part, ekeys, pieces)
        else:
            root = self.root(part)
            if self.disk is not None:
                ok = self.disk.put(root, ekeys, pieces)
            if self.remote is not None and self.write_remote:
                for i, hit in enumerate(self.remote.put(root, ekeys, pieces)):
                    ok[i] = ok[i] or hit
        n = sum(ok)
        self.counts["pages_written"] += n
        self.counts["pages_not_written"] += len(ok) - n
        return ok

    # lifetime ---------------------------------------------------------------------------------

    def stats(self) -> dict:
        out = {"format": self.digest.hex(), "page_bytes": self.page_bytes, **self.counts}
        for tier in self.tiers:
            try:
                out[tier.name] = tier.stats()
            except Exception as exc:         # a stats call must never take the caller down
                out[tier.name] = {"error": str(exc)}
        return out

    def close(self) -> None:
        for tier in self.tiers:
            try:
                tier.close()
            except Exception:
                log.exception("closing the page store's %s tier failed", tier.name)


def disk_pages(config: PageStoreConfig, format: PageFormat, path: str) -> int:
    """Pages `tiers.disk` holds: `num_blocks` pages, or `capacity` bytes (or a share of the
    free space at `path`) divided by what one page takes on disk (header + payload strides)."""
    from tiered_cache.data.disk_layout import Layout
    from tiered_cache.sizing import disk_free_bytes, parse_size

    disk = config.disk
    if disk.num_blocks is not None:
        n = disk.num_blocks
    else:
        lay = Layout(format.digest(), identity.IDENT_TOKENS, format.page_bytes)
        per = lay.header_stride + lay.payload_stride
        kind, value = parse_size(disk.capacity, "tiers.disk.capacity")
        if kind == "bytes":
            n = int(value) // per
        else:
            os.makedirs(path, exist_ok=True)
            n = int(value * disk_free_bytes(path)) // per
    if n < 1:
        raise ConfigError("tiers.disk", f"holds no page of {format.page_bytes:,} bytes")
    return n
