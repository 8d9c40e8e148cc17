"""The control-plane lock, with every hold timed.

NOTE: the lock is re-entrant (public calls nest); only the outermost hold of a thread is timed.
Holds are filed into fixed log-spaced buckets (O(1) per hold, no allocation), exported as the
`tiered_cache_lock_hold_seconds` histogram and summarised as p50/p99/max for benchmarks.
"""

from __future__ import annotations

import bisect
import threading
import time

# 1 us .. ~4 s, 4 buckets per octave
BUCKETS: tuple[float, ...] = tuple(1e-6 * 2 ** (i / 4) for i in range(88))


class HoldStats:
    def __init__(self) -> None:
        self.counts = [0] * (len(BUCKETS) + 1)
        self.total = 0
        self.sum = 0.0
        self.max = 0.0

    def observe(self, seconds: float) -> None:
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
        self.__init__()

    def summary(self) -> dict[str, float]:
        return {"count": self.total, "p50_s": self.quantile(0.5), "p99_s": self.quantile(0.99),
                "max_s": self.max, "mean_s": self.sum / self.total if self.total else 0.0}


class TimedLock:
    """A re-entrant lock whose outermost holds are timed.

    NOTE: the nesting depth and the start of the outermost hold are plain attributes, not
    thread-locals: only the thread holding the lock reads or writes them (set after acquire,
    back to 0 before release), so the lock itself guards them.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._depth = 0
        self._t0 = 0.0
        self.holds = HoldStats()

    def __enter__(self) -> TimedLock:
        self._lock.acquire()
        depth = self._depth
        if depth == 0:
            self._t0 = time.perf_counter()
        self._depth = depth + 1
        return self

    def __exit__(self, *exc) -> None:
        depth = self._depth - 1
        self._depth = depth
        if depth == 0:
            self.holds.observe(time.perf_counter() - self._t0)
        self._lock.release()
