"""The node daemon with a remote tier (`tiers.remote` in the daemon's config), against a real
redis-server: two daemons (two nodes' worth) share prefixes through the store with identical
data, tenants stay apart in it, a corrupt value is a miss, a dead server costs the daemons
nothing but the store, and the cost model skips a store that loses to recomputing.

Engines are real processes (tests/daemon_engine.py) whose KV is a fixed function of token id,
position and layer, so every cached token read anywhere is checked.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import tests.redis_servers as rs
from tests.oracles import wait_for as _wait_for
from tiered_cache.daemon.process import NodeProcess
from tiered_cache.wire.client import Client
from tiered_cache.wire.ops import make_protocol

pytestmark = pytest.mark.slow     # processes, servers or sweeps (tests/conftest.py)

rs.require()
HERE = Path(__file__).resolve().parents[1]     # tests/
ENGINE = str(HERE / "daemon_engine.py")
BLOCK = 4


@pytest.fixture
def redis_url(redis_flushed):
    return redis_flushed.url


def daemon_config(tmp: Path, name: str, url: str, *, remote: str = "", daemon: str = "",
                  model: str = "") -> tuple[Path, str]:
    sock = str(tmp / name / "d.sock")
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        model: {{name: tiny, num_layers: 2, num_kv_heads: 2, head_dim: 8, num_q_heads: 4,
                dtype: float32{model}}}
        block_size: {BLOCK}
        tiers:
          gpu: {{num_blocks: 8, device: cpu}}
          host: {{num_blocks: 128}}
          remote: {{url: "{url}", lookup_deadline_ms: 1000{remote}}}
        daemon:
          socket: {sock}
          lease_s: 2
        """) + daemon)
    return cfg, sock


@contextlib.contextmanager
def daemons(tmp: Path, url: str, names: str = "ab", **kw) -> Iterator[list[NodeProcess]]:
    """One `tiered-cache serve` per name, all on the store at `url`; stopped on the way out."""
    started: list[NodeProcess] = []
    try:
        for name in names:
            cfg, sock = daemon_config(tmp, name, url, **kw)
            started.append(NodeProcess(cfg, sock, log_path=tmp / f"{name}.log").start())
        yield started
    finally:
        for d in started:
            d.stop()


def wait_for(cond, what: str, timeout: float = 30.0) -> None:
    _wait_for(cond, what, timeout, interval=0.05)   # each poll asks a daemon over its socket


def run_engine(sock: str, *args, gid: int | None = None) -> dict:
    env = dict(os.environ)
    if gid is not None:
        env["TC_ENGINE_GID"] = str(gid)
    p = subprocess.run([sys.executable, ENGINE, sock, *map(str, args)], capture_output=True,
                       text=True, timeout=180, env=env)
    assert p.returncode == 0, p.stderr[-3000:]
    [out] = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    return out


def partition(sock: str) -> dict:
    c = Client(sock, make_protocol(), timeout_s=10).connect()
    try:
        c.call("hello")
        return json.loads(c.call("stats")["json"])["partition"]
    finally:
        c.close()


def put_blocks(sock: str) -> int:
    return partition(sock)["tiers"]["remote"]["put_blocks"]


# ------------------------------------------------------------------ sharing across daemons


def test_two_daemons_share_prefixes_through_the_store_with_identical_data(tmp_path,
                                                                          redis_url):
    with daemons(tmp_path, redis_url) as (a, b):
        w = run_engine(a.socket_path, "write", 5000, 96)
        assert w["ok"] and w["cached"] == 0 and w["published"] == 24, w
        wait_for(lambda: put_blocks(a.socket_path) == 24, "A's puts to reach the store")
        # B never saw these tokens: its engine finds all 96 through B's daemon, which loads
        # them from the store into its pool; every token's KV checked by the engine.
        r = run_engine(b.socket_path, "read", 5000, 96 + 8)
        assert r["ok"] and r["cached"] == 96 and r["by_tier"]["daemon"] == 96, r
        pb = partition(b.socket_path)
        assert pb["daemon"]["remote_blocks"] == 24
        assert pb["tiers"]["remote"]["loaded_blocks"] == 24
        assert pb["tiers"]["remote"]["load_failures"] == 0
        # B's own continuation (2 blocks) went to the store too; the 24 it loaded did not
        # go back (a block that came from the store is not put again).
        wait_for(lambda: put_blocks(b.socket_path) == 2, "B's continuation to be put")
        # Now in B's pool: the next read is served from there, not the store again.
        r2 = run_engine(b.socket_path, "read", 5000, 96 + 8)
        assert r2["ok"] and r2["cached"] == 104
        assert partition(b.socket_path)["daemon"]["remote_blocks"] == 24
        # And A finds B's continuation through the store.
        r3 = run_engine(a.socket_path, "read", 5000, 96 + 8)
        assert r3["ok"] and r3["cached"] == 104
        assert partition(a.socket_path)["daemon"]["remote_blocks"] == 2


