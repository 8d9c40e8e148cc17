"""Exception safety: a KeyboardInterrupt at any line a public call executes leaves the cache whole.

For each public call (open, write, append, close, invalidate, gather, attention,
prefill_attention), in each tier setup (device only; device + host without the migrator, write
back and write through; device + host with the migrator), the call is first run once under
`sys.settrace`, counting 'line' events in frames whose code lives in the tiered_cache package
(tiered_cache/, and migrator/ and kernels/, installed as tiered_cache.migrator and
tiered_cache.kernels). Then, for each k, the same state is rebuilt and a KeyboardInterrupt is
raised at the k-th line event, except where `tiered_cache.core.atomic.active()` is true: inside
a commit section a real SIGINT is deferred, so there `defer_interrupt()` is called instead (the
section raises KeyboardInterrupt when it ends, as a deferred SIGINT does).

After each interrupted call (`_verify`):
- the control-plane lock can be taken by another thread (with a timeout);
- `check_invariants` holds (before and after the migrator drains);
- no deferred interrupt is left pending, and a deferred one was raised, not swallowed;
- the open sequences are exactly those the test holds (an interrupted open hands nothing back
  and leaves nothing open; an interrupted close either closed the sequence or left it open);
- every held sequence returns exactly its pattern KV for every written token, can be written
  to the end in every layer (no layer stuck "being written"), and closes;
- every prompt ever cached returns exactly its pattern KV for its cached prefix, per tenant;
- after everything is closed nothing stays pinned.

The calls that change cached state (open, write, append, close, invalidate) are interrupted
at every distinct line they execute, over all setups together (`test_interrupt_at_every_line`);
an open that hits and the reads at a stride through their line events
(`test_interrupt_sampled_lines`).
`TC_INTERRUPT_STRIDE=1` interrupts every line event of every setup instead (minutes);
`TC_INTERRUPT_STRIDE=n` sets the reads' stride.

A real SIGINT test runs open/write/close in a subprocess while the parent sends SIGINT
repeatedly; the child checks invariants and data and reports through its exit code.
"""

from __future__ import annotations

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
import tiered_cache.kernels
import tiered_cache.migrator
import torch

import tiered_cache
from tests.helpers import (
    check_invariants,
    check_pattern,
    invariants_after_test,  # noqa: F401 - autouse fixture: invariants hold after each test
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


class Injector:
    """`sys.settrace` hook: counts 'line' events in tiered_cache frames; at the k-th raises
    KeyboardInterrupt, or, inside a commit section, defers one (as the SIGINT handler does)."""

    def __init__(self, k: int | None = None) -> None:
        self.k = k
        self.n = 0
        self.fired: str | None = None       # "raise" | "defer"
        self.where: str | None = None

    def global_trace(self, frame, event, arg):
        if self.fired is not None:
            return None
        if frame.f_code.co_filename.startswith(PKG_DIRS):
            return self.local_trace
        return None

    def local_trace(self, frame, event, arg):
        if self.fired is not None:
            return None
        if event != "line":
            return self.local_trace
        self.n += 1
        if self.k is not None and self.n == self.k:
            self.where = f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno} " \
                         f"({frame.f_code.co_name})"
            if atomic.active():
                self.fired = "defer"
                atomic.defer_interrupt()
                return None
            self.fired = "raise"
            raise KeyboardInterrupt
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
        except KeyboardInterrupt:
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
        cache.migrator.drain()
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
    where = f"interrupt ({inj.fired}) at line event {inj.k}: {inj.where}"
    assert lock_usable(c), f"{where}: the lock is held (no other thread can take it)"
    check_invariants(c)
    assert not atomic.interrupt_pending(), f"{where}: a deferred interrupt is still pending"
    if inj.fired is not None:
        assert interrupted, f"{where}: the interrupt was swallowed (the call returned)"
    if c.migrator is not None:
        assert c.migrator.drain(30.0), f"{where}: the migrator does not drain"
        check_invariants(c)
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


def count_lines(setup: str, op: str) -> int:
    w = build(setup)
    try:
        inj = Injector()
        fn = op_fn(w, op)
        result, interrupted = inj.run(fn)
        assert not interrupted
        check_result(w, op, result)
        _verify(w, inj, False, op)
        return inj.n
    finally:
        w.cache.shutdown()


