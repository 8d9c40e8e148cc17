"""core/atomic.py, locking.py and core/wakeup.py: what makes a commit section indivisible.

- Signals: every Python handler present when a cache is built is wrapped; inside a section its
  call waits for the outermost section's end (real signals, `signal.raise_signal`), and what it
  raises is raised there, replacing the section's own exception.
- Exceptions nothing can defer (raised at a line of a section by a trace function here, as
  `PyThreadState_SetAsyncExc` would): the section is recorded as torn and every index that
  exists is told; the cache refuses every call (`CacheBrokenError`), its threads stop moving.
- The control-plane lock is released in C: an exception raised at any line of `__enter__` or
  of the body never leaves it held; a hold is timed inside its section.
- `Wakeup` and the promotion waits built on it: an exception at any line of a wait (the
  standard library's lines included) is what the caller sees, never "cannot release
  un-acquired lock", and leaves nothing registered.

The whole-cache sweeps (every line of every module a call reaches) are tests/test_interrupts.py.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

import pytest
import torch

from tests.helpers import (
    make_cache,
    tokens,
    write_pattern_all,
)
from tiered_cache.core import atomic
from tiered_cache.core.readiness import LayerReadiness
from tiered_cache.core.wakeup import Wakeup
from tiered_cache.errors import CacheBrokenError, PromotionTimeout
from tiered_cache.locking import TimedLock


class Exit(BaseException):
    """What the application's handler raises (SystemExit would end pytest's run)."""


@pytest.fixture
def app_handler():
    """An application handler for SIGUSR1 installed before the cache is built."""
    calls = []

    def handler(signum, frame):
        calls.append(signum)
        raise Exit(signum)

    old = signal.signal(signal.SIGUSR1, handler)
    try:
        yield calls
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_handlers_present_when_a_cache_is_built_are_wrapped(app_handler):
    cache = make_cache()
    try:
        h = signal.getsignal(signal.SIGUSR1)
        assert isinstance(h, atomic._Deferring) and h.handler.__name__ == "handler"
        assert isinstance(signal.getsignal(signal.SIGINT), atomic._Deferring)
        atomic.install()                        # idempotent: not wrapped twice
        assert signal.getsignal(signal.SIGUSR1) is h
    finally:
        cache.shutdown()


def test_a_real_signal_inside_a_section_runs_its_handler_when_the_section_ends(app_handler):
    """(Regression: only SIGINT was deferred; an application's handler ran, and raised, in the
    middle of a mutation.)"""
    cache = make_cache()
    try:
        reached = []
        with pytest.raises(Exit):
            with atomic.atomic():
                with atomic.atomic():
                    signal.raise_signal(signal.SIGUSR1)
                    for _ in range(1000):       # the handler would run at any of these
                        pass
                    reached.append("inner")
                assert app_handler == [] and atomic.interrupt_pending()
                reached.append("outer")
        assert reached == ["inner", "outer"] and app_handler == [signal.SIGUSR1]
        assert not atomic.interrupt_pending() and not atomic.active()
        with pytest.raises(Exit):               # outside a section: at once
            signal.raise_signal(signal.SIGUSR1)
            for _ in range(1000):
                pass
    finally:
        cache.shutdown()


def test_a_deferred_interrupt_replaces_the_sections_own_error():
    """A section ending with an error still delivers what was deferred (the user asked to
    stop): never swallowed. (Regression: it was dropped.)"""
    make_cache().shutdown()
    with pytest.raises(KeyboardInterrupt) as err:
        with atomic.atomic():
            signal.getsignal(signal.SIGINT)(signal.SIGINT, sys._getframe())
            raise ValueError("the section's own error")
    assert isinstance(err.value.__context__, ValueError)
    assert not atomic.interrupt_pending()


def test_a_signal_is_deferred_at_most_defer_limit(monkeypatch):
    """Past DEFER_LIMIT_S into the outermost section a handler runs at once (a section that
    ran that long is then torn: refused, never wrong data)."""
    make_cache().shutdown()
    handler = signal.getsignal(signal.SIGINT)
    with atomic.atomic():
        handler(signal.SIGINT, sys._getframe())
        assert atomic.interrupt_pending()
        atomic._deferred.clear()
        monkeypatch.setattr(atomic, "DEFER_LIMIT_S", 0.0)
        with pytest.raises(KeyboardInterrupt):
            handler(signal.SIGINT, sys._getframe())


def raise_at_line(code, line: int, exc=KeyboardInterrupt):
    """A trace hook raising `exc` at the first 'line' event of `line` in frames of `code`
    (what an exception nothing can defer does)."""
    fired = []

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == line and not fired:
            fired.append(line)
            raise exc
        return local

    def glob(frame, event, arg):
        return local if frame.f_code is code else None

    return glob, fired


def test_a_section_an_exception_tears_marks_every_cache_broken():
    """An exception that is not an `Exception` leaving a section: the state may be half
    changed, so the cache (built before) refuses every call; one built after is whole. The
    migrator's threads stop instead of moving data of a half-changed state."""
    cache = make_cache(host_blocks=16, extra={"migrator": {"enabled": True}})
    s = cache.open(tokens(8))
    write_pattern_all(cache, s)
    with pytest.raises(KeyboardInterrupt):
        with atomic.atomic():
            raise KeyboardInterrupt             # as if injected at this line
    assert cache.index.broken is not None and "KeyboardInterrupt" in cache.index.broken
    assert "KeyboardInterrupt" in atomic.tears()[-1]
    for call in (lambda: cache.open(tokens(4)), lambda: cache.gather(s, 0),
                 lambda: cache.close(s), lambda: cache.index.open(s.token_ids)):
        with pytest.raises(CacheBrokenError, match="build a new"):
            call()
    cache.shutdown()                            # closes files, writes nothing down
    assert not any(t.is_alive() for t in cache.migrator._threads)
    fresh = make_cache()
    seq = fresh.open(tokens(4))
    fresh.close(seq)
    fresh.shutdown()


