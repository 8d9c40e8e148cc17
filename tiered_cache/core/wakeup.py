"""`Wakeup`: wait until a predicate holds, woken by whoever changes it; safe at any line.

`threading.Condition.wait` releases its lock, waits, and takes the lock back in Python code: an
asynchronous exception (KeyboardInterrupt) landing between the release and the `try` that
re-acquires makes the enclosing `with cond:` raise "cannot release un-acquired lock" instead,
and one landing in `notify_all` can leave the condition's lock held. A `Wakeup` holds no lock
while anyone waits: each waiter sleeps in one C-level `acquire` of a gate of its own, which a
notifier opens. Wherever an exception lands, nothing stays held and the exception itself is what
the caller sees.

NOTE: the predicate is checked after the waiter's gate is registered, and notifiers change the
state before they open the gates, so a wake-up between the check and the sleep is never lost
(a gate registered in the set a notifier has just taken is registered after the change, so the
check that follows sees it).
"""

from __future__ import annotations

import time
from _thread import allocate_lock
from collections.abc import Callable


class Wakeup:
    __slots__ = ("_gates",)

    def __init__(self) -> None:
        self._gates: set = set()

    def wait_for(self, predicate: Callable[[], bool], timeout: float | None = None) -> bool:
        """Block until `predicate()` is true (True) or `timeout` seconds passed (its value
        then). None: no timeout."""
        if predicate():
            return True
        deadline = None if timeout is None else time.monotonic() + timeout
        gate = allocate_lock()
        gate.acquire()
        # NOTE: one `return` of a variable after the `try`: CPython runs no `finally` for an
        # exception raised at the line event of a `return <constant>` inside the `try`.
        try:
            while True:
                self._gates.add(gate)       # (again after each wake-up: notify takes them all)
                done = predicate()
                if done:
                    break
                if deadline is None:
                    gate.acquire()
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    done = predicate()
                    break
                gate.acquire(timeout=left)
        finally:
            self._gates.discard(gate)
        return done

    def notify_all(self) -> None:
        """Wake every waiter (each checks its predicate again). Gates left registered by a
        waiter that an exception ended go with them."""
        gates, self._gates = self._gates, set()
        for gate in list(gates):
            try:
                gate.release()
            except RuntimeError:        # already open: its waiter has not slept again yet
                pass
