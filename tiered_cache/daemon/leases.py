"""Leases: how long the daemon keeps believing a client is alive.

Every client the service admits gets a lease (`grant`), renewed by its heartbeats (`renew`).
A client whose lease passes, or whose connection closes (`close`), is handed to
`expired(client)` exactly once, on the reaper thread: that is where the service reaps its pins.
A client of a SIGKILLed process is reaped as soon as the kernel closes its socket (the transport
calls `close`); the lease bounds the reap of a client that is alive but stuck (stopped, hung,
partitioned by a full socket buffer).

NOTE: once expired, a client stays expired. `renew` of an unknown or expired client raises
LeaseExpiredError instead of granting a fresh lease: a client that was reaped while it was
stuck must learn that its pins are gone, not carry on as if it still held them. Client ids
must never be reused (the transport's ids are unique for the daemon's lifetime).

Each operation is O(log n): a heap of (expiry, seq, client) with lazy deletion (a renewal pushes
a new entry; the one it replaces is skipped when it surfaces) and a rebuild when stale entries
outnumber live ones.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable, Hashable
from typing import Any

from tiered_cache.wire.errors import LeaseExpiredError

log = logging.getLogger(__name__)

_CLOSED = float("-inf")         # the expiry of a closed client: before every real one


class LeaseTable:
    """client -> expiry, with a reaper thread (started by `start`) calling `expired`."""

    def __init__(self, lease_s: float, expired: Callable[[Hashable], None], *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not lease_s > 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self._expired = expired
        self._clock = clock
        self._cond = threading.Condition(threading.Lock())
        self._live: dict[Hashable, tuple[float, int]] = {}     # client -> (expiry, seq)
        self._heap: list[tuple[float, int, Hashable]] = []
        self._seq = itertools.count()
        self._counts = {"granted": 0, "renewed": 0, "timed_out": 0, "closed": 0,
                        "callback_errors": 0, "reaper_errors": 0, "passes": 0}
        self._stopping = False
        self._thread: threading.Thread | None = None

    # the table --------------------------------------------------------------------------------

    def grant(self, client: Hashable, lease_s: float | None = None) -> float:
        """Start `client`'s lease (of `lease_s`, default the table's); returns its expiry (on
        the table's clock)."""
        with self._cond:
            if client in self._live:
                raise ValueError(f"client {client!r} already holds a lease")
            self._counts["granted"] += 1
            return self._set(client, self._clock() + (self.lease_s if lease_s is None
                                                      else lease_s))

    def renew(self, client: Hashable) -> float:
        """Extend `client`'s lease by lease_s from now; LeaseExpiredError if it has none (or
        its connection has closed)."""
        with self._cond:
            entry = self._live.get(client)
            if entry is None or entry[0] == _CLOSED:
                raise LeaseExpiredError(f"client {client!r} holds no lease (expired, closed or "
                                        "never granted): attach again")
            self._counts["renewed"] += 1
            return self._set(client, self._clock() + self.lease_s)

    def close(self, client: Hashable) -> bool:
        """The client's connection closed: expire it now (on the reaper). False if it held no
        lease (already expired, or never granted)."""
        with self._cond:
            entry = self._live.get(client)
            if entry is None or entry[0] == _CLOSED:
                return False
            self._set(client, _CLOSED)
            return True

    def expires_at(self, client: Hashable) -> float | None:
        with self._cond:
            entry = self._live.get(client)
            return None if entry is None else entry[0]

    def __contains__(self, client: Hashable) -> bool:
        with self._cond:
            return client in self._live

    def __len__(self) -> int:
        with self._cond:
            return len(self._live)

    def stats(self) -> dict[str, Any]:
        with self._cond:
            return {**self._counts, "live": len(self._live), "heap": len(self._heap)}

    def _set(self, client: Hashable, expiry: float) -> float:
        seq = next(self._seq)
        self._live[client] = (expiry, seq)
        if len(self._heap) > 2 * len(self._live) + 64:
            # NOTE: O(n) once per ~n renewals: amortised O(1), and the heap stays O(n).
            self._heap = [(e, s, c) for c, (e, s) in self._live.items() if s != seq]
            heapq.heapify(self._heap)
        head = self._heap[0][0] if self._heap else float("inf")
        heapq.heappush(self._heap, (expiry, seq, client))
        if expiry < head:
            self._cond.notify()         # the reaper sleeps until the old head: wake it
        return expiry

    # reaping ----------------------------------------------------------------------------------

    def reap(self) -> list[Hashable]:
        """Expire every client whose lease has passed (or was closed) and call `expired` for
        each, in expiry order, on the calling thread. Returns them. The reaper thread calls this;
        tests may too."""
        with self._cond:
            due = self._pop_due(self._clock())
        self._notify(due)
        return [c for c, _ in due]

    def _pop_due(self, now: float) -> list[tuple[Hashable, bool]]:
        due = []
        heap, live = self._heap, self._live
        while heap and heap[0][0] <= now:
            expiry, seq, client = heapq.heappop(heap)
            entry = live.get(client)
            if entry is None or entry[1] != seq:
                continue                # replaced by a renewal, or already expired
            del live[client]
            closed = expiry == _CLOSED
            self._counts["closed" if closed else "timed_out"] += 1
            due.append((client, closed))
        self._counts["passes"] += 1
        return due

    def _notify(self, due: list[tuple[Hashable, bool]]) -> None:
        # NOTE: outside the lock, so `expired` may call back into the table (or block on the
        # service's lock) without stalling renewals.
        for client, closed in due:
            log.info("lease of client %r ended (%s)", client, "closed" if closed else "timed out")
            try:
                self._expired(client)
            except Exception:
                with self._cond:
                    self._counts["callback_errors"] += 1
                log.exception("expired(%r) failed; the client is not retried", client)

    def start(self) -> LeaseTable:
        """Start the reaper thread."""
        with self._cond:
            if self._thread is not None:
                return self
            self._stopping = False
            self._thread = threading.Thread(target=self._run, daemon=True,
                                            name="tc-daemon-reaper")
        self._thread.start()
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Stop the reaper. Clients still holding leases are left as they are (the service
        decides what a shutdown does with them)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(timeout)

    def _run(self) -> None:
        while True:
            try:
                with self._cond:
                    while not self._stopping:
                        now = self._clock()
                        if self._heap and self._heap[0][0] <= now:
                            break
                        wait = self._heap[0][0] - now if self._heap else None
                        self._cond.wait(wait)
                    if self._stopping:
                        return
                    due = self._pop_due(self._clock())
                self._notify(due)
            except Exception:
                # NOTE: the reaper must outlive any bug: a dead reaper leaks every pin after it.
                with self._cond:
                    self._counts["reaper_errors"] += 1
                log.exception("lease reaper pass failed; carrying on")
                time.sleep(0.01)
