"""Faults: background threads never die silently, failing copies degrade instead of refusing,
and a promotion that fails part way is a TransferError on every layer.

Faults are injected through the public hooks: `Migrator.fault_hook`, the public
`tiered_cache.kernels` copy functions, and (for exceptions that are not copy failures) methods
of the migrator and compactor objects monkeypatched on the instance.
"""

from __future__ import annotations

import logging
import threading
import time

import pytest
import torch

from tests.helpers import (
    check_invariants,
    check_pattern,
    make_cache,
    pattern_kv,
    tokens,
    write_pattern_all,
)
from tests.oracles import (
    ATTENTION_TOL,
    expected_attention,
    needs_promotion,
    query,
    ref_prefill_attention,
)
from tiered_cache import kernels
from tiered_cache.errors import CapacityError, TieredCacheError, TransferError

WAIT_S = 20.0           # bound of every wait for a background thread (never asserted on)


def wait_until(cond, what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(0.002)


def serve(cache, prompt, salt=None):
    """One request: open, check the cached prefix, write the rest, check, close."""
    s = cache.open(prompt, salt=salt)
    check_pattern(cache, s)
    write_pattern_all(cache, s)
    check_pattern(cache, s)
    cache.close(s)
    return s


def migrating(**kw):
    migrator = {"enabled": True, "high_watermark": 0.75, "low_watermark": 0.5,
                "wait_timeout_s": WAIT_S, **kw.pop("migrator", {})}
    extra = {"migrator": migrator, **kw.pop("extra", {})}
    return make_cache(extra=extra, **kw)


def thread_health(cache, prefix: str) -> dict:
    """Summed health of the threads whose name starts with `prefix`."""
    hs = [h for name, h in cache.stats()["threads"].items() if name.startswith(prefix)]
    assert hs, f"no thread {prefix}* in {list(cache.stats()['threads'])}"
    return {"alive": all(h["alive"] for h in hs), "errors": sum(h["errors"] for h in hs),
            "last_error": " | ".join(h["last_error"] or "" for h in hs)}


# ---------------------------------------------------------------------------- resize race


def demotion_workload(race_resize: bool, requests: int = 240) -> dict:
    """Requests of fresh 2-block prompts push the device tier (32 blocks) past its high
    watermark again and again; the demoter has to keep it down. With `race_resize`, another
    thread shrinks the host tier to 8 blocks and grows it back meanwhile."""
    cache = migrating(gpu_blocks=32, host_blocks=64)
    stop = threading.Event()
    outcomes = {"resized": 0, "refused": 0}

    def resizer():
        while not stop.is_set():
            for size in (8, 64):
                try:
                    cache.resize("host", size, timeout=0.2)
                    outcomes["resized"] += 1
                except CapacityError:
                    outcomes["refused"] += 1
                time.sleep(0.001)

    t = threading.Thread(target=resizer, name="resizer", daemon=True)
    if race_resize:
        t.start()
    try:
        for i in range(requests):
            serve(cache, tokens(8, start=100 * i))
    finally:
        stop.set()
        if race_resize:
            t.join(WAIT_S)
    stats = cache.stats()
    cache.migrator.drain()
    check_invariants(cache)
    cache.shutdown()
    return {"sync_evictions": stats["sync_evictions"], "demotions": stats["demotions"],
            "demoter": stats["threads"]["tc-demoter"], **outcomes}


def test_host_resize_racing_watermark_demotion_keeps_the_demoter_alive_and_demoting():
    base = demotion_workload(race_resize=False)
    raced = demotion_workload(race_resize=True)
    assert raced["resized"] > 10, raced                    # the race really happened
    demoter = raced["demoter"]
    assert demoter["alive"], f"the demoter died: {demoter}"
    # The device tier kept being demoted: with demotion stopped every request past the first
    # 16 evicts synchronously (224 of 240 here), with a live demoter a handful do.
    assert raced["demotions"] > 0
    limit = max(3 * base["sync_evictions"], base["sync_evictions"] + 60)
    assert raced["sync_evictions"] <= limit, (base, raced)


# ---------------------------------------------------------------------------- thread health


class Once:
    """Wraps a bound method: the first call for which `when(*args)` holds raises
    RuntimeError('injected ...'); every other call goes through."""

    def __init__(self, fn, when=lambda *a, **k: True, name: str = "fault") -> None:
        self.fn, self.when, self.name = fn, when, name
        self.fired = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, *args, **kwargs):
        with self._lock:
            fire = not self.fired.is_set() and self.when(*args, **kwargs)
            if fire:
                self.fired.set()
        if fire:
            raise RuntimeError(f"injected {self.name}")
        return self.fn(*args, **kwargs)


