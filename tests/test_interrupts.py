"""Exception safety: an asynchronous exception at any line a public call executes, in any
module it reaches, leaves the cache whole, or (one nothing can defer) refusing to serve.

For each public call (open, write, append, close, invalidate, gather, attention,
prefill_attention), in each tier setup (device only; device + host without the migrator, write
back and write through; device + host with the migrator), the call is first run once under
`sys.settrace`, counting 'line' events in every frame it runs: the package (tiered_cache/, its
migrator and kernels included) and what it calls below (threading, queue, numpy, torch's Python
code); `test_every_module_the_calls_reach_is_traced` checks that the lock, the sections, the
allocator, the owner's parts, the policies and the data plane are among them. Then, for each k,
the same state is rebuilt and an exception is delivered at the k-th line event, in one of three
modes (`Injector`):

- `sigint`: what CPython does when SIGINT arrives there: it calls the installed handler (the
  library's wrapper: deferred to the end of a commit section, else KeyboardInterrupt at once);
- `sigterm`: the same for an application's SIGTERM handler that raises SystemExit, installed
  before the cache was built (`app_sigterm_handler`);
- `async`: KeyboardInterrupt raised right there, in a section or not, as
  `PyThreadState_SetAsyncExc` or a debugger would (package frames only: the standard library's
  own locks are not safe against that, and no code of ours can change it).
- `memory`: MemoryError raised right there (package frames only), as an allocation that fails
  anywhere would: an ordinary `Exception`, so the code's own failure handling sees it (it may
  end in a miss or a copy given up, or reach the caller); one that leaves a commit section
  tears it like a KeyboardInterrupt (core/atomic.py).

After each interrupted call (`_verify`):
- the control-plane lock can be taken by another thread at once (with a timeout);
- no deferred interrupt is left pending, and a deferred one was raised, not swallowed;
- if the exception cut a commit section (`async` and `memory` only): the cache says so and
  refuses every call (`CacheBrokenError`: open, invalidate, gather, write and close of the held
  sequences), so nothing it holds can be read (`_verify_refused`). Otherwise:
- `check_invariants` holds (before and after the migrator drains), and every copy under way
  ends: no reservation or busy count is left over;
- the open sequences are exactly those the test holds (an interrupted open hands nothing back
  and leaves nothing open; an interrupted close either closed the sequence or left it open);
- every held sequence returns exactly its pattern KV for every written token, can be written
  to the end in every layer (no layer stuck "being written"), and closes;
- every prompt ever cached returns exactly its pattern KV for its cached prefix, per tenant;
- after everything is closed nothing stays pinned.

The calls that change cached state (open, write, append, close, invalidate) are interrupted
at every distinct line they execute, over all setups together, in every mode
(`test_interrupt_at_every_line`, `slow`: minutes), and at a sample of those lines
(`test_interrupt_at_sampled_lines`, seconds); an open that hits and the reads at a stride
through their line events, the modes taking turns (`test_interrupt_sampled_lines`).
`TC_INTERRUPT_STRIDE=1` interrupts every line event of every setup instead (long);
`TC_INTERRUPT_STRIDE=n` sets the reads' stride.

A real SIGINT test runs open/write/close in a subprocess while the parent sends SIGINT
repeatedly; the child checks invariants and data and reports through its exit code.
tests/core/test_atomic.py tests the mechanisms themselves (sections, the lock, waits).
"""

from __future__ import annotations

import dis
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time
import zlib
from dataclasses import dataclass, field

import pytest
import torch

import tiered_cache
import tiered_cache.kernels
import tiered_cache.migrator
from tests.helpers import (
    check_invariants,
    check_pattern,
    make_cache,
    pattern_kv,
    tokens,
    write_pattern,
    write_pattern_all,
)
from tests.oracles import (
    ATTENTION_TOL,
    expected_attention,
    lock_usable,
    query,
    ref_prefill_attention,
)
from tiered_cache.core import atomic
from tiered_cache.core.sequence import Sequence
from tiered_cache.errors import CacheBrokenError

pytestmark = pytest.mark.slow     # processes, servers or sweeps (tests/conftest.py)

PKG_DIRS = tuple(os.path.dirname(m.__file__) + os.sep
                 for m in (tiered_cache, tiered_cache.migrator, tiered_cache.kernels))

MIGRATOR = {"enabled": True, "high_watermark": 0.75, "low_watermark": 0.5,
            "wait_timeout_s": 20.0}
