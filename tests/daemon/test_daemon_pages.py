"""The daemon's page ops with real processes: `tiered-cache serve`, engine processes using the
page store through it (tests/page_client.py), SIGKILL of a client holding pins, a restart that
recovers the pages from the daemon's disk, a corrupted page record, two daemons sharing pages
through a real redis-server, and random page requests against the live service."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from tests import redis_servers as rs
from tests.oracles import wait_for
from tests.pages.test_pages import FMT, PART, PB, page
from tiered_cache.daemon.pages import PageSpaceError
from tiered_cache.daemon.process import NodeProcess
from tiered_cache.pages import identity
from tiered_cache.pages.daemon import DaemonPages
from tiered_cache.pages.disk import PageDisk
from tiered_cache.pages.store import PageStore, part_name
from tiered_cache.wire.client import Client
from tiered_cache.wire.errors import DaemonError, LeaseExpiredError, VersionError
from tiered_cache.wire.ops import make_protocol

pytestmark = pytest.mark.slow     # processes, servers or sweeps (tests/conftest.py)

HERE = Path(__file__).resolve().parents[1]     # tests/
CLIENT = str(HERE / "page_client.py")


def write_config(tmp: Path, name: str = "d", remote: str | None = None,
                 **daemon) -> tuple[Path, str]:
    sock = str(tmp / name / "d.sock")
    daemon = {"page_pool_mib": 1, "page_disk_mib": 4, "lease_s": 2, "staging_blocks": 4,
              **daemon}
    extra = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in daemon.items())
    remote_line = f"  remote: {{url: {json.dumps(remote)}}}\n" if remote else ""
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        model: {{name: tiny, num_layers: 2, num_kv_heads: 2, head_dim: 8, num_q_heads: 4,
                dtype: float32}}
        block_size: 4
        tiers:
          gpu: {{num_blocks: 8, device: cpu}}
          host: {{num_blocks: 16}}
          disk: {{num_blocks: 16, path: {tmp / (name + '-disk')}}}
        """) + remote_line + f"daemon:\n  socket: {sock}\n" + extra)
    return cfg, sock


@pytest.fixture
def node(tmp_path):
    cfg, sock = write_config(tmp_path)
    proc = NodeProcess(cfg, sock, log_path=tmp_path / "daemon.log").start()
    yield proc
    if proc.proc and proc.proc.poll() is None:
        proc.kill()


def client(sock: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, CLIENT, sock, *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen, timeout: float = 120) -> dict:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def store(sock: str) -> PageStore:
    return PageStore(FMT, daemon=DaemonPages(sock, FMT, timeout_s=10), lookup_deadline_s=1.0)


def space_stats(sock: str) -> dict:
    c = Client(sock, make_protocol(), timeout_s=10).connect()
    try:
        c.call("hello")
        [space] = json.loads(c.call("stats")["json"])["pages"].values()
        return space
    finally:
        c.close()


def test_a_page_one_process_puts_is_found_by_another(node):
    sock = node.socket_path
    names = [f"n{i}" for i in range(10)]          # more than one staging area (4) at once
    assert result(client(sock, "put", *names))["stored"] == [True] * 10
    st = store(sock)
    assert st.exists(names + ["absent"], PART) == 10
    assert st.exists(names, part_name(1, 2, False)) == 0          # another rank's part
    outs = [np.zeros(PB, np.uint8) for _ in names]
    assert st.get(names, outs, PART) == [True] * 10
    assert all(np.array_equal(o, page(n)) for o, n in zip(outs, names))
    got = result(client(sock, "get", "n3", "n4", "absent", "n5"))
    # the daemon answers the leading run (what an engine loads is a prefix)
    assert got == {"ok": [True, True, False, False], "equal": [True, True, False, False]}
    st.close()


