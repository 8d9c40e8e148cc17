"""No client can lock the others out of the daemon (issue 23, item 8: lock-out), with a real
`tiered-cache serve`:

- a connection that never says hello is closed after `daemon.hello_timeout_s`;
- a client silent past its lease is reaped *and* disconnected (its connection slot freed), and
  its next request is told `lease_expired`;
- so `max_clients` idle peers hold their slots only for a while: a new client gets in;
- a fetch that matches more than a reply can carry (4,096 blocks) is answered with the first
  4,096, within the reply's schema, and pins only those; the rest is fetched after them.
"""

from __future__ import annotations

import json
import socket
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from tiered_cache.daemon.process import NodeProcess
from tiered_cache.hashing import xxh3_128
from tiered_cache.wire.client import Client
from tiered_cache.wire.errors import DaemonError, LeaseExpiredError, OverloadedError
from tiered_cache.wire.ops import MAX_BLOCKS, make_protocol

pytestmark = pytest.mark.slow     # processes, servers or sweeps (tests/conftest.py)

BS = 4


def start(tmp: Path, host_blocks: int = 64, **daemon) -> NodeProcess:
    sock = str(tmp / "s" / "d.sock")
    extra = "".join(f", {k}: {json.dumps(v)}" for k, v in daemon.items())
    cfg = tmp / "daemon.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        model: {{name: tiny, num_layers: 2, num_kv_heads: 2, head_dim: 8, num_q_heads: 4,
                dtype: float32}}
        block_size: {BS}
        tiers:
          host: {{num_blocks: {host_blocks}}}
        daemon: {{socket: {sock}{extra}}}
        """))
    return NodeProcess(cfg, sock, log_path=tmp / "daemon.log").start()


def client(node: NodeProcess) -> Client:
    return Client(node.socket_path, make_protocol(64 << 20), timeout_s=10).connect()


def admitted(node: NodeProcess) -> bool:
    """Whether a new client gets a lease now."""
    try:
        c = client(node)
    except OverloadedError:
        return False
    try:
        c.call("hello")
        return True
    except OverloadedError:
        return False
    finally:
        c.close()


def wait_for(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def closed_by_daemon(s: socket.socket) -> bool:
    """Whether the daemon closed this raw connection (EOF after whatever it sent last)."""
    s.settimeout(0.05)
    try:
        while True:
            data = s.recv(65536)
            if not data:
                return True
    except (TimeoutError, BlockingIOError):
        return False
    except OSError:
        return True


@pytest.fixture
def nodes():
    started: list[NodeProcess] = []
    yield started
    for n in started:
        if n.proc is not None and n.proc.poll() is None:
            n.kill()


def test_connections_that_never_say_hello_are_closed_and_free_their_slots(tmp_path, nodes):
    node = start(tmp_path, max_clients=3, hello_timeout_s=1)
    nodes.append(node)
    idle = []
    for _ in range(3):              # connect, take the welcome, then say nothing at all
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(node.socket_path)
        idle.append(s)
    try:
        time.sleep(0.2)
        with pytest.raises(OverloadedError):
            client(node)            # every slot taken by a silent peer
        wait_for(lambda: all(closed_by_daemon(s) for s in idle),
                 "the daemon to close connections that never said hello")
        wait_for(lambda: admitted(node), "a new client to get in")
    finally:
        for s in idle:
            s.close()
    assert node.stop() == 0, node.log()[-3000:]


def test_clients_silent_past_their_lease_are_disconnected_and_told(tmp_path, nodes):
    node = start(tmp_path, max_clients=3, lease_s=1)
    nodes.append(node)
    silent = [client(node) for _ in range(3)]
    for c in silent:
        c.call("hello")             # a lease, never renewed
    with pytest.raises(OverloadedError):
        client(node)
    wait_for(lambda: admitted(node), "a slot of a reaped client to be freed", 20)
    # the reaped clients learn that their lease is gone (not only that a socket broke)
    for c in silent:
        with pytest.raises(LeaseExpiredError):
            c.call("heartbeat")
        c.close()
    assert node.stop() == 0, node.log()[-3000:]


def _publish_chain(c: Client, root: bytes, tokens: np.ndarray, staging_slots: int) -> list:
    keys, parent, entries = [], root, []
    for j in range(len(tokens) // BS):
        t = tokens[j * BS:(j + 1) * BS].astype(np.int32).tobytes()
        key = xxh3_128(parent + t)
        entries.append({"key": key, "parent": parent, "depth": j, "tokens": t, "hits": 0})
        keys.append(key)
        parent = key
    for first in range(0, len(entries), staging_slots):
        chunk = [dict(e, slot=i) for i, e in enumerate(entries[first:first + staging_slots])]
        assert all(c.call("publish", root=root, entries=chunk)["taken"])
    return keys


def pinned(c: Client) -> int:
    s = json.loads(c.call("stats")["json"])
    return s["partition"]["tiers"]["host"]["pinned_blocks"]


def test_a_fetch_matching_more_than_a_reply_carries_is_answered_with_a_prefix(tmp_path, nodes):
    n = MAX_BLOCKS + 904
    node = start(tmp_path, host_blocks=n + 64, staging_blocks=MAX_BLOCKS, max_frame_mib=64)
    nodes.append(node)
    c = client(node)
    try:
        c.call("hello")
        _ = c.request("attach")
        root = c.call("root", salt=b"")["root"]
        tokens = np.arange(7, 7 + n * BS)
        keys = _publish_chain(c, root, tokens, MAX_BLOCKS)
        try:
            got = c.call("fetch", root=root, parent=root, tokens=tokens, wait_ms=10_000)
        except DaemonError as exc:
            pytest.fail(f"a fetch of {n} cached blocks was refused: {exc!r}")
        assert got["handle"] and len(got["slots"]) == MAX_BLOCKS
        assert pinned(c) == MAX_BLOCKS           # nothing past the reply is held
        assert c.call("release", handle=got["handle"])["held"]
        assert pinned(c) == 0
        rest = c.call("fetch", root=root, parent=keys[MAX_BLOCKS - 1],
                      tokens=tokens[MAX_BLOCKS * BS:], wait_ms=10_000)
        assert len(rest["slots"]) == n - MAX_BLOCKS
        assert len(set(got["slots"]) | set(rest["slots"])) == n
        c.call("release", handle=rest["handle"])
        assert json.loads(c.call("stats")["json"])["service"]["server"]["failures"] == {}
    finally:
        c.close()
    assert node.stop() == 0, node.log()[-3000:]