def test_errors_the_code_raises_in_a_section_are_not_tears():
    cache = make_cache()
    n = len(atomic.tears())
    with pytest.raises(ValueError):
        with atomic.atomic():
            raise ValueError("rolled back by the code that raised it")
    assert len(atomic.tears()) == n and cache.index.broken is None
    cache.shutdown()


@pytest.mark.parametrize("exc", [MemoryError, torch.OutOfMemoryError])
def test_running_out_of_memory_in_a_section_tears_it(exc):
    """An allocation can fail at any line: a section left by MemoryError (or torch's
    OutOfMemoryError, a RuntimeError) may be half changed, so it is a tear, not an error the
    code rolled back. Outside a section it is only the caller's error."""
    cache = make_cache()
    s = cache.open(tokens(8))
    write_pattern_all(cache, s)
    with pytest.raises(exc):
        raise exc("outside any section")
    assert cache.index.broken is None
    with pytest.raises(exc):
        with atomic.atomic():
            raise exc("as if an allocation failed at this line")
    assert cache.index.broken is not None and exc.__name__ in cache.index.broken
    with pytest.raises(CacheBrokenError):
        cache.gather(s, 0)
    cache.shutdown()


# ---------------------------------------------------------------------------- the lock


def _lines(fn) -> list[int]:
    import inspect

    src, first = inspect.getsourcelines(fn)
    return [first + i for i, line in enumerate(src)
            if line.strip() and not line.strip().startswith(("def ", "#", '"""', "@"))]


def _free(lock) -> bool:
    got = threading.Event()

    def probe():
        if lock.acquire(timeout=5):
            lock.release()
            got.set()

    t = threading.Thread(target=probe)
    t.start()
    t.join()
    return got.is_set()


