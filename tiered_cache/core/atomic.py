"""Commit sections: state changes that an asynchronous exception cannot cut in half.

An asynchronous exception is one raised at a point the code did not choose: KeyboardInterrupt
from SIGINT, SystemExit from an application's SIGTERM handler that calls `sys.exit`, any
exception any Python signal handler raises (they run on the main thread, between two
bytecodes), or one a debugger, a trace function or `PyThreadState_SetAsyncExc` injects into a
thread. Landing in the middle of a control-plane mutation (a block half published, a pin
counted in one place and not the other) would leave the index inconsistent, and the next request
could be handed another prompt's KV. So every mutation of `BlockIndex` runs inside `atomic()`.

Two mechanisms, by what can be deferred:

- **Signals** (the only source of asynchronous exceptions in a normal program). `install()`
  wraps the Python handler of every signal that has one (SIGINT's default handler, which raises
  KeyboardInterrupt, and any handler the application installed before the cache was built):
  a signal that arrives while the main thread is inside a section is recorded, and its handler
  runs when the outermost section ends, once the state is whole again. Whatever the handler
  raises is raised there. A section that ends by an exception still runs it (the interrupt is
  never swallowed: its exception replaces the section's).
- **Everything else** cannot be deferred by Python code. A section that an exception which is
  not an `Exception` (KeyboardInterrupt, SystemExit, ...) leaves is *torn*: the state it was
  changing may be half changed. So is one that a MemoryError (or torch's OutOfMemoryError)
  leaves: an allocation can fail at any line, so, unlike the errors a section raises on
  purpose (each before it changes anything: CapacityError, TransferError, ...), it says
  nothing about how far the section got. The tear is recorded and every `BlockIndex` that
  exists then is told (`on_tear`): it refuses every later call (`CacheBrokenError`, a miss,
  never wrong data) and its background threads stop moving data. The control-plane lock is a
  C-level lock (locking.py), so a tear never leaves it held.

NOTE: the lock's own bookkeeping (the timing of a hold, `HoldStats`) runs inside the section
that holds the lock: `TimedLock.__enter__` notes the hold, and the section observes it as it
ends, after the lock's C-level release and before the deferred handlers run.

NOTE: handlers installed after the last cache was built are not wrapped (`install()` again, or
build the cache after installing them); a signal they raise in a section is then a tear.
`active()` tells whether the calling thread is inside a section; the interrupt-injection tests
use it and the installed handlers to raise only where a real signal could land.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable

_local = threading.local()
_main = threading.main_thread().ident
_get_ident = threading.get_ident
_perf = time.perf_counter

_deferred: dict[int, tuple[Callable, object]] = {}
"""Signals that arrived while the main thread was inside a section: signum -> (the handler it
was to run, the frame it landed in), in arrival order; each signal once, as the OS
coalesces a signal that is already pending."""

_DEFER_EXC = -1          # the key of `defer_interrupt()`'s entry (no signal number)

DEFER_LIMIT_S = 10.0
"""A signal is deferred only while the outermost section has run less than this long. Sections
last micro- to milliseconds; past the limit the handler runs at once (a section it cuts is then
torn: refused, never wrong data). It bounds how long Ctrl-C can wait, and keeps signals working
if a non-deferrable exception ever landed in a section's own exit lines and left the thread
counted as inside one."""

_tears: list[str] = []   # what tore a section, oldest first (bounded)
_tear_listeners: list[weakref.ref] = []   # weak references to callables told of a tear


def _depth() -> int:
    return getattr(_local, "depth", 0)


def active() -> bool:
    """Whether the calling thread is inside a commit section."""
    return getattr(_local, "depth", 0) > 0


def defer_interrupt(exc: type[BaseException] | BaseException = KeyboardInterrupt) -> None:
    """Record an exception to raise when the main thread's outermost section ends (what a
    deferred SIGINT does; tests call it to simulate one)."""
    def _raise(signum=None, frame=None):
        raise exc
    _deferred.setdefault(_DEFER_EXC, (_raise, None))


def interrupt_pending() -> bool:
    """Whether a deferred signal waits for the outermost section to end (a section that hands
    a resource to its caller releases it first, since the caller will never see it)."""
    return bool(_deferred) and _get_ident() == _main


class _Deferring:
    """A signal handler's stand-in: inside a section of the main thread the handler's call
    waits for the section's end; anywhere else it runs at once."""

    __slots__ = ("handler", "__weakref__")

    def __init__(self, handler: Callable) -> None:
        self.handler = handler

    def __call__(self, signum: int, frame) -> None:
        if _get_ident() == _main and getattr(_local, "depth", 0) > 0 and \
                _perf() - _local.since < DEFER_LIMIT_S:
            _deferred.setdefault(signum, (self.handler, frame))
            return
        self.handler(signum, frame)

    def __repr__(self) -> str:
        return f"<deferred in commit sections: {self.handler!r}>"


def _signals() -> list[int]:
    try:
        return sorted(signal.valid_signals())
    except (AttributeError, ValueError):        # pragma: no cover - exotic platforms
        return [signal.SIGINT]