def pushed_to_host(cache, prompt, others: int = 6, base: int = 7000):
    """Cache `prompt`, then enough others to push it down to the host tier."""
    serve(cache, prompt)
    for i in range(others):
        serve(cache, tokens(len(prompt), start=base + 100 * i))
    cache.migrator.drain()
    # a demotion may still be copying or committing: wait until an open must promote
    wait_until(lambda: needs_promotion(cache, prompt), "a block of the prompt to leave the device")


def check_logged(caplog, needle: str) -> None:
    hits = [r for r in caplog.records if needle in r.getMessage() or
            (r.exc_info and needle in str(r.exc_info[1]))]
    assert hits, f"nothing logged about {needle!r}"
    assert any(r.exc_info for r in hits), "logged without its traceback"


def test_demoter_survives_an_unexpected_exception(caplog):
    caplog.set_level(logging.WARNING)
    cache = migrating(gpu_blocks=16, host_blocks=64)
    m = cache.migrator
    m._plan_demotion = fault = Once(m._plan_demotion, name="demotion planning fault")
    for i in range(12):                                     # past the watermark
        serve(cache, tokens(8, start=100 * i))
    wait_until(fault.fired.is_set, "the fault to fire")
    wait_until(lambda: thread_health(cache, "tc-demoter")["errors"] >= 1, "the error count")
    h = thread_health(cache, "tc-demoter")
    assert h["alive"] and "injected demotion planning fault" in h["last_error"], h
    check_logged(caplog, "injected demotion planning fault")
    before = cache.stats()["demotions"]
    for i in range(12, 24):                                 # still demoting afterwards
        serve(cache, tokens(8, start=100 * i))
    wait_until(lambda: cache.stats()["demotions"] > before, "a demotion after the fault")
    cache.migrator.drain()
    check_invariants(cache)
    cache.shutdown()


@pytest.mark.parametrize("kind", ["promotion", "demotion", "write_through"])
def test_migrator_threads_survive_an_exception_outside_the_copy_retry_loop(kind, caplog):
    """`Migrator._attempt` (the retry loop around a copy) itself raising: not a copy failure
    but an unexpected error. The job's plan is committed as failed, the error is counted for
    the thread and logged with its traceback, and the thread serves the next job."""
    caplog.set_level(logging.WARNING)
    cache = migrating(gpu_blocks=8, host_blocks=48, num_layers=2,
                      write_policy="write_through" if kind == "write_through" else "write_back",
                      migrator={"max_retries": 0})
    m = cache.migrator
    thread = "tc-demoter" if kind == "demotion" else "tc-migrator"
    prompt = tokens(8, start=3000)
    if kind == "promotion":
        pushed_to_host(cache, prompt)
    fault = Once(m._attempt, when=lambda k, *a: k == kind, name=f"{kind} fault")
    m._attempt = fault
    if kind == "promotion":
        s = cache.open(prompt)
        assert s.cached_tokens_by_tier.get("host", 0) > 0
        with pytest.raises(TransferError, match="injected promotion fault"):
            cache.wait(s, 0)
        cache.close(s)
    else:
        for i in range(8):
            serve(cache, tokens(8, start=100 * i))
    wait_until(fault.fired.is_set, "the fault to fire")
    wait_until(lambda: thread_health(cache, thread)["errors"] >= 1, "the error count")
    h = thread_health(cache, thread)
    assert h["alive"], h
    assert f"injected {kind} fault" in h["last_error"], h
    check_logged(caplog, f"injected {kind} fault")
    m.drain()
    check_invariants(cache)
    # The thread carries on: the same kind of job works now.
    before = cache.stats()
    if kind == "promotion":
        s = serve(cache, prompt)
        assert s.num_cached_tokens == len(prompt)
        assert cache.stats()["promotions"] > before["promotions"]
    elif kind == "demotion":
        for i in range(8, 16):
            serve(cache, tokens(8, start=100 * i))
        wait_until(lambda: cache.stats()["demotions"] > before["demotions"], "a demotion")
    else:
        serve(cache, tokens(8, start=8000))
        wait_until(lambda: cache.stats()["write_through_blocks"] >
                   before["write_through_blocks"], "a write-through copy")
    m.drain()
    check_invariants(cache)
    cache.shutdown()