SETUPS = {
    # gpu 12 blocks: the state below fills them, so open/append evict synchronously
    "device": dict(gpu_blocks=12, host_blocks=0, num_q_heads=4),
    "host": dict(gpu_blocks=12, host_blocks=16, num_q_heads=4),
    "host_wt": dict(gpu_blocks=12, host_blocks=16, num_q_heads=4,
                    write_policy="write_through"),
    "migrator": dict(gpu_blocks=12, host_blocks=16, num_q_heads=4,
                     write_policy="write_through", extra={"migrator": MIGRATOR}),
}
OPS = ["open", "open_hit", "write", "write_publish", "append", "close", "invalidate", "gather",
       "attention", "prefill_attention"]
POINTS = 7                      # default run: about this many k per (op, setup)
SAMPLE = 4                      # sampled every-line run: about this many lines per setup


@pytest.fixture(autouse=True, scope="module")
def one_copy_thread():
    """The CPU block copier (numba, kernels/host_copy.py) with one thread on the main thread
    while this module runs: its parallel start costs ~10 ms a call on a busy two-core machine,
    and every interrupted case rebuilds a cache and copies a few blocks synchronously. Same
    code path, a fraction of the time."""
    try:
        import numba
    except ImportError:
        yield
        return
    old = numba.get_num_threads()
    numba.set_num_threads(1)
    try:
        yield
    finally:
        numba.set_num_threads(old)


# ---------------------------------------------------------------------------- tracing


SIGNALS = {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM}
MODES = ("sigint", "sigterm", "async", "memory")
RAISED = {"async": KeyboardInterrupt, "memory": MemoryError}
"""The modes that raise right at the line (package frames only), and what they raise."""


def _app_sigterm(signum, frame):
    """An application's SIGTERM handler, the common kind: exit (raises SystemExit)."""
    sys.exit(128 + signum)


@pytest.fixture(autouse=True)
def app_sigterm_handler():
    """Each test runs as an application that installed a SIGTERM handler raising SystemExit
    before it built its caches (the `sigterm` mode delivers that signal)."""
    old = signal.signal(signal.SIGTERM, _app_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


_UNREACHABLE: dict = {}


def _unreachable(code, offset: int) -> bool:
    """Whether a line event at `offset` of `code` is one no real asynchronous exception can
    land at, so the `async` mode does not deliver there.

    NOTE: only a trace function can raise at a line event; signal handlers and
    `PyThreadState_SetAsyncExc` run at the eval loop's checks (calls, backward jumps), so a
    real one lands between a call's return and the next instruction (its exception is raised
    at the call's offset, inside the call's exception range). Three line events of CPython 3.11
    start with instructions that are no such point, and an exception raised there skips a
    `with`'s `__exit__`: a `try:` line (one NOP, left out of the enclosing `with`'s exception
    range) and a `with` line's exit (`LOAD_CONST None` x3 before the call of `__exit__`, after
    a SWAP that keeps a `return`'s value below the exit when the block returns; outside the
    range too: the lock of `with atomic(), lock: return ...` would stay held), and the same
    line's exception path (PUSH_EXC_INFO before `__exit__` is called with the exception). None
    is a window for a signal: the call of `__exit__` is the first check point there."""
    key = (code, offset)
    hit = _UNREACHABLE.get(key)
    if hit is None:
        ins = [i for i in dis.get_instructions(code) if i.offset >= offset]
        while ins and ins[0].opname == "SWAP":
            ins = ins[1:]
        ins = ins[:4]
        hit = bool(ins) and (ins[0].opname in ("NOP", "PUSH_EXC_INFO") or (
            len(ins) == 4 and all(i.opname == "LOAD_CONST" and i.argval is None
                                  for i in ins[:3])
            and ins[3].opname in ("PRECALL", "CALL") and ins[3].arg == 2))
        _UNREACHABLE[key] = hit
    return hit


class Injector:
    """`sys.settrace` hook: counts 'line' events in every frame the call runs (every module it
    reaches: the package, and what it calls in the standard library, numpy and torch), and at
    the k-th delivers an asynchronous exception there, as `mode` says:

    - `sigint` / `sigterm`: what CPython does when that signal arrives at that line: it calls
      the installed Python handler (`signal.getsignal`). Inside a commit section the library's
      wrapper defers the call to the section's end; elsewhere the handler raises at once
      (KeyboardInterrupt; the application's SIGTERM handler's SystemExit).
    - `async`: an exception nothing can defer (`PyThreadState_SetAsyncExc`, a debugger):
      KeyboardInterrupt raised right there, in a section or not. Only frames of the package
      (`PKG_DIRS`): the standard library's own locks (queue, threading) are not safe against
      one and no code of ours can change that.
    """

    def __init__(self, k: int | None = None, mode: str = "sigint") -> None:
        assert mode in MODES, mode
        self.k = k
        self.mode = mode
        self.n = 0
        self.fired: str | None = None       # "raise" | "defer"
        self.where: str | None = None
        self.in_section: bool | None = None     # whether the injection landed in a section
        self.modules: set[str] = set()      # files of the frames that ran lines

    def global_trace(self, frame, event, arg):
        if self.fired is not None:
            return None
        if self.mode not in RAISED or frame.f_code.co_filename.startswith(PKG_DIRS):
            return self.local_trace
        return None

    def local_trace(self, frame, event, arg):
        if self.fired is not None:
            return None
        if event != "line":
            return self.local_trace
        self.n += 1
        if self.k is None:
            self.modules.add(frame.f_code.co_filename)
        elif self.n == self.k:
            if self.mode in RAISED and _unreachable(frame.f_code, frame.f_lasti):
                self.k += 1                 # delivered at the next line instead
                return self.local_trace
            self.where = f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno} " \
                         f"({frame.f_code.co_name})"
            self.in_section = atomic.active()
            self.fired = "raise"
            if self.mode in RAISED:
                raise RAISED[self.mode]
            signum = SIGNALS[self.mode]
            signal.getsignal(signum)(signum, frame)     # raises, or returns deferred
            self.fired = "defer"
            return None
        return self.local_trace

    def run(self, fn):
        """fn() under the hook; returns (result, interrupted).

        NOTE: the cyclic garbage collector is off while the call runs: a finalizer (`__del__`)
        of an earlier cache's pool collected inside the traced call would count lines of its
        own, and an interrupt raised in it is only "unraisable" (printed and dropped), which
        is about the harness, not the call."""
        gc.disable()
        old = sys.gettrace()
        sys.settrace(self.global_trace)
        try:
            return fn(), False
        except (KeyboardInterrupt, SystemExit, MemoryError):
            return None, True
        finally:
            sys.settrace(old)
            gc.enable()


