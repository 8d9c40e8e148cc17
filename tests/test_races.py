"""Reads vs close, invalidate, resize and compaction on other threads: a read returns the KV of
the sequence it reads, never a block freed or overwritten under it.

The single-race tests hold a read in the middle of its kernel (a wrapper around the public
`tiered_cache.kernels` entry point, or the device pool's `read_tokens` for gather, that waits
after the block table is built), then, from other threads, close / invalidate / resize / compact
and open new requests that write other KV (they would take any slot freed under the reader).
The read must return exactly the reference computed from the pattern KV of its own tokens; a
close either waits for the read (it returns only after the read finished) or raises
BusySequenceError (cache.close documents both: wait up to the timeout, then BusySequenceError).

Then: writes and opens racing a shrink, FP8 attention racing resizes, and a multi-thread stress
(readers, writers, closers, invalidators, a resizer, the migrator and the compactor) that checks
every output; `TC_STRESS_S=<seconds>` also runs four longer stress runs (other seeds).
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from contextlib import contextmanager

import pytest
import torch

import tiered_cache.kernels as kernels
from tests.helpers import (
    check_invariants,
    check_pattern,
    make_cache,
    pattern_kv,
    pattern_value,
    snapshot,
    tokens,
    write_pattern,
    write_pattern_all,
)
from tests.oracles import (
    ATTENTION_TOL,
    expected_attention,
    needs_promotion,
    query,
    ref_decode_attention,
    ref_prefill_attention,
    wait_for,
)
from tiered_cache.errors import (
    BusySequenceError,
    CapacityError,
    SequenceClosedError,
    TieredCacheError,
)
from tiered_cache.migrator import Compactor

HOLD_S = 0.5            # how long a held read waits inside its kernel for the other threads
JOIN_S = 30.0           # generous bound on every join (a hang fails, it does not stall CI)


@contextmanager
def fast_switching():
    """Switch threads every microsecond (default 5 ms): many more interleavings per second."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


class Held:
    """Wraps `fn`: a call from the reader thread signals `entered`, waits until `release` is
    set (at most JOIN_S seconds), runs `fn`, then sets `left`."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self.entered = threading.Event()
        self.release = threading.Event()
        self.left = threading.Event()
        self.reader_ident: int | None = None

    def __call__(self, *args, **kwargs):
        if threading.get_ident() != self.reader_ident:
            return self.fn(*args, **kwargs)
        self.entered.set()
        self.release.wait(JOIN_S)
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.left.set()


class Worker(threading.Thread):
    """A thread that runs fn() once, keeping its result or exception, and when it ended
    relative to a `Held` read (`read_done_at_return`)."""

    def __init__(self, fn, held: Held | None = None, name: str = "worker") -> None:
        super().__init__(name=name, daemon=True)
        self.fn, self.held = fn, held
        self.result = self.error = None
        self.read_done_at_return: bool | None = None

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            if self.held is not None:
                self.read_done_at_return = self.held.left.is_set()

    def finish(self):
        self.join(JOIN_S)
        assert not self.is_alive(), f"{self.name} still running after {JOIN_S} s (hang)"
        return self


# ---------------------------------------------------------------------------- the state


def full_cache(**kw):
    """gpu 16 blocks, host 32 (block_size 4, 2 layers, 2 kv heads, 4 q heads)."""
    kw.setdefault("gpu_blocks", 16)
    kw.setdefault("host_blocks", 32)
    return make_cache(num_q_heads=4, **kw)


def cached(cache, prompts, salt=None):
    for p in prompts:
        s = cache.open(p, salt=salt)
        write_pattern_all(cache, s)
        cache.close(s)


def reader_target(cache):
    """A written open sequence S whose blocks sit high in the device tier, with holes below
    it (the prompts cached before it are invalidated) and the rest of the tier holding cached
    blocks: a slot freed under a reader is the first one a new request gets."""
    low = [tokens(8, start=1000 + 100 * i) for i in range(3)]       # 6 blocks in low slots
    cached(cache, low)
    s = cache.open(tokens(11, start=5000))                          # 3 blocks above them
    write_pattern_all(cache, s)
    cached(cache, [tokens(8, start=2000 + 100 * i) for i in range(2)])  # 4 more blocks
    for p in low[:2]:
        cache.invalidate(p)                                         # holes below S
    return s


def churn(cache, n: int = 6, start: int = 9000):
    """New requests that write KV of their own and stay open (they hold whatever slots they
    got). Returns them; CapacityError only means the tier was full meanwhile."""
    got = []
    for i in range(n):
        try:
            s = cache.open(tokens(8, start=start + 100 * i), salt="other")
        except CapacityError:
            continue
        write_pattern_all(cache, s)
        got.append(s)
    return got


def q_of(cache, n: int, seed: int = 0) -> torch.Tensor:
    return query(cache, n, seed)


READS = ["attention", "prefill_attention", "gather"]


def start_read(cache, s, kind: str, layer: int = 1):
    """Start a held read of S on a thread; returns (held, reader, check) where check(result)
    asserts the result is S's data."""
    if kind == "attention":
        target, name = kernels, "paged_decode_attention"
        q = q_of(cache, 1)
        want = expected_attention(cache, q, [s], layer)
        fn = lambda: cache.attention(q, [s], layer)                 # noqa: E731

        def check(out):
            torch.testing.assert_close(out.double(), want, **ATTENTION_TOL)
    elif kind == "prefill_attention":
        target, name = kernels, "prefill_attention"
        q = q_of(cache, 3)
        k, v = pattern_kv(cache, s.salt, s.token_ids, 0, s.written[layer], layer)
        want = ref_prefill_attention(q, k, v)
        fn = lambda: cache.prefill_attention(q, s, layer)           # noqa: E731

        def check(out):
            torch.testing.assert_close(out.double(), want, **ATTENTION_TOL)
    else:
        target, name = cache.pools[0], "read_tokens"
        ek, ev = pattern_kv(cache, s.salt, s.token_ids, 0, s.written[layer], layer)
        fn = lambda: cache.gather(s, layer)                         # noqa: E731

        def check(out):
            assert torch.equal(out[0], ek) and torch.equal(out[1], ev), "gather: not S's KV"
    held = Held(getattr(target, name))
    return target, name, held, fn, check


