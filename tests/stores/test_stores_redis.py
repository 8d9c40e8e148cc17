"""RedisStore against real `redis-server` processes (no mocks): round trips, sharing between
processes, tenant isolation, Redis Cluster, TLS, ACL users, and every fault the remote tier must
survive (a killed server, server-side eviction, corrupt values, a slow link, bad credentials).

The one rule checked throughout: a read returns the exact record that was written for that key,
or None. No test asserts a duration; deadlines are shown by what the call returned.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import redis_servers as rs

rs.require()

from tiered_cache import records  # noqa: E402
from tiered_cache.costs import TierCost  # noqa: E402
from tiered_cache.stores import KeyedStore, StoreAuthError, StoreUnavailableError  # noqa: E402
from tiered_cache.stores.redis import RedisStore  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
ROOT_A, ROOT_B = b"A" * 16, b"B" * 16


@pytest.fixture(scope="module")
def cluster():
    with rs.RedisClusterServers(3) as cl:
        yield cl


@pytest.fixture
def ns() -> bytes:
    """A fresh namespace per test: tests share the module's server without seeing each other."""
    return os.urandom(16)


@pytest.fixture
def open_store():
    made: list[RedisStore] = []

    def make(url: str, namespace: bytes, **kw) -> RedisStore:
        kw.setdefault("num_tokens", 16)
        s = RedisStore(url, namespace=namespace, **kw)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def blocks(ns: bytes, root: bytes, n: int, **kw) -> list[tuple[bytes, bytes]]:
    return [rs.sample_record(ns, root, i, **kw) for i in range(n)]


def counters(store: RedisStore) -> dict[str, int]:
    return {k: v for k, v in store.stats().items() if isinstance(v, int) and k != "cluster"}


# --------------------------------------------------------------------------- round trips


@pytest.mark.slow
def test_round_trip(redis_server, ns, open_store):
    store = open_store(redis_server.url, ns)
    assert isinstance(store, KeyedStore)
    items = blocks(ns, ROOT_A, 8)
    assert store.put(ROOT_A, items) == 8
    absent = b"\x00" * 16
    keys = [k for k, _ in items]
    assert store.exists(ROOT_A, keys + [absent], deadline_s=5.0) == [True] * 8 + [False]
    got = store.get(ROOT_A, keys + [absent])
    assert got[:8] == [r for _, r in items] and got[8] is None
    header, payload = records.decode(got[3], namespace=ns, expect_key=keys[3])
    assert header.depth == 3 and header.parent == keys[2] and len(payload) == 4096
    st = store.stats()
    assert st["hits"] == 8 and st["misses"] == 1 and st["puts"] == 8
    assert st["bytes_out"] == st["bytes_in"] == sum(len(r) for _, r in items)
    assert st["errors"] == st["corrupt"] == st["timeouts"] == 0
    assert st["latency"]["get"]["count"] == 1 and st["latency"]["exists"]["count"] == 1
    assert st["available"] and st["breaker"] == "closed"
    assert store.delete(ROOT_A, keys[:2] + [absent]) == 2
    assert store.exists(ROOT_A, keys[:3], 5.0) == [False, False, True]
    assert store.exists(ROOT_A, [], 5.0) == [] and store.get(ROOT_A, []) == []
    # no time left: misses without asking, and not held against the server
    assert store.exists(ROOT_A, keys[2:4], 0.0) == [False, False]
    assert store.get(ROOT_A, keys[2:4], deadline_s=0.0) == [None, None]
    st = store.stats()
    assert st["timeouts"] == st["errors"] == 0 and store.available


@pytest.mark.slow
def test_server_key_schema(redis_server, ns, open_store):
    store = open_store(redis_server.url, ns, prefix="tctest")
    key, record = rs.sample_record(ns, ROOT_A, 0)
    store.put(ROOT_A, [(key, record)])
    expect = f"tctest:v{records.VERSION}:{ns.hex()}:{ROOT_A.hex()}:{key.hex()}".encode()
    assert store.server_key(ROOT_A, key) == expect
    with redis_server.raw() as raw:
        assert raw.get(expect) == record               # one key per block, the whole record
        assert raw.keys(f"tctest:v{records.VERSION}:{ns.hex()}:*".encode()) == [expect]


