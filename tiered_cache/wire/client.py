"""The engine's side of the socket: request/response over one connection, and a heartbeat.

`Client` sends one request at a time over its connection and reads its reply: a lock, rather
than request-id matching with a reader thread, because the daemon serves a connection's
requests in order anyway (see transport.py), so multiplexing one socket would not make anything
faster, and a lock makes a timed-out request easy to make safe (below). Ids are still checked.

Failures are typed. An error reply raises the error class it names (errors.py) and leaves the
connection usable. A daemon that is gone (no socket, refused, closed mid-request) raises
`DaemonUnavailableError`; no reply in time raises `DaemonTimeoutError`. In both cases the
connection is dropped, and the next request connects again ("reconnect on demand"). A request
is never resent by the client: whether a request that failed mid-way took effect is unknown, and
only the caller knows whether its op is idempotent.

NOTE: a new connection is a new client. The daemon keys leases and pins by connection, so after
a reconnect nothing the old connection held exists any more; `generation` counts connections,
and the heartbeat's `on_lost` hears of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from array import array
from collections.abc import Callable, Mapping
from typing import Any

from tiered_cache.wire.errors import (
    DaemonError,
    DaemonTimeoutError,
    DaemonUnavailableError,
    FrameTooLargeError,
    LeaseExpiredError,
    ProtocolError,
)
from tiered_cache.wire.framing import FrameBuffer, set_timeouts
from tiered_cache.wire.protocol import WELCOME_OP, Protocol, Reply

log = logging.getLogger(__name__)

_INT_BYTES = array("i").itemsize
_MSG_CTRUNC = int(socket.MSG_CTRUNC)     # a plain int: IntFlag arithmetic costs microseconds


class Client:
    """One connection to a daemon. Thread-safe: concurrent requests take turns.

    `max_fds` bounds the file descriptors one reply may carry; more is a protocol error.
    """

    def __init__(self, socket_path: str, protocol: Protocol, *, timeout_s: float = 5.0,
                 max_fds: int = 4) -> None:
        self.path = socket_path
        self.protocol = protocol
        self.timeout_s = timeout_s
        self.max_fds = max_fds
        self.welcome: dict[str, Any] = {}
        self.generation = 0
        self._lock = threading.RLock()
        self._sock: socket.socket | None = None
        self._next_id = 0
        self._daemon_max_frame = protocol.max_frame
        self._recv_timeout = timeout_s
        self._frames = FrameBuffer(4096)

    # connection -------------------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._sock is not None

    @property
    def client_id(self) -> int | None:
        """The id the daemon gave this connection (None when not connected)."""
        return self.welcome.get("client") if self._sock is not None else None

    def connect(self) -> Client:
        """Connect unless connected; raises DaemonUnavailableError, or the daemon's refusal
        (UnauthorizedError, OverloadedError)."""
        with self._lock:
            if self._sock is None:
                self._connect()
        return self

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(self.timeout_s)
            sock.connect(self.path)
            sock.settimeout(None)
            set_timeouts(sock, recv_s=self.timeout_s, send_s=self.timeout_s)
            self._recv_timeout = self.timeout_s
            self._frames = FrameBuffer(4096)
            body, fds = self._recv_frame(sock)
            _close_fds(fds)
            reply = self.protocol.decode_reply(body, WELCOME_OP)
        except (TimeoutError, BlockingIOError):
            sock.close()
            raise DaemonTimeoutError(f"daemon at {self.path} did not greet within "
                                     f"{self.timeout_s} s") from None
        except (OSError, EOFError) as exc:
            sock.close()
            raise DaemonUnavailableError(f"no daemon at {self.path}: {exc}") from None
        except BaseException:
            sock.close()
            raise
        if not reply.ok:
            sock.close()
            assert reply.error is not None
            raise reply.error
        self.welcome = reply.fields
        self._daemon_max_frame = min(self.protocol.max_frame, reply.fields["max_frame"])
        self.generation += 1
        self._sock = sock

    def close(self) -> None:
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None

    def __enter__(self) -> Client:
        return self.connect()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # requests ---------------------------------------------------------------------------------

    def request(self, op: str, fields: Mapping[str, Any] | None = None, *,
                timeout_s: float | None = None) -> Reply:
        """Send `op` and return its successful reply; raise the reported error otherwise. The
        caller owns `reply.fds`."""
        with self._lock:
            if self._sock is None:
                self._connect()
            self._next_id += 1
            rid = self._next_id
            data = self.protocol.encode_request(op, rid, fields or {})
            if len(data) - 4 > self._daemon_max_frame:
                raise FrameTooLargeError(f"{op}: request of {len(data) - 4:,} bytes exceeds the "
                                         f"daemon's frame limit of {self._daemon_max_frame:,}")
            sock = self._sock
            assert sock is not None
            timeout = self.timeout_s if timeout_s is None else timeout_s
            try:
                if timeout != self._recv_timeout:
                    set_timeouts(sock, recv_s=timeout, send_s=timeout)
                    self._recv_timeout = timeout
                try:
                    sock.sendall(data)
                except (BrokenPipeError, ConnectionResetError):
                    # NOTE: the daemon ended this connection (a lease it reaped); what it said
                    # as it did (a connection-level error, id 0) may still be waiting to be
                    # read: that, not a broken pipe, is the answer.
                    body, fds = self._recv_frame(sock)
                    _close_fds(fds)
                    reply = self.protocol.decode_reply(body, op)
                    self._drop()
                    if reply.id == 0 and reply.error is not None:
                        raise reply.error from None
                    raise
                body, fds = self._recv_frame(sock)
            except (TimeoutError, BlockingIOError):
                self._drop()
                raise DaemonTimeoutError(f"{op}: no reply from {self.path} within {timeout} s "
                                         "(connection closed)") from None
            except (OSError, EOFError) as exc:
                self._drop()
                raise DaemonUnavailableError(f"{op}: the daemon at {self.path} is gone "
                                             f"({exc or type(exc).__name__})") from None
            except ProtocolError:
                self._drop()
                raise
            try:
                reply = self.protocol.decode_reply(body, op)
            except ProtocolError:
                _close_fds(fds)
                self._drop()
                raise
            if reply.id != rid:
                _close_fds(fds)
                self._drop()
                if reply.id == 0 and reply.error is not None:
                    raise reply.error       # connection-level: the daemon closed after it
                raise ProtocolError(f"{op}: reply id {reply.id} does not match request {rid}")
            if not reply.ok:
                _close_fds(fds)
                assert reply.error is not None
                raise reply.error
            reply.fds = fds
            return reply

    def call(self, op: str, **fields: Any) -> dict[str, Any]:
        """`request(op, fields).fields`, for ops whose replies carry no file descriptors (any
        that come anyway are closed)."""
        reply = self.request(op, fields)
        _close_fds(reply.fds)
        return reply.fields

    def _recv_frame(self, sock: socket.socket) -> tuple[bytearray, list[int]]:
        fds: list[int] = []
        ancbuf = socket.CMSG_SPACE(self.max_fds * _INT_BYTES)

        def recv(view: memoryview, started: float | None) -> int:
            k, anc, flags, _ = sock.recvmsg_into([view], ancbuf, socket.MSG_CMSG_CLOEXEC)
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    got = array("i")
                    got.frombytes(data[:len(data) - len(data) % _INT_BYTES])
                    fds.extend(got)
            if flags & _MSG_CTRUNC or len(fds) > self.max_fds:
                raise ProtocolError(f"a reply carried more than {self.max_fds} file descriptors")
            return k

        try:
            body = self._frames.read(recv, self.protocol.max_frame)
        except BaseException:
            _close_fds(fds)
            raise
        if body is None:
            raise EOFError("connection closed by the daemon")
        return body, fds


def _close_fds(fds: list[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class Heartbeat:
    """Renews a client's lease from a background thread, every `lease_s * fraction` seconds.

    The thread never dies of an error: a daemon that is away counts as a failed beat (the next
    one reconnects on demand); a lease the daemon no longer knows calls `on_lost(exc)` (every
    time a beat finds it gone, so `on_lost` must be idempotent: typically it marks what the
    client held as lost and attaches again); anything else is logged and counted.

    NOTE: a third of the lease leaves room for two lost beats before the daemon reaps the
    client; a beat also waits behind any request in flight on the same connection, so the
    lease must be much longer than the longest request.
    """

    def __init__(self, client: Client, lease_s: float, *, fraction: float = 1 / 3,
                 op: str = "heartbeat", fields: Mapping[str, Any] | None = None,
                 on_lost: Callable[[LeaseExpiredError], None] | None = None) -> None:
        if not 0 < fraction < 1:
            raise ValueError(f"fraction must be in (0, 1), got {fraction}")
        self.client = client
        self.interval_s = lease_s * fraction
        self.op, self.fields = op, dict(fields or {})
        self.on_lost = on_lost
        self.sent = self.failed = self.lost = 0
        self.last_error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> Heartbeat:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="tc-daemon-heartbeat")
            self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def beat(self) -> bool:
        """One renewal now; True if the daemon renewed the lease."""
        try:
            self.client.call(self.op, **self.fields)
            self.sent += 1
            return True
        except LeaseExpiredError as exc:
            self.lost += 1
            self.last_error = exc
            log.warning("lease lost: %s", exc)
            if self.on_lost is not None:
                try:
                    self.on_lost(exc)
                except Exception:
                    log.exception("heartbeat on_lost callback failed")
        except DaemonError as exc:
            self.failed += 1
            self.last_error = exc
            log.log(logging.WARNING if self.failed == 1 else logging.DEBUG,
                    "heartbeat failed (%d so far): %s", self.failed, exc)
        except Exception as exc:
            self.failed += 1
            self.last_error = exc
            log.exception("heartbeat failed")
        return False

    def _run(self) -> None:
        next_at = time.monotonic()
        while True:
            next_at += self.interval_s
            if self._stop.wait(max(0.0, next_at - time.monotonic())):
                return
            self.beat()
            next_at = max(next_at, time.monotonic() - self.interval_s)
