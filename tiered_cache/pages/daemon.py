"""DaemonPages: the page store's tier through the node daemon (the `page_*` ops).

KV bytes never cross the socket: `page_get` pins pages in the daemon's page pool and answers
their slots, and this process copies them out of its read-only mapping of that pool, then
releases the handle; `page_put` copies pages into this client's own staging area (a second
memfd), and the daemon copies them in. The daemon derives every root from the tenant the
socket's credentials name, so the client says only which part (TP rank, or the replicated
copy) it means.

Failures are misses: a daemon that is gone, slow or restarted answers "absent" / "not
stored", is counted and logged, and the next call connects and attaches again (a new
connection is a new client: nothing the old one held survives). A handle the daemon no longer
held when it was released (its lease expired meanwhile) voids what was copied under it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Sequence

from tiered_cache.pages.config import DAEMON
from tiered_cache.pages.identity import PageFormat
from tiered_cache.pages.payload import fill, gather_into
from tiered_cache.wire.client import Client, Heartbeat
from tiered_cache.wire.errors import DaemonError
from tiered_cache.wire.ops import MAX_PAGES, make_protocol
from tiered_cache.wire.pages import VERSION, PageGeometry
from tiered_cache.wire.shm import SharedPool

log = logging.getLogger(__name__)


class _Attachment:
    def __init__(self, generation: int, space: int, pool: SharedPool, staging: SharedPool,
                 num_slots: int, staging_slots: int, page_bytes: int) -> None:
        self.generation = generation
        self.space = space
        self.pool, self.staging = pool, staging
        self.pool_geo = PageGeometry(num_slots, page_bytes)
        self.staging_geo = PageGeometry(staging_slots, page_bytes)
        self.pool_buf = pool.buffer()
        self.staging_buf = staging.buffer()

    def close(self) -> None:
        for view in (self.pool_buf, self.staging_buf):
            try:
                view.release()
            except BufferError:     # pragma: no cover - a slice still alive
                pass
        self.pool.close()
        self.staging.close()


class DaemonPages:
    name = DAEMON
    shared = True               # every engine process of the node sees what it holds
    by_part = True              # names pages by part: the daemon derives the roots

    def __init__(self, socket_path: str, format: PageFormat, *, timeout_s: float = 5.0,
                 heartbeat: bool = True) -> None:
        self.format = format
        self.digest = format.digest()
        self.page_bytes = format.page_bytes
        self.timeout_s = timeout_s
        self.client = Client(socket_path, make_protocol(), timeout_s=timeout_s)
        self._lock = threading.RLock()
        self._att: _Attachment | None = None
        self._heartbeat: Heartbeat | None = None
        self._want_heartbeat = heartbeat
        self.counts = {"errors": 0, "voided": 0, "reattached": 0}
        try:
            self._attach()
        except DaemonError as exc:
            # NOTE: a daemon that is not up yet is not a reason not to serve: every call
            # misses until it answers, and attaches then.
            log.warning("page store: the daemon at %s is not answering (%s); pages miss "
                        "until it does", socket_path, exc)

    # attachment -------------------------------------------------------------------------------

    def _attach(self) -> _Attachment:
        with self._lock:
            att = self._att
            if att is not None and att.generation == self.client.generation \
                    and self.client.connected:
                return att
            if att is not None:
                self._att = None
                att.close()
                self.counts["reattached"] += 1
            hello = self.client.call("hello")
            reply = self.client.request("page_attach", {"version": VERSION,
                                                        "format": self.digest,
                                                        "page_bytes": self.page_bytes})
            f = reply.fields
            fds, reply.fds = list(reply.fds), []
            pool = staging = None
            try:
                if len(fds) != 2:
                    raise DaemonError(f"page_attach sent {len(fds)} fds, expected 2")
                if f["slot_stride"] != PageGeometry(1, self.page_bytes).slot_stride:
                    raise DaemonError(f"the daemon's page slot stride {f['slot_stride']} "
                                      "differs from ours")
                pool = SharedPool.attach(fds.pop(0), PageGeometry(f["num_slots"],
                                                                  self.page_bytes),
                                         writable=False)
                staging = SharedPool.attach(fds.pop(0),
                                            PageGeometry(f["staging_slots"], self.page_bytes))
            except BaseException:
                for area in (pool, staging):
                    if area is not None:
                        area.close()
                raise
            finally:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            att = _Attachment(self.client.generation, f["space"], pool, staging,
                              f["num_slots"], f["staging_slots"], self.page_bytes)
            self._att = att
            if self._want_heartbeat and self._heartbeat is None:
                self._heartbeat = Heartbeat(self.client, hello["lease_s"]).start()
            return att

    def _failed(self, what: str, exc: BaseException) -> None:
        with self._lock:
            self.counts["errors"] += 1
        log.log(logging.WARNING if self.counts["errors"] <= 3 else logging.DEBUG,
                "page store: daemon %s failed: %s", what, exc)

    # the tier ---------------------------------------------------------------------------------

    def exists_parts(self, parts: Sequence[bytes], engine_keys: Sequence[bytes],
                     deadline_s: float) -> int:
        """Leading keys present for every part."""
        if not engine_keys:
            return 0
        try:
            att = self._attach()
            n = 0
            for a in range(0, len(engine_keys), MAX_PAGES):
                chunk = list(engine_keys[a:a + MAX_PAGES])
                got = self.client.request("page_exists", {
                    "space": att.space, "parts": list(parts), "keys": chunk,
                    "deadline_ms": int(max(0.0, deadline_s) * 1000)},
                    timeout_s=self.timeout_s + deadline_s).fields["count"]
                n += got
                if got < len(chunk):
                    break
            return n
        except DaemonError as exc:
            self._failed("page_exists", exc)
            return 0

    def get(self, part: bytes, engine_keys: Sequence[bytes],
            outs: Sequence[tuple[memoryview, ...]], deadline_s: float = 1.0) -> list[bool]:
        ok = [False] * len(engine_keys)
        try:
            att = self._attach()
            for a in range(0, len(engine_keys), MAX_PAGES):
                chunk = list(engine_keys[a:a + MAX_PAGES])
                f = self.client.request("page_get", {
                    "space": att.space, "part": part, "keys": chunk,
                    "deadline_ms": int(deadline_s * 1000)},
                    timeout_s=self.timeout_s + deadline_s).fields
                slots = f["slots"]
                for j, slot in enumerate(slots):
                    fill(outs[a + j], att.pool_geo.slot(att.pool_buf, slot))
                held = True
                if f["handle"]:
                    held = self.client.call("release", handle=f["handle"])["held"]
                if not held:
                    # NOTE: the lease expired between the reply and the release: the daemon
                    # may have reused those slots while we copied, so the copies are void.
                    with self._lock:
                        self.counts["voided"] += len(slots)
                    return ok
                for j in range(len(slots)):
                    ok[a + j] = True
                if len(slots) < len(chunk):
                    break
        except DaemonError as exc:
            self._failed("page_get", exc)
        return ok

    def put(self, part: bytes, engine_keys: Sequence[bytes],
            payloads: Sequence[tuple[memoryview, ...]]) -> list[bool]:
        ok = [False] * len(engine_keys)
        try:
            att = self._attach()
            per = att.staging_geo.num_slots
            for a in range(0, len(engine_keys), per):
                idx = range(a, min(a + per, len(engine_keys)))
                with self._lock:            # one staging area: one put at a time
                    for j, i in enumerate(idx):
                        gather_into(att.staging_geo.slot(att.staging_buf, j), payloads[i])
                    stored = self.client.call("page_put", space=att.space, part=part, entries=[
                        {"slot": j, "key": bytes(engine_keys[i])} for j, i in enumerate(idx)]
                    )["stored"]
                for j, i in enumerate(idx):
                    ok[i] = bool(stored[j])
        except DaemonError as exc:
            self._failed("page_put", exc)
        return ok

    def stats(self) -> dict:
        with self._lock:
            out = dict(self.counts)
        out["connected"] = self.client.connected
        return out

    def close(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.stop(1.0)
        with self._lock:
            if self._att is not None:
                self._att.close()
                self._att = None
        self.client.close()