@pytest.mark.slow
def test_batches_are_bounded(redis_server, ns, open_store):
    # 10 records of ~4.2 KB with 9 KB batches: several pipelines each way, same answers.
    store = open_store(redis_server.url, ns, batch_bytes=9000, batch_keys=3)
    items = blocks(ns, ROOT_A, 10)
    assert store.put(ROOT_A, items) == 10
    keys = [k for k, _ in items]
    assert store.exists(ROOT_A, keys, 5.0) == [True] * 10
    assert store.get(ROOT_A, keys) == [r for _, r in items]
    assert store.get(ROOT_A, keys, deadline_s=5.0) == [r for _, r in items]
    # a store that has seen no record yet sizes its first batches blind: same answers
    fresh = open_store(redis_server.url, ns, batch_bytes=9000)
    absent = [bytes([i]) * 16 for i in range(5)]
    assert fresh.get(ROOT_A, absent + keys) == [None] * 5 + [r for _, r in items]


@pytest.mark.slow
def test_put_async(redis_server, ns, open_store):
    cost = TierCost("remote", latency_s=1e-3, bandwidth_bps=1e9)
    store = open_store(redis_server.url, ns, cost=cost)
    items = blocks(ns, ROOT_A, 20)
    assert store.put_async(ROOT_A, items) == 20
    assert store.flush(30)
    assert store.get(ROOT_A, [k for k, _ in items]) == [r for _, r in items]
    assert store.stats()["puts"] == 20
    store.exists(ROOT_A, [items[0][0]], 5.0)
    assert cost.latency_samples == 1 and cost.bandwidth_samples == 1


