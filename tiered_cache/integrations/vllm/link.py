"""One side's connection to the node service: hello, attach, heartbeats, roots, and the ops the
connector uses (fetch / release / publish), with reconnects in the background.

Two transports carry the same ops to the same handlers (daemon/service.py `NodeService`):
- `SocketTransport`: a `wire.client.Client` over the Unix socket of `tiered-cache serve` or
  of an embedded service in another process (SO_PEERCRED admits it, the kernel reaps it);
- `LocalTransport`: direct calls of `NodeService.handle` in the process that runs the
  embedded service (no framing, no socket: the scheduler's lookup stays far under a
  millisecond). It is a client like any other: a lease, handles reaped when it closes.

NOTE: nothing on the scheduler's critical path connects. `start()` tries once without
waiting long; afterwards the `tc-vllm-link` thread renews the lease and reattaches with a
backoff (0.1 s doubling to 2 s) while the daemon is away. Until then every op answers a miss
at once. A new connection is a new client: the handles of the old one are gone (the daemon
reaped them), so every handle carries the generation it was taken under.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from tiered_cache.hashing import BlockHasher, Namespace
from tiered_cache.integrations.vllm.identity import Geometry
from tiered_cache.wire.client import Client
from tiered_cache.wire.errors import (
    DaemonError,
    DaemonTimeoutError,
    DaemonUnavailableError,
    LeaseExpiredError,
)
from tiered_cache.wire.ops import make_protocol
from tiered_cache.wire.peer import Peer
from tiered_cache.wire.protocol import Request
from tiered_cache.wire.shm import PoolGeometry, SharedPool
from tiered_cache.wire.transport import Response

log = logging.getLogger(__name__)

_LOCAL_IDS = itertools.count(1 << 62)   # client ids of in-process clients: never a socket's
_MAX_ROOTS = 1 << 16


class NamespaceMismatch(DaemonError):
    """The daemon serves another model, dtype, geometry or block size than this engine."""

    wire_type = "vllm_namespace"


def namespace_digest(geometry: Geometry) -> bytes:
    g = geometry
    return BlockHasher(Namespace(g.model, g.dtype, g.num_layers, g.num_kv_heads, g.head_dim,
                                 g.block_size, None)).namespace_digest()


# ------------------------------------------------------------------------------- transports

class SocketTransport:
    def __init__(self, path: str, timeout_s: float) -> None:
        self.path = path
        self.client = Client(path, make_protocol(), timeout_s=timeout_s)

    def request(self, op: str, fields: Mapping[str, Any], timeout_s: float
                ) -> tuple[dict[str, Any], list[int]]:
        reply = self.client.request(op, fields, timeout_s=timeout_s)
        return reply.fields, list(reply.fds)

    @property
    def connected(self) -> bool:
        return self.client.connected

    def close(self) -> None:
        self.client.close()

    def describe(self) -> str:
        return self.path


class LocalTransport:
    """The ops as calls of an in-process NodeService's handler, as a client of its own."""

    def __init__(self, service, name: str = "local") -> None:
        self.service = service
        self.peer = Peer(next(_LOCAL_IDS), os.getpid(), os.geteuid(), os.getegid())
        self.name = name
        self._open = True

    def request(self, op: str, fields: Mapping[str, Any], timeout_s: float
                ) -> tuple[dict[str, Any], list[int]]:
        if not self._open:
            raise DaemonUnavailableError(f"{self.name}: closed")
        if not self.service.server.serving:
            raise DaemonUnavailableError(f"{self.name}: the embedded service has stopped")
        out = self.service.handle(self.peer, Request(op, 0, dict(fields)))
        if isinstance(out, Response):
            return dict(out.fields), list(out.fds)
        return dict(out or {}), []

    @property
    def connected(self) -> bool:
        return self._open

    def close(self) -> None:
        if self._open:
            self._open = False
            self.service.leases.close(self.peer.client)     # reaped like a closed socket

    def describe(self) -> str:
        return f"{self.name} (in process)"


# ------------------------------------------------------------------------------- the link

