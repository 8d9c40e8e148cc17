"""tiered_cache/locking.py: the hold statistics survive an exception at any line of
`observe` (it runs inside commit sections, where an asynchronous exception may land at any
line event, including the one CPython emits on leaving a `with` body before `__exit__`), and
they count every hold observed on any thread."""

from __future__ import annotations

import sys
import threading

import pytest

from tiered_cache.locking import HoldStats


class _RaiseAt:
    """Raise KeyboardInterrupt at the k-th line event of `HoldStats.observe`."""

    def __init__(self, k: int) -> None:
        self.k, self.n, self.fired = k, 0, False

    def __call__(self, frame, event, arg):
        if frame.f_code is not HoldStats.observe.__code__:
            return None
        return self.local

    def local(self, frame, event, arg):
        if event == "line" and not self.fired:
            self.n += 1
            if self.n == self.k:
                self.fired = True
                raise KeyboardInterrupt
        return self.local


def _lines_of_observe() -> int:
    counter = _RaiseAt(10**9)
    stats = HoldStats()
    sys.settrace(counter)
    try:
        stats.observe(1e-3)          # the first call of a thread runs every line
    finally:
        sys.settrace(None)
    return counter.n


@pytest.mark.slow
@pytest.mark.parametrize("k", range(1, 12))
def test_an_exception_at_any_line_of_observe_leaves_the_stats_usable(k):
    if k > _lines_of_observe():
        pytest.skip("observe has fewer lines")
    stats = HoldStats()
    inj = _RaiseAt(k)
    sys.settrace(inj)
    try:
        with pytest.raises(KeyboardInterrupt):
            stats.observe(2e-3)
    finally:
        sys.settrace(None)
    assert inj.fired
    done = threading.Event()

    def other():
        stats.observe(1e-3)
        stats.summary()
        done.set()

    t = threading.Thread(target=other, daemon=True)
    t.start()
    t.join(10)
    assert done.is_set(), "another thread hangs in HoldStats after the interrupted observe"
    stats.observe(1e-3)                          # and this thread goes on observing
    assert 2 <= stats.total <= 3


def test_every_hold_of_every_thread_is_counted():
    stats = HoldStats()
    barrier = threading.Barrier(4)

    def work():
        barrier.wait()
        for _ in range(5000):
            stats.observe(1e-5)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    s = stats.summary()                          # finished threads folded in, nothing lost
    assert s["count"] == 20000 == stats.total == sum(stats.counts)
    assert stats.sum == pytest.approx(20000 * 1e-5)
    stats.reset()
    assert stats.total == 0 and stats.summary()["count"] == 0
