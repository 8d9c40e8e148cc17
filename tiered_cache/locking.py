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
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._local = threading.local()
        self.holds = HoldStats()

    def __enter__(self) -> TimedLock:
        self._lock.acquire()
        depth = getattr(self._local, "depth", 0)
        if depth == 0:
            self._local.t0 = time.perf_counter()
        self._local.depth = depth + 1
        return self

    def __exit__(self, *exc) -> None:
        depth = self._local.depth - 1
        self._local.depth = depth
        if depth == 0:
            self.holds.observe(time.perf_counter() - self._local.t0)
        self._lock.release()