def race(cache, s, kind: str, mutate, monkeypatch, *, churn_start: int = 9000):
    """Hold a `kind` read of S inside its kernel; meanwhile run `mutate()` and churn() on
    other threads. Returns (mutator worker, churned sequences); fails unless the read
    returned S's data."""
    target, name, held, fn, check = start_read(cache, s, kind)
    monkeypatch.setattr(target, name, held)

    def read():
        held.reader_ident = threading.get_ident()       # only this thread's call is held
        return fn()

    reader = Worker(read, name="reader")
    reader.start()
    if not held.entered.wait(JOIN_S):
        reader.finish()
        raise AssertionError(f"the read never reached its kernel: {reader.error!r}")
    mutator = Worker(mutate, held, name="mutator")
    mutator.start()
    churner = Worker(lambda: churn(cache, start=churn_start), name="churn")
    churner.start()
    # Let them act while the read is held: until both are done, or HOLD_S seconds (a close
    # that waits for the reader, or a shrink waiting for pinned blocks, stays blocked).
    deadline = time.monotonic() + HOLD_S
    for w in (mutator, churner):
        w.join(max(0.0, deadline - time.monotonic()))
    held.release.set()
    reader.finish()
    mutator.finish()
    churner.finish()
    monkeypatch.undo()
    if reader.error is not None:
        raise reader.error
    check(reader.result)
    if churner.error is not None:
        raise churner.error
    for t in churner.result:                        # the new requests' data is theirs too
        check_pattern(cache, t)
    return mutator, churner.result


def close_all(cache, seqs):
    for t in seqs:
        if not t.closed:
            check_pattern(cache, t)
            cache.close(t)


# ---------------------------------------------------------------------------- close


@pytest.mark.parametrize("kind", READS)
def test_close_during_a_read_waits_for_it(kind, monkeypatch):
    cache = full_cache()
    s = reader_target(cache)
    mutator, others = race(cache, s, kind, lambda: cache.close(s, timeout=JOIN_S),
                           monkeypatch)
    if mutator.error is None:
        assert mutator.read_done_at_return, "close returned while the read was still running"
        assert s.closed
    else:
        assert isinstance(mutator.error, BusySequenceError), mutator.error
    close_all(cache, others + [s])
    check_invariants(cache)
    cache.shutdown()


