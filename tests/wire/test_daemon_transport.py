"""The Unix-socket transport with real processes: SO_PEERCRED identities, the allowlist, the
socket path's rules, many clients at once, typed client errors, reconnects, graceful stop."""

from __future__ import annotations

import os
import select
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from tests.daemon_reference import ServerProcess, make_protocol
from tiered_cache.errors import ConfigError, TierUnavailableError
from tiered_cache.wire.client import Client
from tiered_cache.wire.errors import (
    DaemonRunningError,
    DaemonTimeoutError,
    DaemonUnavailableError,
    FrameTooLargeError,
    OverloadedError,
    SchemaError,
    UnauthorizedError,
)
from tiered_cache.wire.peer import Allowlist, Peer
from tiered_cache.wire.protocol import Op, Protocol, Str
from tiered_cache.wire.transport import Server, ServerConfig

PROTO = make_protocol()
NOT_US = 12345 if os.getuid() != 12345 else 12346

ROOT = Path(__file__).resolve().parents[2]
"""The repository: child processes run there, so that `tests.daemon_reference` imports."""


@pytest.fixture
def sockdir():
    # NOTE: not tmp_path: its long names can pass the 107-byte limit of a socket path.
    d = Path(tempfile.mkdtemp(prefix="tc-tr-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemon(sockdir):
    """A daemon of the test's own, for tests that kill or stop it."""
    proc = ServerProcess(sockdir / "d.sock").start()
    yield proc
    if proc.proc is not None and proc.proc.poll() is None:
        assert proc.stop() == 0, proc.log()


@pytest.fixture(scope="module")
def shared():
    """One daemon for the tests that leave it as they found it."""
    d = Path(tempfile.mkdtemp(prefix="tc-tr-"))
    proc = ServerProcess(d / "d.sock").start()
    yield proc
    try:
        assert proc.stop() == 0, proc.log()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def wait_for(cond, what: str, timeout: float = 60.0) -> None:
    """Wait until `cond()` holds (a generous bound only against hangs, never a measurement)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def spawn(code: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code), *args], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def read_line(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the child said nothing"
    return proc.stdout.readline().strip()


CHILD_CLIENT = """
    import os, sys
    from tiered_cache.wire.client import Client
    from tests.daemon_reference import make_protocol
    c = Client(sys.argv[1], make_protocol()).connect()
    print(os.getpid(), c.client_id, c.welcome["pid"], flush=True)
    sys.stdin.readline()
"""


def in_process_server(path, handler=None, disconnected=None, **config) -> Server:
    proto = Protocol([Op("ping"), Op("say", {"what": Str(100)}, {"what": Str(100)})])
    return Server(proto, handler or (lambda peer, req: dict(req.fields)),
                  ServerConfig(str(path), **config), disconnected=disconnected)


# --- identities and the allowlist --------------------------------------------------------------


@pytest.mark.slow
def test_so_peercred_gives_the_real_pid_of_a_client_process(shared):
    child = spawn(CHILD_CLIENT, shared.socket_path)
    try:
        pid, client_id, seen_pid = map(int, read_line(child).split())
        assert pid == child.pid == seen_pid
        with Client(shared.socket_path, PROTO) as c:
            peers = {p["client"]: p for p in c.call("peers")["peers"]}
            me = c.call("whoami")
        assert peers[client_id] == {"client": client_id, "pid": child.pid, "uid": os.getuid(),
                                    "gid": os.getgid()}
        assert me["pid"] == os.getpid() and me["client"] != client_id
    finally:
        child.stdin.close()
        child.wait(30)


def test_a_client_not_in_the_allowlist_is_refused_and_counted(sockdir):
    handled, gone = [], []
    server = in_process_server(sockdir / "d.sock", lambda peer, req: handled.append(req) or {},
                               gone.append, allow=Allowlist.of(uids=[NOT_US]))
    with server:
        c = Client(server.path, server.protocol)
        with pytest.raises(UnauthorizedError, match=f"uid {os.getuid()} / gid {os.getgid()}"):
            c.connect()
        assert not c.connected
        with pytest.raises(UnauthorizedError):
            c.request("ping")
        assert server.stats()["rejected"] == {"unauthorized": 2}
        assert server.stats()["connections_total"] == 0
    assert handled == [] and gone == []


def test_the_allowlist_admits_by_gid_too(sockdir):
    with in_process_server(sockdir / "d.sock",
                           allow=Allowlist.of(uids=[NOT_US], gids=[os.getgid()])) as server:
        with Client(server.path, server.protocol) as c:
            assert c.call("say", what="hi") == {"what": "hi"}


@pytest.mark.slow
@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another user")
def test_another_user_cannot_even_reach_the_socket(shared):
    # NOTE: the socket is 0600 in a 0700 directory: a process of another uid cannot connect at
    # all, before the allowlist is consulted.
    code = """
        import os, sys
        from tiered_cache.wire.client import Client
        from tiered_cache.wire.errors import DaemonUnavailableError
        from tests.daemon_reference import make_protocol
        os.setgroups([]); os.setgid(int(sys.argv[2])); os.setuid(int(sys.argv[2]))
        try:
            Client(sys.argv[1], make_protocol()).connect()
            print("connected")
        except DaemonUnavailableError as exc:
            print("refused", exc)
    """
    child = spawn(code, shared.socket_path, str(NOT_US))
    line = read_line(child)
    child.wait(30)
    assert line.startswith("refused") and "Permission denied" in line


# --- the socket path ---------------------------------------------------------------------------


def test_socket_mode_and_private_directory(sockdir):
    path = sockdir / "run" / "d.sock"
    with in_process_server(path) as server:
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600
        assert stat.S_IMODE(os.lstat(path.parent).st_mode) == 0o700
        assert server.serving
    assert not path.exists()                # removed on stop; the lock file stays
    assert (sockdir / "run" / "d.sock.lock").exists()


@pytest.mark.slow
def test_refuses_a_shared_directory_a_non_socket_and_a_long_path(sockdir):
    shared = sockdir / "shared"
    shared.mkdir()
    os.chmod(shared, 0o1777)
    with pytest.raises(ConfigError, match="writable by others"):
        in_process_server(shared / "d.sock").start()
    (sockdir / "file").write_text("not a socket")
    with pytest.raises(ConfigError, match="is not a socket"):
        in_process_server(sockdir / "file").start()
    assert (sockdir / "file").read_text() == "not a socket"
    with pytest.raises(ConfigError, match="too long"):
        in_process_server(sockdir / ("x" * 100)).start()
    with pytest.raises(ConfigError, match="every user"):
        ServerConfig(str(sockdir / "d.sock"), socket_mode=0o666)


@pytest.mark.slow
def test_a_second_daemon_refuses_while_the_first_lives_and_starts_after_a_sigkill(daemon):
    with pytest.raises(DaemonRunningError, match=f"pid {daemon.pid}"):
        in_process_server(daemon.socket_path).start()
    with Client(daemon.socket_path, PROTO) as c:
        assert c.call("ping") == {}         # the refused start left the first one alone
    daemon.kill()                           # SIGKILL: the socket file stays behind
    assert stat.S_ISSOCK(os.lstat(daemon.socket_path).st_mode)
    with in_process_server(daemon.socket_path) as server:
        with Client(server.path, server.protocol) as c:
            assert c.call("say", what="new") == {"what": "new"}


def test_refuses_when_something_answers_without_holding_the_lock(sockdir):
    path = str(sockdir / "d.sock")
    squatter = socket.socket(socket.AF_UNIX)
    squatter.bind(path)
    squatter.listen()
    try:
        with pytest.raises(DaemonRunningError, match="already answers"):
            in_process_server(path).start()
    finally:
        squatter.close()
    with in_process_server(path):           # now it is only a stale file: replaced
        pass


# --- clients -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_many_threads_share_one_client(shared):
    errors = []
    with Client(shared.socket_path, PROTO) as c:
        def work(t: int) -> None:
            try:
                for i in range(40):
                    tokens = np.arange(t * 1000 + i, t * 1000 + i + 50)
                    got = c.call("echo", n=t * 1000 + i, tokens=tokens)
                    assert got["n"] == t * 1000 + i and np.array_equal(got["tokens"], tokens)
            except BaseException as exc:        # noqa: BLE001
                errors.append(exc)
        threads = [threading.Thread(target=work, args=(t,)) for t in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert c.generation == 1
    assert not errors


@pytest.mark.slow
def test_many_client_processes_at_once(shared):
    code = """
        import sys
        from tiered_cache.wire.client import Client
        from tests.daemon_reference import make_protocol
        with Client(sys.argv[1], make_protocol()) as c:
            for i in range(100):
                assert c.call("echo", n=i, s=sys.argv[2])["s"] == sys.argv[2]
        print("ok", flush=True)
    """
    children = [spawn(code, shared.socket_path, f"child-{k}") for k in range(4)]
    assert [read_line(ch) for ch in children] == ["ok"] * 4
    for ch in children:
        ch.wait(30)
    with Client(shared.socket_path, PROTO) as c:
        s = c.call("stats")
    assert s["server"]["requests"] >= 300 and s["rejected"] == {}


@pytest.mark.slow
def test_client_validates_before_sending(shared):
    with Client(shared.socket_path, PROTO) as c:
        with pytest.raises(SchemaError, match="sleep.ms"):
            c.call("sleep", ms=-1)
        with pytest.raises(FrameTooLargeError):
            c.call("echo", tokens=np.zeros(262_144, dtype=np.int64), b=b"x" * 65536,
                   keys=[b"k" * 16] * 4096)
        assert c.call("ping") == {} and c.generation == 1


@pytest.mark.slow
def test_timeout_drops_the_connection_and_the_next_request_reconnects(shared):
    with Client(shared.socket_path, PROTO, timeout_s=30) as c:
        first = c.client_id
        with pytest.raises(DaemonTimeoutError, match="connection closed"):
            c.request("sleep", {"ms": 500}, timeout_s=0.1)
        assert not c.connected
        # NOTE: the late reply to the sleep is never read as this ping's: new connection.
        assert c.call("ping") == {}
        assert c.generation == 2 and c.client_id != first


@pytest.mark.slow
def test_daemon_gone_is_typed_and_reconnect_is_on_demand(sockdir):
    path = sockdir / "d.sock"
    c = Client(str(path), PROTO, timeout_s=30)
    with pytest.raises(DaemonUnavailableError, match="no daemon"):
        c.connect()
    with ServerProcess(path) as d:
        assert c.call("ping") == {} and c.generation == 1
        d.kill()
        with pytest.raises(DaemonUnavailableError) as info:
            c.call("ping")
        assert isinstance(info.value, TierUnavailableError)     # engines fall back on it
    with ServerProcess(path):
        assert c.call("ping") == {} and c.generation == 2
    c.close()


@pytest.mark.slow
def test_too_many_clients_are_refused(sockdir):
    with ServerProcess(sockdir / "d.sock", "--max-clients", "2") as d:
        a, b = Client(d.socket_path, PROTO).connect(), Client(d.socket_path, PROTO).connect()
        with pytest.raises(OverloadedError, match="maximum of 2"):
            Client(d.socket_path, PROTO).connect()
        a.close()
        s = b.call("stats")
        assert s["rejected"] == {"overloaded": 1}
        b.close()


@pytest.mark.slow
def test_disconnected_is_called_once_per_connection(sockdir):
    gone: list[Peer] = []
    with in_process_server(sockdir / "d.sock", disconnected=gone.append) as server:
        clients = [Client(server.path, server.protocol).connect() for _ in range(3)]
        ids = [c.client_id for c in clients]
        for c in clients:
            c.call("ping")
            c.close()
        child = spawn(CHILD_CLIENT, server.path)
        _, child_id, _ = map(int, read_line(child).split())
        child.kill()
        child.wait(30)
        wait_for(lambda: len(gone) == 4, "the connection threads to notice the closes")
    assert sorted(p.client for p in gone) == sorted([*ids, child_id])


# --- graceful stop -----------------------------------------------------------------------------


@pytest.mark.slow
def test_sigterm_finishes_requests_in_flight_then_stops(daemon):
    result: dict = {}

    def slow() -> None:
        with Client(daemon.socket_path, PROTO, timeout_s=60) as c:
            try:
                result["reply"] = c.call("sleep", ms=700)
            except BaseException as exc:         # noqa: BLE001
                result["error"] = exc

    with Client(daemon.socket_path, PROTO) as watcher:
        t = threading.Thread(target=slow)
        t.start()
        # wait until the sleep is in its handler (in flight: it and this stats call), so that
        # SIGTERM arrives while it is
        wait_for(lambda: watcher.call("stats")["server"]["in_flight"] >= 2, "the sleep")
        daemon.proc.send_signal(signal.SIGTERM)
        t.join(60)
    assert result == {"reply": {}}
    assert daemon.proc.wait(30) == 0
    assert not os.path.exists(daemon.socket_path)
    with pytest.raises(DaemonUnavailableError):
        Client(daemon.socket_path, PROTO).connect()


def test_a_client_of_another_version_is_told_at_connect(sockdir):
    from tiered_cache.wire.errors import VersionError
    with in_process_server(sockdir / "d.sock") as server:
        newer = Protocol([Op("ping")], version=server.protocol.version + 1)
        with pytest.raises(VersionError, match="this client speaks version"):
            Client(server.path, newer).connect()
