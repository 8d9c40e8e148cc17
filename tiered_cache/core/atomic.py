"""Commit sections: state changes that an asynchronous exception cannot cut in half.

A KeyboardInterrupt (SIGINT) can arrive between any two bytecodes of the main thread. Landing in
the middle of a control-plane mutation (a block half published, a pin counted in one place and
not the other) would leave the index inconsistent, and the next request could be handed another
prompt's KV. So every mutation of `BlockIndex` runs inside `atomic()`: a SIGINT that arrives
meanwhile is recorded and raised when the outermost section ends, once the state is whole again.

Work that may fail or take long (copies, waits) stays outside commit sections and releases what
it holds in `try/finally`; commit sections are short and only touch control-plane memory.

NOTE: the SIGINT handler is installed only where that is possible and polite: from the main
thread, and only over Python's default handler (an application that installed its own keeps it).
`active()` tells whether the calling thread is inside a section; the interrupt-injection tests
use it to raise only where a real SIGINT could land.
"""

from __future__ import annotations

import signal
import threading

_local = threading.local()
_main = threading.main_thread().ident
_installed = False
_pending = False            # a SIGINT arrived while the main thread was inside a section


def _depth() -> int:
    return getattr(_local, "depth", 0)


def active() -> bool:
    """Whether the calling thread is inside a commit section."""
    return _depth() > 0


def defer_interrupt() -> None:
    """Record an interrupt to raise when the calling thread's outermost section ends (what the
    SIGINT handler does; tests call it to simulate one)."""
    global _pending
    _pending = True


def interrupt_pending() -> bool:
    """Whether an interrupt waits for the outermost section to end (a section that hands a
    resource to its caller releases it first, since the caller will never see it)."""
    return _pending and threading.get_ident() == _main


def _on_sigint(signum, frame) -> None:
    if threading.get_ident() == _main and _depth() > 0:
        defer_interrupt()
        return
    signal.default_int_handler(signum, frame)


def install() -> None:
    """Defer SIGINT inside commit sections (idempotent; a no-op off the main thread or when the
    application has its own SIGINT handler)."""
    global _installed
    if _installed or threading.get_ident() != _main:
        return
    try:
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, _on_sigint)
        _installed = True
    except (ValueError, OSError):       # not the main interpreter, or no signals here
        _installed = True


class _Section:
    __slots__ = ()

    def __enter__(self) -> None:
        _local.depth = getattr(_local, "depth", 0) + 1     # (`_depth()`, inlined: hot)

    def __exit__(self, *exc) -> None:
        global _pending
        depth = _local.depth - 1
        _local.depth = depth
        if depth == 0 and _pending and threading.get_ident() == _main:
            _pending = False
            if exc[0] is None:
                raise KeyboardInterrupt


_SECTION = _Section()


def atomic() -> _Section:
    """`with atomic(): ...` — a commit section (re-entrant, per thread)."""
    return _SECTION