@pytest.mark.parametrize("kind", ["attention", "prefill_attention"])
def test_close_with_a_short_timeout_during_a_read_raises_busy_and_keeps_the_sequence(
        kind, monkeypatch):
    cache = full_cache()
    s = reader_target(cache)
    mutator, others = race(cache, s, kind, lambda: cache.close(s, timeout=0.01), monkeypatch)
    assert isinstance(mutator.error, BusySequenceError), mutator.error
    assert "still being read" in str(mutator.error)
    assert not s.closed
    check_pattern(cache, s)                                 # still intact, still closable
    close_all(cache, others + [s])
    cache.shutdown()


# ---------------------------------------------------------------------------- invalidate


@pytest.mark.parametrize("kind", READS)
def test_invalidate_during_a_read_keeps_the_readers_blocks(kind, monkeypatch):
    cache = full_cache()
    s = reader_target(cache)
    mutator, others = race(cache, s, kind, lambda: cache.invalidate(s.token_ids), monkeypatch)
    assert mutator.error is None, mutator.error
    assert mutator.result >= 2                              # S's published blocks left the index
    check_pattern(cache, s)                                 # S still reads its own KV
    close_all(cache, others + [s])
    again = cache.open(s.token_ids)
    assert again.num_cached_tokens == 0                     # invalidated: a miss, not stale KV
    cache.close(again)
    cache.shutdown()


# ---------------------------------------------------------------------------- resize


RESIZES = [("gpu", 32), ("gpu", 7), ("host", 64), ("host", 8)]


@pytest.mark.parametrize("tier, size", RESIZES, ids=[f"{t}-{n}" for t, n in RESIZES])
@pytest.mark.parametrize("kind", READS)
def test_resize_during_a_read(kind, tier, size, monkeypatch):
    """Grow or shrink while S is read: S's blocks are pinned in the tail of the device tier,
    so a device shrink below them waits and times out (CapacityError, nothing lost) or ends
    after the read; every other outcome is a typed error."""
    cache = full_cache(host_blocks=32)
    s = reader_target(cache)
    mutator, others = race(cache, s, kind, lambda: cache.resize(tier, size, timeout=0.5),
                           monkeypatch)
    if mutator.error is not None:
        assert isinstance(mutator.error, CapacityError), mutator.error
    check_pattern(cache, s)
    close_all(cache, others + [s])
    check_invariants(cache)
    cache.shutdown()


# ---------------------------------------------------------------------------- compaction


@pytest.mark.parametrize("kind", READS)
def test_compaction_during_a_read(kind, monkeypatch):
    cache = full_cache(extra={"compactor": {"threshold": 0.01}})
    s = reader_target(cache)
    compactor = Compactor(cache.index, cache.executor, cache.config.compactor, start=False)
    mutator, others = race(cache, s, kind, lambda: compactor.compact(0), monkeypatch)
    assert mutator.error is None, mutator.error
    check_pattern(cache, s)
    close_all(cache, others + [s])
    assert compactor.compact(0) >= 0
    check_invariants(cache)
    cache.shutdown()


# ---------------------------------------------------------------------------- host reads


def host_reader(**migrator):
    """A cache with the migrator whose open sequence S reads blocks still being promoted from
    the host tier (zero-copy reads of the host pool): the promotion is slowed down."""
    cache = full_cache(gpu_blocks=8, host_blocks=32,
                       extra={"migrator": {"enabled": True, "wait_timeout_s": 20.0,
                                           "promotion_chunk_bytes": 0, **migrator}})
    p = tokens(8, start=3000)
    cached(cache, [p])
    for i in range(6):                              # push p down to the host tier
        cached(cache, [tokens(8, start=4000 + 100 * i)])
    cache.migrator.drain()
    # a demotion may still be copying or committing: wait until opening p must promote
    wait_for(lambda: needs_promotion(cache, p), "a block of p to leave the device", JOIN_S)

    def slow(kind, attempt):
        if kind == "promotion":
            time.sleep(0.2)
    cache.migrator.fault_hook = slow
    s = cache.open(p + [1, 2, 3])
    assert s.cached_tokens_by_tier.get("host", 0) > 0 and s.pending
    for layer in range(cache.num_layers):           # the uncached tail: S's own blocks
        k, v = pattern_kv(cache, None, s.token_ids, s.written[layer], s.num_tokens, layer)
        cache.write(s, layer, k, v)
    return cache, s


