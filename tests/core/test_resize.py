"""cache.resize: online grow and shrink of a tier, data kept, bad input refused, rollback."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tests.migrator.test_migrator import BS, cache_prompt, check_data, fill, settle, stress_api
from tests.migrator.test_migrator import make as make_on
from tiered_cache import TieredKVCache
from tiered_cache.config import CacheConfig
from tiered_cache.core.eviction import Space
from tiered_cache.core.invariants import check_invariants
from tiered_cache.errors import ArgumentError, CapacityError, TierUnavailableError


def make(gpu: int, host: int, **kw) -> TieredKVCache:
    """The device tier in CPU memory, so it is resizable on a GPU machine too (a CUDA device
    pool has a fixed size: test_cuda_device_pool_refuses_to_resize)."""
    return make_on(gpu, host, device="cpu", **kw)


def filled(gpu: int, host: int, n: int) -> tuple[TieredKVCache, list[list[int]]]:
    """A cache without migrator holding `n` cached 2-block prompts, and the prompts."""
    cache = make(gpu, host, migrator={"enabled": False})
    ps = prompts(n)
    for p in ps:
        cache_prompt(cache, p)
    return cache, ps


def prompts(n: int, blocks: int = 2, base: int = 0) -> list[list[int]]:
    return [[base + p * 1000 + i for i in range(blocks * BS)] for p in range(n)]


def cached_tokens(cache: TieredKVCache, tokens: list[int], check: bool = True) -> int:
    seq = cache.open(tokens)
    got = seq.num_cached_tokens
    if check and got == len(tokens):
        check_data(cache, seq, tokens)
    cache.close(seq)
    return got


def test_shrink_then_grow_keeps_data_and_frees_segments():
    cache = make(8, 64, migrator={"enabled": False})
    host = cache.tiers[1]
    cfg = cache.config.tiers.host
    assert cfg.segment_blocks is None
    ps = prompts(14)                             # 28 blocks: most go to the host tier
    for p in ps:
        cache_prompt(cache, p)
    before = sum(cached_tokens(cache, p, check=False) == len(p) for p in ps)
    assert host.allocator.highest_used() >= 16
    pool = cache.pools[1]
    segments = pool._segmented[0][1]
    backed = segments.backed_segments

    assert cache.resize("host", 40) == 40        # everything still fits: nothing is lost
    check_invariants(cache)
    assert host.capacity_blocks == 40 and pool.kv.shape[0] == 40
    assert host.allocator.highest_used() < 40
    assert segments.backed_slots >= 40 and segments.backed_segments <= backed
    after = sum(cached_tokens(cache, p) == len(p) for p in ps)
    assert after == before

    assert cache.resize("host", 200) == 200      # grow back, and past the start
    check_invariants(cache)
    assert pool.kv.shape[0] == 200 and host.allocator.num_free > 150
    for p in prompts(40, base=10**6):            # the new slots are used
        cache_prompt(cache, p)
    assert host.allocator.num_used > 64
    for p in ps[-4:]:
        assert cached_tokens(cache, p) in (0, len(p))
    check_invariants(cache)
    cache.shutdown()


def test_shrink_evicts_by_policy_when_the_rest_does_not_fit():
    cache = make(12, 0, migrator={"enabled": False})
    ps = prompts(6)                              # 12 blocks: the tier is full
    for p in ps:
        cache_prompt(cache, p)
    cached_tokens(cache, ps[0])                  # ps[0] is now the most recent
    cache.resize("gpu", 4)
    check_invariants(cache)
    gpu = cache.tiers[0]
    assert gpu.capacity_blocks == 4 and gpu.allocator.num_used == 4
    assert cached_tokens(cache, ps[0]) == len(ps[0])     # LRU kept the recent prompt
    assert cached_tokens(cache, ps[1]) == 0
    cache.shutdown()


def test_shrinking_the_device_tier_demotes_to_host():
    cache, ps = filled(12, 40, 6)
    cache.resize("gpu", 4)
    check_invariants(cache)
    assert cache.stats()["demotions"] >= 8
    for p in ps:                                 # all of them, from one tier or the other
        assert cached_tokens(cache, p) == len(p)
    cache.shutdown()


def test_pinned_tail_blocks_time_out_and_leave_the_tier_as_it_was():
    cache, ps = filled(12, 0, 6)
    gpu = cache.tiers[0]
    top = gpu.owner[gpu.allocator.highest_used()]

    def holds_top(p: list[int]) -> bool:
        s = cache.open(p)
        inside = top in s.blocks
        cache.close(s)
        return inside

    held = next(p for p in ps if holds_top(p))
    seq = cache.open(held)                       # pins the block in the highest slot
    with pytest.raises(CapacityError, match="cannot shrink to 2 blocks within the timeout"):
        cache.resize("gpu", 2, timeout=0.1)
    check_invariants(cache)
    assert gpu.capacity_blocks == 12 and gpu.allocator.num_slots == 12
    assert gpu.allocator.num_free + gpu.allocator.num_used == 12
    check_data(cache, seq, held)
    cache.close(seq)
    cache.resize("gpu", 2)                        # unpinned now: the shrink goes through
    check_invariants(cache)
    assert gpu.capacity_blocks == 2
    cache.shutdown()


def test_a_shrink_waits_for_a_sequence_that_closes_meanwhile():
    cache, ps = filled(12, 0, 6)
    seqs = [cache.open(p) for p in ps]           # every block pinned
    closer = threading.Timer(0.1, lambda: [cache.close(s) for s in seqs])
    closer.start()
    cache.resize("gpu", 4, timeout=10.0)
    closer.join()
    check_invariants(cache)
    assert cache.tiers[0].capacity_blocks == 4
    cache.shutdown()


@pytest.mark.parametrize("bad, error, match", [
    (("cpu", 4), TierUnavailableError, "no tier named 'cpu'"),
    (("disk", 10), TierUnavailableError, "no tier named 'disk'"),
    (("gpu", 0), ArgumentError, "at least 1"),
    (("gpu", -3), ArgumentError, "at least 1"),
    (("gpu", 10**400), ArgumentError, "at most"),
    (("gpu", 4.0), ArgumentError, "num_blocks must be an int"),
    (("gpu", True), ArgumentError, "num_blocks must be an int"),
    (("gpu", "8"), ArgumentError, "num_blocks must be an int"),
    (("host", "lots"), ArgumentError, "num_blocks must be an int"),
])
def test_bad_input_is_refused_and_changes_nothing(bad, error, match):
    cache = make(8, 16, migrator={"enabled": False})
    cache_prompt(cache, prompts(1)[0])
    with pytest.raises(error, match=match):
        cache.resize(*bad)
    with pytest.raises(ArgumentError, match="timeout must be > 0"):
        cache.resize("gpu", 4, timeout=0)
    check_invariants(cache)
    assert cache.tiers[0].capacity_blocks == 8
    assert cached_tokens(cache, prompts(1)[0]) == 2 * BS
    cache.shutdown()


def test_growth_past_max_num_blocks_or_memory_is_refused(monkeypatch):
    cache = TieredKVCache(CacheConfig.from_dict({
        "block_size": BS, "model": {"num_layers": 3, "num_kv_heads": 1, "head_dim": 4},
        "tiers": {"gpu": {"num_blocks": 8, "max_num_blocks": 16},
                  "host": {"num_blocks": 16}},
        "migrator": {"enabled": False}, "compactor": {"enabled": False}}))
    with pytest.raises(CapacityError, match="exceed max_num_blocks 16"):
        cache.resize("gpu", 17)
    assert cache.resize("gpu", 16) == 16
    monkeypatch.setattr("tiered_cache.data.pools._available_bytes", lambda device: 1000)
    with pytest.raises(CapacityError, match="more bytes of memory but only 1,000"):
        cache.resize("host", 10_000)
    check_invariants(cache)
    assert cache.tiers[1].capacity_blocks == 16 and cache.pools[1].kv.shape[0] == 16
    cache.shutdown()


def test_fixed_pools_refuse_to_resize():
    cache = make(8, 16, migrator={"enabled": False})
    pool = cache.pools[0]
    pool._segmented, pool._fixed_reason = [], "a CUDA device pool is allocated once"
    with pytest.raises(TierUnavailableError, match="fixed size"):
        cache.resize("gpu", 12)
    assert cache.tiers[0].capacity_blocks == 8
    cache.shutdown()


def test_resize_without_storage_moves_metadata_only():
    cache = TieredKVCache(CacheConfig.from_dict({
        "block_size": BS, "storage": "none",
        "tiers": {"gpu": {"num_blocks": 16}, "host": {"num_blocks": 0}}}))
    for p in prompts(8):
        seq = cache.open(p)
        cache.mark_computed(seq)
        cache.close(seq)
    cache.resize("gpu", 6)
    check_invariants(cache)
    cache.resize("gpu", 30)
    check_invariants(cache)
    assert cache.tiers[0].capacity_blocks == 30 and len(cache.index.prefix) == 6


def test_shrink_then_grow_while_the_migrator_compactor_and_api_threads_run():
    cache = make(24, 48, migrator={"high_watermark": 0.75, "low_watermark": 0.5},
                 compactor={"enabled": True, "threshold": 0.2, "interval_s": 0.005})
    errors: list[BaseException] = []
    stop = time.monotonic() + 2.0

    threads = [threading.Thread(target=stress_api, args=(cache, i, stop, errors))
               for i in range(2)]
    for t in threads:
        t.start()
    sizes = [("host", 20), ("gpu", 16), ("host", 64), ("gpu", 32), ("host", 24), ("gpu", 20)]
    while time.monotonic() < stop:
        for tier, n in sizes:
            try:
                cache.resize(tier, n, timeout=1.0)
            except CapacityError:
                pass                                  # pinned by a reader: tried again later
    for t in threads:
        t.join()
    assert not errors, errors[0]
    settle(cache)
    check_invariants(cache)
    assert all(t.pinned_blocks == 0 for t in cache.tiers)
    for t, pool in zip(cache.tiers, cache.pools):
        assert pool.num_slots == t.allocator.num_slots == t.capacity_blocks
    seq = cache.open([1, 2, 3, 1] * 2)
    fill(cache, seq, [1, 2, 3, 1] * 2)
    check_data(cache, seq, [1, 2, 3, 1] * 2)
    cache.close(seq)
    cache.shutdown()


@pytest.mark.parametrize("policy", ["lru", "lfu", "arc", "s3fifo", "cost_aware", "reuse_credit",
                                    "class_credit"])
def test_every_policy_follows_the_new_capacity(policy):
    cache = TieredKVCache(CacheConfig.from_dict({
        "block_size": BS, "storage": "none", "policy": policy,
        "tiers": {"gpu": {"num_blocks": 20}, "host": {"num_blocks": 0}}}))

    def serve(ps: list[list[int]]) -> None:
        for p in ps:
            seq = cache.open(p)
            cache.mark_computed(seq)
            cache.close(seq)

    serve(prompts(10) * 2)
    cache.resize("gpu", 8)
    assert cache.tiers[0].policy.capacity_blocks == 8
    check_invariants(cache)
    serve(prompts(12, base=10**5))
    cache.resize("gpu", 32)
    assert cache.tiers[0].policy.capacity_blocks == 32
    serve(prompts(14, base=10**6) * 2)
    check_invariants(cache)
    assert cache.tiers[0].allocator.num_used == 32          # the grown tier fills up


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_device_pool_refuses_to_resize_and_pinned_host_resizes():
    cache = make_on(8, 16, migrator={"enabled": False}, device="cuda")
    with pytest.raises(TierUnavailableError, match="fixed size"):
        cache.resize("gpu", 12)
    assert cache.pools[1].memory == "pinned" and cache.pools[1].kv.is_pinned()
    cache_prompt(cache, prompts(1)[0])
    cache.resize("host", 64)
    assert cache.pools[1].kv.is_pinned()
    ps = prompts(12, base=10**5)
    for p in ps:
        cache_prompt(cache, p)                   # demotions into the grown pinned segments
    cache.resize("host", 4)
    check_invariants(cache)
    for p in ps[-2:]:
        assert cached_tokens(cache, p) in (0, len(p))
    cache.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_resizable_cuda_device_pool_grows_and_shrinks_with_data_intact():
    pytest.importorskip("cuda.bindings", reason="needs the cuda extra (cuda-python)")
    cache = TieredKVCache(CacheConfig.from_dict({
        "block_size": BS, "model": {"num_layers": 3, "num_kv_heads": 1, "head_dim": 4},
        "tiers": {"gpu": {"device": "cuda", "num_blocks": 16, "resizable": True,
                          "max_num_blocks": 4096},
                  "host": {"num_blocks": 64}},
        "migrator": {"enabled": False}, "compactor": {"enabled": False}}))
    gpu = cache.tiers[0]
    assert cache.pools[0].resizable and cache.pools[0].kv.is_cuda
    ps = prompts(6)
    for p in ps:
        cache_prompt(cache, p)
    cache.resize("gpu", 2048)
    for p in ps:
        assert cached_tokens(cache, p) == len(p)
    more = prompts(200, base=10**6)
    for p in more:
        cache_prompt(cache, p)
    assert gpu.allocator.num_used > 16
    cache.resize("gpu", 8)
    check_invariants(cache)
    for p in ps + more[-3:]:
        assert cached_tokens(cache, p) in (0, len(p))
    cache.shutdown()


def test_a_large_shrink_evicts_in_bounded_rounds(monkeypatch):
    """Each lock hold of a shrink evicts at most _MOVES_PER_ROUND blocks."""
    from tiered_cache.core import resize as resize_mod

    monkeypatch.setattr(resize_mod, "_MOVES_PER_ROUND", 8)
    cache = make(60, 0, migrator={"enabled": False})
    for p in prompts(30):
        cache_prompt(cache, p)
    gpu = cache.tiers[0]
    rounds: list[int] = []
    real = Space.evict

    def counting(space, t, n, need=None):
        before = gpu.evictions
        real(space, t, n, need=need)
        rounds.append(gpu.evictions - before)

    # NOTE: on the class: the index's parts have no instance __dict__ (core/state.py).
    monkeypatch.setattr(Space, "evict", counting)
    cache.resize("gpu", 4)
    check_invariants(cache)
    assert len(rounds) >= 7 and max(rounds) <= 8 and sum(rounds) == 56
    cache.shutdown()


def test_shrinking_the_device_tier_with_the_migrator_demotes_in_the_background(monkeypatch):
    cache = make(24, 64, migrator={"high_watermark": 0.9, "low_watermark": 0.8})
    ps = prompts(12)                              # 24 blocks: the tier is full
    for p in ps:
        cache_prompt(cache, p)
    settle(cache)
    with monkeypatch.context() as m:              # no eviction (and copy) under the lock
        m.setattr(Space, "evict", lambda *a, **k: pytest.fail("synchronous eviction"))
        cache.resize("gpu", 6, timeout=10.0)
    settle(cache)
    check_invariants(cache)
    gpu = cache.tiers[0]
    assert gpu.capacity_blocks == 6 and gpu.allocator.num_used <= 6
    for p in ps:                                  # nothing lost: the rest went to host
        assert cached_tokens(cache, p) == len(p)
    cache.shutdown()
