"""Health of the background threads: every exception is logged with its traceback, counted per
thread, and the thread carries on. `stats()["threads"]` and the
`tiered_cache_background_errors_total{thread}` metric report it.
"""

from __future__ import annotations

import logging
import threading
import time
import traceback


class ThreadHealth:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.errors: dict[str, int] = {}
        self.last_error: dict[str, str] = {}
        self.threads: dict[str, threading.Thread] = {}

    def watch(self, thread: threading.Thread) -> None:
        with self._lock:
            self.threads[thread.name] = thread
            self.errors.setdefault(thread.name, 0)

    def record(self, log: logging.Logger, what: str) -> None:
        """Call from an `except` block of a background thread: log, count, remember."""
        name = threading.current_thread().name
        log.exception("%s failed in thread %s; the thread carries on", what, name)
        with self._lock:
            self.errors[name] = self.errors.get(name, 0) + 1
            self.last_error[name] = f"{time.strftime('%H:%M:%S')} {what}: " + \
                traceback.format_exc(limit=1).strip().splitlines()[-1]

    def summary(self) -> dict[str, dict]:
        with self._lock:
            return {name: {"alive": t.is_alive(), "errors": self.errors.get(name, 0),
                           "last_error": self.last_error.get(name)}
                    for name, t in self.threads.items()}