HOST_MUTATIONS = ["close", "invalidate", "host-grow", "host-shrink", "gpu-shrink"]


@pytest.mark.parametrize("what", HOST_MUTATIONS)
def test_mutation_during_a_zero_copy_read_of_blocks_still_in_the_host_tier(what, monkeypatch):
    cache, s = host_reader()
    mutate = {
        "close": lambda: cache.close(s, timeout=JOIN_S),
        "invalidate": lambda: cache.invalidate(s.token_ids),
        "host-grow": lambda: cache.resize("host", 48, timeout=0.5),
        "host-shrink": lambda: cache.resize("host", 12, timeout=0.5),
        "gpu-shrink": lambda: cache.resize("gpu", 6, timeout=0.5),
    }[what]
    mutator, others = race(cache, s, "attention", mutate, monkeypatch)
    if mutator.error is not None:
        assert isinstance(mutator.error, (CapacityError, BusySequenceError)), mutator.error
    elif what == "close":
        assert mutator.read_done_at_return, "close returned while the read was still running"
    cache.migrator.fault_hook = None
    close_all(cache, others + [s])
    cache.migrator.drain()
    check_invariants(cache)
    cache.shutdown()


# ---------------------------------------------------------------------------- write vs shrink


def test_write_through_during_a_host_shrink_commits_the_write_without_error():
    """A write whose blocks complete (and are published) makes a write-through copy to the
    host tier while a host shrink is draining it: the copy finds no room (or room below the
    shrink's limit) and the write returns normally, its KV written and published.

    (Regression: the copy's slot reservation evicted host blocks in the shrink's tail and
    counted their slots as freed, but the allocator retires tail slots instead of freeing
    them, so `write()` raised `CapacityError('asked for 1 slots but only 0 ... are free')`
    after the KV was written and published. `Eviction.room` counted the tail's blocks as
    room and `_pick_victims` counted their slots as set aside.)

    Deterministic: the shrink's first round of moves is held in its copy (a host->host
    handler registered with the public `Executor.register`), so the tail still holds
    evictable blocks that this round does not move."""
    from tiered_cache.data.executor import within_pool

    cache = make_cache(gpu_blocks=24, host_blocks=160, write_policy="write_through")
    ps = [tokens(4, start=10 * i) for i in range(160)]
    cached(cache, ps)                               # host: every prompt, in order
    for p in ps[:40] + ps[150:]:
        cache.invalidate(p)                         # 40 free host slots below slot 40
    entered, release = threading.Event(), threading.Event()

    def held_copy(*args):
        entered.set()
        release.wait(JOIN_S)
        within_pool(*args)

    cache.executor.register("host", "host", held_copy)
    shrink = Worker(lambda: cache.resize("host", 40, timeout=JOIN_S), name="shrink")
    shrink.start()
    try:
        assert entered.wait(JOIN_S), "the shrink never copied"
        x = cache.open(tokens(4, start=5000))
        try:
            write_pattern_all(cache, x)
            error = None
        except CapacityError as exc:
            error = exc
    finally:
        release.set()
        shrink.finish()
    assert shrink.error is None, shrink.error
    check_invariants(cache)
    check_pattern(cache, x)                         # the KV was written either way
    assert x.written == [4] * cache.num_layers
    assert error is None, f"write() raised {error!r} after its blocks were written"
    cache.close(x)
    cache.shutdown()


