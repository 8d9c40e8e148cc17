"""The control-plane lock, with every hold timed.

NOTE: the lock is re-entrant (public calls nest); only the outermost hold of a thread is timed.
Holds are filed into fixed log-spaced buckets (O(1) per hold, no allocation), exported as the
`tiered_cache_lock_hold_seconds` histogram and summarised as p50/p99/max for benchmarks.

NOTE: asynchronous exceptions (core/atomic.py). The lock is CPython's C-level re-entrant lock
and `with lock:` releases it in C: no Python line runs between the body and the release, so an
exception raised at any line (deferred or not) never leaves it held. Acquiring runs in a
`try` whose handler gives back a hold this call took. The timing is not done by the lock: an
outermost hold is told to `on_hold` as it starts (the index passes `core.atomic.note_hold`: a
hold taken inside a commit section, `with atomic(), lock:` as every hold of the index is, is
observed when that section ends, inside the section, where a signal is deferred).
"""

from __future__ import annotations

import bisect
import threading
from _thread import RLock as _RLock
from _thread import allocate_lock
from collections.abc import Callable

# 1 us .. ~4 s, 4 buckets per octave
BUCKETS: tuple[float, ...] = tuple(1e-6 * 2 ** (i / 4) for i in range(88))


class _Shard:
    """One thread's observations (only that thread writes them)."""

    __slots__ = ("thread", "counts", "total", "sum", "max")

    def __init__(self, thread: threading.Thread | None) -> None:
        self.thread = thread
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0
        self.sum = 0.0
        self.max = 0.0

    def add(self, other: _Shard) -> None:
        for i, c in enumerate(other.counts):
            self.counts[i] += c
        self.total += other.total
        self.sum += other.sum
        self.max = max(self.max, other.max)


class HoldStats:
    """Durations in log-spaced buckets, observed on any thread (a hold is observed after its
    lock's release, by the thread that held it).

    NOTE: `observe` takes no lock. It runs inside commit sections, where an asynchronous
    exception may land at any line (core/atomic.py), including the line event CPython emits
    on leaving a `with` body before it calls `__exit__`: a lock held there would never be
    released and every later observation would hang. So each thread files into a shard of its
    own (`threading.local`; the shard list grows by `list.append`, atomic), and the readers
    merge the shards, folding those of finished threads into one. An exception mid-observe
    loses at most that one observation."""

    def __init__(self) -> None:
        self._mutex = allocate_lock()           # readers only (merging, reset)
        self._local = threading.local()
        self._shards: list[_Shard] = []
        self._done = _Shard(None)               # what finished threads observed

    def observe(self, seconds: float) -> None:
        shard = getattr(self._local, "shard", None)
        if shard is None:
            shard = _Shard(threading.current_thread())
            self._shards.append(shard)          # listed before it is used: none is lost
            self._local.shard = shard
        shard.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
        shard.total += 1
        shard.sum += seconds
        if seconds > shard.max:
            shard.max = seconds

    def _merged(self) -> _Shard:
        with self._mutex:
            live = []
            for shard in list(self._shards):
                if shard.thread is not None and not shard.thread.is_alive():
                    self._done.add(shard)
                else:
                    live.append(shard)
            self._shards[:] = live
            out = _Shard(None)
            out.add(self._done)
            for shard in live:
                out.add(shard)
            return out

    @property
    def counts(self) -> list[int]:
        return self._merged().counts

    @property
    def total(self) -> int:
        return self._merged().total

    @property
    def sum(self) -> float:
        return self._merged().sum

    @property
    def max(self) -> float:
        return self._merged().max

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding the q-quantile (within 19% above the true value)."""
        return _quantile(self._merged(), q)

    def reset(self) -> None:
        with self._mutex:
            self._done = _Shard(None)
            for shard in self._shards:
                shard.counts = [0] * (len(BUCKETS) + 1)
                shard.total, shard.sum, shard.max = 0, 0.0, 0.0

    def summary(self) -> dict[str, float]:
        m = self._merged()
        return {"count": m.total, "p50_s": _quantile(m, 0.5), "p99_s": _quantile(m, 0.99),
                "max_s": m.max, "mean_s": m.sum / m.total if m.total else 0.0}


def _quantile(m: _Shard, q: float) -> float:
    if not m.total:
        return 0.0
    rank = q * m.total
    seen = 0
    for i, c in enumerate(m.counts):
        seen += c
        if seen >= rank and c:
            return min(BUCKETS[i], m.max) if i < len(BUCKETS) else m.max
    return m.max


class TimedLock(_RLock):
    """A re-entrant lock whose outermost holds are told to `on_hold` (which times them into
    `holds`)."""

    def __init__(self, on_hold: Callable[[TimedLock], None] | None = None) -> None:
        super().__init__()
        self.holds = HoldStats()
        self._on_hold = on_hold

    def __enter__(self) -> TimedLock:
        before = self._recursion_count()
        try:
            self.acquire()
            if before == 0 and self._on_hold is not None:
                self._on_hold(self)
            return self
        except BaseException:
            # NOTE: an asynchronous exception after the acquire (the `with` never runs
            # `__exit__` for an `__enter__` that raised): give back what this call took.
            if self._recursion_count() > before:
                self.release()
            raise

    # `__exit__` is the C-level lock's own: the release runs no Python line.

    @property
    def depth(self) -> int:
        """How many times the calling thread holds the lock (0: not at all)."""
        return self._recursion_count()