# ---------------------------------------------------------------------------- the state


@dataclass
class World:
    cache: object
    seqs: dict[str, Sequence] = field(default_factory=dict)
    prompts: list[tuple[list[int], object]] = field(default_factory=list)


P0 = tokens(10)                     # cached for tenant None ...
P1 = tokens(10)                     # ... and the same tokens for tenant "t1"
P2 = tokens(8, start=50)
HIT = P0 + [7, 7, 7]                # open sequence over P0's cached blocks
HALF = tokens(10, start=100)        # open sequence, layer 0 written up to 6 tokens
FILL = tokens(8, start=300)         # cached last: pushes P1's second block out
NEW = tokens(12, start=200)         # a fresh prompt (needs 3 blocks: evicts)


def build(setup: str) -> World:
    """A cache with history: four cached prompts (two tenants share tokens), an open
    sequence over a cached prefix (fully written), a half-written open sequence. The device
    tier (12 blocks) is full, so new blocks evict (demote to host, or drop), and P1 (tenant
    t1) has its second block in the host tier (or nowhere, device only)."""
    cache = make_cache(**SETUPS[setup])
    w = World(cache)
    for p, salt in ((P0, None), (P1, "t1"), (P2, None)):
        s = cache.open(p, salt=salt)
        write_pattern_all(cache, s)
        cache.close(s)
        w.prompts.append((p, salt))
    hit = cache.open(HIT)
    write_pattern_all(cache, hit)
    half = cache.open(HALF)
    write_pattern(cache, half, 0, 6)
    # One more cached prompt: evicts the least recently used block, P1's second one (to the
    # host tier where there is one), so that open_hit promotes.
    f = cache.open(FILL)
    write_pattern_all(cache, f)
    cache.close(f)
    w.seqs = {"hit": hit, "half": half}
    w.prompts += [(HIT, None), (HALF, None), (FILL, None), (NEW, None),
                  (P1 + [9, 9, 9, 9, 9, 9], "t1")]
    if cache.migrator is not None:
        cache.migrator.settle()      # NOTE: quiet, so that every run of `op` takes one path
    return w


def q_for(cache, n: int, seed: int = 0) -> torch.Tensor:
    return query(cache, n, seed)


