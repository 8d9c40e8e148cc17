"""A thread blocked in `wait()` on a sequence another thread closes (issue 23, item 8:
in-flight): it is woken at once and told the sequence is closed. It used to sleep until the
writer wrote or its timeout ended, and then return normally, as if the closed sequence's KV
could still be read."""

from __future__ import annotations

import threading
import time

from tests.helpers import (
    make_cache,
    tokens,
    write_pattern_all,
)
from tiered_cache.errors import SequenceClosedError

WAIT_S = 60.0           # far beyond the join below: only a wake-up by close ends the wait early


def _waiting(cache, seq, layer: int) -> tuple[threading.Thread, dict]:
    out: dict = {}

    def run() -> None:
        try:
            cache.wait(seq, layer)
            out["result"] = "returned"
        except Exception as exc:        # what the engine's thread sees
            out["result"] = type(exc).__name__

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t, out


def _blocked(t: threading.Thread) -> None:
    """Give the thread time to reach its wait (if it has not, it finds the sequence closed:
    the same answer)."""
    time.sleep(0.3)
    assert t.is_alive()


def test_a_waiter_closed_by_another_thread_is_woken_and_told():
    cache = make_cache(gpu_blocks=32, host_blocks=32, share_inflight=True,
                       migrator={"enabled": True, "wait_timeout_s": WAIT_S})
    p = tokens(16)
    writer = cache.open(p)
    waiter = cache.open(p)
    assert waiter.num_cached_tokens == 16           # taken from the writer, not yet written
    t, out = _waiting(cache, waiter, 0)
    _blocked(t)
    cache.close(waiter)                             # another thread gives the request up
    t.join(WAIT_S / 4)
    assert not t.is_alive(), "wait() kept sleeping on a closed sequence"
    assert out["result"] == SequenceClosedError.__name__
    write_pattern_all(cache, writer)                # the writer is unaffected
    cache.close(writer)
    cache.shutdown()


def test_a_promotion_waiter_closed_meanwhile_is_told_too():
    """The same for a wait on a promotion from host (shared by every sequence that wants its
    blocks, so it is not failed: the wait ends with it, and then says the sequence closed)."""
    cache = make_cache(gpu_blocks=8, host_blocks=32,
                       migrator={"enabled": True, "wait_timeout_s": WAIT_S})
    a, b = tokens(24), tokens(24, 5000)
    for p in (a, b):                                # b evicts a to host
        s = cache.open(p)
        write_pattern_all(cache, s)
        cache.close(s)
    cache.migrator.settle()
    # The promotion's copies wait for a gate, so the waiter is surely waiting when its
    # sequence is closed (a fast promotion would otherwise land first and the wait return).
    # NOTE: only the migrator's threads wait: the open() below runs copies on this thread too
    # (it evicts b's blocks to host to make room), and gating those would stall the open
    # itself for WAIT_S before the promotion even started.
    gate = threading.Event()
    executor = cache.migrator.executor
    run = executor.run
    here = threading.get_ident()

    def gated(*args, **kwargs):
        if threading.get_ident() != here:
            gate.wait(WAIT_S)
        return run(*args, **kwargs)

    executor.run = gated
    seq = cache.open(a)
    assert seq.cached_tokens_by_tier.get("host", 0) > 0        # a promotion is under way
    t, out = _waiting(cache, seq, cache.num_layers - 1)
    _blocked(t)
    cache.close(seq)
    gate.set()
    t.join(WAIT_S / 4)
    assert not t.is_alive()
    assert out["result"] == SequenceClosedError.__name__
    executor.run = run
    cache.shutdown()
