"""Fixtures every test module shares (pytest loads this file for each test under tests/).

- `invariants_after_test` (autouse, every test): each `TieredKVCache` a test builds must
  satisfy the control plane's invariants (core/invariants.py) when the test ends. A test opts
  out with `@pytest.mark.no_invariants` (say why beside it).
- `redis_server` (per module) and `redis_flushed` (per test, emptied): a real `redis-server` on
  a free loopback port and a temp dir of its own (tests/redis_servers.py); without one the
  test skips (fails under CI: `rs.require()`).
- `short_dir`: a fresh temp folder with a short name, for Unix socket paths (`tmp_path` names
  can pass the 107-byte limit of a socket path), removed after the test.

Helper modules stay plain modules beside this file (`from tests.helpers import ...`, pytest's
importlib mode resolves `tests` as a namespace package under the rootdir).

Markers (pyproject.toml): `slow` marks what starts processes or servers, compiles, kills or
sweeps, so `make test-fast` (`-m "not slow"`) is the quick loop and `make test` runs it all.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
OWN_VENVS = (HERE / "vllm", HERE / "sglang_hicache")
"""Run in venvs of their own (`make test-vllm`, `make test-sglang`) with their own conftest."""


def pytest_configure(config):
    """SIGINT as an interactive run has it.

    NOTE: a shell starts a background job with SIGINT ignored (`make test &`, a CI runner's
    script), and Python then installs no KeyboardInterrupt handler; the interrupt tests deliver
    what SIGINT's handler does (tests/test_interrupts.py, core/test_atomic.py), so without one
    they fail, and a sweep waiting on an interrupt hangs."""
    if signal.getsignal(signal.SIGINT) in (signal.SIG_IGN, signal.SIG_DFL, None):
        signal.signal(signal.SIGINT, signal.default_int_handler)


@pytest.fixture(autouse=True)
def invariants_after_test(request, monkeypatch):
    """Every cache built by the test satisfies the core invariants when it ends (except one
    that refuses every call because a commit section was torn, core/atomic.py: its state is
    not meant to be whole, and it serves nothing)."""
    path = Path(str(request.node.path))
    if request.node.get_closest_marker("no_invariants") or any(
            d in path.parents for d in OWN_VENVS):
        yield
        return
    from tests.helpers import check_invariants, track_caches

    caches = track_caches(monkeypatch)
    yield
    for cache in caches:
        if cache.index.broken is None:
            check_invariants(cache)


@pytest.fixture(scope="module")
def redis_server():
    from tests import redis_servers as rs

    rs.require()
    with rs.RedisServer() as srv:
        yield srv


@pytest.fixture
def redis_flushed(redis_server):
    """The module's server, restarted if a test killed it, with nothing in it."""
    if redis_server.proc is None or redis_server.proc.poll() is not None:
        redis_server.start()
    redis_server.raw().flushall()
    return redis_server


@pytest.fixture
def short_dir():
    d = Path(tempfile.mkdtemp(prefix="tc-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)
