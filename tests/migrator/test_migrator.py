"""Migrator and compactor: background demotion, layer-wise promotion, compaction, faults,
shutdown, and a concurrency stress run that checks every gathered byte."""

from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from tests.helpers import block_at, seq_blocks
from tiered_cache import TieredKVCache
from tiered_cache.config import CacheConfig
from tiered_cache.core.invariants import check_invariants
from tiered_cache.errors import CapacityError, PromotionTimeout, TransferError

LAYERS, HEADS, DIM, BS = 3, 1, 4, 4


def make(gpu: int, host: int, *, migrator: dict | None = None, compactor: dict | None = None,
         write_policy: str = "write_back", device: str = "auto") -> TieredKVCache:
    return TieredKVCache(CacheConfig.from_dict({
        "block_size": BS, "write_policy": write_policy,
        "model": {"num_layers": LAYERS, "num_kv_heads": HEADS, "head_dim": DIM},
        "tiers": {"gpu": {"num_blocks": gpu, "device": device}, "host": {"num_blocks": host}},
        "migrator": {"wait_timeout_s": 10.0, **(migrator or {})},
        "compactor": {"enabled": False, **(compactor or {})},
    }))


def pattern(tokens: list[int], start: int, end: int, layer: int):
    """KV of positions [start, end) derived from the whole prefix up to each position, so a
    block reused under another prefix would show up as wrong data."""
    rows = []
    h = 0
    for i, t in enumerate(tokens[:end]):
        h = (h * 31 + t + 1) % 1000
        if i >= start:
            rows.append([h + layer * 0.25 + d * 0.001 for d in range(DIM)])
    k = torch.tensor(rows, dtype=torch.float32).reshape(end - start, HEADS, DIM)
    return k, -k


def fill(cache: TieredKVCache, seq, tokens: list[int]) -> None:
    start = seq.num_cached_tokens
    for layer in range(LAYERS):
        k, v = pattern(tokens, start, len(tokens), layer)
        cache.write(seq, layer, k, v)


def check_data(cache: TieredKVCache, seq, tokens: list[int]) -> None:
    for layer in range(LAYERS):
        k, v = cache.gather(seq, layer)
        ek, ev = pattern(tokens, 0, len(tokens), layer)
        assert torch.equal(k, ek) and torch.equal(v, ev), f"layer {layer} data differs"


def cache_prompt(cache: TieredKVCache, tokens: list[int]) -> None:
    seq = cache.open(tokens)
    fill(cache, seq, tokens)
    cache.close(seq)


def push_to_host(cache: TieredKVCache, prompt: list[int], others: int, base: int) -> None:
    """Cache `prompt`, then enough other prompts of its length to push it out of the device
    tier, and wait for the migrator to settle."""
    cache_prompt(cache, prompt)
    for p in range(others):
        cache_prompt(cache, [base + p * 100 + i for i in range(len(prompt))])
    settle(cache)


def settle(cache: TieredKVCache) -> None:
    cache.migrator.drain()
    time.sleep(0.05)
    cache.migrator.drain()


def test_watermark_demotes_without_explicit_calls():
    cache = make(20, 60, migrator={"high_watermark": 0.9, "low_watermark": 0.5})
    prompts = [[p * 1000 + i for i in range(4 * BS)] for p in range(5)]   # 20 blocks
    for p in prompts:
        seq = cache.open(p)
        fill(cache, seq, p)
        cache.close(seq)
    deadline = time.monotonic() + 5
    while cache.stats()["tiers"]["gpu"]["used_blocks"] > 10 and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = cache.stats()
    assert stats["tiers"]["gpu"]["used_blocks"] <= 10          # down to the low watermark
    assert stats["demotions"] >= 10
    for p in prompts:                                          # nothing lost
        seq = cache.open(p)
        assert seq.num_cached_tokens == len(p)
        check_data(cache, seq, p)
        cache.close(seq)
    check_invariants(cache)
    cache.shutdown()


