"""A circuit breaker with exponential backoff: stop calling a server that keeps failing.

States:

- closed: calls go through; `failure_threshold` consecutive failures open the breaker.
- open: calls are refused (the store answers misses at once) until the next probe time.
- half-open: one caller, the first after the probe time, is let through as the probe. Its
  success closes the breaker (backoff reset); its failure opens it again with the backoff
  doubled (up to `backoff_max_s`), with +-`jitter` so that many clients do not probe in step.

Why: a dead server costs every call a connect attempt (or a socket timeout, when packets vanish);
with the breaker, a dead server costs one probe per backoff period and the cache serves from its
local tiers in the meantime. Reconnection needs no thread: the next call after the backoff is
the probe.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    def __init__(self, *, failure_threshold: int = 3, backoff_initial_s: float = 0.1,
                 backoff_max_s: float = 10.0, jitter: float = 0.1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold: expected >= 1, got {failure_threshold}")
        if not 0 < backoff_initial_s <= backoff_max_s:
            raise ValueError("expected 0 < backoff_initial_s <= backoff_max_s, got "
                             f"{backoff_initial_s}, {backoff_max_s}")
        self.failure_threshold = failure_threshold
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.jitter = jitter
        self._clock = clock
        self._lock = threading.Lock()
        self._state = CLOSED
        self._failures = 0
        self._backoff = backoff_initial_s
        self._probe_at = 0.0
        self._probe_started = 0.0
        self.opened = 0             # times opened (from closed or half-open)
        self.recovered = 0          # times closed again after being open

    @property
    def state(self) -> str:
        return self._state

    @property
    def closed(self) -> bool:
        return self._state == CLOSED

    @property
    def next_probe_in_s(self) -> float:
        return max(0.0, self._probe_at - self._clock()) if self._state != CLOSED else 0.0

    def allow(self) -> bool:
        """May this call go to the server? In half-open state only the probe may."""
        if self._state == CLOSED:          # NOTE: unlocked fast path; a stale read is harmless
            return True
        with self._lock:
            now = self._clock()
            if self._state == CLOSED:
                return True
            if self._state == OPEN and now >= self._probe_at:
                self._state = HALF_OPEN
                self._probe_started = now
                return True
            # NOTE: a probe whose caller never reported (an exception we did not see) must not
            # wedge the breaker: after a full backoff_max_s another caller may probe.
            if self._state == HALF_OPEN and now - self._probe_started > self.backoff_max_s:
                self._probe_started = now
                return True
            return False

    def success(self) -> None:
        if self._state == CLOSED and self._failures == 0:
            return
        with self._lock:
            if self._state != CLOSED:
                self.recovered += 1
            self._state = CLOSED
            self._failures = 0
            self._backoff = self.backoff_initial_s

    def failure(self) -> bool:
        """Record a failed call; True when this failure opened the breaker."""
        with self._lock:
            self._failures += 1
            if self._state == OPEN:
                return False
            if self._state == HALF_OPEN or self._failures >= self.failure_threshold:
                delay = self._backoff * (1.0 + self.jitter * (2.0 * random.random() - 1.0))
                self._probe_at = self._clock() + delay
                self._backoff = min(self._backoff * 2.0, self.backoff_max_s)
                self._state = OPEN
                self.opened += 1
                return True
            return False
