"""The node daemon with real processes: `tiered-cache serve` and engine processes attached to it
(tests/daemon_engine.py), SIGKILL and SIGSTOP of clients, the daemon killed and restarted under
load, tenants, and a fuzzed client against the live service."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from tiered_cache.daemon.process import NodeProcess
from tiered_cache.wire.client import Client
from tiered_cache.wire.errors import LeaseExpiredError
from tiered_cache.wire.ops import make_protocol
from tiered_cache.wire.shm import PoolGeometry, SharedPool

pytestmark = pytest.mark.slow     # processes, servers or sweeps (tests/conftest.py)

HERE = Path(__file__).resolve().parents[1]     # tests/
ENGINE = str(HERE / "daemon_engine.py")
BLOCK = 4


def write_config(tmp: Path, **daemon) -> tuple[Path, str]:
    sock = str(tmp / "s" / "d.sock")
    extra = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in daemon.items())
    cfg = tmp / "daemon.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        model: {{name: tiny, num_layers: 2, num_kv_heads: 2, head_dim: 8, num_q_heads: 4,
                dtype: float32}}
        block_size: {BLOCK}
        tiers:
          gpu: {{num_blocks: 8, device: cpu}}
          host: {{num_blocks: 256}}
          disk: {{num_blocks: 512, path: {tmp / 'disk'}}}
        daemon:
          socket: {sock}
          lease_s: 2
        """) + extra)
    return cfg, sock


@pytest.fixture
def node(tmp_path):
    cfg, sock = write_config(tmp_path)
    proc = NodeProcess(cfg, sock, log_path=tmp_path / "daemon.log").start()
    yield proc
    proc.kill() if proc.proc and proc.proc.poll() is None else None