def _slow(kind_to_slow: str, delay: float):
    def hook(kind: str, attempt: int) -> None:
        if kind == kind_to_slow:
            time.sleep(delay)
    return hook


def test_promotion_lands_layer_by_layer_and_readers_wake_per_layer():
    cache = make(8, 40, migrator={"promotion_chunk_bytes": 0})   # one layer per copy
    prompt = list(range(4 * BS))
    push_to_host(cache, prompt, others=3, base=5000)
    cache.migrator.fault_hook = _slow("promotion", 0.3)
    seq = cache.open(prompt)
    assert seq.num_cached_tokens == len(prompt) and seq.cached_tokens_by_tier["host"] >= BS
    (readiness,) = seq.pending
    t0 = time.perf_counter()
    cache.wait(seq, 0)
    first = time.perf_counter() - t0
    assert readiness.ready_layers < LAYERS                     # later layers still copying
    cache.wait(seq, LAYERS - 1)
    last = time.perf_counter() - t0
    assert first < last and last >= 0.3 * (LAYERS - 1)
    cache.migrator.fault_hook = None
    check_data(cache, seq, prompt)
    # A second sequence on the same prefix reuses the in-flight promotion: no second copy.
    promotions = cache.stats()["promotions"]
    seq2 = cache.open(prompt)
    assert cache.stats()["promotions"] == promotions
    cache.close(seq)
    cache.close(seq2)
    settle(cache)
    check_invariants(cache)
    cache.shutdown()


def test_wait_timeout_raises_clearly():
    cache = make(8, 40, migrator={"wait_timeout_s": 0.05, "promotion_chunk_bytes": 0})
    prompt = list(range(2 * BS))
    push_to_host(cache, prompt, others=4, base=7000)
    cache.migrator.fault_hook = _slow("promotion", 0.5)
    seq = cache.open(prompt)
    if seq.pending:
        with pytest.raises(PromotionTimeout, match="did not land"):
            cache.wait(seq, LAYERS - 1)
    cache.migrator.fault_hook = None
    cache.close(seq)
    cache.shutdown()
    check_invariants(cache)