class DaemonLink:
    """A connection to the node service for one side of the connector.

    `connect()` makes a transport (a new client each time). `attach`: map the tenant's pool
    (read-only) and this client's staging area (workers copy through them; the scheduler side
    needs neither)."""

    def __init__(self, connect: Callable[[], Any], geometry: Geometry, *, attach: bool,
                 timeout_s: float, name: str) -> None:
        self._connect = connect
        self.geometry = geometry
        self.want_attach = attach
        self.timeout_s = timeout_s
        self.name = name
        self.namespace = namespace_digest(geometry)
        self._lock = threading.Lock()
        self._transport = None
        self.pool: SharedPool | None = None
        self.staging: SharedPool | None = None
        self.generation = 0
        self.lease_s = 10.0
        self.tenant = ""
        self.staging_slots = 0
        self._roots: dict[tuple[bytes, str | None], bytes] = {}
        self.counters = {"attaches": 0, "attach_failures": 0, "lost": 0, "errors": 0,
                         "timeouts": 0, "refused": 0}
        self.last_error = ""
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._attached = threading.Event()
        self._thread: threading.Thread | None = None

    # lifetime ---------------------------------------------------------------------------------

    @property
    def attached(self) -> bool:
        return self._transport is not None

    def start(self, *, wait_s: float = 0.0) -> DaemonLink:
        """Try to attach (for up to `wait_s`), then keep the link in the background."""
        if self._thread is None:
            self._try_attach()
            self._thread = threading.Thread(target=self._run, name=f"tc-vllm-link-{self.name}",
                                            daemon=True)
            self._thread.start()
        if wait_s > 0:
            self.wait_attached(wait_s)
        return self

    def wait_attached(self, timeout_s: float) -> bool:
        """Wait (bounded) until attached; whether it is."""
        if self.attached:
            return True
        self._wake.set()
        self._attached.wait(timeout_s)
        return self.attached

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        with self._lock:
            old = (self._transport, self.pool, self.staging)
            self._transport = self.pool = self.staging = None
            self._attached.clear()
        _close_all(*old)

    def _try_attach(self) -> bool:
        try:
            self._attach()
            return True
        except NamespaceMismatch as exc:
            self.counters["attach_failures"] += 1
            if self.last_error != str(exc):
                log.error("%s: %s", self.name, exc)
            self.last_error = str(exc)
        except Exception as exc:         # noqa: BLE001 - the daemon may not be up yet
            self.counters["attach_failures"] += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.debug("%s: attach failed: %s", self.name, exc)
        return False

    def _attach(self) -> None:
        transport = self._connect()
        pool = staging = None
        try:
            hello, _ = transport.request("hello", {}, self.timeout_s)
            if hello["namespace"] != self.namespace:
                g = self.geometry
                raise NamespaceMismatch(
                    f"the daemon at {transport.describe()} serves another model, KV dtype, "
                    f"geometry or block size than this engine; its config needs model: "
                    f"{g.model_section()} and block_size: {g.block_size}")
            n_staging = 0
            if self.want_attach:
                fields, fds = transport.request("attach", {}, self.timeout_s)
                fields = dict(fields)
                n_staging = fields.pop("staging_slots")
                if len(fds) != 2:
                    _close_fds(fds)
                    raise DaemonError(f"attach sent {len(fds)} file descriptors, expected 2")
                g = PoolGeometry.from_fields(fields)
                want = self.geometry
                if (g.num_layers, g.block_size, g.num_kv_heads, g.head_dim, g.dtype) != (
                        want.num_layers, want.block_size, want.num_kv_heads, want.head_dim,
                        want.dtype):
                    _close_fds(fds)
                    raise NamespaceMismatch(f"the daemon's pool geometry {g} differs from this "
                                            f"engine's {want}")
                try:
                    pool = SharedPool.attach(fds[0], g, writable=False)
                except BaseException:
                    _close_fds(fds[1:])
                    raise
                staging = SharedPool.attach(fds[1], PoolGeometry(
                    n_staging, g.num_layers, g.block_size, g.num_kv_heads, g.head_dim, g.dtype))
        except BaseException:
            for p in (pool, staging):
                if p is not None:
                    p.close()
            transport.close()
            raise
        with self._lock:
            old = (self._transport, self.pool, self.staging)
            self._transport, self.pool, self.staging = transport, pool, staging
            self.generation += 1
            self._roots.clear()
            self.lease_s = float(hello["lease_s"])
            self.tenant = hello["tenant"]
            self.staging_slots = n_staging or int(hello.get("staging_slots", 0))
            self.counters["attaches"] += 1
            self._attached.set()
        _close_all(*old)
        log.info("%s: attached to %s (tenant %s, generation %d)", self.name,
                 transport.describe(), self.tenant, self.generation)

    def _lost(self, transport, exc: BaseException) -> None:
        with self._lock:
            if self._transport is not transport or transport is None:
                return
            old = (self._transport, self.pool, self.staging)
            self._transport = self.pool = self.staging = None
            self._attached.clear()
            self._roots.clear()
            self.counters["lost"] += 1
        self.last_error = f"{type(exc).__name__}: {exc}"
        log.warning("%s: lost the daemon (%s); misses until it is back", self.name, exc)
        _close_all(*old)
        self._wake.set()

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            transport = self._transport
            if transport is None:
                if self._try_attach():
                    backoff = 0.1
                    continue
                self._wake.wait(backoff)
                self._wake.clear()
                backoff = min(2.0, backoff * 2)
                continue
            if self._stop.wait(self.lease_s / 3):
                return
            if self._transport is not transport:
                continue
            try:
                transport.request("heartbeat", {}, self.timeout_s)
            except Exception as exc:     # noqa: BLE001 - gone, or reaped: reattach
                self._lost(transport, exc)

    # ops --------------------------------------------------------------------------------------

    def call(self, op: str, timeout_s: float | None = None, **fields: Any
             ) -> tuple[dict[str, Any] | None, int]:
        """(reply fields, generation), or (None, generation) when the daemon is away or the
        request failed (counted; a lost connection is given up and reattached)."""
        with self._lock:
            transport, gen = self._transport, self.generation
        if transport is None:
            return None, gen
        try:
            out, fds = transport.request(op, fields, self.timeout_s if timeout_s is None
                                         else timeout_s)
            _close_fds(fds)
            return out, gen
        except (DaemonUnavailableError, LeaseExpiredError) as exc:
            self.counters["timeouts" if isinstance(exc, DaemonTimeoutError) else "errors"] += 1
            self._lost(transport, exc)
        except DaemonError as exc:
            self.counters["refused"] += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.debug("%s: %s refused: %s", self.name, op, exc)
            if not getattr(transport, "connected", True):
                self._lost(transport, exc)
        except Exception as exc:         # noqa: BLE001 - a handler's bug: a miss, counted
            self.counters["errors"] += 1
            self.last_error = f"{type(exc).__name__}: {exc}"
            log.exception("%s: %s failed", self.name, op)
        return None, gen

    def root(self, salt: bytes, adapter: str | None, timeout_s: float | None = None
             ) -> tuple[bytes | None, int]:
        """The daemon's root key of (salt, adapter) in this client's tenant (cached per
        connection), and the generation it belongs to."""
        gen = self.generation
        found = self._roots.get((salt, adapter))
        if found is not None:
            return found, gen
        fields: dict[str, Any] = {"salt": salt}
        if adapter is not None:
            fields["adapter"] = adapter
        reply, gen = self.call("root", timeout_s, **fields)
        if reply is None:
            return None, gen
        with self._lock:
            if gen == self.generation:
                if len(self._roots) >= _MAX_ROOTS:
                    self._roots.clear()
                self._roots[(salt, adapter)] = reply["root"]
        return reply["root"], gen

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "attached": self.attached, "generation": self.generation,
                "tenant": self.tenant, "last_error": self.last_error}


def _close_fds(fds) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _close_all(transport, pool, staging) -> None:
    for p in (pool, staging):
        if p is not None:
            p.close()
    if transport is not None:
        with contextlib.suppress(Exception):
            transport.close()


def deadline_left(deadline: float) -> float:
    return max(0.0, deadline - time.monotonic())
