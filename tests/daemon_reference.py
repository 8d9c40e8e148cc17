"""A reference daemon over the wire layer, run as a real process by the tests and benchmarks
(not part of the wheel: benchmarks import it with the repository root on sys.path).

It wires protocol, transport, leases and (with `--pool`) the shared pool together the way the
node service will, with ops that expose what the tests check: who the peer is (SO_PEERCRED),
the server's counters, the disconnect and lease-expiry events, and the pool's fd. It holds no
KV index; it is not the service.

    python tests/daemon_reference.py --socket DIR/daemon.sock [--allow-uid N] \\
        [--lease-s 10] [--max-frame 1048576] [--pool SLOTS,LAYERS,BLOCK,HEADS,DIM,DTYPE]

It prints `READY <pid>` once it listens and stops gracefully on SIGTERM or SIGINT.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Hashable, Sequence
from pathlib import Path
from typing import Any

from tiered_cache.daemon.leases import LeaseTable
from tiered_cache.daemon.process import DaemonProcess
from tiered_cache.wire.errors import DaemonError, LeaseExpiredError, register_error
from tiered_cache.wire.peer import Allowlist, Peer
from tiered_cache.wire.protocol import (
    DEFAULT_MAX_FRAME,
    MAX_ID,
    Bool,
    Bytes,
    Float,
    Int,
    IntArray,
    IntList,
    ListOf,
    MapOf,
    Op,
    Protocol,
    Request,
    Str,
    Struct,
    key,
)
from tiered_cache.wire.shm import GEOMETRY_FIELDS, PoolGeometry, SharedPool
from tiered_cache.wire.transport import Response, Server, ServerConfig

log = logging.getLogger(__name__)

_U32 = Int(0, 2**32 - 1)
_PEER = {"client": Int(0, MAX_ID), "pid": Int(0, 2**31 - 1), "uid": _U32, "gid": _U32}
_COUNTS = MapOf(Int(0, MAX_ID), max_len=256)
ECHO_FIELDS = {
    "n": Int(-2**63, 2**63 - 1, optional=True), "f": Float(-1e300, 1e300, optional=True),
    "s": Str(1024, optional=True), "b": Bytes(65536, optional=True),
    "flag": Bool(optional=True), "ints": IntList(-2**31, 2**31 - 1, 4096, optional=True),
    "tokens": IntArray(0, 2**31 - 1, 262_144, optional=True),
    "keys": ListOf(key(), 4096, optional=True),
    "nested": Struct({"a": Int(0, 10), "b": Str(8)}, optional=True),
}
OPS = [
    Op("ping", doc="no-op round trip"),
    Op("echo", ECHO_FIELDS, ECHO_FIELDS, doc="returns its fields"),
    Op("whoami", reply=_PEER, doc="the peer as the daemon sees it"),
    Op("peers", reply={"peers": ListOf(Struct(_PEER), 4096)}),
    Op("stats", reply={"server": _COUNTS, "rejected": _COUNTS, "errors": _COUNTS,
                       "failures": _COUNTS, "leases": _COUNTS}),
    Op("hello", reply={"client": Int(0, MAX_ID), "lease_s": Float(0.0, 1e6)},
       doc="grants this connection a lease"),
    Op("heartbeat", reply={"expires_in_s": Float(-1e6, 1e6)}),
    Op("events", reply={"events": ListOf(Struct({"kind": Str(16), "client": Int(0, MAX_ID)}),
                                         1 << 20)}),
    Op("attach", {"writable": Bool()}, GEOMETRY_FIELDS, doc="the pool's fd, with SCM_RIGHTS"),
    Op("fail", {"how": Str(16, choices=("internal", "lease", "bad_reply"))}, {"x": Int(0, 1)}),
    Op("sleep", {"ms": Int(0, 60_000)}),
]


@register_error
class NoPoolError(DaemonError):
    """The daemon was started without --pool."""

    wire_type = "no_pool"


def make_protocol(max_frame: int = DEFAULT_MAX_FRAME) -> Protocol:
    return Protocol(OPS, max_frame=max_frame)


class ReferenceService:
    """The handlers of OPS, the lease table and the event log."""

    def __init__(self, lease_s: float, pool: Any = None) -> None:
        self.pool = pool
        self.leases = LeaseTable(lease_s, self._expired)
        self.server: Server | None = None
        self.events: list[tuple[str, int]] = []
        self._lock = threading.Lock()

    def _event(self, kind: str, client: int) -> None:
        with self._lock:
            self.events.append((kind, client))

    def _expired(self, client: Hashable) -> None:
        assert isinstance(client, int)
        self._event("expired", client)

    def disconnected(self, peer: Peer) -> None:
        self._event("disconnected", peer.client)
        self.leases.close(peer.client)

    def handle(self, peer: Peer, req: Request) -> dict[str, Any] | Response | None:
        op, f = req.op, req.fields
        if op == "ping":
            return None
        if op == "echo":
            return f
        if op == "whoami":
            return {"client": peer.client, "pid": peer.pid, "uid": peer.uid, "gid": peer.gid}
        assert self.server is not None
        if op == "peers":
            return {"peers": [vars(p) for p in self.server.peers()]}
        if op == "stats":
            s = self.server.stats()
            flat = {k: v for k, v in s.items() if isinstance(v, int)}
            return {"server": flat, "rejected": s["rejected"], "errors": s["errors"],
                    "failures": s["failures"], "leases": self.leases.stats()}
        if op == "hello":
            self.leases.grant(peer.client)
            return {"client": peer.client, "lease_s": float(self.leases.lease_s)}
        if op == "heartbeat":
            return {"expires_in_s": self.leases.renew(peer.client) - time.monotonic()}
        if op == "events":
            with self._lock:
                return {"events": [{"kind": k, "client": c} for k, c in self.events]}
        if op == "attach":
            if self.pool is None:
                raise NoPoolError("this daemon was started without --pool")
            fd = self.pool.client_fd(writable=f["writable"])
            return Response(self.pool.geometry.fields(), fds=[fd], close_fds=True)
        if op == "fail":
            if f["how"] == "lease":
                raise LeaseExpiredError("asked to fail with lease_expired")
            if f["how"] == "bad_reply":
                return {"x": 7}             # outside the reply schema's [0, 1]
            raise RuntimeError("asked to fail")
        if op == "sleep":
            time.sleep(f["ms"] / 1000)
            return None
        raise AssertionError(f"no handler for {op}")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python tests/daemon_reference.py")
    ap.add_argument("--socket", required=True)
    ap.add_argument("--allow-uid", type=int, action="append", default=None)
    ap.add_argument("--allow-gid", type=int, action="append", default=[])
    ap.add_argument("--lease-s", type=float, default=10.0)
    ap.add_argument("--max-frame", type=int, default=DEFAULT_MAX_FRAME)
    ap.add_argument("--max-clients", type=int, default=256)
    ap.add_argument("--frame-timeout-s", type=float, default=10.0)
    ap.add_argument("--pool", default=None, help="SLOTS,LAYERS,BLOCK,HEADS,DIM,DTYPE")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    pool = None
    if args.pool:
        *dims, dtype = args.pool.split(",")
        pool = SharedPool.create(PoolGeometry(*map(int, dims), dtype))
    allow = None
    if args.allow_uid is not None or args.allow_gid:
        allow = Allowlist.of(args.allow_uid or (), args.allow_gid)
    service = ReferenceService(args.lease_s, pool)
    config = ServerConfig(args.socket, allow=allow, max_clients=args.max_clients,
                          frame_timeout_s=args.frame_timeout_s)
    server = Server(make_protocol(args.max_frame), service.handle, config,
                    disconnected=service.disconnected)
    service.server = server
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    service.leases.start()
    server.start()
    print(f"READY {os.getpid()}", flush=True)
    stop.wait()
    server.stop()
    service.leases.stop()
    if pool is not None:
        pool.close()
    return 0


class ServerProcess(DaemonProcess):
    """The reference daemon in a subprocess, for tests and benchmarks: started by `start()`
    (which returns once it listens), stopped with SIGTERM by `stop()` or killed by `kill()`."""

    what = "reference daemon"

    def command(self) -> list[str]:
        return [sys.executable, str(Path(__file__).resolve()), "--socket", self.socket_path,
                *self.args]

    def start(self, timeout_s: float = 60.0) -> ServerProcess:
        super().start(timeout_s)
        return self


if __name__ == "__main__":
    sys.exit(main())
