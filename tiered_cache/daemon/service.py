"""The node service: the handlers of wire/ops.py over the tenants' partitions.

Who a client is comes from the kernel (SO_PEERCRED, checked against the allowlist by the
transport); which tenant it belongs to from `daemon.tenants` ("uid:N" / "gid:N" -> name; by
default every uid is its own tenant, "uid-N"). A client holds, for as long as its lease lives:
its handles (pins on blocks it is copying out of the pool), and its staging area (the shared
pages it copies blocks to publish into). When its connection closes (a SIGKILL closes it too)
or its lease passes, the lease table calls `_expired` once, which closes every handle, unmaps
the staging area and closes the connection (telling it `lease_expired`).

Every connection holds a lease from the moment it is accepted: `daemon.hello_timeout_s` until
its `hello`, `daemon.lease_s` after. NOTE: so no connection holds one of `max_clients` slots
for longer than its lease without renewing it: peers that never say hello, and clients reaped
while silent, are disconnected, and cannot lock the others out.

NOTE: a handle added after the reap would pin blocks forever, so every change to a client's
handles happens under its lock and checks `reaped` first; the reap takes the same lock.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any

from tiered_cache import admission
from tiered_cache.config import CacheConfig
from tiered_cache.core.sequence import Sequence
from tiered_cache.daemon.leases import LeaseTable
from tiered_cache.daemon.page_ops import PageService
from tiered_cache.daemon.pages import PageHold
from tiered_cache.daemon.partition import Partition, namespace_of, partition_asks, pool_bytes
from tiered_cache.hashing import BlockHasher, tenant_salt
from tiered_cache.wire.errors import LeaseExpiredError, OverloadedError, UnauthorizedError
from tiered_cache.wire.ops import make_protocol
from tiered_cache.wire.peer import Allowlist, Peer
from tiered_cache.wire.protocol import Request
from tiered_cache.wire.shm import PoolGeometry, SharedPool
from tiered_cache.wire.transport import Response, Server, ServerConfig

log = logging.getLogger(__name__)

MAX_HANDLES = 4096          # open handles per client


@dataclass(eq=False)
class ClientState:
    peer: Peer
    tenant: str
    partition: Partition
    staging: SharedPool | None = None
    handles: dict[int, Sequence | PageHold] = field(default_factory=dict)
    page_staging: dict[int, SharedPool] = field(default_factory=dict)   # page space -> area
    reaped: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class NodeService:
    """Partitions, clients and the request handlers; `server` is the transport serving them."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        d = config.daemon
        tenants = self._known_tenants()
        # every partition built at start, checked together before the first is allocated
        admission.check([a for t in tenants for a in partition_asks(config, t)],
                        config.overcommit,
                        context=admission.partitions_context(len(tenants), 0,
                                                             pool_bytes(config)))
        self.namespace = BlockHasher(namespace_of(config)).namespace_digest()
        self.partitions: dict[str, Partition] = {}
        self._build = threading.Lock()
        self._clients: dict[int, ClientState] = {}
        self._lock = threading.Lock()
        self._handles = itertools.count(1)
        self.counters = {"reaped_clients": 0, "released_handles": 0, "reaped_handles": 0,
                         "closed_connections": 0}
        self.pages = PageService(config)
        self.leases = LeaseTable(d.lease_s, self._expired)
        allow = (Allowlist.of(d.allow_uids, d.allow_gids)
                 if d.allow_uids or d.allow_gids else None)
        self.server = Server(make_protocol(d.max_frame_mib << 20), self.handle,
                             ServerConfig(d.socket, allow=allow, max_clients=d.max_clients,
                                          socket_mode=d.socket_mode),
                             connected=self._connected, disconnected=self._disconnected)
        self.started = time.time()
        for tenant in tenants:
            self.partition(tenant)

    def _known_tenants(self) -> list[str]:
        """Partitions are built at start for every tenant that can be known in advance (so that
        a client's hello does not wait for a pool to be mapped and a disk to be recovered):
        the configured ones, and the daemon's own user's when only it is admitted."""
        d = self.config.daemon
        tenants = set(d.tenants.values())
        if not d.allow_uids and not d.allow_gids:
            tenants.add(self.tenant_of(Peer(0, 0, os.geteuid(), os.getegid())))
        return sorted(tenants)

    # lifetime ---------------------------------------------------------------------------------

    def start(self) -> NodeService:
        self.leases.start()
        self.server.start()
        return self

    def stop(self, *, drain: bool = True) -> None:
        """Stop accepting, finish the requests being served, release every client, write the
        pools to disk (`drain`), close the partitions."""
        self.server.stop()
        self.leases.stop()
        with self._lock:
            clients = list(self._clients.values())
            self._clients.clear()
        for c in clients:
            self._release_all(c)
        for p in list(self.partitions.values()):
            p.close(drain=drain)
        self.pages.close()

    def partition(self, tenant: str) -> Partition:
        found = self.partitions.get(tenant)
        if found is not None:
            return found
        with self._build:
            found = self.partitions.get(tenant)
            if found is None:
                found = Partition(tenant, self.config, existing=len(self.partitions))
                self.partitions[tenant] = found
                log.info("partition %s", found.describe())
            return found

    def tenant_of(self, peer: Peer) -> str:
        """The tenant of a peer: its uid's entry in daemon.tenants, else its gid's, else its
        own ("uid-N")."""
        tenants = self.config.daemon.tenants
        return tenants.get(f"uid:{peer.uid}") or tenants.get(f"gid:{peer.gid}") \
            or f"uid-{peer.uid}"

    # clients ----------------------------------------------------------------------------------

    def _state(self, peer: Peer) -> ClientState:
        with self._lock:
            state = self._clients.get(peer.client)
        if state is None or state.reaped:
            raise LeaseExpiredError(f"{peer} holds no lease (say hello first; after a lease "
                                    "expired, reconnect)")
        return state

    def _connected(self, peer: Peer) -> None:
        self.leases.grant(peer.client, self.config.daemon.hello_timeout_s)

    def _disconnected(self, peer: Peer) -> None:
        self.leases.close(peer.client)

    def _expired(self, client: Hashable) -> None:
        with self._lock:
            state = self._clients.pop(client, None)     # type: ignore[call-overload]
        if state is not None:
            n = self._release_all(state)
            with self._lock:
                self.counters["reaped_clients"] += 1
                self.counters["reaped_handles"] += n
            log.info("%s (tenant %s): reaped, %d handles released", state.peer, state.tenant, n)
        said = "its lease expired" if state is not None else \
            f"no hello within daemon.hello_timeout_s ({self.config.daemon.hello_timeout_s} s)"
        if self.server.close_client(client, LeaseExpiredError(  # type: ignore[arg-type]
                f"{said}: the daemon closed the connection (reconnect and say hello)")):
            with self._lock:
                self.counters["closed_connections"] += 1

    def _release_all(self, state: ClientState) -> int:
        with state.lock:
            state.reaped = True
            handles = list(state.handles.values())
            state.handles.clear()
            staging, state.staging = state.staging, None
            stagings = [staging, *state.page_staging.values()]
            state.page_staging.clear()
        for seq in handles:
            self._release(state, seq)
        for area in stagings:
            if area is not None:
                area.close()
        return len(handles)

    @staticmethod
    def _release(state: ClientState, held: Sequence | PageHold) -> None:
        if isinstance(held, PageHold):
            held.release()
        else:
            state.partition.release(held)

    # requests ---------------------------------------------------------------------------------

    def handle(self, peer: Peer, req: Request) -> dict[str, Any] | Response | None:
        op, f = req.op, req.fields
        if op == "hello":
            return self._hello(peer)
        state = self._state(peer)
        part = state.partition
        if op == "heartbeat":
            return {"expires_in_s": self.leases.renew(peer.client) - time.monotonic()}
        if op == "attach":
            return self._attach(state)
        if op == "root":
            salt = tenant_salt(state.tenant.encode(), f.get("salt", b""))
            return {"root": part.root(salt, f.get("adapter"))}
        if op == "fetch":
            return self._fetch(state, f)
        if op == "release":
            with state.lock:
                seq = state.handles.pop(f["handle"], None)
            if seq is not None:
                try:
                    self._release(state, seq)
                except BaseException:
                    # not released: the lease keeps it, and its reap releases it
                    with state.lock:
                        keep = not state.reaped and not seq.closed
                        if keep:
                            state.handles[f["handle"]] = seq
                    if not keep and not seq.closed:
                        with contextlib.suppress(Exception):    # reaped meanwhile: try again
                            self._release(state, seq)
                    raise
                with self._lock:
                    self.counters["released_handles"] += 1
            return {"held": seq is not None}
        if op == "publish":
            with state.lock:
                if state.reaped:
                    raise LeaseExpiredError("the lease expired: reconnect")
                if state.staging is None:
                    raise UnauthorizedError("publish needs the staging area: attach first")
                # NOTE: retained under the client's lock, which the reap takes before it closes
                # the area: a reap during the copy unmaps it only after the copy (use after
                # unmap: SIGSEGV, or another mapping's bytes published as this client's KV).
                retained = state.staging.retain()
            with retained as staging:
                taken = part.publish(f["root"], f["entries"], staging)
            return {"taken": [int(x) for x in taken]}
        if op == "lookup":
            return {"blocks": part.lookup(f["root"], f["parent"], f["tokens"])}
        if op == "invalidate":
            return {"blocks": part.invalidate(f["root"], f["tokens"])}
        if op == "stats":
            return {"json": json.dumps(self.client_stats(state), default=str)}
        if op.startswith("page_"):
            return self._page_op(state, op, f)
        raise AssertionError(f"no handler for {op}")

    def _page_op(self, state: ClientState, op: str, f: dict[str, Any]) -> Any:
        if op == "page_attach":
            return self.pages.attach(state, f)
        if op == "page_exists":
            return self.pages.exists(state, f)
        if op == "page_put":
            return self.pages.put(state, f)
        assert op == "page_get", op
        with state.lock:
            if len(state.handles) >= MAX_HANDLES:
                raise OverloadedError(f"{MAX_HANDLES} handles open: release some first")
        hold, slots = self.pages.get(state, f)
        if hold is None:
            return {"handle": 0, "slots": []}
        handle = next(self._handles)
        with state.lock:
            if not state.reaped:
                state.handles[handle] = hold
                return {"handle": handle, "slots": slots}
        hold.release()                      # reaped while loading: give the pins back
        raise LeaseExpiredError("the lease expired while loading pages")

    def _hello(self, peer: Peer) -> dict[str, Any]:
        tenant = self.tenant_of(peer)
        part = self.partition(tenant)
        with self._lock:
            known = peer.client in self._clients
        if not known:
            # the connection's lease until hello becomes a full one (LeaseExpiredError if its
            # socket closed meanwhile), and only then the client's state. A peer the transport
            # did not admit (an in-process client: integrations/vllm/link.LocalTransport), or
            # whose hello deadline has just been reaped (its connection is closing, and is
            # reaped again when it has), gets a lease of its own.
            if peer.client in self.leases:
                self.leases.renew(peer.client)
            else:
                self.leases.grant(peer.client)
            with self._lock:
                known = peer.client in self._clients
                if not known:
                    self._clients[peer.client] = ClientState(peer, tenant, part)
            if peer.client not in self.leases:      # expired in between: reaped already
                with self._lock:
                    self._clients.pop(peer.client, None)
                raise LeaseExpiredError("the lease ended during hello: reconnect")
            if not known:
                log.info("%s: hello, tenant %s", peer, tenant)
        return {"client": peer.client, "lease_s": float(self.leases.lease_s), "tenant": tenant,
                "salt": tenant.encode(), "namespace": self.namespace,
                "staging_slots": self.config.daemon.staging_blocks, "pid": peer.pid}

    def _attach(self, state: ClientState) -> Response:
        part = state.partition
        with state.lock:
            if state.staging is None:
                g = part.geometry
                state.staging = SharedPool.create(
                    PoolGeometry(self.config.daemon.staging_blocks, g.num_layers, g.block_size,
                                 g.num_kv_heads, g.head_dim, g.dtype),
                    name=f"staging-{state.peer.client}", populate=False)
            fds = [part.shared.client_fd(writable=False), state.staging.client_fd()]
        return Response({**part.geometry.fields(), "staging_slots": state.staging.geometry
                         .num_slots}, fds=fds, close_fds=True)

    def _fetch(self, state: ClientState, f: dict[str, Any]) -> dict[str, Any]:
        with state.lock:
            if len(state.handles) >= MAX_HANDLES:
                raise OverloadedError(f"{MAX_HANDLES} handles open: release some first")
        seq, slots = state.partition.fetch(f["root"], f["parent"], f["tokens"],
                                           f["wait_ms"] / 1000)
        if seq is None:
            return {"handle": 0, "slots": []}
        kept = False
        try:
            handle = next(self._handles)
            with state.lock:
                if not state.reaped:
                    state.handles[handle] = seq     # the lease's from here: a reap releases it
                    kept = True
                    return {"handle": handle, "slots": slots}
        finally:
            if not kept:
                # reaped while fetching, or a failure before the handle was kept (a
                # MemoryError): the pins go back
                state.partition.release(seq)
        raise LeaseExpiredError("the lease expired while fetching")

    # introspection ----------------------------------------------------------------------------

    def client_stats(self, state: ClientState) -> dict[str, Any]:
        """What a client may see: its own tenant's partition, and the service's counters."""
        return {"tenant": state.tenant, "partition": state.partition.stats(),
                "pages": self.pages.stats(state.tenant),
                "service": self.stats(partitions=False)}

    def stats(self, *, partitions: bool = True) -> dict[str, Any]:
        with self._lock:
            clients = list(self._clients.values())
            counters = dict(self.counters)
        out: dict[str, Any] = {
            "uptime_s": time.time() - self.started, "clients": len(clients),
            "handles": sum(len(c.handles) for c in clients), **counters,
            "server": self.server.stats(), "leases": self.leases.stats(),
        }
        if partitions:
            out["partitions"] = {name: p.stats() for name, p in list(self.partitions.items())}
            out["page_spaces"] = self.pages.stats()
        return out

    def healthy(self) -> tuple[bool, str]:
        """(ok, why): serving, no partition refusing every request (its index torn: a commit
        section cut by an exception nothing could defer, or by running out of memory; only a
        restart serves its tenant again), and no background thread of any partition dead."""
        if not self.server.serving:
            return False, "not serving"
        broken = [f"{p.tenant}: {p.index.broken}" for p in list(self.partitions.values())
                  if p.index.broken is not None]
        if broken:
            return False, f"partitions refusing every request (restart the daemon): {broken}"
        dead = [f"{p.tenant}/{name}" for p in list(self.partitions.values())
                for name, t in p.health.summary().items() if not t["alive"]]
        if dead:
            return False, f"background threads dead: {dead}"
        return True, "ok"