@pytest.mark.slow
@pytest.mark.parametrize("line", _lines(TimedLock.__enter__))
def test_an_exception_at_any_line_of_taking_the_lock_leaves_it_free(line):
    """(Regression: an exception after `acquire()` inside `__enter__`, or before the release
    inside `__exit__`, left the lock held: every later call of every thread hung.)"""
    lock = TimedLock()
    hook, fired = raise_at_line(TimedLock.__enter__.__code__, line)
    old = sys.gettrace()
    sys.settrace(hook)
    try:
        with pytest.raises(KeyboardInterrupt):
            with lock:
                pass
    except BaseException:
        if not fired:                           # a line not run on this path (the except)
            pytest.skip(f"line {line} does not run when taking a free lock")
        raise
    finally:
        sys.settrace(old)
    assert fired and _free(lock)


def test_the_lock_is_released_in_c_whatever_the_body_raises():
    lock = TimedLock()
    assert "__exit__" not in TimedLock.__dict__    # the C lock's own
    with pytest.raises(KeyboardInterrupt):
        with atomic.atomic(), lock:
            with lock:
                raise KeyboardInterrupt
    assert lock.depth == 0 and _free(lock)


def test_a_hold_is_timed_once_inside_its_section():
    lock = TimedLock(on_hold=atomic.note_hold)
    with atomic.atomic(), lock:
        with lock:                              # re-entrant: only the outermost is timed
            pass
        assert lock.holds.total == 0            # observed when the section ends
    assert lock.holds.total == 1
    with lock:                                  # outside a section: untimed
        pass
    assert lock.holds.total == 1


# ---------------------------------------------------------------------------- waits


def test_wakeup_waits_until_notified_or_the_timeout():
    w = Wakeup()
    state = []
    t = threading.Timer(0.05, lambda: (state.append(1), w.notify_all()))
    t.start()
    assert w.wait_for(lambda: bool(state), 10)
    assert not w.wait_for(lambda: False, 0.01)
    assert not w._gates


def _wait_lines():
    """Every line of a promotion wait and of what it runs (core/readiness.py, wakeup.py), and
    of `threading.Condition.wait` (which it must not run: an interrupt between its release
    and its `try` turns into RuntimeError at the `with` statement's exit)."""
    return [(f, line) for f in (LayerReadiness.wait, Wakeup.wait_for, threading.Condition.wait)
            for line in _lines(f)]


@pytest.mark.slow
@pytest.mark.parametrize("fn, line", _wait_lines(),
                         ids=lambda x: getattr(x, "__qualname__", str(x)))
def test_an_interrupt_at_any_line_of_a_promotion_wait_is_what_the_caller_sees(fn, line):
    """A reader blocked on a layer that has not landed, interrupted at any line: it sees
    KeyboardInterrupt (not "cannot release un-acquired lock", as `threading.Condition` can
    give), later waits work, and nothing stays registered past the next notify. (Regression:
    the promotion wait used `threading.Condition`.)"""
    r = LayerReadiness(2, 1)
    timer = threading.Timer(0.2, r.layer_done, args=(0,))
    timer.start()
    hook, fired = raise_at_line(fn.__code__, line)
    old = sys.gettrace()
    sys.settrace(hook)
    try:
        r.wait(0, 5.0)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
    finally:
        sys.settrace(old)
        timer.join()
    assert interrupted == bool(fired)
    assert r.wait(0, 5.0) is None
    with pytest.raises(PromotionTimeout):
        r.wait(1, 0.01)
    r.layer_done(1)                 # a gate an interrupt left registered goes with a notify
    assert not r._landed._gates


def test_the_real_sigint_child_reports_no_condition_errors():
    """The NOTE of tests/test_interrupts.py's real-SIGINT child about CPython's
    `threading.Condition` no longer applies to the cache's own waits."""
    src = open(os.path.join(os.path.dirname(__file__), os.pardir, os.pardir, "tiered_cache", "core",
                            "readiness.py")).read()
    assert "threading.Condition" not in src