def engine(sock: str, *args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, ENGINE, sock, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def result(proc: subprocess.Popen, timeout: float = 120) -> list[dict]:
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, err[-3000:]
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def connect(sock: str) -> tuple[Client, dict]:
    c = Client(sock, make_protocol(), timeout_s=10).connect()
    return c, c.call("hello")


def stats(sock: str) -> dict:
    c, _ = connect(sock)
    try:
        return json.loads(c.call("stats")["json"])
    finally:
        c.close()


def wait_for(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


# ------------------------------------------------------------------ sharing


def test_three_engine_processes_share_prefixes_with_identical_data(node):
    sock = node.socket_path
    [a] = result(engine(sock, "write", 1000, 96))
    assert a["cached"] == 0 and a["ok"] and a["published"] == 24, a
    # B and C at once: each finds A's 24 blocks (or more: the other's continuation, which
    # overlaps its own), checks every cached token's KV, and adds its own continuation.
    b, c = engine(sock, "read", 1000, 96 + 8), engine(sock, "read", 1000, 96 + 12)
    [rb], [rc] = result(b), result(c)
    for r in (rb, rc):
        assert r["ok"] and r["cached"] >= 96 and r["by_tier"]["daemon"] >= 96
    s = stats(sock)["partition"]
    # One copy per block on the node: A's 24 and the 3 of the longer continuation (a block
    # both computed at once is taken once; the second publish of its key is refused).
    assert s["daemon"]["published_blocks"] == 27
    assert s["cached_blocks"] == 27
    [rd] = result(engine(sock, "read", 1000, 96 + 12))
    assert rd["ok"] and rd["cached"] == 108


def test_salts_separate_prefixes_within_a_tenant(node):
    sock = node.socket_path
    result(engine(sock, "write", 5000, 32, "alpha"))
    [same] = result(engine(sock, "read", 5000, 32, "alpha"))
    [other] = result(engine(sock, "read", 5000, 32, "beta"))
    assert same["cached"] == 32 and same["ok"]
    assert other["cached"] == 0


# ------------------------------------------------------------------ leases


HOLDER = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    from tiered_cache.wire.client import Client
    from tiered_cache.wire.ops import make_protocol
    sock, first, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    c = Client(sock, make_protocol(), timeout_s=10).connect()
    c.call("hello")
    root = c.call("root", salt=b"")["root"]
    r = c.call("fetch", root=root, parent=root, tokens=np.arange(first, first + n), wait_ms=5000)
    print(json.dumps({"handle": r["handle"], "slots": len(r["slots"])}), flush=True)
    sys.stdin.readline()        # hold the pins until told (or killed)
    try:
        print(json.dumps({"held": c.call("release", handle=r["handle"])["held"]}), flush=True)
    except Exception as exc:
        print(json.dumps({"error": type(exc).__name__}), flush=True)
""")


def holder(sock: str, first: int, n: int) -> tuple[subprocess.Popen, dict]:
    p = subprocess.Popen([sys.executable, "-c", HOLDER, sock, str(first), str(n)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    return p, json.loads(p.stdout.readline())


def pinned(sock: str) -> tuple[int, int]:
    s = stats(sock)
    return s["service"]["handles"], s["partition"]["tiers"]["host"]["pinned_blocks"]


def test_sigkill_of_a_client_holding_pins_releases_them(node):
    sock = node.socket_path
    result(engine(sock, "write", 2000, 64))
    p, got = holder(sock, 2000, 64)
    assert got["handle"] and got["slots"] == 16
    assert pinned(sock) == (1, 16)
    os.kill(p.pid, signal.SIGKILL)
    p.wait()
    # The kernel closes the dead process's socket: the reap follows at once (well within the
    # 2 s lease).
    wait_for(lambda: pinned(sock) == (0, 0), "the dead client's pins to be reaped", 5)
    assert stats(sock)["service"]["reaped_handles"] >= 1


def test_a_stalled_client_loses_its_pins_after_its_lease_and_is_told(node):
    sock = node.socket_path
    result(engine(sock, "write", 3000, 32))
    p, got = holder(sock, 3000, 32)
    assert pinned(sock) == (1, 8)
    os.kill(p.pid, signal.SIGSTOP)           # alive, connected, silent: only the lease ends it
    try:
        wait_for(lambda: pinned(sock) == (0, 0), "the stalled client's lease to expire", 10)
    finally:
        os.kill(p.pid, signal.SIGCONT)
    p.stdin.write("\n")
    p.stdin.flush()
    told = json.loads(p.stdout.readline())
    # What it copied under the handle meanwhile cannot be trusted, and it learns so.
    assert told == {"error": "LeaseExpiredError"} or told == {"held": False}
    p.wait(timeout=30)


# ------------------------------------------------------------------ restarts


def test_daemon_killed_and_restarted_under_load(tmp_path):
    cfg, sock = write_config(tmp_path)
    d = NodeProcess(cfg, sock, log_path=tmp_path / "d.log").start()
    load = engine(sock, "loop", 7000, 0, 240)
    rounds: list[dict] = []

    def read(until) -> None:
        while not until():
            line = load.stdout.readline()
            assert line, load.stderr.read()[-3000:]
            rounds.append(json.loads(line))

    try:
        read(lambda: any(r["by_tier"].get("daemon") for r in rounds))
        d.kill()                              # SIGKILL, mid-load: no drain, no goodbye
        killed_at = len(rounds)
        read(lambda: len(rounds) > killed_at + 10)
        d = NodeProcess(cfg, sock, log_path=tmp_path / "d.log").start()
        restarted_at = len(rounds)
        rounds += [json.loads(line) for line in load.communicate(timeout=300)[0].splitlines()]
    finally:
        d.kill()
    assert load.returncode == 0 and len(rounds) == 240
    # Never wrong KV: every cached token of every round checked, across the kill.
    assert all(r["ok"] for r in rounds), [r for r in rounds if not r["ok"]][:3]
    # Served locally while the daemon was gone; attached again by itself; served from the
    # new daemon afterwards.
    assert not any(r["by_tier"].get("daemon") for r in rounds[killed_at + 2:restarted_at])
    assert rounds[-1]["attaches"] == 2
    assert any(r["by_tier"].get("daemon") for r in rounds[restarted_at:]), (
        killed_at, restarted_at, rounds[restarted_at:][::10])


def test_sigterm_drains_the_pool_to_disk_and_a_restart_recovers_it(tmp_path):
    cfg, sock = write_config(tmp_path)
    d = NodeProcess(cfg, sock, log_path=tmp_path / "d.log").start()
    result(engine(sock, "write", 4000, 80))
    assert d.stop() == 0                     # SIGTERM
    assert "20 blocks written to disk" in d.log() or "blocks written to disk" in d.log()
    d = NodeProcess(cfg, sock, log_path=tmp_path / "d.log").start()
    try:
        [r] = result(engine(sock, "read", 4000, 80))
    finally:
        d.stop()
    assert r["ok"] and r["cached"] == 80


def test_an_engine_started_before_the_daemon_attaches_when_it_comes(tmp_path):
    cfg, sock = write_config(tmp_path)
    code = textwrap.dedent(f"""
        import json, sys, time
        sys.path.insert(0, {str(HERE)!r})
        import daemon_engine as e
        from tiered_cache import TieredKVCache
        with TieredKVCache(e.config({sock!r})) as c:
            first = e.step(c, list(range(100, 132)), None)      # no daemon: served locally
            print(json.dumps({{"available": c.stores[0].available}}), flush=True)
            sys.stdin.readline()
            deadline = time.monotonic() + 30
            while not c.stores[0].available and time.monotonic() < deadline:
                time.sleep(0.05)
            second = e.step(c, list(range(200, 232)), None)
            print(json.dumps({{"available": c.stores[0].available, "first": first,
                               "published": e.wait_published(c, 8)}}), flush=True)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert json.loads(p.stdout.readline()) == {"available": False}
    d = NodeProcess(cfg, sock, log_path=tmp_path / "d.log").start()
    try:
        p.stdin.write("\n")
        p.stdin.flush()
        late = json.loads(p.stdout.readline())
        assert p.wait(timeout=60) == 0
        assert late["available"] and late["first"]["ok"] and late["published"] == 8
        [r] = result(engine(sock, "read", 200, 32))
        assert r["cached"] == 32 and r["ok"]
    finally:
        d.stop()


def test_blocks_computed_while_the_daemon_was_away_are_published_when_it_is_back(tmp_path):
    cfg, sock = write_config(tmp_path)
    d = NodeProcess(cfg, sock, log_path=tmp_path / "d.log").start()
    code = textwrap.dedent(f"""
        import json, sys, time
        sys.path.insert(0, {str(HERE)!r})
        import daemon_engine as e
        from tiered_cache import TieredKVCache

        def until(cond):
            deadline = time.monotonic() + 30
            while not cond() and time.monotonic() < deadline:
                time.sleep(0.05)
            return cond()

        with TieredKVCache(e.config({sock!r})) as c:
            daemon = c.stores[0]
            print(json.dumps({{"attached": until(lambda: daemon.available)}}), flush=True)
            sys.stdin.readline()                            # the daemon is killed
            gone = until(lambda: not daemon.available)
            away = e.step(c, list(range(300, 364)), None)   # computed while it is away
            print(json.dumps({{"gone": gone, "away": away}}), flush=True)
            sys.stdin.readline()                            # a new daemon is up
            back = until(lambda: daemon.available)
            taken = until(lambda: c.stats()["tiers"]["daemon"]["store"]["taken_blocks"] >= 16)
            print(json.dumps({{"back": back, "taken": taken}}), flush=True)
    """)
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert json.loads(p.stdout.readline()) == {"attached": True}
        d.kill()                                            # SIGKILL: nothing drained
        p.stdin.write("\n")
        p.stdin.flush()
        away = json.loads(p.stdout.readline())
        assert away["gone"] and away["away"]["cached"] == 0 and away["away"]["ok"]
        d = NodeProcess(cfg, sock, log_path=tmp_path / "d.log").start()
        p.stdin.write("\n")
        p.stdin.flush()
        assert json.loads(p.stdout.readline()) == {"back": True, "taken": True}
        assert p.wait(timeout=60) == 0, p.stderr.read()[-3000:]
        # Another engine finds what the first computed while the daemon was gone.
        [r] = result(engine(sock, "read", 300, 64))
        assert r["ok"] and r["cached"] == 64 and r["by_tier"]["daemon"] == 64
    finally:
        p.kill()
        d.stop()


# ------------------------------------------------------------------ tenants


def test_two_tenants_cannot_reach_each_others_blocks(tmp_path):
    cfg, sock = write_config(tmp_path, tenants={"gid:0": "red", "gid:65534": "blue"})
    d = NodeProcess(cfg, sock, log_path=tmp_path / "d.log").start()
    try:
        [w] = result(engine(sock, "write", 9000, 64))         # gid 0: tenant red
        assert w["daemon"]["tenant"] == "red"
        blue = textwrap.dedent(f"""
            import json, os, sys
            os.setgroups([]); os.setgid(65534)                    # uid 0, gid 65534: blue
            sys.path.insert(0, {str(HERE)!r})
            import numpy as np, torch
            import daemon_engine as e
            from tiered_cache import TieredKVCache
            from tiered_cache.wire.client import Client
            from tiered_cache.wire.ops import make_protocol
            from tiered_cache.wire.shm import PoolGeometry, SharedPool
            from tiered_cache.hashing import BlockHasher, Namespace
            out = {{}}
            with TieredKVCache(e.config({sock!r})) as c:
                seq = c.open(list(range(9000, 9064)))
                out["cached"] = seq.num_cached_tokens
                out["tenant"] = c.stores[0].tenant
                c.close(seq)
            cl = Client({sock!r}, make_protocol()).connect()
            hello = cl.call("hello")
            # Claiming red's salt derives a root of blue's own, not red's.
            claimed = cl.call("root", salt=b"red")["root"]
            ns = Namespace("tiny", "float32", 2, 2, 8, {BLOCK})
            red_root = BlockHasher(ns, tenant=b"red").root()[0]
            out["claimed_is_red"] = claimed == red_root
            try:
                cl.call("fetch", root=red_root, parent=red_root,
                        tokens=np.arange(9000, 9064), wait_ms=100)
                out["fetch"] = "served"
            except Exception as exc:
                out["fetch"] = getattr(exc, "wire_type", type(exc).__name__)
            reply = cl.request("attach")
            f = dict(reply.fields); f.pop("staging_slots")
            pool = SharedPool.attach(reply.fds[0], PoolGeometry.from_fields(f), writable=False)
            os.close(reply.fds[1])
            out["pool_nonzero"] = int(torch.count_nonzero(pool.kv.view(torch.uint8)))
            print(json.dumps(out))
        """)
        p = subprocess.run([sys.executable, "-c", blue], capture_output=True, text=True,
                           timeout=120)
        assert p.returncode == 0, p.stderr[-3000:]
        out = json.loads(p.stdout.strip().splitlines()[-1])
        assert out["tenant"] == "blue" and out["cached"] == 0
        assert not out["claimed_is_red"]
        assert out["fetch"] == "unknown_root"
        # Blue's mapping is blue's pool: not one byte of red's KV is in it.
        assert out["pool_nonzero"] == 0
        [again] = result(engine(sock, "read", 9000, 64))     # red still finds its own
        assert again["cached"] == 64 and again["ok"]
    finally:
        d.stop()


# ------------------------------------------------------------------ the protocol, fuzzed


def test_forged_and_malformed_publishes_are_refused_and_change_nothing(node):
    import torch

    torch.empty(1 << 16).fill_(1.0)     # a process's first parallel torch op can take seconds:
    sock = node.socket_path             # not inside this client's 2 s lease (no heartbeats)
    c, hello = connect(sock)
    reply = c.request("attach")
    f = dict(reply.fields)
    n_staging = f.pop("staging_slots")
    os.close(reply.fds[0])
    staging = SharedPool.attach(reply.fds[1], PoolGeometry(n_staging, 2, BLOCK, 2, 8,
                                                           "float32"))
    staging.kv.fill_(1.0)
    root = c.call("root", salt=b"")["root"]
    toks = np.arange(50, 50 + BLOCK, dtype="<i4").tobytes()
    forged = {"slot": 0, "key": b"k" * 16, "parent": root, "depth": 0, "tokens": toks, "hits": 0}
    assert c.call("publish", root=root, entries=[forged])["taken"] == [0]
    for bad, why in (([{**forged, "slot": n_staging}], "staging"),
                     ([{**forged, "tokens": toks[:-4]}], "tokens"),
                     ([forged, {**forged, "depth": 1}], "entries[1].slot"),     # repeated
                     ([{**forged, "depth": 1}, {**forged, "slot": 1}], "entries[1].depth")):
        with pytest.raises(Exception) as info:
            c.call("publish", root=root, entries=bad)
        assert info.value.wire_type == "bad_entry" and why in str(info.value)
    s = stats(sock)["partition"]
    assert s["cached_blocks"] == 0 and s["tiers"]["host"]["used_blocks"] == 0
    with pytest.raises(LeaseExpiredError):
        Client(sock, make_protocol()).connect().call("fetch", root=root, parent=root,
                                                     tokens=np.arange(4), wait_ms=0)
    staging.close()
    c.close()


def test_random_requests_never_hurt_the_daemon(node):
    sock = node.socket_path
    result(engine(sock, "write", 11000, 64))
    rng = np.random.default_rng(0)
    c, _ = connect(sock)
    reply = c.request("attach")
    for fd in reply.fds:
        os.close(fd)
    root = c.call("root", salt=b"")["root"]
    errors = 0
    for _ in range(400):
        op = rng.choice(["fetch", "release", "publish", "lookup", "root", "invalidate"])
        key = bytes(rng.integers(0, 256, 16, dtype=np.uint8))
        toks = rng.integers(0, 2**31 - 1, int(rng.integers(0, 64)))
        if rng.random() < 0.5:
            toks = np.arange(11000, 11000 + int(rng.integers(0, 64)))
        r = root if rng.random() < 0.7 else key
        fields = {
            "fetch": dict(root=r, parent=r if rng.random() < 0.6 else key, tokens=toks,
                          wait_ms=int(rng.integers(0, 50))),
            "release": dict(handle=int(rng.integers(0, 10))),
            "publish": dict(root=r, entries=[{
                "slot": int(rng.integers(0, 40)), "key": key, "parent": r,
                "depth": int(rng.integers(0, 3)), "hits": 0,
                "tokens": rng.integers(0, 99, int(rng.choice([BLOCK, 3])), dtype="<i4")
                .tobytes()}]),
            "lookup": dict(root=r, parent=key if rng.random() < 0.3 else r, tokens=toks),
            "root": dict(salt=bytes(rng.integers(0, 256, int(rng.integers(0, 20)),
                                                 dtype=np.uint8))),
            "invalidate": dict(root=r, tokens=toks[:0]),
        }[op]
        try:
            c.call(op, **fields)
        except Exception as exc:
            assert getattr(exc, "wire_type", None) in (
                "bad_entry", "unknown_root", "schema"), exc
            errors += 1
    s = stats(sock)
    assert s["service"]["server"]["failures"] == {}          # no handler ever crashed
    assert errors > 0
    # Handles the fuzzer opened and never released are released when it goes away.
    c.close()
    wait_for(lambda: pinned(sock) == (0, 0), "the fuzzer's handles to be reaped", 5)
    [r] = result(engine(sock, "read", 11000, 64))
    assert r["ok"] and r["cached"] == 64