def install() -> None:
    """Wrap the Python handler of every signal that has one so that it waits for commit
    sections to end (idempotent; a no-op off the main thread). Handlers already wrapped, and
    signals with no Python handler (SIG_DFL, SIG_IGN, C handlers), are left alone."""
    if _get_ident() != _main:
        return
    for signum in _signals():
        try:
            handler = signal.getsignal(signum)
        except (ValueError, OSError):
            continue
        if handler is None or handler in (signal.SIG_DFL, signal.SIG_IGN) \
                or isinstance(handler, _Deferring) or not callable(handler):
            continue
        try:
            signal.signal(signum, _Deferring(handler))
        except (ValueError, OSError, RuntimeError):    # not settable here
            continue


def on_tear(listener: Callable[[str], None]) -> None:
    """`listener(what)` is called when a section is torn (see the module doc). Held weakly (a
    bound method through its object): a listener that goes away is forgotten."""
    ref = weakref.WeakMethod(listener) if hasattr(listener, "__self__") else \
        weakref.ref(listener)
    _tear_listeners[:] = [r for r in _tear_listeners if r() is not None] + [ref]


def tears() -> list[str]:
    """Descriptions of the sections torn in this process so far (oldest first)."""
    return list(_tears)


def _torn(exc_type: type, exc: BaseException | None, section) -> None:
    """A section was left by an exception that cannot be one of the code's own (`_is_tear`):
    the state it changed may be half changed. Tell every listener. `section`:
    the frame whose `with atomic()` it left."""
    if exc is not None:
        if getattr(exc, "_tiered_cache_torn", False):
            return              # the same exception, leaving an enclosing section
        try:
            exc._tiered_cache_torn = True  # type: ignore[attr-defined]  # a mark on any exception
        except AttributeError:  # pragma: no cover - an exception type without a __dict__
            pass
    tb = exc.__traceback__ if exc is not None else None
    landed = "?"
    while tb is not None:
        landed = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}"
        tb = tb.tb_next
    code = section.f_code if section is not None else None
    what = (f"{exc_type.__name__} (raised at {landed}) in the section of "
            f"{code.co_qualname if code else '?'} ({code.co_filename if code else '?'})")
    if len(_tears) < 64:
        _tears.append(what)
    for ref in list(_tear_listeners):
        listener = ref()
        if listener is None:
            continue
        try:
            listener(what)
        except Exception:       # noqa: BLE001 - a listener never makes the tear worse
            pass


def note_hold(lock) -> None:
    """The calling thread's current section has just taken `lock` (outermost): the hold is
    timed from now and observed into `lock.holds` when the section ends (locking.py)."""
    depth = getattr(_local, "depth", 0)
    if depth <= 0:
        return                  # not inside a section: untimed
    holds = getattr(_local, "holds", None)
    if holds is None:
        holds = _local.holds = []
    holds.append((depth, lock, _perf()))


class _Section:
    __slots__ = ()

    def __enter__(self) -> None:
        depth = getattr(_local, "depth", 0)
        if not depth:
            _local.since = _perf()
        _local.depth = depth + 1

    def __exit__(self, exc_type, exc, tb) -> None:
        depth = _local.depth
        try:
            if exc_type is not None and _is_tear(exc_type):
                _torn(exc_type, exc, sys._getframe(1))
            holds = None
            try:
                holds = getattr(_local, "holds", None)
                if holds:
                    now = _perf()
                    while holds and holds[-1][0] >= depth:
                        _, lock, t0 = holds.pop()
                        lock.holds.observe(now - t0)
            except Exception:       # noqa: BLE001 - NOTE: timing only (a MemoryError here
                # must not turn a section that committed into a failed call)
                if holds:
                    del holds[:]
        finally:
            _local.depth = depth - 1
        if depth == 1 and _deferred and _get_ident() == _main:
            _run_deferred()


def _is_tear(exc_type: type[BaseException]) -> bool:
    """Whether an exception that leaves a section tears it (see the module doc): anything but
    an `Exception`, and running out of memory (MemoryError; torch's OutOfMemoryError, a
    RuntimeError, when torch is loaded: core never imports it)."""
    if not issubclass(exc_type, (Exception, GeneratorExit)) or issubclass(exc_type, MemoryError):
        return True
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return oom is not None and issubclass(exc_type, oom)


def _run_deferred() -> None:
    """The outermost section of the main thread ended and the state is whole: run what the
    signals that landed inside it wanted, in arrival order.

    NOTE: a handler that raises ends the section with its exception (KeyboardInterrupt
    replaces a CapacityError the section was raising: the user asked to stop); signals still
    waiting behind it are delivered again (`signal.raise_signal`), so none is lost."""
    try:
        while _deferred:
            signum = next(iter(_deferred))
            handler, frame = _deferred.pop(signum)
            handler(signum if signum != _DEFER_EXC else None, frame)
    except BaseException:
        rest = [s for s in _deferred if s != _DEFER_EXC]
        _deferred.clear()
        for signum in rest:
            signal.raise_signal(signum)
        raise


_SECTION = _Section()


def atomic() -> _Section:
    """`with atomic(): ...` — a commit section (re-entrant, per thread)."""
    return _SECTION