def test_tenants_stay_apart_in_the_store(tmp_path, redis_url):
    tenants = '  tenants: {"gid:0": "red", "gid:65534": "blue"}\n'
    with daemons(tmp_path, redis_url, daemon=tenants) as (a, b):
        w = run_engine(a.socket_path, "write", 7000, 64)                  # red, on node A
        assert w["daemon"]["tenant"] == "red" and w["published"] == 16
        wait_for(lambda: put_blocks(a.socket_path) == 16, "red's puts")
        blue = run_engine(b.socket_path, "read", 7000, 64, gid=65534)     # blue, on node B
        assert blue["daemon"]["tenant"] == "blue"
        assert blue["ok"] and blue["cached"] == 0, blue
        red = run_engine(b.socket_path, "read", 7000, 64)                 # red, on node B
        assert red["ok"] and red["cached"] == 64, red


# ------------------------------------------------------------------ faults


def test_a_corrupt_value_in_the_store_is_a_miss_never_wrong_kv(tmp_path, redis_server, redis_url):
    with daemons(tmp_path, redis_url) as (a, b):
        run_engine(a.socket_path, "write", 3000, 48)
        wait_for(lambda: put_blocks(a.socket_path) == 12, "A's puts")
        raw = redis_server.raw()
        keys = sorted(raw.keys("tc:*"))
        assert len(keys) == 12
        for k in keys[::3]:                 # flip one payload byte in every third value
            v = bytearray(raw.get(k))
            v[-1] ^= 0x40
            raw.set(k, bytes(v))
        r = run_engine(b.socket_path, "read", 3000, 48)
        assert r["ok"], r                   # whatever was cached is the right KV
        pb = partition(b.socket_path)
        assert pb["tiers"]["remote"]["load_failures"] >= 1, pb["tiers"]["remote"]
        assert pb["tiers"]["remote"]["store"]["corrupt"] == 4
        assert r["cached"] < 48             # the corrupt blocks were not served


def test_a_corrupt_record_costs_only_the_blocks_from_the_store(tmp_path, redis_server, redis_url):
    """B holds the first 4 blocks itself; the 8 after them only the store has, one of them
    corrupt: B's fetch still serves its own 4 (checked KV), not nothing."""
    with daemons(tmp_path, redis_url) as (a, b):
        run_engine(b.socket_path, "write", 4000, 16)            # B's own 4 blocks
        wait_for(lambda: put_blocks(b.socket_path) == 4, "B's puts")
        raw = redis_server.raw()
        own = set(raw.keys("tc:*"))
        run_engine(a.socket_path, "write", 4000, 48)            # A: the same 4, then 8 more
        wait_for(lambda: len(raw.keys("tc:*")) == 12, "A's puts")
        later = sorted(set(raw.keys("tc:*")) - own)
        assert len(later) == 8
        for k in later:                     # every record after B's blocks fails its check
            v = bytearray(raw.get(k))
            v[-1] ^= 0x40
            raw.set(k, bytes(v))
        r = run_engine(b.socket_path, "read", 4000, 48)
        assert r["ok"], r                   # every cached token's KV checked by the engine
        assert r["cached"] == 16, r         # B's own blocks, not a whole miss
        pb = partition(b.socket_path)
        assert pb["tiers"]["remote"]["load_failures"] >= 1, pb["tiers"]["remote"]
        assert pb["daemon"]["fetch_failures"] >= 1


