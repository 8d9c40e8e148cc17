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
from _thread import RLock as _RLock
from _thread import allocate_lock
from collections.abc import Callable

# 1 us .. ~4 s, 4 buckets per octave
BUCKETS: tuple[float, ...] = tuple(1e-6 * 2 ** (i / 4) for i in range(88))


class HoldStats:
    """Durations in log-spaced buckets. `observe` may run on several threads at once (a hold
    is observed after its lock's release): it takes a C-level mutex of its own."""

    def __init__(self) -> None:
        self._mutex = allocate_lock()
        self._clear()

    def _clear(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0
        self.sum = 0.0
        self.max = 0.0

    def observe(self, seconds: float) -> None:
        with self._mutex:
            self.counts[bisect.bisect_left(BUCKETS, seconds)] += 1
            self.total += 1
            self.sum += seconds
            if seconds > self.max:
                self.max = seconds

    def quantile(self, q: float) -> float:
        """Upper bound of the bucket holding the q-quantile (within 19% above the true value)."""
        if not self.total:
            return 0.0
        rank = q * self.total
        seen = 0
        for i, c in enumerate(self.counts):
            seen += c
            if seen >= rank and c:
                return min(BUCKETS[i], self.max) if i < len(BUCKETS) else self.max
        return self.max

    def reset(self) -> None:
        with self._mutex:
            self._clear()

    def summary(self) -> dict[str, float]:
        return {"count": self.total, "p50_s": self.quantile(0.5), "p99_s": self.quantile(0.99),
                "max_s": self.max, "mean_s": self.sum / self.total if self.total else 0.0}


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