def test_failed_demotion_keeps_block_valid_and_is_counted():
    cache = make(10, 40, migrator={"high_watermark": 0.5, "low_watermark": 0.2,
                                   "max_retries": 1})

    def fail(kind: str, attempt: int) -> None:
        if kind == "demotion":
            raise OSError("injected copy failure")
    cache.migrator.fault_hook = fail
    prompt = list(range(3 * BS))
    seq = cache.open(prompt)
    fill(cache, seq, prompt)
    cache.close(seq)
    other = [900 + i for i in range(3 * BS)]
    seq = cache.open(other)                                    # usage 6/10 > 0.5
    fill(cache, seq, other)
    cache.close(seq)
    deadline = time.monotonic() + 5
    while cache.stats()["transfer_failures"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    cache.migrator.fault_hook = None
    settle(cache)
    stats = cache.stats()
    assert stats["transfer_failures"] >= 1 and stats["transfer_retries"] >= 1
    seq = cache.open(prompt)                                   # still cached, data intact
    assert seq.num_cached_tokens == len(prompt)
    check_data(cache, seq, prompt)
    cache.close(seq)
    check_invariants(cache)
    cache.shutdown()


def test_failed_promotion_raises_and_host_copy_stays_valid():
    cache = make(8, 40, migrator={"max_retries": 0})
    prompt = list(range(2 * BS))
    push_to_host(cache, prompt, others=4, base=3000)

    def fail(kind: str, attempt: int) -> None:
        if kind == "promotion":
            raise OSError("injected promotion failure")
    cache.migrator.fault_hook = fail
    seq = cache.open(prompt)
    assert seq.cached_tokens_by_tier["host"] > 0
    with pytest.raises(TransferError, match="injected promotion failure"):
        cache.wait(seq, 0)
    cache.close(seq)
    cache.migrator.fault_hook = None
    settle(cache)
    check_invariants(cache)
    seq = cache.open(prompt)                                   # retried by the next open
    check_data(cache, seq, prompt)
    cache.close(seq)
    cache.shutdown()


def test_a_fault_before_the_copy_still_fails_the_waiters_and_commits(monkeypatch):
    """An exception while the worker prepares a promotion batch (here: grouping its plan) is
    logged and counted, its readers hear of it at once (no wait for the timeout), and the
    blocks leave flight: the next open promotes them again."""
    from tiered_cache.migrator import worker

    cache = make(8, 40, migrator={"max_retries": 0, "wait_timeout_s": 30.0})
    prompt = list(range(2 * BS))
    push_to_host(cache, prompt, others=4, base=3000)

    def broken(transfers):
        raise RuntimeError("injected grouping failure")
    monkeypatch.setattr(worker, "GroupedPlan", broken)
    errors = sum(cache.health.errors.values())
    seq = cache.open(prompt)
    assert seq.cached_tokens_by_tier["host"] > 0
    t0 = time.perf_counter()
    with pytest.raises(TransferError, match="injected grouping failure"):
        cache.wait(seq, 0)
    assert time.perf_counter() - t0 < 10                       # told, not timed out
    cache.close(seq)
    monkeypatch.undo()
    settle(cache)
    assert sum(cache.health.errors.values()) > errors
    check_invariants(cache)
    seq = cache.open(prompt)                                   # promoted again
    check_data(cache, seq, prompt)
    cache.close(seq)
    cache.shutdown()


def test_write_through_copies_in_background():
    cache = make(16, 40, write_policy="write_through")
    prompt = list(range(3 * BS))
    seq = cache.open(prompt)
    fill(cache, seq, prompt)
    settle(cache)
    assert cache.stats()["write_through_blocks"] == 3
    cache.close(seq)
    check_invariants(cache)
    cache.shutdown()


def test_compaction_reduces_fragmentation_and_keeps_data():
    cache = make(40, 0, migrator={"enabled": False},
                 compactor={"enabled": False, "threshold": 0.1})
    prompts = [[p * 100 + i for i in range(2 * BS)] for p in range(16)]   # 32 blocks
    for p in prompts:
        seq = cache.open(p)
        fill(cache, seq, p)
        cache.close(seq)
    for p in prompts[::2]:                                     # holes below the top
        cache.invalidate(p)
    gpu = cache.tiers[0]
    assert gpu.allocator.fragmentation() > 0.5
    from tiered_cache.migrator import Compactor

    compactor = Compactor(cache.index, cache.executor, cache.config.compactor, start=False)
    moved = compactor.compact(0)
    assert moved > 0
    assert gpu.allocator.fragmentation() <= 0.1
    check_invariants(cache)
    for p in prompts[1::2]:
        seq = cache.open(p)
        assert seq.num_cached_tokens == len(p)
        check_data(cache, seq, p)
        cache.close(seq)
    assert cache.stats()["lock_hold"]["count"] > 0
    cache.shutdown()


def test_shutdown_with_copies_in_flight_loses_nothing():
    cache = make(8, 40)
    prompt = list(range(2 * BS))
    push_to_host(cache, prompt, others=4, base=4000)
    cache.migrator.fault_hook = _slow("promotion", 0.05)
    seq = cache.open(prompt)
    assert seq.pending                                         # a promotion is in flight
    cache.shutdown()                                           # finishes the promotion
    assert not cache.open_sequences()
    check_invariants(cache)
    assert all(t.pinned_blocks == 0 for t in cache.tiers)
    assert cache.index.prefix                                  # blocks are still cached


def stress_api(cache, seed: int, stop: float, errors: list[BaseException]) -> None:
    """One API thread of the stress tests: random open/write/append/gather/invalidate/close
    until `stop`, every gather checked against the pattern of its tokens; an exception is
    appended to `errors` for the main thread to report."""
    alphabet = [1, 2, 3]
    rng = random.Random(seed)
    try:
        while time.monotonic() < stop:
            tokens = [rng.choice(alphabet) for _ in range(rng.randrange(1, 5 * BS))]
            try:
                seq = cache.open(tokens, salt=rng.choice([None, "t1"]))
            except CapacityError:
                continue
            fill(cache, seq, tokens)
            if rng.random() < 0.5:
                extra = [rng.choice(alphabet) for _ in range(rng.randrange(1, BS + 2))]
                try:
                    cache.append(seq, extra)
                except CapacityError:
                    extra = []
                if extra:
                    whole = tokens + extra
                    for layer in range(LAYERS):
                        k, v = pattern(whole, len(tokens), len(whole), layer)
                        cache.write(seq, layer, k, v)
                    tokens = whole
            check_data(cache, seq, tokens)
            if rng.random() < 0.05:
                cache.invalidate(tokens[:BS], salt=seq.salt)
            cache.close(seq)
    except BaseException as exc:  # noqa: BLE001 - reported by the main thread
        errors.append(exc)


def test_concurrent_stress_with_migrator_and_compactor():
    cache = make(24, 48, migrator={"high_watermark": 0.75, "low_watermark": 0.5},
                 compactor={"enabled": True, "threshold": 0.2, "interval_s": 0.005})
    errors: list[BaseException] = []
    stop = time.monotonic() + 3.0
    threads = [threading.Thread(target=stress_api, args=(cache, i, stop, errors))
               for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    settle(cache)
    check_invariants(cache)
    assert all(t.pinned_blocks == 0 for t in cache.tiers)
    stats = cache.stats()
    assert stats["hit_tokens"] > 0 and stats["demotions"] > 0
    cache.shutdown()
    check_invariants(cache)


def test_watermark_demotion_moves_whole_chains_as_contiguous_runs():
    """Only leaves are candidates, yet a chain leaves in one batch (parents ride along once all
    their device children leave) and lands in ascending host slots: one large copy."""
    cache = make(40, 80, migrator={"high_watermark": 0.5, "low_watermark": 0.1,
                                   "batch_blocks": 64})
    prompt = list(range(8 * BS))
    seq = cache.open(prompt)
    fill(cache, seq, prompt)
    cache.close(seq)
    other = [5000 + i for i in range(14 * BS)]                 # 22/40 blocks > 50%
    seq = cache.open(other)
    fill(cache, seq, other)
    cache.close(seq)
    deadline = time.monotonic() + 5
    while cache.stats()["tiers"]["gpu"]["used_blocks"] > 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    settle(cache)
    with cache.locked():
        chain = [block_at(cache, k) for k in keys_of(cache, prompt)]
        host = [b.slots[1] for b in chain]
    assert all(s >= 0 for s in host)
    assert host == list(range(host[0], host[0] + len(host)))     # one contiguous run
    seq = cache.open(prompt)
    check_data(cache, seq, prompt)
    cache.close(seq)
    check_invariants(cache)
    cache.shutdown()


def keys_of(cache: TieredKVCache, tokens: list[int]) -> list[bytes]:
    import numpy as np

    root, _ = cache.hasher.root(None, None)
    data = np.asarray(tokens, dtype=np.int32).tobytes()
    keys, key = [], root
    for i in range(len(tokens) // BS):
        key = cache.hasher.key(key, data[i * BS * 4:(i + 1) * BS * 4])
        keys.append(key)
    return keys


def test_synchronous_moves_roll_back_a_failed_copy(monkeypatch):
    """Without the migrator, promotion and write-through run the same plan/commit in line: a
    failed copy raises TransferError, frees what it reserved and leaves the blocks valid."""
    from tiered_cache import kernels
    from tiered_cache.errors import TransferError

    cache = make(8, 40, migrator={"enabled": False}, write_policy="write_through")
    prompt = list(range(2 * BS))
    cache_prompt(cache, prompt)
    for p in range(4):                                          # push the prompt to host
        cache_prompt(cache, [6000 + p * 100 + i for i in range(2 * BS)])
    cached = set(cache.index.prefix)

    def broken(*args, **kwargs):
        raise OSError("injected")
    monkeypatch.setattr(kernels, "copy_blocks_to_gpu", broken)
    with pytest.raises(TransferError, match="injected"):
        cache.open(prompt)
    check_invariants(cache)
    # Room was made first (blocks that also had a host copy left the device), but nothing
    # cached was lost and the reserved device slots were given back (invariants: no leak).
    assert set(cache.index.prefix) == cached
    monkeypatch.undo()
    seq = cache.open(prompt)                                    # works once copies do
    assert seq.cached_tokens_by_tier["host"] > 0
    check_data(cache, seq, prompt)
    cache.close(seq)

    monkeypatch.setattr(kernels, "copy_blocks_to_host", broken)
    fresh = [9000 + i for i in range(BS)]
    seq = cache.open(fresh)
    failures = cache.stats()["transfer_failures"]
    fill(cache, seq, fresh)         # the write-through copy fails: not an error for the write
    assert cache.stats()["transfer_failures"] == failures + 1
    assert cache.stats()["write_through_blocks"] == 0 or all(
        b.slots[1] == -1 for b in seq_blocks(cache, seq))     # no host copy was recorded
    monkeypatch.undo()
    check_invariants(cache)
    check_data(cache, seq, fresh)                               # the device copy is intact
    cache.close(seq)
    check_invariants(cache)
    cache.shutdown()


def test_demotion_batches_of_one_long_chain_pipeline_in_chain_order():
    """While a batch of a chain is in flight its parents are not candidates yet; the next
    batch starts from them anyway (moves._chain_tops), and committing in batch order keeps
    leaves leaving first."""
    from tiered_cache.core import moves

    cache = make(16, 32, migrator={"enabled": False})
    prompt = list(range(12 * BS))
    cache_prompt(cache, prompt)
    idx = cache.index
    with cache.locked():
        chain = [block_at(cache, k) for k in keys_of(cache, prompt)]
        first = moves.plan_demotion(idx, 0, 1, 4)
        assert {t.block for t in first} == {b.id for b in chain[8:]}
        second = moves.plan_demotion(idx, 0, 1, 4, after=first)
        assert {t.block for t in second} == {b.id for b in chain[4:8]}
        assert cache.tiers[0].policy.victims(1) == []      # nothing else is evictable now
    for batch in (first, second):
        cache.executor.run(batch)
        moves.commit_demotion(idx, batch, True)
        check_invariants(cache)
    assert all(b.slots[0] == -1 and b.slots[1] >= 0 for b in chain[4:])
    seq = cache.open(prompt)
    assert seq.num_cached_tokens == len(prompt)
    check_data(cache, seq, prompt)
    cache.close(seq)
    cache.shutdown()


def test_the_demoter_queues_the_next_batch_behind_the_one_copying():
    """Two demotion batches in flight: the next is planned and queued while one copies (the
    copier never waits for the demoter's commit); each is committed once, in order, by its
    own outcome: a failed first batch leaves its blocks where they were (planned again once
    it is committed), the second moves."""
    from concurrent.futures import ThreadPoolExecutor

    cache = make(16, 64, migrator={"high_watermark": 0.5, "low_watermark": 0.1,
                                   "batch_blocks": 2})
    try:
        prompts = [[i * 100 + j for j in range(2 * BS)] for i in range(6)]
        mig = cache.migrator
        mig.stop()                                  # the rounds by hand below
        for p in prompts:                           # 12 of 16 device blocks
            cache_prompt(cache, p)
        mig._stop.clear()
        mig._lowering[0] = True
        submitted: list[list] = []
        copier = ThreadPoolExecutor(max_workers=1)
        real_submit = copier.submit

        def submit(fn, plan):
            submitted.append(plan)
            return real_submit(fn, plan)
        copier.submit = submit
        seen: list[int] = []

        def copy(plan):
            if not seen:                            # the first waits for the second to queue
                deadline = time.monotonic() + 10
                while len(submitted) < 2 and time.monotonic() < deadline:
                    time.sleep(0.001)
            seen.append(len(submitted))
            if len(seen) == 1:
                return TransferError("injected failure of the first batch")
            cache.executor.run(plan)
            return None
        mig._demote_round(0, copier, copy)
        copier.shutdown()
        assert seen[0] == 2, "the second batch was not queued while the first copied"
        first = {t.block for t in submitted[0]}
        moved = [t.block for plan in submitted[1:] for t in plan]
        assert len(set(moved)) == len(moved), "a block was in two batches in flight"
        assert not first & {t.block for t in submitted[1]}
        assert first <= set(moved), "the failed batch's blocks were not demoted later"
        assert cache.stats()["demotions"] == len(moved)
        assert cache.tiers[0].used_blocks <= 0.1 * 16 + 2
        mig._stop.set()
        check_invariants(cache)
        for p in prompts:                           # every prompt whole, wherever it is
            seq = cache.open(p)
            assert seq.num_cached_tokens == len(p)
            check_data(cache, seq, p)
            cache.close(seq)
        check_invariants(cache)
    finally:
        cache.shutdown()


@pytest.mark.parametrize("cap, floor, used, demand, batch, want", [
    # a small tier: the watermarks leave 2 free (8 at 0.9/0.8) for 2-block requests: keep 4
    (8, 6, 5, 2, 64, (4, True)),
    (8, 6, 4, 2, 64, (4, False)),
    (8, 6, 8, 2, 1, (5, True)),         # at most one batch below the low watermark
    # watermarks that already leave two requests' worth, or requests too big to help
    (1000, 800, 950, 64, 64, (800, False)),
    (8, 6, 8, 3, 64, (6, False)),       # 2 x 3 > 8 // 2: one request is most of the tier
    (65536, 52428, 65000, 62500, 64, (52428, False)),     # a 1M-token prompt
    (8, 6, 8, 0, 64, (6, False)),       # nothing allocated yet
])
def test_the_device_demoter_keeps_room_for_two_requests_in_a_small_tier(
        cap, floor, used, demand, batch, want):
    """(Regression: with an 8-block device tier the demoter started only once the tier was
    full and freed 2 blocks, so about half of back-to-back 2-block requests evicted
    synchronously.)"""
    from tiered_cache.migrator.worker import _headroom

    assert _headroom(cap, floor, used, demand, batch) == want


def test_a_small_device_tier_pokes_the_demoter_before_it_is_full():
    """The allocation that leaves less than two recent requests' worth free asks the
    demoter to run, below the high watermark too."""
    pokes = []
    cache = make(8, 16, migrator={"enabled": False})
    try:
        cache.index.space.on_pressure = lambda: pokes.append(1)
        for i in range(3):                          # 2 blocks each: 6 of 8 used, 2 free
            cache_prompt(cache, [i * 100 + j for j in range(2 * BS)])
        assert cache.index.space.demand == 2
        assert pokes and cache.tiers[0].used_blocks <= 0.9 * 8
    finally:
        cache.shutdown()


def test_no_demotion_batch_starts_while_a_request_waits_for_copies():
    """A request waiting for copies under way to end (core/eviction.py `wait_for_copies`)
    keeps the demoters from starting new batches: otherwise each new batch of the very blocks
    it is about to pin would keep it waiting, round after round."""
    cache = make(8, 16, migrator={"high_watermark": 0.5, "low_watermark": 0.25})
    try:
        cache.migrator.stop()                       # the demoter's rounds, by hand below
        for i in range(4):                          # 8 of 8 device blocks used
            cache_prompt(cache, [i * 100 + j for j in range(2 * BS)])
        mig, space = cache.migrator, cache.index.space
        with cache.locked():
            space.waiting += 1
        try:
            mig._lowering[0] = False
            assert mig._plan_demotion(0, []) is None
        finally:
            with cache.locked():
                space.waiting -= 1
        plan = mig._plan_demotion(0, [])
        assert plan                                 # above the watermark: a batch
        from tiered_cache.core import moves

        moves.commit_demotion(cache.index, plan, False)
    finally:
        cache.shutdown()