def test_a_dead_store_costs_the_daemon_only_the_store(tmp_path, redis_server, redis_url):
    with daemons(tmp_path, redis_url, "a") as (a,):
        run_engine(a.socket_path, "write", 1000, 32)
        wait_for(lambda: put_blocks(a.socket_path) == 8, "A's puts")
        redis_server.kill()                       # SIGKILL: the store vanishes mid-run
        # The pool still serves what it has, new prefixes are computed and published, and a
        # prefix nobody has is a plain miss (bounded by the lookup deadline).
        r = run_engine(a.socket_path, "read", 1000, 32)
        assert r["ok"] and r["cached"] == 32
        w = run_engine(a.socket_path, "write", 2000, 32)
        assert w["ok"] and w["published"] == 8
        m = run_engine(a.socket_path, "read", 9000, 32)
        assert m["ok"] and m["cached"] == 0
        store = partition(a.socket_path)["tiers"]["remote"]["store"]
        assert store["errors"] + store["put_failed"] + store["skipped"] >= 1, store
        # The server comes back (empty): the daemon's breaker lets it in again, and what is
        # written from then on reaches it.
        redis_server.start()
        w2 = run_engine(a.socket_path, "write", 4000, 32)
        assert w2["ok"] and w2["published"] == 8
        wait_for(lambda: partition(a.socket_path)["tiers"]["remote"]["store"]["reconnects"]
                 >= 1, "the store to be taken back", 60)
        run_engine(a.socket_path, "write", 4400, 32)
        wait_for(lambda: len(redis_server.raw().keys("tc:*")) >= 8, "puts after the restart", 60)


def test_the_cost_model_skips_a_store_that_loses_to_recompute(tmp_path, redis_url):
    # A tiny model at a huge prefill rate: recomputing 24 blocks takes nanoseconds, a load
    # from the store (prior 1 s of latency) far longer. B must not load, and say so.
    slow = ", latency_ms: 1000"
    size = ", num_params: 1000000"
    with daemons(tmp_path, redis_url, remote=slow, model=size) as (a, b):
        run_engine(a.socket_path, "write", 6000, 96)
        wait_for(lambda: put_blocks(a.socket_path) == 24, "A's puts")
        r = run_engine(b.socket_path, "read", 6000, 96)
        assert r["ok"] and r["cached"] == 0
        pb = partition(b.socket_path)
        assert pb["tiers"]["remote"]["skipped_loads"] >= 1
        assert pb["tiers"]["remote"]["loaded_blocks"] == 0


def test_invalidate_through_one_daemon_reaches_the_store(tmp_path, redis_server, redis_url):
    import numpy as np

    with daemons(tmp_path, redis_url) as (a, b):
        run_engine(a.socket_path, "write", 8000, 48)
        wait_for(lambda: put_blocks(a.socket_path) == 12, "A's puts")
        c = Client(a.socket_path, make_protocol(), timeout_s=10).connect()
        try:
            c.call("hello")
            root = c.call("root", salt=b"")["root"]
            dropped = c.call("invalidate", root=root, tokens=np.arange(8000, 8008))["blocks"]
        finally:
            c.close()
        assert dropped == 12                    # the prefix and everything below it, in A
        assert len(redis_server.raw().keys("tc:*")) == 10     # its own two records, in the store
        r = run_engine(b.socket_path, "read", 8000, 48)
        assert r["ok"] and r["cached"] == 0     # nothing below them is reachable


def test_a_bad_remote_section_stops_the_daemon_in_one_line(tmp_path, redis_url):
    cfg, _ = daemon_config(tmp_path, "a", redis_url, remote=", password_env: TC_NOT_SET_ANYWHERE")
    env = {k: v for k, v in os.environ.items() if k != "TC_NOT_SET_ANYWHERE"}
    p = subprocess.run([sys.executable, "-m", "tiered_cache", "serve", "--config", str(cfg)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert p.returncode == 2, p.stderr[-2000:]
    assert "tiers.remote.password_env" in p.stderr and "Traceback" not in p.stderr