def op_fn(w: World, op: str):
    """The call under test, and a check of what it returned (if it returned)."""
    c, hit, half = w.cache, w.seqs["hit"], w.seqs["half"]
    if op == "open":                            # a miss that evicts
        return lambda: c.open(NEW)
    if op == "open_hit":                        # a hit (promotes from host where demoted)
        return lambda: c.open(P1 + [9, 9, 9, 9, 9, 9], salt="t1")
    if op == "write":                           # no block completes in every layer
        k, v = pattern_kv(c, None, half.token_ids, 6, 10, 0)
        return lambda: c.write(half, 0, k, v)
    if op == "write_publish":                   # publishes HALF's first block
        k, v = pattern_kv(c, None, half.token_ids, 0, 10, 1)
        return lambda: c.write(half, 1, k, v)
    if op == "append":                          # needs a new block: evicts
        return lambda: c.append(hit, [5, 5, 5, 5, 5])
    if op == "close":
        return lambda: c.close(hit)
    if op == "invalidate":                      # HIT still reads P0's blocks
        return lambda: c.invalidate(P0)
    if op == "gather":
        return lambda: c.gather(hit, 1)
    if op == "attention":
        q = q_for(c, 2)
        return lambda: c.attention(q, [hit, half], 0)
    if op == "prefill_attention":
        q = q_for(c, 3)
        return lambda: c.prefill_attention(q, hit, 1)
    raise AssertionError(op)


def check_result(w: World, op: str, result) -> None:
    """What a call that was not interrupted returned is right."""
    c, hit, half = w.cache, w.seqs["hit"], w.seqs["half"]
    if op in ("open", "open_hit"):
        assert isinstance(result, Sequence)
        w.seqs["new"] = result
    elif op == "gather":
        ek, ev = pattern_kv(c, None, hit.token_ids, 0, hit.written[1], 1)
        assert torch.equal(result[0], ek) and torch.equal(result[1], ev)
    elif op == "attention":
        want = expected_attention(c, q_for(c, 2), [hit, half], 0)
        torch.testing.assert_close(result.double(), want, **ATTENTION_TOL)
    elif op == "prefill_attention":
        k, v = pattern_kv(c, None, hit.token_ids, 0, hit.written[1], 1)
        want = ref_prefill_attention(q_for(c, 3), k, v)
        torch.testing.assert_close(result.double(), want, **ATTENTION_TOL)


def finish(cache, seq) -> None:
    """Write every layer of `seq` to its end: fails if a layer is stuck 'being written'."""
    for layer in range(cache.num_layers):
        if seq.written[layer] < seq.num_tokens:
            write_pattern(cache, seq, layer)


def _verify(w: World, inj: Injector, interrupted: bool, op: str) -> None:
    """Check the cache after one (possibly interrupted) call; see the module doc."""
    c = w.cache
    where = f"{inj.mode} ({inj.fired}) at line event {inj.k}: {inj.where}"
    assert lock_usable(c), f"{where}: the lock is held (no other thread can take it)"
    assert not atomic.interrupt_pending(), f"{where}: a deferred interrupt is still pending"
    if inj.fired is not None and inj.mode != "memory":
        # (a MemoryError may be handled where the code handles failures: a miss, a copy
        # given up; the state must then be whole, as checked below)
        assert interrupted, f"{where}: the interrupt was swallowed (the call returned)"
    if atomic.active():
        # NOTE: the one window left (core/atomic.py): an exception no handler can defer,
        # landing in a section's own exit lines, leaves the thread counted inside a section
        # (the state is whole); signals then act at once after DEFER_LIMIT_S
        # (tests/core/test_atomic.py).
        assert inj.mode in RAISED and "core/atomic.py" in inj.where \
            and "__exit__" in inj.where, f"{where}: the thread is still counted in a section"
        atomic._local.depth = 0
    if c.index.broken is not None:
        _verify_refused(w, inj, where)
        return
    check_invariants(c)
    if c.migrator is not None:
        assert c.migrator.drain(30.0), f"{where}: the migrator does not drain"
        check_invariants(c)
    assert quiet(c), f"{where}: copies under way never end: " + ", ".join(
        f"{t.name} {t.reserved} reserved, {t.busy} busy" for t in c.tiers)
    held = {s.id: s for s in w.seqs.values() if not s.closed}
    live = {s.id: s for s in c.open_sequences()}
    assert set(held) <= set(live), f"{where}: a held sequence was closed behind our back"
    assert set(live) == set(held), (f"{where}: open sequences {sorted(live)}, the caller "
                                    f"holds {sorted(held)}: a pinned sequence leaked")
    for s in held.values():
        check_pattern(c, s)
        finish(c, s)
        check_pattern(c, s)
        c.close(s)
    assert not c.open_sequences()
    assert all(t.pinned_blocks == 0 for t in c.tiers), f"{where}: pins leaked"
    check_invariants(c)
    for p, salt in w.prompts:
        s = c.open(p, salt=salt)
        check_pattern(c, s)                     # the cached prefix is exactly its data
        c.close(s)
    check_invariants(c)


def quiet(c, timeout: float = 30.0) -> bool:
    """Wait until no copy is under way (background demotion rounds finish on their own):
    every reservation and busy count is back to zero, so none leaked."""
    deadline = time.monotonic() + timeout
    while True:
        with c.locked():
            if all(t.reserved == len(t.erasing) and t.busy == 0 for t in c.tiers):
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)


