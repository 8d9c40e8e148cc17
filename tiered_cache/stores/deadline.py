"""Hard deadlines for blocking client calls: run them on worker threads, stop waiting in time.

redis-py bounds each socket read by `socket_timeout`, but a pipeline makes several reads, a
reconnect adds a handshake, and a server that trickles bytes resets the timer on every read, so
no socket setting bounds a whole call. Here the caller hands the call to a small pool of
workers and waits on a future until the deadline; then it answers without the result. The
worker finishes (or times out on its socket) in the background and its connection returns to
the pool, so a slow server does not cost a reconnect per call.

NOTE: a call that has not started when its deadline passes is not started at all, so a backlog
behind a stuck server drains at once instead of queueing more work on it. Workers hold at most
`threads` connections on a slow server; callers beyond that wait in the queue, still bounded by
their own deadline.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import TypeVar

T = TypeVar("T")
log = logging.getLogger(__name__)


class DeadlineExceeded(Exception):
    """The call did not finish before its deadline (it may still finish in the background)."""


class _Expired(Exception):
    """The call's deadline passed before a worker picked it up; it was not started."""


class DeadlineRunner:
    def __init__(self, threads: int, name: str,
                 on_late_error: Callable[[BaseException], None] | None = None) -> None:
        if threads < 1:
            raise ValueError(f"threads: expected >= 1, got {threads}")
        self.threads = threads
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=name)
        self._on_late_error = on_late_error

    def warm(self, fn: Callable[[Callable[[], None]], object], timeout_s: float) -> None:
        """Start every worker now and run `fn(meet)` once on each (a store opens a connection
        there), without waiting for them: the first real call then finds its worker and its
        connection ready instead of paying for both inside its deadline.

        NOTE: `meet()` returns once every worker has called it (or after `timeout_s`): `fn`
        holds its connection across it, so each worker opens one of its own (a connection given
        back early would be the next worker's, and the pool would keep one), and no worker
        takes two tasks. A failing `fn` (a server not up yet) is only logged: the first real
        call finds out, and counts."""
        barrier = threading.Barrier(self.threads)

        def meet() -> None:
            try:
                barrier.wait(timeout_s)
            except threading.BrokenBarrierError:
                pass

        def task() -> None:
            try:
                fn(meet)
            except Exception as exc:  # noqa: BLE001 - warming is best effort
                log.debug("warming a store worker failed: %r", exc)
                barrier.abort()

        for _ in range(self.threads):
            self._pool.submit(task)

    def run(self, fn: Callable[[], T], timeout_s: float) -> T:
        """`fn()`'s result, or DeadlineExceeded after `timeout_s`; `fn`'s exceptions propagate."""
        deadline = time.monotonic() + timeout_s

        def guarded() -> T:
            if time.monotonic() >= deadline:
                raise _Expired()
            return fn()

        fut = self._pool.submit(guarded)
        try:
            return fut.result(timeout=max(0.0, deadline - time.monotonic()))
        except (FutureTimeout, _Expired, CancelledError):
            if not fut.cancel():
                fut.add_done_callback(self._late)
            raise DeadlineExceeded() from None

    def _late(self, fut: Future) -> None:
        # NOTE: a call abandoned at its deadline may fail later; nobody waits for it any more,
        # so it is reported here instead of vanishing.
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None or isinstance(exc, _Expired):
            return
        log.debug("store call failed after its deadline: %r", exc)
        if self._on_late_error is not None:
            try:
                self._on_late_error(exc)
            except Exception:                       # pragma: no cover - a counter
                log.exception("late-error callback failed")

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
