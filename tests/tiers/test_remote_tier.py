"""The remote tier through the cache, against real redis-server processes: prefixes shared
across caches and processes, tenants kept apart, a 3-master cluster, a server killed and
restarted mid-run, server-side eviction, corrupt values, a slow link and the cost model.

KV is the pattern of tests/helpers.py (a function of the tenant, the tokens up to each position
and the layer), so a block loaded from the server is checked wherever it was computed.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

import tests.redis_servers as rs
from tests.helpers import (
    check_pattern,
    make_cache,
    write_pattern_all,
)
from tiered_cache.core.invariants import check_invariants
from tiered_cache.errors import ConfigError, TransferError

pytestmark = pytest.mark.slow     # processes, servers or sweeps (tests/conftest.py)

rs.require()
REPO = Path(__file__).resolve().parents[2]
BS = 4


def remote_cache(url: str, *, gpu=8, host=8, cluster=False, write="on_host", name="test-model",
                 extra=None, **kw):
    tiers = {"remote": {"url": url, "cluster": cluster, "write": write,
                        "lookup_deadline_ms": 500.0}}
    return make_cache(gpu_blocks=gpu, host_blocks=host, name=name,
                      migrator={"enabled": True, "wait_timeout_s": 20.0},
                      extra={"tiers": tiers, **(extra or {})}, **kw)


def prompt(i: int, blocks: int = 3) -> list[int]:
    return [i * 1000 + j for j in range(blocks * BS)]


def serve(cache, tokens, salt=None) -> dict[str, int]:
    seq = cache.open(tokens, salt=salt)
    try:
        for layer in range(cache.num_layers):
            cache.wait(seq, layer)
        check_pattern(cache, seq)          # what came from the cache is exactly this prompt's
    except TransferError:
        got = {"failed": 1}
        cache.close(seq)
        return got
    write_pattern_all(cache, seq)
    got = dict(seq.cached_tokens_by_tier)
    cache.close(seq)
    return got


def publish(cache, prompts, salt=None) -> None:
    """Serve each prompt and push it out of memory, so its blocks are put to the redis_server."""
    for p in prompts:
        serve(cache, p, salt)
    cache.migrator.settle()
    for store in cache.stores:
        store.store.flush(10.0)


def test_a_second_cache_loads_what_the_first_put(redis_flushed):
    a = remote_cache(redis_flushed.url)
    ps = [prompt(i) for i in range(12)]
    publish(a, ps)
    put = a.stats()["tiers"]["remote"]["put_blocks"]
    assert put > 0
    b = remote_cache(redis_flushed.url)                 # an empty cache on the same server
    got = sum(serve(b, p).get("remote", 0) for p in ps)   # every load is checked
    assert got > 0
    s = b.stats()
    assert s["tiers"]["remote"]["loaded_blocks"] == got // BS
    assert s["hit_tokens_by_tier"]["remote"] == got
    check_invariants(b)
    a.shutdown()
    b.shutdown()


def test_invalidate_deletes_the_prefix_from_the_store(redis_flushed):
    a = remote_cache(redis_flushed.url)
    ps = [prompt(i) for i in range(12)]
    publish(a, ps)
    before = redis_flushed.raw().dbsize()
    assert before > 0
    a.invalidate(ps[0][:2 * BS])                   # the first two blocks of prompt 0
    assert redis_flushed.raw().dbsize() == before - 2
    b = remote_cache(redis_flushed.url)
    # Prompt 0 is gone for everyone (its third block is unreachable below the deleted two);
    # the others are still shared.
    assert serve(b, ps[0]).get("remote", 0) == 0
    assert serve(b, ps[5]).get("remote", 0) > 0
    a.shutdown()
    b.shutdown()


def test_write_off_only_reads(redis_flushed):
    ro = remote_cache(redis_flushed.url, write="off")
    ps = [prompt(i) for i in range(12)]
    publish(ro, ps)
    assert ro.stats()["tiers"]["remote"]["put_blocks"] == 0
    assert redis_flushed.raw().dbsize() == 0               # nothing reached the server
    a = remote_cache(redis_flushed.url)
    publish(a, ps)
    assert redis_flushed.raw().dbsize() > 0
    got = sum(serve(ro, p).get("remote", 0) for p in ps[:2])    # ... but it reads
    assert got > 0
    a.shutdown()
    ro.shutdown()


_WRITER = """
import sys
sys.path.insert(0, {repo!r})
from tests.tiers.test_remote_tier import publish, prompt, remote_cache
cache = remote_cache({url!r})
publish(cache, [prompt(i) for i in range(10)])
print(cache.stats()["tiers"]["remote"]["put_blocks"], flush=True)
cache.shutdown()
"""


def test_prefixes_are_shared_across_processes(redis_flushed):
    out = subprocess.run([sys.executable, "-c", _WRITER.format(repo=str(REPO),
                                                              url=redis_flushed.url)],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert int(out.stdout.split()[-1]) > 0
    reader = remote_cache(redis_flushed.url)
    got = sum(serve(reader, prompt(i)).get("remote", 0) for i in range(10))
    assert got > 0
    reader.shutdown()


def test_tenants_never_see_each_others_blocks(redis_flushed):
    a = remote_cache(redis_flushed.url)
    ps = [prompt(i) for i in range(10)]
    publish(a, ps, salt="tenant-a")
    b = remote_cache(redis_flushed.url)
    assert all(serve(b, p, salt="tenant-b").get("remote", 0) == 0 for p in ps)
    assert sum(serve(b, p, salt="tenant-a").get("remote", 0) for p in ps) > 0
    a.shutdown()
    b.shutdown()


def test_another_model_never_reads_the_values(redis_flushed):
    a = remote_cache(redis_flushed.url)
    ps = [prompt(i) for i in range(10)]
    publish(a, ps)
    other = remote_cache(redis_flushed.url, name="another-model")
    assert all(serve(other, p).get("remote", 0) == 0 for p in ps)
    a.shutdown()
    other.shutdown()


def test_a_value_evicted_or_damaged_after_the_lookup_is_a_miss(redis_flushed):
    a = remote_cache(redis_flushed.url)
    ps = [prompt(i) for i in range(10)]
    publish(a, ps)
    raw = redis_flushed.raw()
    keys = raw.keys("tc:*")
    assert keys
    for i, k in enumerate(keys):                 # damage every value in place
        v = raw.get(k)
        raw.set(k, v[:-7] + bytes(7) if i % 2 else v[: len(v) // 2])
    b = remote_cache(redis_flushed.url)
    results = [serve(b, p) for p in ps]           # found by exists(), then fail verification
    assert sum(r.get("failed", 0) for r in results) > 0
    assert b.stats()["tiers"]["remote"]["load_failures"] > 0
    for p in ps:                                  # misses from now on, never wrong data
        serve(b, p)
    a.shutdown()
    b.shutdown()


def test_server_side_eviction_only_costs_misses(redis_flushed):
    with rs.RedisServer(extra=("--maxmemory", "2mb", "--maxmemory-policy",
                               "allkeys-lru")) as small:
        a = remote_cache(small.url)
        ps = [prompt(i, blocks=4) for i in range(40)]
        publish(a, ps)
        b = remote_cache(small.url)
        for p in ps:
            serve(b, p)                           # checks every block that does come back
        a.shutdown()
        b.shutdown()


def test_a_dead_server_costs_only_the_deadline_and_recovers(redis_flushed):
    with rs.RedisServer() as srv:
        a = remote_cache(srv.url)
        ps = [prompt(i) for i in range(10)]
        publish(a, ps)
        srv.kill()
        for p in [prompt(100 + i) for i in range(10)]:
            serve(a, p)                           # served from local tiers, no error
        assert a.stats()["tiers"]["remote"]["store"]["errors"] > 0
        srv.start()                               # same port, empty
        deadline = time.monotonic() + 30
        i = 200
        while time.monotonic() < deadline and not a.stores[0].available:
            serve(a, prompt(i))                   # new prompts: each looks the server up
            i += 1
            time.sleep(0.1)
        assert a.stores[0].available
        a.shutdown()


def test_a_slow_server_is_skipped_when_recomputing_is_cheaper(redis_flushed):
    """70B-sized cost model, tiny blocks: recomputing a few tokens costs microseconds, a lookup
    through a 50 ms link far more: the cache never waits for the link."""
    with rs.LatencyProxy(redis_flushed.port, delay_s=0.05) as proxy:
        url = f"redis://:{redis_flushed.password}@127.0.0.1:{proxy.port}/0"
        a = remote_cache(redis_flushed.url)
        publish(a, [prompt(i) for i in range(10)])
        b = remote_cache(url, num_params=70.6e9)
        got = [serve(b, prompt(i)).get("remote", 0) for i in range(10)]
        assert sum(got) == 0
        assert b.stats()["tiers"]["remote"]["skipped_loads"] > 0
        a.shutdown()
        b.shutdown()


def test_cluster_mode_spreads_and_shares():
    with rs.RedisClusterServers(3) as cluster:
        a = remote_cache(cluster.url, cluster=True)
        ps = [prompt(i) for i in range(12)]
        publish(a, ps)
        b = remote_cache(cluster.url, cluster=True)
        assert sum(serve(b, p).get("remote", 0) for p in ps) > 0
        per_node = [node.raw().dbsize() for node in cluster.nodes]
        assert sum(1 for n in per_node if n > 0) >= 2
        a.shutdown()
        b.shutdown()


def test_config_needs_a_host_tier_and_the_migrator(redis_server):
    with pytest.raises(ConfigError, match="needs a host tier"):
        make_cache(host_blocks=0, migrator={"enabled": True},
                   extra={"tiers": {"remote": {"url": redis_server.url}}})
    with pytest.raises(ConfigError, match="needs the migrator"):
        make_cache(extra={"tiers": {"remote": {"url": redis_server.url}}})
    with pytest.raises(ConfigError, match="tiers.remote.url"):
        make_cache(extra={"tiers": {"remote": {"url": "http://x"}}})