def _verify_refused(w: World, inj: Injector, where: str) -> None:
    """A commit section was torn (an `async` exception, nothing deferred it): the cache says
    so and serves nothing any more, so nothing wrong can be read from it."""
    c = w.cache
    assert inj.mode in RAISED and inj.in_section, \
        f"{where}: the cache refuses, but the exception did not land in a commit section"
    refused = [lambda: c.open(P0), lambda: c.invalidate(P0)]
    for s in w.seqs.values():
        refused += [lambda s=s: c.gather(s, 0), lambda s=s: c.close(s),
                    lambda s=s: c.write(s, 0, *pattern_kv(c, None, s.token_ids, 0, 0, 0))]
    for call in refused:
        with pytest.raises(CacheBrokenError):
            call()


def count_lines(setup: str, op: str, mode: str = "sigint") -> int:
    w = build(setup)
    try:
        inj = Injector(mode=mode)
        fn = op_fn(w, op)
        result, interrupted = inj.run(fn)
        assert not interrupted
        check_result(w, op, result)
        _verify(w, inj, False, op)
        return inj.n
    finally:
        w.cache.shutdown()


def interrupt_at(setup: str, op: str, k: int, mode: str = "sigint") -> Injector:
    """Rebuild the state, run `op` with an exception delivered at line event k, verify;
    returns the injector (whether and where it fired)."""
    w = build(setup)
    try:
        inj = Injector(k, mode)
        result, interrupted = inj.run(op_fn(w, op))
        if not interrupted:
            check_result(w, op, result)
        _verify(w, inj, interrupted, op)
        return inj
    finally:
        atomic._local.depth = 0             # (a failed case never spoils the next one)
        getattr(atomic, "_deferred", {}).clear()
        w.cache.shutdown()