def test_compactor_survives_an_unexpected_exception(caplog):
    caplog.set_level(logging.WARNING)
    cache = make_cache(gpu_blocks=40, host_blocks=0,
                       extra={"compactor": {"enabled": True, "threshold": 0.1,
                                            "interval_s": 0.005}})
    c = cache.compactor
    c.step = fault = Once(c.step, name="compaction fault")
    prompts = [tokens(8, start=100 * i) for i in range(16)]
    for p in prompts:
        serve(cache, p)
    for p in prompts[::2]:
        cache.invalidate(p)                                 # holes: fragmentation
    wait_until(fault.fired.is_set, "the fault to fire")
    wait_until(lambda: thread_health(cache, "tc-compactor")["errors"] >= 1, "the error count")
    h = thread_health(cache, "tc-compactor")
    assert h["alive"] and "injected compaction fault" in h["last_error"], h
    check_logged(caplog, "injected compaction fault")
    wait_until(lambda: cache.stats()["compaction_moves"] > 0, "a compaction after the fault")
    for p in prompts[1::2]:
        s = serve(cache, p)
        assert s.num_cached_tokens == len(p)
    check_invariants(cache)
    cache.shutdown()


@pytest.mark.parametrize("fail", ["copy_blocks_to_host", "copy_blocks_to_gpu"])
def test_copy_failures_in_background_threads_are_counted_and_survived(fail, monkeypatch):
    """A kernel copy raising is a copy failure: retried, given up, counted in
    transfer_failures; the thread stays alive with no error of its own."""
    cache = migrating(gpu_blocks=8, host_blocks=48, migrator={"max_retries": 1})
    prompt = tokens(8, start=3000)
    if fail == "copy_blocks_to_gpu":
        pushed_to_host(cache, prompt)

    def broken(*args, **kwargs):
        raise RuntimeError("injected kernel failure")

    monkeypatch.setattr(kernels, fail, broken)
    if fail == "copy_blocks_to_gpu":
        s = cache.open(prompt)
        with pytest.raises(TransferError):
            cache.wait(s, 0)
        cache.close(s)
    else:
        for i in range(20):
            serve(cache, tokens(4 + 4 * (i % 2), start=100 * i))
    wait_until(lambda: cache.stats()["transfer_failures"] >= 1, "a counted failure")
    assert cache.stats()["transfer_retries"] >= 1
    monkeypatch.undo()
    cache.migrator.drain()
    threads = cache.stats()["threads"]
    assert all(h["alive"] for h in threads.values()), threads
    s = serve(cache, prompt)                                 # works again, data exact
    check_invariants(cache)
    cache.shutdown()


# ---------------------------------------------------------------------------- degrade


@pytest.mark.parametrize("migrator", [False, True])
@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
def test_failing_device_to_host_copies_degrade_to_drops(migrator, write_policy, monkeypatch):
    """Every device->host copy fails: requests are still served (no TransferError from
    open), evicted blocks are dropped and counted, every byte served is exact. Prompts of one
    to three blocks (a chain demoted in one plan)."""
    cache = make_cache(gpu_blocks=16, host_blocks=32, write_policy=write_policy,
                       extra={"migrator": {"enabled": migrator, "max_retries": 0,
                                           "high_watermark": 0.75, "low_watermark": 0.5,
                                           "wait_timeout_s": WAIT_S}})

    def broken(*args, **kwargs):
        raise OSError("injected: device->host copy path down")

    monkeypatch.setattr(kernels, "copy_blocks_to_host", broken)
    prompts = [tokens(4 * (1 + i % 3), start=100 * i) for i in range(40)]   # 80 blocks, 16 slots
    for i, p in enumerate(prompts):
        serve(cache, p)
        if i % 3 == 2:
            serve(cache, prompts[i - 2])                         # a hit (or a miss): exact
    if cache.migrator is not None:
        cache.migrator.drain()
    stats = cache.stats()
    assert stats["transfer_failures"] > 0, stats
    if write_policy == "write_back" and not migrator:
        # each synchronous eviction tried to demote, failed and dropped its victims
        assert stats["degraded_evictions"] > 0, stats
    assert stats["demotions"] == 0 and stats["write_through_blocks"] == 0, stats
    with cache.locked():                                         # no host copy ever landed
        slots = cache.index.blocks.slots
        assert all(slots[1][b] == -1 for b in cache.index.prefix.values())
    check_invariants(cache)
    monkeypatch.undo()
    for p in prompts:                                            # a miss or exact data
        serve(cache, p)
    threads = stats["threads"]
    assert all(h["alive"] for h in threads.values()), threads
    check_invariants(cache)
    cache.shutdown()


