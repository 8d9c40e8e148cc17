"""The handlers of the `page_*` ops (daemon/ops.py) over the tenants' page spaces.

A space is made on the first `page_attach` of a (tenant, format digest, page size); every
client of that tenant naming the same format shares it. A client's page staging areas (one per
space it attached) live in its ClientState and go with its lease, like its block staging area.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

from tiered_cache.config import CacheConfig, ConfigError
from tiered_cache.daemon.pages import MAX_SPACES, PageSpace, PageSpaceError
from tiered_cache.pages import identity
from tiered_cache.tiers.disk import DiskKind
from tiered_cache.tiers.host import HostKind
from tiered_cache.tiers.remote import RemoteKind
from tiered_cache.wire.errors import OverloadedError, VersionError
from tiered_cache.wire.pages import VERSION, PageGeometry
from tiered_cache.wire.shm import SharedPool
from tiered_cache.wire.transport import Response

log = logging.getLogger(__name__)


class PageService:
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        d = config.daemon
        if d.page_disk_mib and getattr(config.tiers, DiskKind.name) is None:
            raise ConfigError("daemon.page_disk_mib", "pages on disk need tiers.disk.path (the "
                                                      "directory they go under)")
        self._spaces: dict[tuple[str, bytes, int], tuple[int, PageSpace]] = {}
        self._by_id: dict[int, PageSpace] = {}
        self._owner: dict[int, str] = {}
        self._next = 1
        self._lock = threading.Lock()

    # spaces -----------------------------------------------------------------------------------

    def _space(self, tenant: str, digest: bytes, page_bytes: int) -> tuple[int, PageSpace]:
        with self._lock:
            found = self._spaces.get((tenant, digest, page_bytes))
            if found is not None:
                return found
            d = self.config.daemon
            stride = PageGeometry(1, page_bytes).slot_stride
            slots = (d.page_pool_mib << 20) // stride
            if slots < 1:
                raise PageSpaceError(f"daemon.page_pool_mib ({d.page_pool_mib} MiB) holds no page "
                                     f"of {page_bytes:,} bytes: page ops are off")
            if sum(1 for t, _, _ in self._spaces if t == tenant) >= MAX_SPACES:
                raise OverloadedError(f"tenant {tenant} already has {MAX_SPACES} page formats")
            self._admit(tenant, digest, slots * stride, page_bytes)
            space = PageSpace(tenant, digest, page_bytes, num_slots=slots,
                              staging_slots=d.staging_blocks, disk=self._disk(tenant, digest,
                                                                              page_bytes),
                              remote=self._remote(digest, page_bytes))
            sid = self._next
            self._next += 1
            self._spaces[(tenant, digest, page_bytes)] = (sid, space)
            self._by_id[sid] = space
            self._owner[sid] = tenant
            log.info("page space %d: tenant %s, format %s, %d pages of %d bytes", sid, tenant,
                     digest.hex(), slots, page_bytes)
            return sid, space

    def _admit(self, tenant: str, digest: bytes, pool_bytes: int, page_bytes: int) -> None:
        """The memory admission check (tiered_cache.admission) of a new space, before its pool
        is allocated: its shared memory, and its disk when it has one."""
        from tiered_cache import admission

        d = self.config.daemon
        # NOTE: page pools live in host memory and page disks on the disk tier's filesystem:
        # `overcommit` names them by those tiers.
        asks = [admission.Ask(HostKind.name, "daemon.page_pool_mib", pool_bytes, admission.RAM,
                              f"the page pool of tenant {tenant!r} for a new page format "
                              f"({page_bytes:,}-byte pages)")]
        if d.page_disk_mib:
            from pathlib import Path

            from tiered_cache.sizing import held_bytes

            path = os.path.join(self._disk_section().path, tenant, "pages")
            held = held_bytes(Path(path) / digest.hex())      # reopened, not grown
            asks.append(admission.Ask(DiskKind.name, "daemon.page_disk_mib",
                                      d.page_disk_mib << 20, admission.FILESYSTEM,
                                      f"the page disk of tenant {tenant!r}", path, held=held))
        try:
            admission.check(asks, self.config.overcommit,
                            context=f" ({len(self._spaces)} page space(s) exist already)")
        except ConfigError as exc:
            raise PageSpaceError(str(exc)) from None

    def _disk_section(self):
        return getattr(self.config.tiers, DiskKind.name)

    def _format(self, digest: bytes, page_bytes: int) -> identity.PageFormat:
        """A stand-in format whose digest is the client's: the daemon never learns the
        engine's format fields, only their digest (what every record carries)."""
        return _DigestFormat(digest, page_bytes)

    def _disk(self, tenant: str, digest: bytes, page_bytes: int):
        d = self.config.daemon
        if not d.page_disk_mib:
            return None
        from tiered_cache.data.disk_layout import Layout
        from tiered_cache.pages.disk import PageDisk

        lay = Layout(digest, identity.IDENT_TOKENS, page_bytes)
        n = (d.page_disk_mib << 20) // (lay.header_stride + lay.payload_stride)
        if n < 1:
            raise PageSpaceError(f"daemon.page_disk_mib ({d.page_disk_mib} MiB) holds no page of "
                                 f"{page_bytes:,} bytes")
        path = os.path.join(self._disk_section().path, tenant, "pages")
        return PageDisk(path, num_pages=n, format=self._format(digest, page_bytes),
                        o_direct=self._disk_section().o_direct)

    def _remote(self, digest: bytes, page_bytes: int):
        remote = getattr(self.config.tiers, RemoteKind.name)
        if remote is None:
            return None
        from tiered_cache.pages.remote import PageRemote
        from tiered_cache.tiers.remote import connect

        store = connect(remote, namespace=digest, num_tokens=identity.IDENT_TOKENS,
                        payload_bytes=page_bytes, delete_corrupt=True)
        return PageRemote(store, self._format(digest, page_bytes))

    def space_of(self, state, space_id: int) -> PageSpace:
        space = self._by_id.get(space_id)
        if space is None or self._owner.get(space_id) != state.tenant \
                or space_id not in state.page_staging:
            raise PageSpaceError(f"page space {space_id} was not attached by this client "
                                 "(page_attach first)")
        return space

    # requests ---------------------------------------------------------------------------------

    def attach(self, state, f: dict[str, Any]) -> Response:
        if f["version"] != VERSION:
            raise VersionError(f"page ops version {f['version']} is not supported: this daemon "
                               f"speaks version {VERSION}")
        sid, space = self._space(state.tenant, f["format"], f["page_bytes"])
        with state.lock:
            staging = state.page_staging.get(sid)
            if staging is None:
                staging = SharedPool.create(PageGeometry(space.staging_slots, space.page_bytes),
                                            name=f"page-staging-{state.peer.client}",
                                            populate=False)
                state.page_staging[sid] = staging
            fds = [space.shared.client_fd(writable=False), staging.client_fd()]
        return Response({"version": VERSION, "space": sid,
                         "num_slots": space.geometry.num_slots,
                         "slot_stride": space.geometry.slot_stride,
                         "staging_slots": space.staging_slots}, fds=fds, close_fds=True)

    def exists(self, state, f: dict[str, Any]) -> dict[str, Any]:
        space = self.space_of(state, f["space"])
        return {"count": space.exists(f["parts"], f["keys"], f["deadline_ms"] / 1000)}

    def get(self, state, f: dict[str, Any]):
        space = self.space_of(state, f["space"])
        return space.get(f["part"], f["keys"], f["deadline_ms"] / 1000)

    def put(self, state, f: dict[str, Any]) -> dict[str, Any]:
        space = self.space_of(state, f["space"])
        with state.lock:
            staging = state.page_staging.get(f["space"])
            if staging is None:
                raise PageSpaceError("page_put needs the space's staging area: page_attach "
                                     "first")
            retained = staging.retain()     # a reap meanwhile unmaps it after the copy
        with retained:
            stored = space.put(f["part"], f["entries"], staging)
        return {"stored": [int(x) for x in stored]}

    # lifetime ---------------------------------------------------------------------------------

    def stats(self, tenant: str | None = None) -> dict[str, Any]:
        with self._lock:
            items = list(self._spaces.items())
        return {str(sid): {"tenant": t, "format": dg.hex(), **space.stats()}
                for (t, dg, _), (sid, space) in items if tenant is None or t == tenant}

    def close(self) -> None:
        with self._lock:
            spaces = [s for _, s in self._spaces.values()]
            self._spaces.clear()
            self._by_id.clear()
        for space in spaces:
            try:
                space.close()
            except Exception:
                log.exception("closing page space %s failed", space.tenant)


class _DigestFormat:
    """What PageDisk and PageRemote read of a format: its digest and page size."""

    def __init__(self, digest: bytes, page_bytes: int) -> None:
        self._digest = digest
        self.page_bytes = page_bytes

    def digest(self) -> bytes:
        return self._digest