def points(n: int, case: str, count: int = POINTS) -> list[int]:
    """A stride through line events 1..n (about `count` of them, offset per case so that
    neighbouring cases cover different lines), with the first and last always."""
    stride = int(os.environ.get("TC_INTERRUPT_STRIDE", "0")) or max(1, n // count)
    offset = zlib.crc32(case.encode()) % stride
    ks = list(range(1 + offset, n + 1, stride))
    return sorted(set(ks) | {1, n})


def sweep(setup: str, op: str, ks: list[int], mode: str = "sigint") -> list[Injector]:
    """Deliver an exception to `op` at each line event in `ks` (a fresh state each time) and
    verify; returns the injectors of those that fired."""
    out = []
    for k in ks:
        inj = interrupt_at(setup, op, k, mode)
        if inj.fired is not None:
            out.append(inj)
    return out


class LineRecorder(Injector):
    """Counts line events like the Injector (never fires) and notes the first event of each
    distinct line (file, line number)."""

    def __init__(self, mode: str = "sigint") -> None:
        super().__init__(None, mode)
        self.first: dict[tuple[str, int], int] = {}

    def local_trace(self, frame, event, arg):
        if event == "line":
            self.first.setdefault((frame.f_code.co_filename, frame.f_lineno), self.n + 1)
        return super().local_trace(frame, event, arg)


def distinct_lines(setup: str, op: str, mode: str = "sigint"
                   ) -> tuple[int, dict[tuple[str, int], int], set[str]]:
    """Run `op` once (uninterrupted, checked): its line event count, the first event of each
    distinct line it executes, and the files (modules) those lines are in.

    NOTE: `op` runs once untraced first: what a process does once (an import at first use, a
    kernel loaded, a cache of the interpreter's) would otherwise count in the traced run only,
    and the interrupted runs after it, shorter by that much, would end before their line."""
    w = build(setup)
    try:
        op_fn(w, op)()
    finally:
        w.cache.shutdown()
    w = build(setup)
    try:
        rec = LineRecorder(mode)
        result, interrupted = rec.run(op_fn(w, op))
        assert not interrupted
        check_result(w, op, result)
        _verify(w, rec, False, op)
        return rec.n, rec.first, rec.modules
    finally:
        w.cache.shutdown()


EVERY_LINE_OPS = ["open", "write", "write_publish", "append", "close", "invalidate"]
SAMPLED_OPS = [op for op in OPS if op not in EVERY_LINE_OPS]
SETUP_ORDER = ("device", "migrator", "host", "host_wt")


def every_line(op: str, mode: str, sample: int | None = None) -> list[Injector]:
    """Deliver at every distinct line `op` executes, in every tier setup: each setup is traced
    once, and each line not already covered by an earlier setup is hit at its first execution
    (a line run again in a loop at its first run only; `TC_INTERRUPT_STRIDE=1`: every line
    event of every setup). Setups go cheapest first, so the device-only one covers the shared
    lines and the host setups add their demotion and write-through paths. `sample`: about
    that many of those lines per setup instead (spread evenly, offset per case).

    NOTE: with the migrator, background threads can shift the main thread's path a little
    between the traced run and an interrupted one; an interrupt then lands on a neighbouring
    line (or, past the end, does not fire)."""
    covered: set[tuple[str, int]] = set()
    fired: list[Injector] = []
    tried = 0
    missed: list[tuple[str, int, int, int]] = []  # (setup, tried, fired, traced run's events)
    for setup in SETUP_ORDER:
        n, first, _ = distinct_lines(setup, op, mode)
        if os.environ.get("TC_INTERRUPT_STRIDE") == "1":
            ks = list(range(1, n + 1))
        else:
            ks = sorted(k for line, k in first.items() if line not in covered)
            if sample is not None and ks:
                step = max(1, len(ks) // sample)
                off = zlib.crc32(f"{op}/{mode}/{setup}".encode()) % step
                ks = ks[off::step]
        covered |= first.keys()
        tried += len(ks)
        got = sweep(setup, op, ks, mode)
        missed.append((setup, len(ks), len(got), n))
        fired += got
    assert tried >= (50 if sample is None else 4) and len(fired) >= tried - 8, \
        (tried, len(fired), missed)
    return fired


@pytest.mark.slow
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", EVERY_LINE_OPS)
def test_interrupt_at_every_line(op, mode):
    """Every distinct line of every module the call reaches (`every_line`), each delivery
    mode (`Injector`); then the properties of the module doc. Minutes: `-m slow`."""
    every_line(op, mode)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("op", EVERY_LINE_OPS)
def test_interrupt_at_sampled_lines(op, mode):
    """The fast variant of `test_interrupt_at_every_line`: about SAMPLE of those lines per
    setup (different ones per case and mode)."""
    every_line(op, mode, sample=SAMPLE)


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("op", SAMPLED_OPS)
def test_interrupt_sampled_lines(setup, op):
    """An open that hits (promoting from the host tier where it can) and the reads (which
    change no cached state, only pins): a sample of the line events (see `points`); the
    properties of the module doc. (Every mode: the modes take turns along the sample.)"""
    n = count_lines(setup, op)
    assert n > 0
    # With the migrator, background timing can change the main thread's path a little: a
    # few k past the counted end make sure the tail is covered (those may not fire).
    extra = 8 if setup == "migrator" else 0
    fired = []
    for i, k in enumerate(points(n + extra, f"{setup}/{op}")):
        fired += sweep(setup, op, [k], MODES[i % len(MODES)])
    assert fired, "no interrupt fired"


def test_every_module_the_calls_reach_is_traced():
    """The injector hits every module a call runs lines in, not a chosen list: the lock, the
    sections, the allocator, the owner and its parts, the policies and the data plane, and
    what they call below (the standard library's threading, numpy)."""
    seen: set[str] = set()
    for setup in SETUP_ORDER:
        for op in ("open", "append", "write_publish", "close", "invalidate"):
            seen |= distinct_lines(setup, op)[2]
    rel = {os.path.relpath(f) for f in seen}
    for want in ("tiered_cache/locking.py", "tiered_cache/core/atomic.py",
                 "tiered_cache/core/allocator.py", "tiered_cache/core/index.py",
                 "tiered_cache/core/eviction.py", "tiered_cache/core/copies.py",
                 "tiered_cache/core/tree.py", "tiered_cache/core/batch.py",
                 "tiered_cache/core/blocks.py", "tiered_cache/policies/lru.py",
                 "tiered_cache/data/pools.py", "tiered_cache/data/executor.py",
                 "tiered_cache/cache.py", "tiered_cache/migrator/worker.py"):
        assert want in rel, (want, sorted(rel))
    assert any(f.endswith(os.sep + "threading.py") for f in seen)
    assert any(os.sep + "numpy" + os.sep in f for f in seen)


OPEN_TAIL = 16      # line events at the end of open() (its commit section's end and after)


@pytest.mark.parametrize("op, setup", [("open", "device"), ("open", "host"),
                                       ("open_hit", "host"), ("open_hit", "migrator")])
def test_an_interrupt_at_the_end_of_open_leaks_no_sequence(setup, op):
    """Every one of the last OPEN_TAIL line events of open() is interrupted (deferred inside
    its commit section, raised after it): none may leave a sequence open that the caller
    does not hold (`_verify` fails on any open sequence the caller was not handed).

    (Regression: open() closed the new sequence only if an interrupt was pending at one check
    inside its section; one deferred after that check, at `return seq` or in the section's
    `__exit__`, was raised by the section's end and the sequence stayed open and pinned for
    ever.)"""
    n = count_lines(setup, op)
    ks = range(max(1, n - OPEN_TAIL), n + 1 + (8 if setup == "migrator" else 0))
    assert sweep(setup, op, list(ks))


def _open_lines(*texts: str) -> list[int]:
    """Line numbers of `TieredKVCache.open` whose stripped text is one of `texts`."""
    import inspect

    from tiered_cache import TieredKVCache

    src, first = inspect.getsourcelines(TieredKVCache.open)
    return [first + i for i, x in enumerate(src) if x.strip() in texts]


@pytest.mark.parametrize("where", ["in the section", "after it"])
def test_open_interrupted_as_it_returns_closes_its_sequence(where):
    """Minimal: an interrupt deferred at the last line of open's commit section, or raised at
    its `return seq` (after the section), reaches the caller as KeyboardInterrupt with the
    sequence it opened already closed (nothing open, nothing pinned)."""
    from tiered_cache import TieredKVCache

    (line,) = _open_lines("if self.stores and not interrupt_pending():"
                          if where == "in the section" else "return seq")
    code = TieredKVCache.open.__code__
    cache = make_cache()
    fired = []

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == line and not fired:
            fired.append(atomic.active())
            if atomic.active():                 # where a real SIGINT is deferred
                atomic.defer_interrupt()
                return local
            raise KeyboardInterrupt
        return local

    def glob(frame, event, arg):
        return local if frame.f_code is code else None

    old = sys.gettrace()
    sys.settrace(glob)
    try:
        with pytest.raises(KeyboardInterrupt):
            cache.open(tokens(8))
    finally:
        sys.settrace(old)
    assert fired == [where == "in the section"]
    check_invariants(cache)
    try:
        assert cache.open_sequences() == [], "open() raised KeyboardInterrupt but left a " \
            "sequence open and pinned"
        assert all(t.pinned_blocks == 0 for t in cache.tiers)
        assert not atomic.interrupt_pending()
    finally:
        cache.shutdown()


def test_injector_defers_inside_commit_sections():
    """The harness itself: outside a commit section the injection raises at once; a deferred
    interrupt is raised when the outermost section ends, and is then no longer pending."""
    w = build("device")
    try:
        inj = Injector(1)
        _, interrupted = inj.run(lambda: w.cache.stats())
        assert interrupted and inj.fired == "raise"
        atomic.defer_interrupt()
        with pytest.raises(KeyboardInterrupt):
            with atomic.atomic():
                with atomic.atomic():
                    assert atomic.active()
                assert atomic.interrupt_pending()      # not raised by the inner section
        assert not atomic.interrupt_pending() and not atomic.active()
    finally:
        w.cache.shutdown()


# ---------------------------------------------------------------------------- real SIGINT


CHILD = textwrap.dedent(r"""
    import os, sys, time, signal
    import tiered_cache, tiered_cache.kernels, tiered_cache.migrator
    sys.path.insert(0, os.getcwd())
    from tests.helpers import make_cache, write_pattern, check_pattern, tokens
    from tests.oracles import lock_usable
    from tiered_cache.core.invariants import check_invariants
    from tiered_cache.errors import CapacityError

    mig = sys.argv[1] == "1"
    cache = make_cache(gpu_blocks=64, host_blocks=64 if mig else 0,
                       extra={"migrator": {"enabled": mig, "high_watermark": 0.5,
                                           "low_watermark": 0.25}})
    held = []          # sequences handed back and not closed yet
    counts = {"interrupts": 0, "done": 0, "capacity": 0, "resumed": 0,
              "cond_runtime_error": 0}

    def prompt(i):
        return tokens(4 + i % 13, start=(i % 7) * 50), ("a" if i % 2 else None)

    def finish(s):
        # an interrupted sequence: what was written is exact, the rest can still be written
        check_pattern(cache, s)
        for layer in range(cache.num_layers):
            if s.written[layer] < s.num_tokens:
                write_pattern(cache, s, layer)
        check_pattern(cache, s)
        cache.close(s)

    def step(i):
        while held:                                 # leftovers of an interrupted step
            s = held[-1]
            if not s.closed:
                finish(s)
                counts["resumed"] += 1
            held.pop()
        toks, salt = prompt(i)
        seq = cache.open(toks, salt=salt)
        held.append(seq)
        check_pattern(cache, seq)                   # the cached prefix
        for layer in range(cache.num_layers):
            write_pattern(cache, seq, layer)
        check_pattern(cache, seq)
        cache.close(seq)
        held.pop()
        counts["done"] += 1

    # NOTE: the library's own SIGINT handler (atomic._on_sigint: defer inside a commit
    # section, else KeyboardInterrupt) gets every SIGINT that lands while library code runs;
    # one that lands in this harness's own lines is dropped (counted), so the harness loop
    # itself is never cut and everything it sees comes from inside the library.
    lib_handler = signal.getsignal(signal.SIGINT)
    assert lib_handler is not signal.default_int_handler, "the cache installed no handler"
    dirs = tuple(os.path.dirname(m.__file__) + os.sep for m in (
        sys.modules["tiered_cache"], sys.modules["tiered_cache.migrator"],
        sys.modules["tiered_cache.kernels"]))
    counts["dropped"] = 0

    def handler(signum, frame):
        f = frame
        while f is not None:
            if f.f_code.co_filename.startswith(dirs):
                return lib_handler(signum, frame)
            f = f.f_back
        counts["dropped"] += 1

    signal.signal(signal.SIGINT, handler)
    print("ready", flush=True)
    deadline = time.monotonic() + float(sys.argv[2])
    i = 0
    while time.monotonic() < deadline:
        try:
            i += 1
            step(i)
        except KeyboardInterrupt:
            counts["interrupts"] += 1
        except CapacityError:
            counts["capacity"] += 1
        except RuntimeError as exc:
            # NOTE: CPython's threading.Condition.wait is not safe against an asynchronous
            # KeyboardInterrupt: one raised right after it released its lock makes the
            # `with cond:` exit raise "cannot release un-acquired lock" instead. The cache's
            # waits do not use one (core/wakeup.py): counted, and the parent fails on any.
            if "un-acquired lock" not in str(exc):
                raise
            counts["cond_runtime_error"] += 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)    # from here on, no more interrupts
    ok = lock_usable(cache)
    check_invariants(cache)
    if cache.migrator is not None:
        cache.migrator.drain(30)
    check_invariants(cache)
    mine = {s.id for s in held if not s.closed}
    leaked = [s for s in cache.open_sequences() if s.id not in mine]
    for s in held:
        if not s.closed:
            finish(s)
    for s in leaked:                                # still sound: exact data, closable
        check_pattern(cache, s)
        cache.close(s)
    for j in range(1, 60):
        toks, salt = prompt(j)
        s = cache.open(toks, salt=salt)
        check_pattern(cache, s)
        cache.close(s)
    check_invariants(cache)
    pinned = [t.pinned_blocks for t in cache.tiers]
    cache.shutdown()
    print(f"result ok={ok} leaked={len(leaked)} pinned={sum(pinned)} " +
          " ".join(f"{k}={v}" for k, v in counts.items()), flush=True)
    sys.exit(0 if ok and not any(pinned) else 3)
""")


def run_sigint_child(tmp_path, migrator: bool, seconds: float = 1.5) -> dict[str, str]:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    proc = subprocess.Popen([sys.executable, str(script), "1" if migrator else "0",
                             str(seconds + 1.0)],
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-4000:]
        time.sleep(0.2)                         # let it enter its loop
        sent = 0
        end = time.monotonic() + seconds
        while time.monotonic() < end and proc.poll() is None:
            os.kill(proc.pid, signal.SIGINT)
            sent += 1
            time.sleep(0.002 + (sent % 5) * 0.0007)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"child exit {proc.returncode}\n{out}\n{err[-6000:]}"
    line = [x for x in out.splitlines() if x.startswith("result")][-1]
    fields = dict(x.split("=", 1) for x in line.split()[1:])
    fields["sent"] = str(sent)
    return fields


@pytest.mark.parametrize("migrator", [False, True])
def test_real_sigint_during_open_write_close(migrator, tmp_path):
    """A child process runs open / check / write / check / close in a loop while the parent
    sends it SIGINT every few milliseconds; each KeyboardInterrupt is caught, the interrupted
    sequence is checked, written to the end and closed, and the loop goes on. At the end the
    child checks the lock, the invariants, every prompt's data and that nothing stays pinned
    (exit code 0). Open sequences the loop was never handed are reported (`leaked=`), checked
    and closed, not failed on: a second SIGINT landing in the few bytecodes between open()'s
    KeyboardInterrupt and its cleanup can still leak one (no Python code can close that
    window); the tests above cover every single-interrupt position deterministically."""
    fields = run_sigint_child(tmp_path, migrator)
    print(fields)
    assert int(fields["interrupts"]) > 10, fields       # the loop really was interrupted
    assert int(fields["done"]) > 10, fields             # and still made progress
    assert int(fields["cond_runtime_error"]) == 0, fields