def test_open_during_a_device_shrink_refuses_without_evicting():
    """An open() that needs more device slots than the tier below a shrink's limit can give
    raises CapacityError and changes nothing, although an unpinned block sits in the tail
    being drained: evicting it would free no slot anyone can have.

    (Regression: `Eviction.room` counted blocks in a shrink's tail as room, so the open
    evicted the tail block, whose slot the allocator retires, found nothing else to evict and
    raised CapacityError after dropping it.)

    Layout, device only (24 slots, shrinking to 8): a 4-block prompt pinned in slots 0-3, 4
    free slots, a pinned tail block X and 15 cached tail blocks. The shrink evicts the tail's
    unpinned blocks until the rest fits below and starts moving 3 of them (held in its copy:
    a gpu->gpu handler registered with the public `Executor.register`); then X is closed."""
    from tiered_cache.data.executor import within_pool

    cache = make_cache(gpu_blocks=24, host_blocks=0, extra={"migrator": {"wait_timeout_s": 0.2}})
    pinned = tokens(16, start=9000)
    cached(cache, [pinned])                         # slots 0-3
    holes = [tokens(4, start=10 * i) for i in range(4)]
    cached(cache, holes)                            # slots 4-7
    tail = [tokens(4, start=1000 + 10 * i) for i in range(16)]
    cached(cache, tail)                             # slots 8-23
    for p in holes:
        cache.invalidate(p)
    p_seq = cache.open(pinned)
    x = cache.open(tail[-1])
    assert p_seq.num_cached_tokens == 16 and x.num_cached_tokens == 4
    entered, release = threading.Event(), threading.Event()

    def held_copy(*args):
        entered.set()
        release.wait(JOIN_S)
        within_pool(*args)

    cache.executor.register("gpu", "gpu", held_copy)
    shrink = Worker(lambda: cache.resize("gpu", 8, timeout=JOIN_S), name="shrink")
    shrink.start()
    try:
        assert entered.wait(JOIN_S), "the shrink never copied"
        cache.close(x)                              # X: unpinned, in the tail, not moving
        with cache.locked():
            gpu = cache.tiers[0]
            assert gpu.allocator.num_free < 2 <= gpu.allocator.draining, \
                (gpu.allocator.num_free, gpu.allocator.draining)
        before = snapshot(cache)
        with pytest.raises(CapacityError):
            cache.open(tokens(8, start=7000))
        assert snapshot(cache) == before, "a refused open() evicted blocks"
    finally:
        release.set()
        shrink.finish()
    check_invariants(cache)
    if shrink.error is not None:
        assert isinstance(shrink.error, CapacityError), shrink.error
    check_pattern(cache, p_seq)
    cache.close(p_seq)
    for p in [pinned] + tail:                       # every cached prefix is exact
        s = cache.open(p)
        check_pattern(cache, s)
        cache.close(s)
    cache.shutdown()


# ---------------------------------------------------------------------------- FP8


RESIZE_ROUNDS = 150     # grow-and-shrink rounds of each tier while attention reads


def fp8_pattern(cache, salt, toks, start: int, end: int, layer: int):
    """pattern_kv in float32 (an fp8_e4m3 cache quantizes float KV on write)."""
    H, D = cache.num_kv_heads, cache.head_dim
    j = torch.arange(H * D, dtype=torch.float32).view(H, D)
    c = torch.tensor([pattern_value(salt, toks, p, layer) for p in range(start, end)],
                     dtype=torch.float32).view(-1, 1, 1)
    return c + j, -c - 2 * j


def test_fp8_attention_racing_a_resize_of_either_tier():
    """With `model.dtype: fp8_e4m3`, attention runs while another thread grows and shrinks
    the device and host tiers: every call returns, and every output matches the reference
    over the stored (dequantized) KV.

    (Regression: `_Pool._set_views` swapped a pool's `kv` view and then its `scales` view
    outside the lock, and `data.attention.layer_pools` read them one after the other, so a
    reader could pair KV of one size with scales of the other and the kernel refused with
    `ShapeError('k_scales[i]: expected N scales (one per slot), got M')`.)"""
    cache = make_cache(dtype="fp8_e4m3", gpu_blocks=32, host_blocks=32, num_q_heads=4)
    seqs = []
    for i in range(3):
        s = cache.open(tokens(10, start=100 * i))
        for layer in range(cache.num_layers):
            cache.write(s, layer, *fp8_pattern(cache, None, s.token_ids, 0, 10, layer))
        seqs.append(s)
    q = q_of(cache, 3)
    want = []
    for layer in range(cache.num_layers):
        ks, vs = zip(*(cache.gather(s, layer) for s in seqs))
        for s, k, v in zip(seqs, ks, vs):                   # FP8 is close to the pattern
            ek, ev = fp8_pattern(cache, None, s.token_ids, 0, 10, layer)
            torch.testing.assert_close(k, ek, rtol=0.07, atol=0.5)
            torch.testing.assert_close(v, ev, rtol=0.07, atol=0.5)
        want.append(ref_decode_attention(q, list(ks), list(vs)))
    errors: list[BaseException] = []
    wrong: list[str] = []
    done = threading.Event()
    counts = {"reads": 0, "resizes": 0}

    def reader():
        i = 0
        while not done.is_set() or counts["reads"] < 20:
            layer = i % cache.num_layers
            i += 1
            try:
                out = cache.attention(q, seqs, layer)
            except TieredCacheError as exc:
                errors.append(exc)
                if len(errors) > 50:
                    return
                continue
            counts["reads"] += 1
            if not torch.allclose(out.double(), want[layer], **ATTENTION_TOL):
                wrong.append(f"layer {layer}: max diff "
                             f"{(out.double() - want[layer]).abs().max():.3g}")

    def resizer():
        try:
            for _ in range(RESIZE_ROUNDS):
                for tier, a, b in (("gpu", 32, 48), ("host", 32, 48)):
                    try:
                        cache.resize(tier, b, timeout=1.0)
                        cache.resize(tier, a, timeout=1.0)
                        counts["resizes"] += 1
                    except CapacityError:
                        pass
        finally:
            done.set()

    with fast_switching():
        threads = [Worker(reader, name="fp8-reader"), Worker(resizer, name="fp8-resizer")]
        for t in threads:
            t.start()
        for t in threads:
            t.finish()
    for t in threads:
        if t.error is not None:
            raise t.error
    assert counts["reads"] >= 20 and counts["resizes"] > RESIZE_ROUNDS, counts
    assert not wrong, f"{len(wrong)} wrong attention outputs, e.g. {wrong[:3]}"
    assert not errors, (f"{len(errors)} of {len(errors) + counts['reads']} attention calls "
                        f"racing a resize raised, e.g. {errors[0]!r}")
    for s in seqs:
        cache.close(s)
    cache.shutdown()


