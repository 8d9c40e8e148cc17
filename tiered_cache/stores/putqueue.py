"""A bounded queue of puts and the one thread that writes them in batches.

Why: writing a demoted block to a remote server must never stall the thread that demotes it.
`offer` never blocks: what does not fit under `max_bytes` is dropped and counted (a dropped put
is only a future miss). The worker drains up to `batch_bytes` per write, so the server sees
large pipelines. It survives every exception: it logs, counts and takes the next batch.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence

from tiered_cache.stores.stats import StoreStats

log = logging.getLogger(__name__)

Writer = Callable[[bytes, Sequence[tuple[bytes, bytes]]], int]


class PutQueue:
    def __init__(self, write: Writer, stats: StoreStats, *, max_bytes: int, batch_bytes: int,
                 name: str = "tiered-cache-store-put") -> None:
        self._write = write
        self._stats = stats
        self.max_bytes = max_bytes
        self.batch_bytes = batch_bytes
        self._cond = threading.Condition()
        self._queue: deque[tuple[bytes, bytes, bytes]] = deque()     # (root, key, record)
        self._queued_bytes = 0
        self._busy = False
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def offer(self, root: bytes, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Queue what fits; returns how many items were queued."""
        taken = 0
        with self._cond:
            if not self._closed:
                for key, record in items:
                    n = len(record)
                    if self._queued_bytes + n > self.max_bytes:
                        break
                    self._queue.append((root, key, record))
                    self._queued_bytes += n
                    taken += 1
                if taken:
                    self._cond.notify()
        if taken < len(items):
            self._stats.add(dropped_puts=len(items) - taken)
        return taken

    def flush(self, timeout_s: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._queue and not self._busy, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        with self._cond:
            self._closed = True
            dropped = len(self._queue)
            self._queue.clear()
            self._queued_bytes = 0
            self._cond.notify_all()
        if dropped:
            self._stats.add(dropped_puts=dropped)
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _take(self) -> list[tuple[bytes, bytes, bytes]] | None:
        with self._cond:
            self._cond.wait_for(lambda: self._queue or self._closed)
            if self._closed:
                return None
            batch, size = [], 0
            while self._queue and (not batch or size + len(self._queue[0][2]) <= self.batch_bytes):
                item = self._queue.popleft()
                size += len(item[2])
                batch.append(item)
            self._queued_bytes -= size
            self._busy = True
            return batch

    def _run(self) -> None:
        while True:
            try:
                batch = self._take()
                if batch is None:
                    return
                try:
                    self._write_batch(batch)
                finally:
                    with self._cond:
                        self._busy = False
                        self._cond.notify_all()
            except Exception:
                # NOTE: never let the writer die: a dead writer would silently turn every later
                # put into a drop. Count, log, carry on.
                self._stats.add(worker_errors=1)
                log.exception("remote put worker: unexpected error (continuing)")

    def _write_batch(self, batch: list[tuple[bytes, bytes, bytes]]) -> None:
        # One write per tenant root in the batch, in queue order.
        start = 0
        while start < len(batch):
            root = batch[start][0]
            end = start
            while end < len(batch) and batch[end][0] == root:
                end += 1
            self._write(root, [(k, r) for _, k, r in batch[start:end]])
            start = end