@pytest.mark.parametrize("migrator", [False, True])
def test_failed_synchronous_demotion_of_a_chain_degrades_to_drops(migrator, monkeypatch):
    """With the device->host copy path failing, an open() that has to evict a cached prompt
    of two blocks demotes the chain (parent and child in one plan); the copy fails and both
    are dropped: the request is served, every victim counts as a degraded eviction.

    (Regression: `Eviction._drop_demoted` cleared the child's host slot again after dropping
    the parent had already released it, and open() raised `ValueError('slot -1 is out of
    range')`.) Minimal: gpu 4 blocks, two cached 2-block prompts, copies down failing."""
    cache = make_cache(gpu_blocks=4, host_blocks=8,
                       extra={"migrator": {"enabled": migrator, "max_retries": 0,
                                           "wait_timeout_s": WAIT_S}})
    for start in (0, 100):
        serve(cache, tokens(8, start=start))
    if cache.migrator is not None:
        assert cache.migrator.settle(WAIT_S)        # no demotion still copying
    demoted = cache.stats()["demotions"]

    def broken(*args, **kwargs):
        raise OSError("injected: device->host copy path down")

    monkeypatch.setattr(kernels, "copy_blocks_to_host", broken)
    try:
        for i in range(2, 12):                      # each evicts a 2-block chain
            serve(cache, tokens(8, start=100 * i))
    finally:
        check_invariants(cache)
    stats = cache.stats()
    # 10 requests of 2 blocks into a full 4-block tier: 20 victims, each demoted and dropped
    # (with the migrator, its demoter fails the same copies in the background).
    assert stats["transfer_failures"] >= 1, stats
    if not migrator:
        assert stats["degraded_evictions"] == 20, stats
    assert stats["demotions"] == demoted, stats
    monkeypatch.undo()
    for start in (0, 100, 1100):                    # misses now, served exactly
        serve(cache, tokens(8, start=start))
    check_invariants(cache)
    cache.shutdown()


# ---------------------------------------------------------------------------- partial promotion


LAYERS = 3


def partial_promotion_cache():
    cache = migrating(gpu_blocks=8, host_blocks=48, num_layers=LAYERS, num_q_heads=4,
                      migrator={"max_retries": 0, "promotion_chunk_bytes": 0})
    prompt = tokens(8, start=3000)
    pushed_to_host(cache, prompt)
    return cache, prompt


def assert_transfer_error_on_every_layer(cache, s) -> None:
    """Every read of `s` (wait, gather, attention, prefill_attention) raises TransferError on
    every layer."""
    for layer in range(LAYERS):
        q, qp = query(cache, 1, seed=layer), query(cache, 2, seed=layer)
        calls = [("wait", lambda layer=layer: cache.wait(s, layer)),
                 ("gather", lambda layer=layer: cache.gather(s, layer)),
                 ("attention", lambda layer=layer, q=q: cache.attention(q, [s], layer)),
                 ("prefill_attention",
                  lambda layer=layer, qp=qp: cache.prefill_attention(qp, s, layer))]
        for what, call in calls:
            try:
                call()
            except TransferError:
                continue
            except TieredCacheError as exc:
                raise AssertionError(f"{what}(layer {layer}) raised {exc!r}, not "
                                     "TransferError") from exc
            raise AssertionError(f"{what}(layer {layer}) returned although the promotion of "
                                 "the sequence's blocks failed")


def fail_on_call(n: int):
    """A Migrator.fault_hook failing the n-th promotion copy (one copy per layer here)."""
    calls = []

    def hook(kind: str, attempt: int) -> None:
        if kind == "promotion":
            calls.append(attempt)
            if len(calls) == n:
                raise OSError(f"injected: promotion copy {n} fails")
    return hook, calls


def test_promotion_failing_after_one_layer_is_a_transfer_error_on_every_layer():
    """Layer 0 of a promotion lands, layer 1's copy fails (fault_hook): every read of the
    sequence raises TransferError on every layer, `wait(seq, 0)` included (the failed
    promotion's device slots are released, so the layer that landed is gone too).
    (Regression: `LayerReadiness.wait` returned for layers that had landed before the
    failure, so an engine that waited for layer 0 computed on released slots.)"""
    cache, prompt = partial_promotion_cache()
    hook, calls = fail_on_call(2)
    cache.migrator.fault_hook = hook
    s = cache.open(prompt)
    assert s.pending and s.cached_tokens_by_tier.get("host", 0) > 0
    (readiness,) = s.pending
    wait_until(lambda: readiness.done, "the promotion to fail")
    assert readiness.error is not None and readiness.ready_layers == 1
    try:
        assert_transfer_error_on_every_layer(cache, s)
    finally:
        cache.migrator.fault_hook = None
        cache.close(s)
        check_invariants(cache)
        s = serve(cache, prompt)                         # a new open works, data exact
        check_invariants(cache)
        cache.shutdown()