def test_pool_evicts_to_disk_and_pages_come_back(node):
    sock = node.socket_path
    st = store(sock)
    many = [f"m{i}" for i in range(150)]          # the 1 MiB pool holds 128 pages of 8 KiB
    assert all(st.put(many, [page(n) for n in many], PART))
    s = space_stats(sock)
    assert s["evicted"] > 0 and s["pages"] == s["slots"]
    outs = [np.zeros(PB, np.uint8) for _ in many[:5]]
    assert st.get(many[:5], outs, PART) == [True] * 5            # from the daemon's disk
    assert all(np.array_equal(o, page(n)) for o, n in zip(outs, many[:5]))
    assert space_stats(sock)["disk_loads"] >= 5
    st.close()


def test_sigkill_of_a_client_holding_pins_releases_them(node):
    sock = node.socket_path
    result(client(sock, "put", "h0", "h1"))
    holder = client(sock, "hold", "h0", "h1")
    line = holder.stdout.readline()
    assert json.loads(line)["slots"] == 2
    assert space_stats(sock)["pinned"] == 2
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    wait_for(lambda: space_stats(sock)["pinned"] == 0, "the killed client's pins", 10)


def test_restart_recovers_pages_from_disk_and_a_corrupt_one_is_a_miss(tmp_path):
    cfg, sock = write_config(tmp_path)
    node = NodeProcess(cfg, sock, log_path=tmp_path / "daemon.log").start()
    try:
        assert result(client(sock, "put", "a", "b", "c"))["stored"] == [True] * 3
    finally:
        node.stop()
    # flip a byte of "b"'s payload on the daemon's page disk
    [ns_dir] = (tmp_path / "d-disk").glob(f"*/pages/{FMT.digest().hex()}")
    disk = PageDisk(ns_dir.parent, num_pages=8, format=FMT)
    offsets = [e.slot * disk.pool.layout.payload_stride for e in disk._index.values()
               if identity.stored_key(e.header) == b"b"]
    assert len(offsets) == 1 and len(disk) == 3
    off = offsets[0]
    disk.close()
    with open(ns_dir / "payloads", "r+b") as f:
        f.seek(off + 10)
        b = f.read(1)
        f.seek(off + 10)
        f.write(bytes([b[0] ^ 1]))
    node = NodeProcess(cfg, sock, log_path=tmp_path / "daemon2.log").start()
    try:
        got = result(client(sock, "get", "a", "b", "c"))
        assert got == {"ok": [True, False, False], "equal": [True, False, False]}
        assert result(client(sock, "put", "b"))["stored"] == [True]       # rewritten
        assert result(client(sock, "get", "b")) == {"ok": [True], "equal": [True]}
        assert space_stats(sock)["disk"]["corrupt"] == 1
    finally:
        node.kill()


def test_two_daemons_share_pages_through_redis(tmp_path):
    rs.require()
    with rs.RedisServer() as srv:
        cfg_a, sock_a = write_config(tmp_path, "a", remote=srv.url, page_disk_mib=0)
        cfg_b, sock_b = write_config(tmp_path, "b", remote=srv.url, page_disk_mib=0)
        a = NodeProcess(cfg_a, sock_a, log_path=tmp_path / "a.log").start()
        b = NodeProcess(cfg_b, sock_b, log_path=tmp_path / "b.log").start()
        try:
            assert result(client(sock_a, "put", "x", "y"))["stored"] == [True, True]
            st = store(sock_b)
            wait_for(lambda: st.exists(["x", "y"], PART) == 2, "the puts to reach redis", 20)
            outs = [np.zeros(PB, np.uint8), np.zeros(PB, np.uint8)]
            assert st.get(["x", "y"], outs, PART) == [True, True]
            assert np.array_equal(outs[0], page("x")) and np.array_equal(outs[1], page("y"))
            assert space_stats(sock_b)["remote_loads"] == 2
            st.close()
        finally:
            a.kill()
            b.kill()


