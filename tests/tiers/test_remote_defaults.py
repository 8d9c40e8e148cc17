"""The remote tier with the defaults an operator gets (issue 23, items 5, 6 and 8), against
real redis-server processes:

- a second process finds what the first computed without the first evicting anything (the
  default put point is `write: on_compute`: published blocks are put from the device tier);
- the store's lookup workers and their connections are up before the first lookup, so the
  first open after start does not spend its 5 ms deadline on setting them up;
- a record that fails verification is deleted from the store: the next open recomputes the
  block and writes it again (it used to be found, and fail, forever);
- a server that wants a password the config does not give is a ConfigError naming the key,
  not the server's raw reply.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import tests.redis_servers as rs
from tests.helpers import (
    check_pattern,
    make_cache,
    write_pattern_all,
)
from tiered_cache.errors import ConfigError, TransferError

rs.require()
pytestmark = pytest.mark.slow          # real redis-server processes
REPO = Path(__file__).resolve().parents[2]
BS = 4


def cache_on(url: str, **remote):
    """gpu 64 / host 64 blocks (nothing is evicted below), `tiers.remote` with its defaults
    but for the URL (and a lookup deadline that a loaded test machine always meets)."""
    tiers = {"remote": {"url": url, "lookup_deadline_ms": 2000.0, **remote}}
    return make_cache(gpu_blocks=64, host_blocks=64, migrator={"enabled": True,
                                                               "wait_timeout_s": 20.0},
                      write_policy="write_back", extra={"tiers": tiers})


def prompt(i: int, blocks: int = 3) -> list[int]:
    return [i * 1000 + j for j in range(blocks * BS)]


def serve(cache, tokens) -> dict[str, int]:
    seq = cache.open(tokens)
    try:
        for layer in range(cache.num_layers):
            cache.wait(seq, layer)
        check_pattern(cache, seq)
    except TransferError:
        cache.close(seq)
        return {"failed": 1}
    write_pattern_all(cache, seq)
    got = dict(seq.cached_tokens_by_tier)
    cache.close(seq)
    return got


def settle(cache) -> None:
    cache.migrator.settle()
    for store in cache.stores:
        store.store.flush(10.0)


_READER = """
import json, sys
sys.path.insert(0, {repo!r})
from tests.tiers.test_remote_defaults import cache_on, prompt, serve
cache = cache_on({url!r})
print(json.dumps([serve(cache, prompt(i)) for i in range({n})]), flush=True)
cache.shutdown()
"""


def test_a_second_process_finds_what_the_first_computed_without_any_eviction(redis_flushed):
    a = cache_on(redis_flushed.url)
    assert a.config.tiers.remote.write == "on_compute"
    ps = [prompt(i) for i in range(4)]
    for p in ps:
        serve(a, p)
    settle(a)
    s = a.stats()
    assert s["evictions"] == 0 if "evictions" in s else True
    assert s["tiers"]["host"]["used_blocks"] == 0, "nothing was evicted to host"
    assert s["tiers"]["remote"]["put_blocks"] == 4 * 3
    out = subprocess.run([sys.executable, "-c", _READER.format(
                              repo=str(REPO), url=redis_flushed.url, n=len(ps))],
                         capture_output=True, text=True, cwd=REPO, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert [g.get("remote", 0) for g in got] == [3 * BS] * len(ps)   # every load was checked
    a.shutdown()


def test_write_on_host_still_puts_only_what_reaches_host(redis_flushed):
    a = cache_on(redis_flushed.url, write="on_host")
    serve(a, prompt(0))
    settle(a)
    assert a.stats()["tiers"]["remote"]["put_blocks"] == 0
    a.shutdown()


def _workers_ready(store) -> tuple[int, int]:
    runner = store._runner._pool
    pool = store._client.connection_pool
    return len(runner._threads), len(pool._available_connections) + len(pool._in_use_connections)


def test_lookup_workers_and_their_connections_are_up_before_the_first_lookup(redis_flushed):
    """The first exists() after start must not pay for a worker thread and a connection inside
    its deadline (7.7 ms were seen on a loaded machine against a 5 ms deadline)."""
    a = cache_on(redis_flushed.url)
    store = a.stores[0].store
    threads = store._runner._pool._max_workers
    deadline = time.monotonic() + 20
    while _workers_ready(store) < (threads, threads) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _workers_ready(store) >= (threads, threads)
    assert store.stats()["exists_true"] + store.stats()["exists_false"] == 0   # no lookup yet
    a.shutdown()


def test_a_record_that_fails_verification_is_deleted_and_the_next_open_recomputes_it(redis_flushed):
    a = cache_on(redis_flushed.url)
    p = prompt(7)
    serve(a, p)
    settle(a)
    a.shutdown()
    raw = redis_flushed.raw()
    keys = sorted(raw.keys("tc:*"))
    assert len(keys) == 3
    for k in keys:                                  # one bit of every payload flipped
        v = bytearray(raw.get(k))
        v[-1] ^= 1
        raw.set(k, bytes(v))
    b = cache_on(redis_flushed.url)
    assert serve(b, p) == {"failed": 1}            # found, loaded, failed verification
    assert raw.dbsize() == 0, "the corrupt records were deleted from the store"
    again = serve(b, p)                             # the documented recovery: open again
    assert "failed" not in again and again.get("remote", 0) == 0    # recomputed
    settle(b)
    assert raw.dbsize() == 3, "the recomputed blocks were written back"
    b.shutdown()
    c = cache_on(redis_flushed.url)
    assert serve(c, p).get("remote", 0) == 3 * BS   # and are served, verified, from then on
    c.shutdown()


def test_a_server_that_wants_a_password_names_the_key(redis_flushed):
    bare = redis_flushed.url.replace(f":{rs.PASSWORD}@", "", 1)
    assert rs.PASSWORD not in bare
    with pytest.raises(ConfigError) as exc:
        cache_on(bare)
    text = str(exc.value)
    assert exc.value.path == "tiers.remote.password_env"
    assert "requires a password" in text and "HELLO" not in text


def test_a_wrong_password_names_the_key(redis_flushed, monkeypatch):
    monkeypatch.setenv("TC_TEST_WRONG_PW", "not-the-password")
    bare = redis_flushed.url.replace(f":{rs.PASSWORD}@", "", 1)
    with pytest.raises(ConfigError) as exc:
        cache_on(bare, password_env="TC_TEST_WRONG_PW")
    assert exc.value.path == "tiers.remote.password_env"
    assert "refused" in str(exc.value) and "not-the-password" not in str(exc.value)


def test_a_password_from_the_environment_is_used(redis_flushed, monkeypatch):
    monkeypatch.setenv("TC_TEST_PW", rs.PASSWORD)
    bare = redis_flushed.url.replace(f":{rs.PASSWORD}@", "", 1)
    a = cache_on(bare, password_env="TC_TEST_PW")
    serve(a, prompt(1))
    settle(a)
    assert a.stats()["tiers"]["remote"]["put_blocks"] == 3
    a.shutdown()


def _script(code: str) -> str:
    return textwrap.dedent(code)
