"""Leases: exactly one `expired` per client however it ends (timeout, close, both, from many
threads), a reaper that survives its callbacks, and with real processes: a SIGKILLed client is
reaped once, a stopped one times out once, a heartbeat keeps a lease and hears of its loss."""

from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from collections import Counter
from pathlib import Path

import pytest

from tests.daemon_reference import ServerProcess, make_protocol
from tiered_cache.daemon.leases import LeaseTable
from tiered_cache.wire.client import Client, Heartbeat
from tiered_cache.wire.errors import LeaseExpiredError

PROTO = make_protocol()

ROOT = Path(__file__).resolve().parents[2]
"""The repository: child processes run there, so that `tests.daemon_reference` imports."""


def wait_for(cond, what: str, timeout: float = 60.0) -> None:
    """Wait until `cond()` holds (a generous bound only against hangs, never a measurement)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"gave up waiting for {what}"
        time.sleep(0.01)


def past(table: LeaseTable, client) -> None:
    """Wait until `client`'s lease has passed on the table's clock."""
    expiry = table.expires_at(client)
    while time.monotonic() <= expiry:
        time.sleep(max(0.001, expiry - time.monotonic()))


# --- the table (in process) --------------------------------------------------------------------


def test_grant_renew_close_and_reap():
    ended = []
    t = LeaseTable(0.05, ended.append)
    t.grant("a")
    t.grant("b")
    with pytest.raises(ValueError, match="already holds"):
        t.grant("a")
    assert t.close("b") and not t.close("b")        # a close is queued once
    assert t.reap() == ["b"] and ended == ["b"]
    past(t, "a")
    assert t.reap() == ["a"] and ended == ["b", "a"]
    assert t.reap() == [] and len(t) == 0
    with pytest.raises(LeaseExpiredError, match="attach again"):
        t.renew("a")                                # expired stays expired
    assert not t.close("a")
    s = t.stats()
    assert (s["granted"], s["timed_out"], s["closed"], s["live"]) == (2, 1, 1, 0)


def test_renewal_pushes_the_expiry_and_old_entries_are_skipped():
    ended = []
    t = LeaseTable(0.05, ended.append)
    t.grant("a")
    first = t.expires_at("a")
    past(t, "a")
    t.renew("a")                                    # renewed before any reap: still alive
    assert t.expires_at("a") > first
    assert t.reap() == [] and "a" in t              # the stale heap entry is skipped
    past(t, "a")
    assert t.reap() == ["a"] and ended == ["a"]


def test_heap_stays_bounded_under_renewals():
    t = LeaseTable(60.0, lambda c: None)
    for c in range(10):
        t.grant(c)
    for i in range(20_000):
        t.renew(i % 10)
    assert t.stats()["heap"] <= 2 * 10 + 64 + 1


def test_exactly_once_under_concurrent_close_renew_and_timeout():
    ended: Counter = Counter()
    lock = threading.Lock()

    def expired(c):
        with lock:
            ended[c] += 1

    t = LeaseTable(0.005, expired).start()
    clients_per_thread, threads = 300, 6

    def work(k: int) -> None:
        for i in range(clients_per_thread):
            c = (k, i)
            t.grant(c)
            for _ in range(i % 3):
                try:
                    t.renew(c)
                except LeaseExpiredError:
                    break                           # the reaper got there first: fine
            if i % 2:
                t.close(c)
            if i % 5 == 0:
                t.reap()                            # a second reaper racing the thread

    workers = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(60)
    wait_for(lambda: len(t) == 0, "every lease to end")
    t.stop(10)
    assert len(ended) == clients_per_thread * threads
    assert set(ended.values()) == {1}
    s = t.stats()
    assert s["timed_out"] + s["closed"] == clients_per_thread * threads


def test_the_reaper_survives_a_failing_callback():
    ended = []

    def expired(c):
        if c == "bad":
            raise RuntimeError("service bug")
        ended.append(c)

    t = LeaseTable(30.0, expired).start()
    t.grant("bad")
    t.grant("good")
    t.close("bad")
    t.close("good")
    wait_for(lambda: ended == ["good"], "the good client to be reaped")
    t.grant("later")
    t.close("later")
    wait_for(lambda: ended == ["good", "later"], "the reaper to carry on")
    assert t.stats()["callback_errors"] == 1
    t.stop(10)


def test_an_earlier_expiry_wakes_a_sleeping_reaper():
    ended = []
    t = LeaseTable(3600.0, ended.append).start()
    t.grant("long")                     # the reaper now sleeps for an hour
    t.grant("short")
    t.close("short")
    wait_for(lambda: ended == ["short"], "the close to be reaped")
    t.stop(10)


# --- with real processes -----------------------------------------------------------------------

CHILD = """
    import os, sys, threading
    from tiered_cache.wire.client import Client, Heartbeat
    from tests.daemon_reference import make_protocol
    c = Client(sys.argv[1], make_protocol()).connect()
    lease = c.call("hello")["lease_s"]
    lost = threading.Event()
    hb = Heartbeat(c, lease, fraction=0.1, on_lost=lambda exc: lost.set()).start()
    print(c.client_id, flush=True)
    lost.wait()
    print("LOST", flush=True)
    sys.stdin.readline()