# ---------------------------------------------------------------------------- stress


ALPHABET = [1, 2, 3]


class Shared:
    """Open, fully written sequences any thread may read or close."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seqs: list = []
        self.prompts: set[tuple[tuple[int, ...], object]] = set()

    def add(self, s) -> None:
        with self.lock:
            self.seqs.append(s)
            self.prompts.add((tuple(s.token_ids.tolist()), s.salt))

    def pick(self, rng: random.Random, k: int = 1):
        with self.lock:
            live = [s for s in self.seqs if not s.closed]
            self.seqs = live
            return rng.sample(live, min(k, len(live)))


def stress(cache, seconds: float, seed: int = 0) -> dict[str, int]:
    """Writers open prompts (shared prefixes, two tenants) and write their pattern; readers
    run attention / prefill_attention / gather on sequences other threads may close; a closer
    closes them; an invalidator drops prefixes; a resizer grows and shrinks both tiers. Every
    output is checked against the pattern. Returns operation counts."""
    shared = Shared()
    stop = time.monotonic() + seconds
    counts: dict[str, int] = {}
    problems: list[str] = []
    plock = threading.Lock()

    def bump(name: str) -> None:
        with plock:
            counts[name] = counts.get(name, 0) + 1

    def writer(i: int) -> None:
        rng = random.Random(seed * 100 + i)
        while time.monotonic() < stop:
            toks = [rng.choice(ALPHABET) for _ in range(rng.randrange(1, 14))]
            salt = rng.choice([None, "t1"])
            try:
                s = cache.open(toks, salt=salt)
            except CapacityError:
                bump("capacity")
                continue
            check_pattern(cache, s)                 # the cached prefix is this prompt's
            for layer in range(cache.num_layers):
                write_pattern(cache, s, layer)
            check_pattern(cache, s)
            shared.add(s)
            bump("opened")
            if len(shared.seqs) > 6:                # keep the device tier from filling up
                time.sleep(0.001)

    def reader(i: int) -> None:
        rng = random.Random(seed * 100 + 50 + i)
        while time.monotonic() < stop:
            picked = shared.pick(rng, rng.randrange(1, 3))
            if not picked:
                time.sleep(0.0005)
                continue
            layer = rng.randrange(cache.num_layers)
            kind = rng.choice(READS)
            try:
                if kind == "attention":
                    q = q_of(cache, len(picked), seed=rng.randrange(1000))
                    out = cache.attention(q, picked, layer)
                    want = expected_attention(cache, q, picked, layer)
                    ok = torch.allclose(out.double(), want, **ATTENTION_TOL)
                elif kind == "prefill_attention":
                    s = picked[0]
                    n = rng.randrange(1, s.written[layer] + 1)
                    q = q_of(cache, n, seed=rng.randrange(1000))
                    out = cache.prefill_attention(q, s, layer)
                    k, v = pattern_kv(cache, s.salt, s.token_ids, 0, s.written[layer], layer)
                    ok = torch.allclose(out.double(), ref_prefill_attention(q, k, v),
                                        **ATTENTION_TOL)
                else:
                    s = picked[0]
                    k, v = cache.gather(s, layer)
                    ek, ev = pattern_kv(cache, s.salt, s.token_ids, 0, s.written[layer], layer)
                    ok = torch.equal(k, ek) and torch.equal(v, ev)
            except SequenceClosedError:
                bump("read_closed")                 # closed by the closer first: allowed
                continue
            bump(kind)
            if not ok:
                with plock:
                    problems.append(f"{kind} of {[s.id for s in picked]} layer {layer}: "
                                    "not the KV of those tokens")

    def closer() -> None:
        rng = random.Random(seed * 100 + 80)
        while time.monotonic() < stop:
            picked = shared.pick(rng)
            if not picked:
                time.sleep(0.0005)
                continue
            try:
                cache.close(picked[0], timeout=2.0)
                bump("closed")
            except BusySequenceError:
                bump("close_busy")
            except SequenceClosedError:
                bump("close_twice")
            time.sleep(rng.random() * 0.002)

    def invalidator() -> None:
        rng = random.Random(seed * 100 + 90)
        while time.monotonic() < stop:
            toks = [rng.choice(ALPHABET) for _ in range(rng.randrange(4, 9))]
            cache.invalidate(toks, salt=rng.choice([None, "t1"]))
            bump("invalidated")
            time.sleep(0.003)

    def resizer() -> None:
        rng = random.Random(seed * 100 + 95)
        while time.monotonic() < stop:
            tier, size = rng.choice([("gpu", 40), ("gpu", 64), ("host", 24), ("host", 64)])
            try:
                cache.resize(tier, size, timeout=0.3)
                bump("resized")
            except CapacityError:
                bump("resize_refused")
            time.sleep(0.005)

    workers = ([Worker(lambda i=i: writer(i), name=f"writer-{i}") for i in range(2)]
               + [Worker(lambda i=i: reader(i), name=f"reader-{i}") for i in range(2)]
               + [Worker(closer, name="closer"), Worker(invalidator, name="invalidator"),
                  Worker(resizer, name="resizer")])
    for w in workers:
        w.start()
    for w in workers:
        w.finish()
    for w in workers:
        if w.error is not None:
            raise AssertionError(f"{w.name} raised {w.error!r}") from w.error
    assert not problems, f"{len(problems)} wrong outputs, e.g. {problems[:3]}"
    for s in shared.pick(random.Random(0), 10**6):
        check_pattern(cache, s)
        cache.close(s)
    if cache.migrator is not None:
        cache.migrator.drain()
    check_invariants(cache)
    assert all(t.pinned_blocks == 0 for t in cache.tiers)
    for toks, salt in sorted(shared.prompts, key=repr):      # every cached prefix is exact
        s = cache.open(list(toks), salt=salt)
        check_pattern(cache, s)
        cache.close(s)
    return counts


def stress_cache():
    return full_cache(gpu_blocks=48, host_blocks=48, write_policy="write_through",
                      extra={"migrator": {"enabled": True, "high_watermark": 0.75,
                                          "low_watermark": 0.5},
                             "compactor": {"enabled": True, "threshold": 0.2,
                                           "interval_s": 0.005}})


def test_stress_readers_writers_closers_invalidators_resizer():
    cache = stress_cache()
    with fast_switching():
        counts = stress(cache, seconds=3.0)
    for name in ("opened", "attention", "gather", "prefill_attention", "closed",
                 "invalidated", "resized"):
        assert counts.get(name, 0) > 0, counts
    health = cache.stats()["threads"]
    assert all(h["alive"] for h in health.values()), health
    cache.shutdown()


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("TC_STRESS_S"),
                    reason="set TC_STRESS_S=<seconds> for the long stress runs")
@pytest.mark.parametrize("seed", range(4))
def test_stress_long(seed):
    cache = stress_cache()
    with fast_switching():
        stress(cache, seconds=float(os.environ["TC_STRESS_S"]), seed=seed)
    cache.shutdown()
