"""The parts of keyed stores that need no server: key schema, URL redaction, circuit breaker,
deadline runner, put queue. (The store itself is tested against real servers in
test_stores_redis.py.)"""

from __future__ import annotations

import threading

import pytest

from tiered_cache import records
from tiered_cache.stores import KeyedStore, StoreAuthError, StoreError, StoreUnavailableError
from tiered_cache.stores.base import check_keys, redact_url
from tiered_cache.stores.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker
from tiered_cache.stores.deadline import DeadlineExceeded, DeadlineRunner
from tiered_cache.stores.keys import key_space, server_key
from tiered_cache.stores.putqueue import PutQueue
from tiered_cache.stores.stats import StoreStats


def test_key_schema():
    ns, root, key = bytes(range(16)), b"\xaa" * 16, b"\x01" * 16
    space = key_space("tc", ns)
    assert space == b"tc:v%d:000102030405060708090a0b0c0d0e0f:" % records.VERSION
    assert server_key(space, root, key) == space + b"a" * 32 + b":" + b"01" * 16
    assert b"{" not in server_key(space, root, key)          # no hash tags: spread over slots
    with pytest.raises(ValueError, match="prefix"):
        key_space("tc{x}", ns)
    with pytest.raises(ValueError, match="prefix"):
        key_space("", ns)


def test_check_keys():
    check_keys([b"x" * 16])
    with pytest.raises(ValueError, match="16 bytes"):
        check_keys([b"x" * 15])
    with pytest.raises(ValueError, match="root"):
        check_keys(["a" * 16], "root")         # type: ignore[list-item]


def test_redact_url():
    assert redact_url("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("rediss://user:s3cret@h/1") == "rediss://user:***@h/1"
    assert "s3cret" not in redact_url("redis://h:1/0?password=s3cret&db=1")
    assert redact_url("redis://h:1/0") == "redis://h:1/0"


def test_errors_are_typed():
    e = StoreAuthError("redis://:***@h:1/0", "bad password")
    assert isinstance(e, StoreError) and str(e).startswith("redis://:***@h:1/0: ")
    from tiered_cache.errors import TierUnavailableError

    assert issubclass(StoreUnavailableError, TierUnavailableError)
    assert not issubclass(StoreAuthError, StoreUnavailableError)


def test_protocol_is_runtime_checkable():
    assert not isinstance(object(), KeyedStore)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_breaker_opens_after_threshold_and_backs_off():
    clock = FakeClock()
    b = CircuitBreaker(failure_threshold=3, backoff_initial_s=1.0, backoff_max_s=4.0,
                       jitter=0.0, clock=clock)
    assert b.allow() and b.state == CLOSED
    assert not b.failure() and not b.failure()
    assert b.allow()
    assert b.failure() and b.state == OPEN and b.opened == 1
    assert not b.allow()
    clock.t += 0.99
    assert not b.allow()
    clock.t += 0.02
    assert b.allow() and b.state == HALF_OPEN        # the probe
    assert not b.allow()                             # only one probe at a time
    assert b.failure() and b.state == OPEN           # probe failed: backoff doubled to 2 s
    clock.t += 1.5
    assert not b.allow()
    clock.t += 0.6
    assert b.allow()
    b.failure()                                      # now 4 s (the cap)
    clock.t += 4.01
    assert b.allow()
    b.failure()                                      # still 4 s
    clock.t += 3.9
    assert not b.allow()
    clock.t += 0.2
    assert b.allow()
    b.success()
    assert b.state == CLOSED and b.recovered == 1
    # the backoff was reset: the next opening waits 1 s again
    for _ in range(3):
        b.failure()
    clock.t += 1.01
    assert b.allow()


def test_breaker_success_resets_the_count():
    b = CircuitBreaker(failure_threshold=2, jitter=0.0, clock=FakeClock())
    b.failure()
    b.success()
    assert not b.failure() and b.closed


def test_breaker_stale_probe_does_not_wedge():
    clock = FakeClock()
    b = CircuitBreaker(failure_threshold=1, backoff_initial_s=1.0, backoff_max_s=2.0,
                       jitter=0.0, clock=clock)
    b.failure()
    clock.t += 1.5
    assert b.allow()                  # a probe that never reports back
    clock.t += 1.0
    assert not b.allow()
    clock.t += 1.5
    assert b.allow()                  # after backoff_max_s another caller may probe


def test_deadline_runner():
    seen: list[BaseException] = []
    r = DeadlineRunner(1, "t", on_late_error=seen.append)
    try:
        assert r.run(lambda: 42, 5.0) == 42
        with pytest.raises(ZeroDivisionError):
            r.run(lambda: 1 / 0, 5.0)
        release = threading.Event()

        def stuck() -> None:
            release.wait(10)
            raise RuntimeError("late")

        with pytest.raises(DeadlineExceeded):
            r.run(stuck, 0.01)
        # the only worker is stuck: a second call queues, and is never started
        ran = threading.Event()
        with pytest.raises(DeadlineExceeded):
            r.run(ran.set, 0.01)
        release.set()
        assert r.run(lambda: "after", 5.0) == "after"
        assert not ran.is_set()
        assert len(seen) == 1 and str(seen[0]) == "late"     # the late failure was reported
    finally:
        r.close()


def test_put_queue_batches_and_survives_exceptions():
    stats = StoreStats()
    written: list[tuple[bytes, list[bytes]]] = []
    boom = {"left": 1}

    def write(root, items):
        if boom["left"]:
            boom["left"] -= 1
            raise RuntimeError("injected")
        written.append((root, [k for k, _ in items]))
        return len(items)

    q = PutQueue(write, stats, max_bytes=1000, batch_bytes=250)
    try:
        assert q.offer(b"r" * 16, [(b"%016d" % 0, b"x" * 100)]) == 1
        assert q.flush(10)
        assert stats["worker_errors"] == 1                 # logged, counted, alive
        keys = [b"%016d" % i for i in range(1, 6)]
        assert q.offer(b"a" * 16, [(k, b"x" * 100) for k in keys[:3]]) == 3
        assert q.offer(b"b" * 16, [(k, b"x" * 100) for k in keys[3:]]) == 2
        assert q.flush(10)
        got = [k for _, ks in written for k in ks]
        assert got == keys                                  # order kept
        assert all(len(ks) <= 2 for _, ks in written)       # 250-byte batches of 100-byte items
        assert {r for r, _ in written} == {b"a" * 16, b"b" * 16}
        # full: an offer never blocks, drops what does not fit and counts it
        release = threading.Event()
        q._write = lambda root, items: release.wait(10) and 0       # hold the worker
        q.offer(b"c" * 16, [(b"%016d" % 9, b"y" * 100)])
        many = [(b"%016d" % i, b"z" * 300) for i in range(10, 15)]
        taken = q.offer(b"c" * 16, many)
        assert taken == 3 and stats["dropped_puts"] == 2
        release.set()
        assert q.flush(10)
    finally:
        q.close()
    assert q.offer(b"c" * 16, [(b"%016d" % 99, b"x")]) == 0
