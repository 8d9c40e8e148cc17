"""Counters and latency histograms of one keyed store.

Why its own lock: the caller's threads, the lookup workers and the put worker all count, and a
lost increment would make `errors` or `corrupt` lie. Increments are a few per batch, never per
byte, so one lock is cheap.
"""

from __future__ import annotations

import threading
from typing import Any

from tiered_cache.locking import BUCKETS, HoldStats

COUNTERS = (
    "hits",             # get: keys answered with a verified record
    "misses",           # get: keys answered None (absent, evicted, corrupt, failed, skipped)
    "exists_true",      # exists: keys found
    "exists_false",     # exists: keys not found, timed out or skipped
    "bytes_in",         # record bytes read (verified or not)
    "bytes_out",        # record bytes the server accepted
    "puts",             # records the server accepted
    "put_failed",       # records a put did not store (server error, connection failure)
    "errors",           # failed server calls (connection, protocol, server errors)
    "timeouts",         # calls cut at their deadline or by a socket timeout
    "corrupt",          # values that failed the record check (counted as misses)
    "skipped",          # calls not sent because the breaker was open
    "dropped_puts",     # records put_async could not queue (queue full, or closing)
    "worker_errors",    # unexpected exceptions caught in background threads
    "breaker_opened",   # times the breaker opened
    "reconnects",       # times the breaker closed again after being open
)
OPS = ("exists", "get", "put")


class StoreStats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._latency = {op: HoldStats() for op in OPS}

    def add(self, **increments: int) -> None:
        with self._lock:
            for name, n in increments.items():
                self._counts[name] += n

    def observe(self, op: str, seconds: float) -> None:
        with self._lock:
            self._latency[op].observe(seconds)

    def __getitem__(self, name: str) -> int:
        return self._counts[name]

    def snapshot(self) -> dict[str, Any]:
        """Counters, plus per operation `{count, p50_s, p99_s, max_s, mean_s}` and the raw
        histogram (`buckets`: upper bounds in seconds, `counts`: one more than buckets, the last
        one past the largest bound) for a Prometheus exporter."""
        with self._lock:
            out: dict[str, Any] = dict(self._counts)
            out["latency"] = {op: {**h.summary(), "sum_s": h.sum, "counts": list(h.counts)}
                              for op, h in self._latency.items()}
        out["latency_buckets_s"] = BUCKETS
        return out