@pytest.mark.parametrize("failing_call", [1, 2, 3])
def test_promotion_failing_part_way_in_the_copy_kernel(failing_call, monkeypatch):
    """kernels.copy_blocks_to_gpu raises on its n-th call (one call per layer): every read
    of every layer raises TransferError (never IndexError or ShapeError), the sequence
    closes, invariants hold, and the prefix opens again once copies work."""
    cache, prompt = partial_promotion_cache()
    real = kernels.copy_blocks_to_gpu
    calls = []

    def flaky(*args, **kwargs):
        calls.append(kwargs.get("layers"))
        if len(calls) == failing_call:
            raise RuntimeError(f"injected: copy call {failing_call} fails")
        return real(*args, **kwargs)

    monkeypatch.setattr(kernels, "copy_blocks_to_gpu", flaky)
    s = cache.open(prompt)
    (readiness,) = s.pending
    wait_until(lambda: readiness.done, "the promotion to fail")
    assert readiness.ready_layers == failing_call - 1
    assert_transfer_error_on_every_layer(cache, s)
    cache.close(s)
    monkeypatch.undo()
    cache.migrator.drain()
    check_invariants(cache)
    s = serve(cache, prompt)
    assert s.num_cached_tokens == len(prompt)
    check_invariants(cache)
    cache.shutdown()


def test_synchronous_promotion_failing_part_way_leaves_nothing_behind(monkeypatch):
    """Without the migrator the promotion runs inside open(): a copy that lands layer 0 and
    then raises makes open raise TransferError, reserves nothing, and loses nothing."""
    cache = make_cache(gpu_blocks=8, host_blocks=48, num_layers=LAYERS)
    prompt = tokens(8, start=3000)
    serve(cache, prompt)
    for i in range(6):
        serve(cache, tokens(8, start=7000 + 100 * i))       # pushed to host synchronously
    real = kernels.copy_blocks_to_gpu

    def partial(src, src_slots, dst, dst_slots, *, layers=None, non_blocking=False):
        real(src, src_slots, dst, dst_slots, layers=[0], non_blocking=non_blocking)
        raise RuntimeError("injected: failed after layer 0")

    monkeypatch.setattr(kernels, "copy_blocks_to_gpu", partial)
    cached = dict(cache.index.prefix)
    with pytest.raises(TransferError, match="after layer 0"):
        cache.open(prompt)
    check_invariants(cache)
    assert not cache.open_sequences()
    assert dict(cache.index.prefix).keys() == cached.keys()
    monkeypatch.undo()
    s = serve(cache, prompt)
    assert s.num_cached_tokens == len(prompt)
    cache.shutdown()


def test_reads_of_a_failed_promotion_never_return_other_kv():
    """After a failed promotion, the device slots it reserved are reused by other requests;
    a read of the failed sequence must still never return their KV (it raises)."""
    cache, prompt = partial_promotion_cache()
    hook, _ = fail_on_call(1)
    cache.migrator.fault_hook = hook
    s = cache.open(prompt)
    (readiness,) = s.pending
    wait_until(lambda: readiness.done, "the promotion to fail")
    cache.migrator.fault_hook = None
    others = []
    for i in range(2):                                      # take whatever slots are free
        try:
            t = cache.open(tokens(8, start=20000 + 100 * i))
        except CapacityError:
            continue
        write_pattern_all(cache, t)
        others.append(t)
    for layer in range(LAYERS):
        q = query(cache, 1, seed=layer)
        try:
            out = cache.attention(q, [s], layer)
        except TransferError:
            continue
        torch.testing.assert_close(out.double(), expected_attention(cache, q, [s], layer),
                                   **ATTENTION_TOL)
        k, v = pattern_kv(cache, None, s.token_ids, 0, s.written[layer], layer)
        qp = query(cache, 2, seed=layer)
        torch.testing.assert_close(cache.prefill_attention(qp, s, layer).double(),
                                   ref_prefill_attention(qp, k, v), **ATTENTION_TOL)
    for t in others:
        check_pattern(cache, t)
        cache.close(t)
    cache.close(s)
    check_invariants(cache)
    cache.shutdown()