"""


@pytest.fixture
def daemon():
    d = Path(tempfile.mkdtemp(prefix="tc-ls-"))
    proc = ServerProcess(d / "d.sock", "--lease-s", "0.5").start()
    yield proc
    try:
        assert proc.stop() == 0, proc.log()
    finally:
        shutil.rmtree(d, ignore_errors=True)


def spawn_child(path: str) -> tuple[subprocess.Popen, int]:
    child = subprocess.Popen([sys.executable, "-c", textwrap.dedent(CHILD), path], cwd=ROOT,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return child, int(read_line(child))


def read_line(proc: subprocess.Popen, timeout: float = 60.0) -> str:
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, "the child said nothing"
    return proc.stdout.readline().strip()


def events(c: Client, client: int) -> Counter:
    return Counter(e["kind"] for e in c.call("events")["events"] if e["client"] == client)


def flush_reaper(c: Client) -> None:
    """Make the reaper run at least one more pass after everything so far: a throwaway
    connection's lease, closed, must be reaped after whatever was due before it."""
    with Client(c.path, PROTO) as tmp:
        tmp.call("hello")
        probe = tmp.client_id
    wait_for(lambda: events(c, probe)["expired"] == 1, "the probe's lease to end")


@pytest.mark.slow
def test_a_sigkilled_client_is_disconnected_and_reaped_exactly_once(daemon):
    child, client = spawn_child(daemon.socket_path)
    with Client(daemon.socket_path, PROTO) as c:
        assert events(c, client) == Counter()
        os.kill(child.pid, signal.SIGKILL)
        child.wait(30)
        wait_for(lambda: events(c, client)["expired"] == 1, "the killed client's expiry")
        flush_reaper(c)
        assert events(c, client) == Counter({"disconnected": 1, "expired": 1})
        leases = c.call("stats")["leases"]
    assert leases["closed"] >= 2 and leases["callback_errors"] == 0


@pytest.mark.slow
def test_a_stopped_client_times_out_once_and_its_heartbeat_hears_of_it(daemon):
    child, client = spawn_child(daemon.socket_path)
    with Client(daemon.socket_path, PROTO) as c:
        os.kill(child.pid, signal.SIGSTOP)          # alive, connected, silent
        try:
            wait_for(lambda: events(c, client)["expired"] == 1, "the stopped client's expiry")
            assert events(c, client) == Counter({"expired": 1})    # still connected
            timed_out = c.call("stats")["leases"]["timed_out"]
            assert timed_out >= 1
        finally:
            os.kill(child.pid, signal.SIGCONT)
        # its next heartbeat is refused: the lease is not silently granted again
        assert read_line(child) == "LOST"
        child.stdin.close()
        child.wait(30)
        wait_for(lambda: events(c, client)["disconnected"] == 1, "the disconnect")
        flush_reaper(c)
        assert events(c, client) == Counter({"expired": 1, "disconnected": 1})


@pytest.mark.slow
def test_heartbeat_keeps_a_lease_and_survives_the_daemon_going_away():
    d = Path(tempfile.mkdtemp(prefix="tc-hb-"))
    path = d / "d.sock"
    lost = []
    try:
        with ServerProcess(path, "--lease-s", "5"):
            c = Client(str(path), PROTO, timeout_s=10).connect()
            lease = c.call("hello")["lease_s"]
            hb = Heartbeat(c, lease, fraction=0.02, on_lost=lost.append).start()
            wait_for(lambda: hb.sent >= 5, "five heartbeats")
            assert c.call("heartbeat")["expires_in_s"] > 0 and lost == []
        wait_for(lambda: hb.failed >= 2, "heartbeats to fail while the daemon is away")
        assert hb.running
        with ServerProcess(path, "--lease-s", "5"):
            # the heartbeat reconnects on demand; the new connection holds no lease: on_lost
            wait_for(lambda: lost, "the heartbeat to report the lost lease")
            assert isinstance(lost[0], LeaseExpiredError) and c.generation == 2
            hb.stop(10)
            assert not hb.running
            c.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