@pytest.mark.slow
def test_put_async_full_queue_drops_and_never_blocks(redis_server, ns, open_store):
    items = blocks(ns, ROOT_A, 5)
    size = len(items[0][1])
    store = open_store(redis_server.url, ns, put_queue_bytes=2 * size + size // 2)
    assert store.put_async(ROOT_A, items) == 2
    assert store.stats()["dropped_puts"] == 3
    assert store.flush(30)


@pytest.mark.slow
def test_bad_input_is_refused_before_sending(redis_server, ns, open_store):
    store = open_store(redis_server.url, ns)
    (k0, r0), (k1, r1) = blocks(ns, ROOT_A, 2)
    with pytest.raises(ValueError, match="offered under"):
        store.put(ROOT_A, [(k1, r0)])                          # a record under another key
    with pytest.raises(ValueError, match="another tenant"):
        store.put(ROOT_B, [(k0, r0)])
    other_ns = rs.sample_record(os.urandom(16), ROOT_A, 0)
    with pytest.raises(ValueError, match="namespace"):
        store.put(ROOT_A, [other_ns])
    with pytest.raises(ValueError, match="bytes"):
        store.put(ROOT_A, [(k0, r0[:-1])])                     # payload cut short
    with pytest.raises(ValueError, match="tokens per block"):
        store.put(ROOT_A, [rs.sample_record(ns, ROOT_A, 0, num_tokens=8)])
    with pytest.raises(TypeError, match="must be bytes"):
        store.put_async(ROOT_A, [(k0, memoryview(r0))])

    with pytest.raises(ValueError, match="16 bytes"):
        store.exists(ROOT_A, [b"short"], 1.0)
    with pytest.raises(ValueError, match="root"):
        store.get(b"short", [k0])
    assert store.exists(ROOT_A, [k0, k1], 5.0) == [False, False]     # nothing was sent
    # a synchronous put takes any buffer of the record, e.g. a view of a pool slot
    assert store.put(ROOT_A, [(k0, memoryview(bytearray(r0)))]) == 1
    assert store.get(ROOT_A, [k0]) == [r0]
    import numpy as np

    assert len(r1) % 4 == 0
    as_ints = memoryview(np.frombuffer(r1, dtype=np.int32))          # len() counts int32s
    assert store.put(ROOT_A, [(k1, as_ints)]) == 1
    assert store.get(ROOT_A, [k1]) == [r1]


# --------------------------------------------------------------------------- sharing, tenants

CHILD = r"""
import json, sys
from tests import redis_servers as rs
from tiered_cache.stores.redis import RedisStore
url, n = sys.argv[1], int(sys.argv[4])
ns, root = bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
store = RedisStore(url, namespace=ns, num_tokens=16)
mine = [rs.sample_record(ns, root, i, seed=2) for i in range(n)]
stored = store.put(root, mine)
theirs = [rs.sample_record(ns, root, i, seed=1) for i in range(n)]
found = store.exists(root, [k for k, _ in theirs], 5.0)
got = store.get(root, [k for k, _ in theirs])
same = [g == r for g, (_, r) in zip(got, theirs)]
store.close()
print(json.dumps({"stored": stored, "found": found, "same": same}))
"""


@pytest.mark.slow
def test_two_processes_share_one_server(redis_server, ns, open_store):
    store = open_store(redis_server.url, ns)
    n = 6
    mine = [rs.sample_record(ns, ROOT_A, i, seed=1) for i in range(n)]
    assert store.put(ROOT_A, mine) == n
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, "-c", CHILD, redis_server.url, ns.hex(), ROOT_A.hex(),
                           str(n)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    child = json.loads(proc.stdout.strip().splitlines()[-1])
    # the other process found and read back identical bytes of what this one wrote ...
    assert child == {"stored": n, "found": [True] * n, "same": [True] * n}
    # ... and this one reads identical bytes of what it wrote
    theirs = [rs.sample_record(ns, ROOT_A, i, seed=2) for i in range(n)]
    assert store.get(ROOT_A, [k for k, _ in theirs]) == [r for _, r in theirs]


@pytest.mark.slow
def test_tenants_never_see_each_other(redis_server, ns, open_store):
    store = open_store(redis_server.url, ns)
    a = blocks(ns, ROOT_A, 4)
    assert store.put(ROOT_A, a) == 4
    keys = [k for k, _ in a]
    # the same block keys asked for by another tenant: not there
    assert store.exists(ROOT_B, keys, 5.0) == [False] * 4
    assert store.get(ROOT_B, keys) == [None] * 4
    # a record of tenant A written (behind the store's back) under tenant B's key: a miss
    with redis_server.raw() as raw:
        raw.set(store.server_key(ROOT_B, keys[0]), a[0][1])
    assert store.exists(ROOT_B, keys[:1], 5.0) == [True]           # exists is only a hint
    assert store.get(ROOT_B, keys[:1]) == [None]
    assert store.stats()["corrupt"] == 1
    assert store.get(ROOT_A, keys) == [r for _, r in a]


# --------------------------------------------------------------------------- cluster


@pytest.mark.slow
def test_cluster_round_trip_spreads_over_masters(cluster, ns, open_store):
    store = open_store(cluster.url, ns, cluster=True)
    items = blocks(ns, ROOT_A, 64)
    keys = [k for k, _ in items]
    assert store.put(ROOT_A, items) == 64
    assert store.exists(ROOT_A, keys + [b"\x00" * 16], 5.0) == [True] * 64 + [False]
    assert store.get(ROOT_A, keys) == [r for _, r in items]
    assert store.get(ROOT_A, keys, deadline_s=5.0) == [r for _, r in items]
    per_node = []
    for node in cluster.nodes:
        with node.raw() as raw:
            per_node.append(len(raw.keys(f"tc:v{records.VERSION}:{ns.hex()}:*".encode())))
    assert sum(per_node) == 64 and all(n > 0 for n in per_node), per_node
    assert store.delete(ROOT_A, keys[:10]) == 10
    st = store.stats()
    assert st["cluster"] and st["errors"] == 0 and st["hits"] == 128


# --------------------------------------------------------------------------- faults


@pytest.mark.slow
def test_server_killed_mid_run_then_restarted(ns, open_store):
    with rs.RedisServer() as srv:
        # NOTE: a backoff far longer than the calls below, so they find the breaker open
        store = open_store(srv.url, ns, failure_threshold=2, backoff_initial_s=0.5,
                           backoff_max_s=1.0, socket_timeout_s=1.0, connect_timeout_s=0.5)
        items = blocks(ns, ROOT_A, 4)
        keys = [k for k, _ in items]
        assert store.put(ROOT_A, items) == 4
        srv.kill()                                                  # SIGKILL mid-run
        assert store.exists(ROOT_A, keys, 2.0) == [False] * 4
        assert store.get(ROOT_A, keys) == [None] * 4
        st = store.stats()
        assert st["errors"] == 2 and st["breaker_opened"] == 1
        assert not store.available and st["breaker"] == "open"
        # while open the server is not called at all: misses at once, counted as skipped
        assert store.put(ROOT_A, items[:1]) == 0
        assert store.get(ROOT_A, keys) == [None] * 4
        st = store.stats()
        assert st["skipped"] == 2 and st["errors"] == 2 and st["put_failed"] == 1
        # the background writer survives the outage: its puts are failed and counted
        assert store.put_async(ROOT_A, items) == 4
        assert store.flush(30)
        assert store.stats()["worker_errors"] == 0
        with pytest.raises(StoreUnavailableError):
            store.ping()

        srv.start()                                 # same port, empty (no persistence)
        for _ in range(400):                        # poll: the next call after backoff probes
            store.exists(ROOT_A, keys[:1], 2.0)
            if store.available:
                break
            time.sleep(0.025)
        assert store.available, store.stats()
        assert store.stats()["reconnects"] >= 1
        assert store.get(ROOT_A, keys) == [None] * 4          # the restarted server is empty
        assert store.put_async(ROOT_A, items) == 4
        assert store.flush(30)
        assert store.get(ROOT_A, keys) == [r for _, r in items]
        assert store.stats()["worker_errors"] == 0


def test_unreachable_server(ns, open_store):
    port = rs.free_port()
    url = f"redis://:pw@127.0.0.1:{port}/0"
    with pytest.raises(StoreUnavailableError) as err:
        RedisStore(url, namespace=ns, connect_timeout_s=0.5)
    assert "pw@" not in str(err.value) and f"127.0.0.1:{port}" in str(err.value)
    store = open_store(url, ns, verify=False, failure_threshold=1, backoff_initial_s=5.0)
    key, record = rs.sample_record(ns, ROOT_A, 0)
    assert store.exists(ROOT_A, [key], 1.0) == [False]
    assert store.get(ROOT_A, [key]) == [None]
    assert store.put(ROOT_A, [(key, record)]) == 0
    st = store.stats()
    assert st["errors"] == 1 and st["skipped"] == 2 and not st["available"]


@pytest.mark.slow
def test_server_side_eviction_gives_misses_never_corruption(ns, open_store):
    extra = ("--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru")
    with rs.RedisServer(extra=extra) as srv:
        store = open_store(srv.url, ns, batch_bytes=256 * 1024)
        items = blocks(ns, ROOT_A, 160, payload_bytes=64 * 1024)      # ~10 MiB into 4 MiB
        store.put(ROOT_A, items)
        keys = [k for k, _ in items]
        got = store.get(ROOT_A, keys)
        hits = [g for g in got if g is not None]
        assert 0 < len(hits) < len(items)
        for g, (_, r) in zip(got, items):
            assert g is None or g == r
        st = store.stats()
        assert st["corrupt"] == 0 and st["misses"] == len(items) - len(hits)
        with srv.raw() as raw:
            assert int(raw.info("stats")["evicted_keys"]) > 0


@pytest.mark.slow
def test_corrupt_values_are_counted_misses(redis_server, ns, open_store):
    store = open_store(redis_server.url, ns)
    items = blocks(ns, ROOT_A, 8)
    keys = [k for k, _ in items]
    store.put(ROOT_A, items)
    good = items[7][1]
    flipped = bytearray(items[5][1])
    flipped[-10] ^= 0x01
    header_flip = bytearray(items[6][1])
    header_flip[85] ^= 0x01                                         # num_tokens field
    other_ns = records.encode(os.urandom(16), keys[4], ROOT_A, ROOT_A, 0,
                              records.tokens_bytes(range(16)), 0, b"x" * 4096)
    bad = {
        0: b"garbage, not a record",
        1: items[1][1][: len(items[1][1]) // 2],                    # truncated
        2: items[3][1],                                             # another key's record
        3: b"",                                                     # empty value
        4: other_ns,                                                # another namespace
        5: bytes(flipped),                                          # one payload bit flipped
        6: bytes(header_flip),                                      # one header bit flipped
    }
    with redis_server.raw() as raw:
        for i, value in bad.items():
            raw.set(store.server_key(ROOT_A, keys[i]), value)
    got = store.get(ROOT_A, keys)
    assert got == [None] * 7 + [good]
    st = store.stats()
    assert st["corrupt"] == 7 and st["misses"] == 7 and st["hits"] == 1
    assert store.available                        # corrupt values are not server failures
    # the next put of those blocks overwrites the damage
    store.put(ROOT_A, items[:7])
    assert store.get(ROOT_A, keys) == [r for _, r in items]


@pytest.mark.slow
def test_deadline_through_a_slow_link(redis_server, ns, open_store):
    direct = open_store(redis_server.url, ns)
    items = blocks(ns, ROOT_A, 16)
    keys = [k for k, _ in items]
    assert direct.put(ROOT_A, items) == 16
    with rs.LatencyProxy(redis_server.port, delay_s=0.2) as proxy:      # 400 ms per round trip
        slow = open_store(proxy.url(), ns, verify=False, failure_threshold=10)
        # every key is there, but not within 50 ms: the answer is "not there"
        assert slow.exists(ROOT_A, keys, deadline_s=0.05) == [False] * 16
        assert slow.get(ROOT_A, keys, deadline_s=0.05) == [None] * 16
        st = slow.stats()
        assert st["timeouts"] == 2 and st["exists_false"] == 16 and st["misses"] == 16
        # the link works, only slowly: with a deadline it can meet, the keys are found
        assert slow.exists(ROOT_A, keys, deadline_s=30.0) == [True] * 16
        assert slow.get(ROOT_A, keys, deadline_s=30.0) == [r for _, r in items]
        assert slow.available


@pytest.mark.slow
def test_wrong_password_is_a_typed_error_without_the_password(redis_server, ns):
    bad = f"redis://:not-the-password@127.0.0.1:{redis_server.port}/0"
    with pytest.raises(StoreAuthError) as err:
        RedisStore(bad, namespace=ns)
    msg = str(err.value)
    assert "not-the-password" not in msg and rs.PASSWORD not in msg
    assert msg.startswith(f"redis://:***@127.0.0.1:{redis_server.port}/0: ")
    with pytest.raises(StoreAuthError):
        RedisStore(redis_server.url_no_auth, namespace=ns)                # no password at all
    with pytest.raises(StoreAuthError):
        RedisStore(redis_server.url_no_auth, namespace=ns, password="nope")


@pytest.mark.slow
def test_acl_users(redis_server, ns, open_store):
    with redis_server.raw() as raw:
        raw.execute_command("ACL", "SETUSER", "tc-rw", "on", ">rw-pw", "~tc:*", "+@all")
        raw.execute_command("ACL", "SETUSER", "tc-ro", "on", ">ro-pw", "~tc:*", "+ping",
                            "+exists", "+get")
    items = blocks(ns, ROOT_A, 3)
    keys = [k for k, _ in items]
    rw = open_store(f"redis://tc-rw:rw-pw@127.0.0.1:{redis_server.port}/0", ns)
    assert rw.put(ROOT_A, items) == 3
    ro = open_store(redis_server.url_no_auth, ns, username="tc-ro", password="ro-pw")
    assert ro.get(ROOT_A, keys) == [r for _, r in items]
    assert ro.put(ROOT_A, items) == 0                       # NOPERM: refused, counted
    st = ro.stats()
    assert st["errors"] == 3 and st["put_failed"] == 3 and ro.available
    with pytest.raises(StoreAuthError) as err:
        RedisStore(f"redis://tc-rw:wrong@127.0.0.1:{redis_server.port}/0", namespace=ns)
    assert "tc-rw:***@" in str(err.value)


@pytest.mark.slow
def test_tls(tmp_path, ns, open_store):
    tls = rs.make_tls_files(tmp_path / "tls")
    with rs.RedisServer(tls=tls) as srv:
        store = open_store(srv.url, ns, ssl_ca_certs=tls["ca"], ssl_certfile=tls["client_cert"],
                           ssl_keyfile=tls["client_key"])
        items = blocks(ns, ROOT_A, 4)
        assert store.put(ROOT_A, items) == 4
        assert store.get(ROOT_A, [k for k, _ in items]) == [r for _, r in items]
        with pytest.raises(StoreUnavailableError):          # the server's CA is not trusted
            RedisStore(srv.url, namespace=ns, ssl_certfile=tls["client_cert"],
                       ssl_keyfile=tls["client_key"])
        with pytest.raises(StoreUnavailableError):          # no client certificate
            RedisStore(srv.url, namespace=ns, ssl_ca_certs=tls["ca"])


# --------------------------------------------------------------------------- benchmark smoke


@pytest.mark.slow
def test_benchmark_quick(tmp_path):
    out = tmp_path / "remote.json"
    env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "remote.py"), "--quick",
                           "--out", str(out)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["benchmark"] == "remote" and data["quick"] is True
    assert {r["op"] for r in data["throughput"]} == {"put", "get", "put_async+flush"}
    for r in data["throughput"]:
        assert r["store_gbps"] > 0 and r["redis_py_gbps"] > 0 and r["ratio"] > 0
    assert {(r["link"], r["blocks"]) for r in data["lookup"]} >= {("loopback", 1)}
    assert {"load_s", "recompute_s", "load"} <= set(data["cost_model"][0])
    assert "remote store vs plain redis-py" in proc.stdout