def interrupt_at(setup: str, op: str, k: int) -> Injector:
    """Rebuild the state, run `op` with an interrupt at line event k, verify; returns the
    injector (whether and where it fired)."""
    w = build(setup)
    try:
        inj = Injector(k)
        result, interrupted = inj.run(op_fn(w, op))
        if not interrupted:
            check_result(w, op, result)
        _verify(w, inj, interrupted, op)
        return inj
    finally:
        w.cache.shutdown()


def points(n: int, case: str) -> list[int]:
    """A stride through line events 1..n (about POINTS of them, offset per case so that
    neighbouring cases cover different lines), with the first and last always."""
    stride = int(os.environ.get("TC_INTERRUPT_STRIDE", "0")) or max(1, n // POINTS)
    offset = zlib.crc32(case.encode()) % stride
    ks = list(range(1 + offset, n + 1, stride))
    return sorted(set(ks) | {1, n})


def sweep(setup: str, op: str, ks: list[int]) -> int:
    """Interrupt `op` at each line event in `ks` (a fresh state each time) and verify; returns
    how many of the interrupts fired."""
    fired = 0
    for k in ks:
        inj = interrupt_at(setup, op, k)
        fired += inj.fired is not None
    return fired


class LineRecorder(Injector):
    """Counts line events like the Injector (never fires) and notes the first event of each
    distinct line (file, line number)."""

    def __init__(self) -> None:
        super().__init__(None)
        self.first: dict[tuple[str, int], int] = {}

    def local_trace(self, frame, event, arg):
        if event == "line":
            self.first.setdefault((frame.f_code.co_filename, frame.f_lineno), self.n + 1)
        return super().local_trace(frame, event, arg)


def distinct_lines(setup: str, op: str) -> tuple[int, dict[tuple[str, int], int]]:
    """Run `op` once (uninterrupted, checked): its line event count and the first event of
    each distinct line it executes."""
    w = build(setup)
    try:
        rec = LineRecorder()
        result, interrupted = rec.run(op_fn(w, op))
        assert not interrupted
        check_result(w, op, result)
        _verify(w, rec, False, op)
        return rec.n, rec.first
    finally:
        w.cache.shutdown()


EVERY_LINE_OPS = ["open", "write", "write_publish", "append", "close", "invalidate"]
SAMPLED_OPS = [op for op in OPS if op not in EVERY_LINE_OPS]


@pytest.mark.parametrize("op", EVERY_LINE_OPS)
def test_interrupt_at_every_line(op):
    """An interrupt at every distinct line the call executes, in every tier setup: each
    setup is traced once, and each line not already covered by an earlier setup is
    interrupted at its first execution (a line run again in a loop is interrupted at its
    first run only; `TC_INTERRUPT_STRIDE=1` sweeps every line event of every setup); then
    the properties of the module doc. Setups are ordered cheapest first, so the device-only
    one covers the shared lines and the host setups add their demotion and write-through
    paths.

    NOTE: with the migrator, background threads can shift the main thread's path a little
    between the traced run and an interrupted one; an interrupt then lands on a neighbouring
    line (or, past the end, does not fire)."""
    covered: set[tuple[str, int]] = set()
    fired = tried = 0
    for setup in ("device", "migrator", "host", "host_wt"):
        n, first = distinct_lines(setup, op)
        if os.environ.get("TC_INTERRUPT_STRIDE") == "1":
            ks = list(range(1, n + 1))
        else:
            ks = sorted(k for line, k in first.items() if line not in covered)
        covered |= first.keys()
        tried += len(ks)
        fired += sweep(setup, op, ks)
    assert tried > 50 and fired >= tried - 8, (tried, fired)


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("op", SAMPLED_OPS)
def test_interrupt_sampled_lines(setup, op):
    """An open that hits (promoting from the host tier where it can) and the reads (which
    change no cached state, only pins): a sample of the line events (see `points`); the
    properties of the module doc."""
    n = count_lines(setup, op)
    assert n > 0
    # With the migrator, background timing can change the main thread's path a little: a
    # few k past the counted end make sure the tail is covered (those may not fire).
    extra = 8 if setup == "migrator" else 0
    assert sweep(setup, op, points(n + extra, f"{setup}/{op}")), "no interrupt fired"


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
            # `with cond:` exit raise "cannot release un-acquired lock" instead (the cache's
            # promotion waits, readiness.py, use one). Counted and reported, not failed on.
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