def test_page_ops_refuse_bad_requests_and_change_nothing(node):
    sock = node.socket_path
    c = Client(sock, make_protocol(), timeout_s=10).connect()
    c.call("hello")
    with pytest.raises(PageSpaceError, match="not attached"):
        c.call("page_exists", space=1, parts=[PART], keys=[b"k"], deadline_ms=0)
    with pytest.raises(VersionError, match="version 2"):
        c.request("page_attach", {"version": 2, "format": FMT.digest(), "page_bytes": PB})
    reply = c.request("page_attach", {"version": 1, "format": FMT.digest(), "page_bytes": PB})
    for fd in reply.fds:
        os.close(fd)
    space, n = reply.fields["space"], reply.fields["staging_slots"]
    for entries, why in (([{"slot": n, "key": b"k"}], "outside"),
                         ([{"slot": 0, "key": b"k"}, {"slot": 0, "key": b"j"}], "repeated"),
                         ([{"slot": 0, "key": b"k"}, {"slot": 1, "key": b"k"}], "twice")):
        with pytest.raises(PageSpaceError, match=why):
            c.call("page_put", space=space, part=PART, entries=entries)
    assert space_stats(sock)["pages"] == 0
    c.close()
    with pytest.raises(LeaseExpiredError):
        Client(sock, make_protocol()).connect().call("page_exists", space=space, parts=[PART],
                                                     keys=[], deadline_ms=0)


def test_random_page_requests_never_hurt_the_daemon(node):
    sock = node.socket_path
    result(client(sock, "put", "r0", "r1", "r2"))
    rng = np.random.default_rng(1)
    c = Client(sock, make_protocol(), timeout_s=10).connect()
    c.call("hello")
    reply = c.request("page_attach", {"version": 1, "format": FMT.digest(), "page_bytes": PB})
    for fd in reply.fds:
        os.close(fd)
    space = reply.fields["space"]
    errors = 0
    for _ in range(300):
        op = rng.choice(["page_exists", "page_get", "page_put", "release"])
        keys = [(b"r%d" % rng.integers(0, 5)) if rng.random() < 0.7
                else bytes(rng.integers(1, 256, int(rng.integers(1, 30)), dtype=np.uint8))
                for _ in range(int(rng.integers(1, 6)))]
        sp = space if rng.random() < 0.8 else int(rng.integers(1, 50))
        fields = {
            "page_exists": dict(space=sp, parts=[PART], keys=keys,
                                deadline_ms=int(rng.integers(0, 20))),
            "page_get": dict(space=sp, part=PART, keys=keys, deadline_ms=int(rng.integers(0, 20))),
            "page_put": dict(space=sp, part=PART, entries=[
                {"slot": int(rng.integers(0, 6)), "key": k} for k in keys]),
            "release": dict(handle=int(rng.integers(0, 20))),
        }[op]
        try:
            c.call(op, **fields)
        except DaemonError as exc:
            assert exc.wire_type in ("page_space",), exc
            errors += 1
    assert errors > 0
    c.close()
    wait_for(lambda: space_stats(sock)["pinned"] == 0, "the fuzzer's pins to be reaped", 10)
    assert result(client(sock, "get", "r0", "r1", "r2")) == {"ok": [True] * 3,
                                                             "equal": [True] * 3}
    c = Client(sock, make_protocol(), timeout_s=10).connect()
    c.call("hello")
    s = json.loads(c.call("stats")["json"])
    assert s["service"]["server"]["failures"] == {}             # no handler ever crashed
    c.close()


def test_a_page_pool_the_machine_cannot_give_is_refused_at_attach(tmp_path):
    cfg, sock = write_config(tmp_path, page_pool_mib=1 << 23, page_disk_mib=0)    # 8 TiB
    node = NodeProcess(cfg, sock, log_path=tmp_path / "daemon.log").start()
    try:
        c = Client(sock, make_protocol(), timeout_s=10).connect()
        c.call("hello")
        with pytest.raises(PageSpaceError, match="daemon.page_pool_mib"):
            c.request("page_attach", {"version": 1, "format": FMT.digest(), "page_bytes": PB})
        c.close()
        st = store(sock)                        # the engine's page store: misses, no error
        assert st.put(["a"], [page("a")], PART) == [False]
        assert st.exists(["a"], PART) == 0
        st.close()
    finally:
        node.kill()
