"""The daemon's side of the socket: a Unix-socket server that frames, checks and dispatches.

`Server` listens on a Unix socket, admits peers whose `SO_PEERCRED` uid or gid is allowlisted,
reads frames within the limits of protocol.py, hands each decoded request to
`handler(peer, request)` and writes the reply. A bad frame is answered with a typed error (or,
when the framing itself is broken, the connection is closed) and counted by reason; it never
affects another client. `disconnected(peer)` is called once for every admitted connection when
it ends, however it ends: that is where a service releases what the client held.

Threads, not selectors
----------------------
One thread per connection, plus one accept thread. A node has a handful of clients (one per
engine process, tens at most; `max_clients` caps it), and the handlers are the control plane's
calls: short, but they take the control plane's lock and may block on it. With a thread per
connection a blocked handler or a slow client delays only its own connection, reads and writes
are plain blocking calls with timeouts (no partial-frame state machine), and the GIL is released
in every socket call. A selector loop would still need a worker pool for blocking handlers, and
would then have to keep per-connection order itself. Requests on one connection are served in
order, one at a time; clients that want concurrency open more connections.

The socket path
---------------
The socket lives in a directory the daemon owns that no one else may write (checked, and
created with mode 0700 if missing). The socket is bound under a temporary name, given its mode
(0600 by default) and only then renamed into place, so it is never reachable with looser
permissions. A lock file beside it (`<path>.lock`, flock) says a daemon is alive: the kernel
drops the lock when its process dies, even by SIGKILL. A second daemon on the same path refuses
to start; a socket left by a dead one is removed (after checking that nothing answers there).
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import logging
import os
import selectors
import socket
import stat
import threading
import time
from array import array
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiered_cache.errors import ConfigError
from tiered_cache.wire.errors import (
    DaemonError,
    DaemonRunningError,
    FrameTooLargeError,
    InternalError,
    OverloadedError,
    ProtocolError,
    UnauthorizedError,
)
from tiered_cache.wire.framing import FrameBuffer, TruncatedFrame, set_timeouts
from tiered_cache.wire.peer import Allowlist, Peer, peer_credentials
from tiered_cache.wire.protocol import WELCOME_OP, Protocol, Request

log = logging.getLogger(__name__)

SUN_PATH_MAX = 107          # bytes of a Unix socket path (108 with the NUL)


@dataclass(frozen=True)
class Response:
    """What a handler returns to pass file descriptors with its reply (SCM_RIGHTS). The
    transport sends `fds` and closes them afterwards only when `close_fds` is true."""

    fields: Mapping[str, Any] = field(default_factory=dict)
    fds: Sequence[int] = ()
    close_fds: bool = False


Handler = Callable[[Peer, Request], "Mapping[str, Any] | Response | None"]


@dataclass(frozen=True)
class ServerConfig:
    """The transport's settings (the `daemon:` section of the daemon's YAML).

    `frame_timeout_s` bounds how long a frame, once its first byte has arrived, may take to
    arrive whole, and how long a reply may take to be written; an idle connection may stay open
    indefinitely (its lease, not the transport, decides how long its client counts as alive).
    """

    socket_path: str
    allow: Allowlist | None = None        # None: the daemon's own effective uid only
    max_clients: int = 256
    frame_timeout_s: float = 10.0
    stop_timeout_s: float = 5.0
    socket_mode: int = 0o600
    backlog: int = 128

    def __post_init__(self) -> None:
        if self.socket_mode & 0o007:
            raise ConfigError("daemon.socket_mode", f"{oct(self.socket_mode)} grants access to "
                              "every user; use 0600 (or 0660 with a group allowlist)")
        if self.max_clients < 1:
            raise ConfigError("daemon.max_clients", f"must be >= 1, got {self.max_clients}")
        if not self.frame_timeout_s > 0:
            raise ConfigError("daemon.frame_timeout_s",
                              f"must be > 0, got {self.frame_timeout_s}")


class _Stalled(Exception):
    """A frame begun did not arrive whole within frame_timeout_s."""


class _Connection:
    __slots__ = ("sock", "peer", "thread", "frames", "goodbye")

    def __init__(self, sock: socket.socket, peer: Peer) -> None:
        self.sock, self.peer = sock, peer
        self.frames = FrameBuffer()
        self.thread: threading.Thread | None = None
        self.goodbye: DaemonError | None = None     # set by close_client: sent as it ends


class Server:
    """A Unix-socket server dispatching validated requests to `handler`.

    `handler(peer, request)` runs on the connection's thread and returns the reply's fields (a
    mapping, None for none) or a `Response`; it reports a failure by raising a `DaemonError`
    (sent as that error type). Any other exception is logged and answered with `internal`.
    `connected(peer)` runs on the connection's thread before anything is read from it,
    `disconnected(peer)` as it ends; `close_client` ends a connection from any thread.
    """

    def __init__(self, protocol: Protocol, handler: Handler, config: ServerConfig, *,
                 connected: Callable[[Peer], None] | None = None,
                 disconnected: Callable[[Peer], None] | None = None) -> None:
        self.protocol = protocol
        self.handler = handler
        self.config = config
        self.allow = config.allow if config.allow is not None else Allowlist.own()
        self.path = os.path.abspath(config.socket_path)
        self._connected = connected
        self._disconnected = disconnected
        self._lock = threading.Lock()
        self._conns: dict[int, _Connection] = {}
        self._ids = itertools.count(1)
        self._stats: Counter[str] = Counter()
        self._rejected: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()
        self._failures: Counter[str] = Counter()
        self._in_flight = 0
        self._logged: set[str] = set()
        self._state = "new"
        self._stopping = False
        self._listener: socket.socket | None = None
        self._inode: tuple[int, int] | None = None
        self._lock_fd: int | None = None
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._accept_thread: threading.Thread | None = None

    # lifecycle --------------------------------------------------------------------------------

    def start(self) -> Server:
        with self._lock:
            if self._state != "new":
                raise RuntimeError(f"server is {self._state}; a Server starts once")
            self._state = "starting"
        try:
            self._bind()
        except BaseException as exc:
            self._release_path()
            with self._lock:
                self._state = "stopped"
            if isinstance(exc, OSError):
                # NOTE: the path is the operator's (daemon.socket): a directory that cannot be
                # made, a read-only filesystem, a path taken by something else
                raise ConfigError("daemon.socket", f"cannot listen at {self.path}: "
                                  f"{exc.strerror or exc}"
                                  + (f" ({exc.filename})" if exc.filename else "")) from exc
            raise
        self._wake = socket.socketpair()
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True,
                                               name="tc-daemon-accept")
        with self._lock:
            self._state = "serving"
        self._accept_thread.start()
        log.info("daemon listening on %s (allow %s)", self.path, self.allow)
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop accepting, let every connection finish the request it is serving (and any it
        had already sent), then close. Connections still open after `timeout` (default
        config.stop_timeout_s) are closed hard."""
        with self._lock:
            if self._state != "serving":
                if self._state == "new":
                    self._state = "stopped"
                return
            self._state = "stopping"
            self._stopping = True
        timeout = self.config.stop_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        assert self._wake is not None and self._accept_thread is not None
        with contextlib.suppress(OSError):
            self._wake[1].send(b"x")
        self._accept_thread.join(timeout)
        self._release_path()
        with self._lock:
            conns = list(self._conns.values())
        # NOTE: SHUT_RD, not close: the thread finishes the handler it is in and writes its
        # reply; its next read then sees end-of-file (after any request already queued).
        for c in conns:
            with contextlib.suppress(OSError):
                c.sock.shutdown(socket.SHUT_RD)
        for c in conns:
            if c.thread is not None:
                c.thread.join(max(0.0, deadline - time.monotonic()))
        for c in conns:
            if c.thread is not None and c.thread.is_alive():
                log.warning("%s still busy after %.1f s; closing it", c.peer, timeout)
                with contextlib.suppress(OSError):
                    c.sock.shutdown(socket.SHUT_RDWR)
                c.thread.join(1.0)
        for s in self._wake:
            s.close()
        with self._lock:
            self._state = "stopped"
        log.info("daemon on %s stopped", self.path)

    def __enter__(self) -> Server:
        return self.start() if self._state == "new" else self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def serving(self) -> bool:
        return self._state == "serving"

    # introspection ----------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        """Counters: connections, requests (`in_flight`: those in a handler now);
        `rejected` by reason (what clients got wrong: bad frames and messages, refused peers);
        `errors` by type (typed errors the handler raised); `failures` by reason (what the
        daemon got wrong: `internal`, a handler that raised something untyped, `bad_reply`, a
        reply that broke its schema, `connection`, a connection thread that failed)."""
        with self._lock:
            out: dict[str, Any] = dict(self._stats)
            out["connections_open"] = len(self._conns)
            out["in_flight"] = self._in_flight
            out["rejected"] = dict(self._rejected)
            out["rejected_total"] = sum(self._rejected.values())
            out["errors"] = dict(self._errors)
            out["failures"] = dict(self._failures)
        for k in ("connections_total", "requests", "replies", "io_errors", "accept_errors",
                  "callback_errors", "closed_by_daemon"):
            out.setdefault(k, 0)
        return out

    def peers(self) -> list[Peer]:
        with self._lock:
            return [c.peer for c in self._conns.values()]

    def close_client(self, client: int, goodbye: DaemonError | None = None) -> bool:
        """End connection `client` (its slot of max_clients is free once its thread is done):
        the request being served, if any, is answered first; then `goodbye` is sent, as a
        connection-level error (request id 0), and the socket closed. False if it is gone.

        NOTE: only the read side is shut down here, which wakes the connection's thread in its
        recv; that thread alone writes to the socket, so a reply and the goodbye never
        interleave."""
        with self._lock:
            c = self._conns.get(client)
            if c is None:
                return False
            c.goodbye = goodbye
        with contextlib.suppress(OSError):
            c.sock.shutdown(socket.SHUT_RD)
        self._count("closed_by_daemon")
        return True

    # socket path ------------------------------------------------------------------------------

    def _bind(self) -> None:
        path = self.path
        if len(os.fsencode(path)) + 16 > SUN_PATH_MAX:
            raise ConfigError("daemon.socket", f"{path!r} is too long for a Unix socket (at most "
                              f"{SUN_PATH_MAX - 16} bytes here)")
        directory = os.path.dirname(path)
        _prepare_directory(directory)
        lock_fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW,
                          0o600)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(lock_fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(lock_fd)
            raise DaemonRunningError(f"a daemon (pid {holder}) already serves {path}") from None
        self._lock_fd = lock_fd
        os.ftruncate(lock_fd, 0)
        os.pwrite(lock_fd, f"{os.getpid()}\n".encode(), 0)
        if os.path.lexists(path):
            st = os.lstat(path)
            if not stat.S_ISSOCK(st.st_mode):
                raise ConfigError("daemon.socket", f"{path} exists and is not a socket; refusing "
                                  "to replace it")
            if _answers(path):
                raise DaemonRunningError(f"something already answers at {path}")
            os.unlink(path)
            log.warning("removed the stale socket %s (its daemon is gone)", path)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(tmp)
            os.chmod(tmp, self.config.socket_mode)
            sock.listen(self.config.backlog)
            os.rename(tmp, path)
        except BaseException:
            sock.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        st = os.lstat(path)
        self._inode = (st.st_dev, st.st_ino)
        sock.setblocking(False)
        self._listener = sock

    def _release_path(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        if self._inode is not None:
            # Only our own socket: a successor may already have bound the path.
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(self.path)
                if (st.st_dev, st.st_ino) == self._inode:
                    os.unlink(self.path)
            self._inode = None
        if self._lock_fd is not None:
            # NOTE: the lock file stays: unlinking it would let a third daemon lock a new file
            # while a second one holds the old, unlinked one.
            os.close(self._lock_fd)
            self._lock_fd = None

    # accepting --------------------------------------------------------------------------------

    def _accept_loop(self) -> None:
        assert self._listener is not None and self._wake is not None
        sel = selectors.DefaultSelector()
        sel.register(self._listener, selectors.EVENT_READ)
        sel.register(self._wake[0], selectors.EVENT_READ)
        try:
            while not self._stopping:
                try:
                    events = sel.select()
                    if any(key.fileobj is self._wake[0] for key, _ in events):
                        return
                    conn, _ = self._listener.accept()
                except (BlockingIOError, InterruptedError):
                    continue
                except Exception as exc:
                    self._count("accept_errors")
                    log.warning("accept on %s failed: %s", self.path, exc)
                    time.sleep(0.05)     # EMFILE and friends: do not spin
                    continue
                try:
                    self._admit(conn)
                except Exception:
                    self._count("accept_errors")
                    log.exception("admitting a connection on %s failed", self.path)
                    conn.close()
        finally:
            sel.close()

    def _admit(self, conn: socket.socket) -> None:
        conn.setblocking(True)
        set_timeouts(conn, recv_s=self.config.frame_timeout_s,
                     send_s=self.config.frame_timeout_s)
        pid, uid, gid = peer_credentials(conn)
        if not self.allow.allows(uid, gid):
            self._refuse(conn, "unauthorized", UnauthorizedError(
                f"uid {uid} / gid {gid} is not in this daemon's allowlist"),
                f"pid {pid} uid {uid} gid {gid}")
            return
        with self._lock:
            if self._stopping:
                conn.close()
                return
            full = len(self._conns) >= self.config.max_clients
            if not full:
                peer = Peer(next(self._ids), pid, uid, gid)
                c = self._conns[peer.client] = _Connection(conn, peer)
                self._stats["connections_total"] += 1
        if full:
            self._refuse(conn, "overloaded", OverloadedError(
                f"the daemon serves its maximum of {self.config.max_clients} clients"),
                f"pid {pid} uid {uid}")
            return
        c.thread = threading.Thread(target=self._serve, args=(c,), daemon=True,
                                    name=f"tc-daemon-client-{peer.client}")
        c.thread.start()

    def _refuse(self, conn: socket.socket, reason: str, exc: DaemonError, who: str) -> None:
        self._reject(reason, f"{who}: {exc}")
        with contextlib.suppress(OSError):
            conn.sendall(self.protocol.encode_error(0, exc))
        conn.close()

    # serving one connection -------------------------------------------------------------------

    def _serve(self, c: _Connection) -> None:
        sock, peer = c.sock, c.peer
        try:
            if self._connected is not None:
                self._connected(peer)
            self._send(sock, self.protocol.encode_reply(0, WELCOME_OP, {
                "client": peer.client, "pid": peer.pid, "uid": peer.uid, "gid": peer.gid,
                "max_frame": self.protocol.max_frame}))
            while True:
                try:
                    body = self._recv_frame(c)
                except FrameTooLargeError as exc:
                    self._reject(exc.wire_type, f"{peer}: {exc}")
                    with contextlib.suppress(OSError):
                        sock.sendall(self.protocol.encode_error(0, exc))
                    return
                except TruncatedFrame:
                    if not self._stopping and c.goodbye is None:
                        self._reject("truncated", f"{peer}: closed in the middle of a frame")
                    return
                except _Stalled:
                    self._reject("stalled", f"{peer}: a frame did not arrive whole within "
                                 f"{self.config.frame_timeout_s} s")
                    return
                if body is None:
                    return
                data, fds, close_fds = self._dispatch(peer, body)
                try:
                    self._send(sock, data, fds)
                    self._count("replies")
                finally:
                    if close_fds:
                        for fd in fds:
                            with contextlib.suppress(OSError):
                                os.close(fd)
        except OSError as exc:
            if not self._stopping:
                self._count("io_errors")
                log.debug("%s: connection failed: %s", peer, exc)
        except Exception:
            self._fail("connection")
            log.exception("%s: the connection thread failed", peer)
        finally:
            if c.goodbye is not None:
                with contextlib.suppress(OSError):
                    sock.sendall(self.protocol.encode_error(0, c.goodbye))
            with self._lock:
                self._conns.pop(peer.client, None)
            sock.close()
            if self._disconnected is not None:
                try:
                    self._disconnected(peer)
                except Exception:
                    self._count("callback_errors")
                    log.exception("disconnected(%s) failed", peer)

    def _dispatch(self, peer: Peer, body: bytearray) -> tuple[bytes, Sequence[int], bool]:
        """The reply frame to one request body (and the fds to send with it)."""
        try:
            req = self.protocol.decode_request(body)
        except ProtocolError as exc:
            self._reject(exc.wire_type, f"{peer}: {exc}")
            return self.protocol.encode_error(exc.request_id, exc), (), False
        with self._lock:
            self._stats["requests"] += 1
            self._in_flight += 1
        try:
            result = self.handler(peer, req)
        except DaemonError as exc:
            with self._lock:
                self._errors[exc.wire_type] += 1
            return self.protocol.encode_error(req.id, exc), (), False
        except Exception as exc:
            self._fail("internal")
            log.exception("%s: handler of %r failed", peer, req.op)
            err = InternalError(f"{req.op} failed in the daemon ({type(exc).__name__})")
            return self.protocol.encode_error(req.id, err), (), False
        finally:
            with self._lock:
                self._in_flight -= 1
        if isinstance(result, Response):
            fields, fds, close_fds = result.fields, tuple(result.fds), result.close_fds
        else:
            fields, fds, close_fds = (result or {}), (), False
        try:
            return self.protocol.encode_reply(req.id, req.op, fields), fds, close_fds
        except DaemonError as exc:
            self._fail("bad_reply")
            log.error("%s: the reply of %r breaks its schema: %s", peer, req.op, exc)
            if close_fds:
                for fd in fds:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            err = InternalError(f"{req.op}: the daemon built an invalid reply ({exc})")
            return self.protocol.encode_error(req.id, err), (), False

    def _recv_frame(self, c: _Connection) -> bytearray | None:
        """The next frame's body; None on a clean end of stream between frames."""
        timeout = self.config.frame_timeout_s
        sock, shortened = c.sock, False

        def recv(view: memoryview, started: float | None) -> int:
            nonlocal shortened
            while True:
                if started is not None:
                    # NOTE: a frame begun must arrive whole within frame_timeout_s, however
                    # it trickles in; only this (rare) path shortens the socket's timeout.
                    left = started + timeout - time.monotonic()
                    if left <= 0:
                        raise _Stalled()
                    set_timeouts(sock, recv_s=left)
                    shortened = True
                try:
                    return sock.recv_into(view)
                except BlockingIOError:         # SO_RCVTIMEO passed with nothing read
                    if started is None and not self._stopping:
                        continue                # an idle connection between frames
                    raise _Stalled() from None

        try:
            return c.frames.read(recv, self.protocol.max_frame)
        finally:
            if shortened:
                set_timeouts(sock, recv_s=timeout)

    @staticmethod
    def _send(sock: socket.socket, data: bytes, fds: Sequence[int] = ()) -> None:
        if not fds:
            sock.sendall(data)
            return
        sent = sock.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array("i", fds))])
        if sent < len(data):
            sock.sendall(memoryview(data)[sent:])

    # counting ---------------------------------------------------------------------------------

    def _count(self, key: str) -> None:
        with self._lock:
            self._stats[key] += 1

    def _fail(self, reason: str) -> None:
        with self._lock:
            self._failures[reason] += 1

    def _reject(self, reason: str, detail: str) -> None:
        with self._lock:
            self._rejected[reason] += 1
            first = reason not in self._logged
            self._logged.add(reason)
        # NOTE: the first rejection of each reason is a warning, later ones debug: a client
        # that floods bad frames must not flood the log too (the counters keep the total).
        log.log(logging.WARNING if first else logging.DEBUG, "rejected (%s): %s", reason, detail)


def _prepare_directory(directory: str) -> None:
    """Create the socket's directory (0700) or check that only its owner, this user, can
    change it: whoever can write the directory can replace the socket."""
    if not os.path.lexists(directory):
        os.makedirs(directory, mode=0o700, exist_ok=True)
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError("daemon.socket", f"{directory} is not a directory (or is a symlink)")
    if st.st_uid != os.geteuid():
        raise ConfigError("daemon.socket", f"{directory} belongs to uid {st.st_uid}, not to the "
                          f"daemon's uid {os.geteuid()}")
    if st.st_mode & 0o022:
        raise ConfigError("daemon.socket", f"{directory} is writable by others "
                          f"({oct(st.st_mode & 0o777)}); the socket needs a private directory")


def _answers(path: str) -> bool:
    """Whether something accepts connections on the socket at `path`."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    probe.settimeout(1.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        return False
    except OSError:
        return True             # cannot tell (permissions, timeout): assume alive, refuse
    finally:
        probe.close()
    return True
