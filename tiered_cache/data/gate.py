"""A gate for a pool's calls: many I/O calls at once, or one structural call (a scan, a resize,
a close) alone, and nothing after close.

NOTE: why close waits. A file descriptor closed under a running pwrite is not just an error:
its number can be reused by the next open() in the process, and the write lands in someone
else's file. So close (and resize, which changes what is in range) waits for calls in flight.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from tiered_cache.errors import TierUnavailableError


class Gate:
    """Many I/O calls at once, or one structural call (scan, resize, close) alone."""

    def __init__(self, closed_message: str) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._exclusive = False
        self._waiting = 0
        self.closed = False
        self._closed_message = closed_message

    def _check(self) -> None:
        if self.closed:
            raise TierUnavailableError(self._closed_message)

    @contextmanager
    def shared(self) -> Iterator[None]:
        with self._cond:
            # NOTE: new I/O waits behind a waiting resize/close, so those cannot starve.
            while self._exclusive or self._waiting:
                self._cond.wait()
            self._check()
            self._active += 1
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                if not self._active:
                    self._cond.notify_all()

    @contextmanager
    def exclusive(self, *, closing: bool = False) -> Iterator[bool]:
        """Yields False (and does nothing) when closing a pool that is already closed."""
        with self._cond:
            self._waiting += 1
            try:
                while self._exclusive or self._active:
                    self._cond.wait()
            finally:
                self._waiting -= 1
            already_closed = self.closed and closing
            if not already_closed:
                self._check()
                self._exclusive = True
        if already_closed:
            yield False
            return
        try:
            yield True
        finally:
            with self._cond:
                self._exclusive = False
                self._cond.notify_all()
