"""Prometheus metrics: `tiered_cache_*` families read from the cache at scrape time, into the
registry the caller passes in."""

from __future__ import annotations

import re

import prometheus_client
import torch
from prometheus_client import CollectorRegistry, generate_latest

from tests.helpers import (
    make_cache,
    tokens,
    write_random,
)


def value(registry, name, **labels):
    return registry.get_sample_value(name, labels or None)


def request(cache, prompt, g):
    s = cache.open(prompt)
    if cache.has_storage:
        write_random(cache, s, g)
    else:
        cache.mark_computed(s)
    cache.close(s)
    return s


def test_metrics_after_traffic():
    registry = CollectorRegistry()
    cache = make_cache(registry=registry, gpu_blocks=4, host_blocks=8)
    g = torch.Generator().manual_seed(0)
    p = tokens(9, start=10)                               # 2 full blocks + 1
    request(cache, p, g)                                  # miss
    request(cache, p, g)                                  # 8 tokens from gpu
    request(cache, tokens(16, start=500), g)              # fills gpu: p demoted to host
    s = request(cache, p, g)                              # 8 tokens from host
    assert s.cached_tokens_by_tier == {"gpu": 0, "host": 8}
    held = cache.open(tokens(4, start=900))               # one open sequence, pinned

    st = cache.stats()
    assert value(registry, "tiered_cache_query_tokens_total") == 9 + 9 + 16 + 9 + 4
    assert value(registry, "tiered_cache_hit_tokens_total", tier="gpu") == 8
    assert value(registry, "tiered_cache_hit_tokens_total", tier="host") == 8
    assert value(registry, "tiered_cache_migrated_blocks_total", direction="demotion") == \
        st["demotions"] >= 2
    assert value(registry, "tiered_cache_migrated_blocks_total", direction="promotion") == 2
    assert value(registry, "tiered_cache_migrated_blocks_total", direction="write_through") == 0
    assert value(registry, "tiered_cache_migrated_bytes_total", direction="promotion") == \
        2 * cache.block_bytes
    assert value(registry, "tiered_cache_migrated_bytes_total", direction="demotion") == \
        st["demotions"] * cache.block_bytes
    for tier in ("gpu", "host"):
        t = st["tiers"][tier]
        assert value(registry, "tiered_cache_evictions_total", tier=tier) == t["evictions"]
        assert value(registry, "tiered_cache_capacity_blocks", tier=tier) == t["capacity_blocks"]
        assert value(registry, "tiered_cache_used_blocks", tier=tier) == t["used_blocks"]
        assert value(registry, "tiered_cache_pinned_blocks", tier=tier) == t["pinned_blocks"]
    assert value(registry, "tiered_cache_capacity_blocks", tier="gpu") == 4
    assert value(registry, "tiered_cache_capacity_blocks", tier="host") == 8
    assert value(registry, "tiered_cache_pinned_blocks", tier="gpu") == 1
    assert value(registry, "tiered_cache_evictions_total", tier="gpu") >= 2
    assert value(registry, "tiered_cache_cached_blocks") == st["cached_blocks"]
    assert value(registry, "tiered_cache_open_sequences") == 1
    assert value(registry, "tiered_cache_hash_collisions_total") == 0
    assert value(registry, "tiered_cache_lookup_seconds_count") == 5
    assert value(registry, "tiered_cache_lookup_seconds_sum") > 0
    assert value(registry, "tiered_cache_lock_hold_seconds_count") > 0

    text = generate_latest(registry).decode()
    assert re.search(r"^# TYPE tiered_cache_query_tokens(_total)? counter$", text, re.M)
    assert "tiered_cache_query_tokens_total 47.0" in text
    assert 'tiered_cache_hit_tokens_total{tier="gpu"} 8.0' in text
    assert 'tiered_cache_hit_tokens_total{tier="host"} 8.0' in text
    assert "# TYPE tiered_cache_used_blocks gauge" in text
    assert "# TYPE tiered_cache_lookup_seconds histogram" in text
    names = {m.name for m in registry.collect()}
    assert names and all(n.startswith("tiered_cache_") for n in names)
    cache.close(held)
    assert value(registry, "tiered_cache_open_sequences") == 0
    assert value(registry, "tiered_cache_pinned_blocks", tier="gpu") == 0


def test_counters_are_monotonic_and_live():
    registry = CollectorRegistry()
    cache = make_cache(registry=registry, storage="none", gpu_blocks=8, host_blocks=0)
    assert value(registry, "tiered_cache_query_tokens_total") == 0
    assert value(registry, "tiered_cache_hit_tokens_total", tier="host") is None  # no host tier
    g = torch.Generator()
    counters = ("tiered_cache_query_tokens_total", "tiered_cache_lookup_seconds_count")
    last = {c: 0.0 for c in counters}
    last_hits = 0.0
    for i in range(12):
        request(cache, tokens(8, start=100 * (i % 3)), g)   # 3 prompts x 2 blocks fit
        for c in counters:
            v = value(registry, c)
            assert v > last[c]
            last[c] = v
        hits = value(registry, "tiered_cache_hit_tokens_total", tier="gpu")
        assert hits >= last_hits
        last_hits = hits
        assert value(registry, "tiered_cache_evictions_total", tier="gpu") == \
            cache.stats()["tiers"]["gpu"]["evictions"]
    assert value(registry, "tiered_cache_query_tokens_total") == 12 * 8
    assert last_hits == cache.stats()["hit_tokens"] > 0


def test_collisions_metric():
    registry = CollectorRegistry()
    cache = make_cache(registry=registry, storage="none", hash_fn=lambda b: b"\1" * 16)
    request(cache, tokens(4, start=1), None)
    request(cache, tokens(4, start=2), None)
    assert value(registry, "tiered_cache_hash_collisions_total") == \
        cache.stats()["collisions"] > 0


def test_two_caches_two_registries():
    r1, r2 = CollectorRegistry(), CollectorRegistry()
    c1 = make_cache(registry=r1, storage="none")
    c2 = make_cache(registry=r2, storage="none", gpu_blocks=32)
    g = torch.Generator()
    request(c1, tokens(8), g)
    request(c1, tokens(8), g)
    request(c2, tokens(12), g)
    assert value(r1, "tiered_cache_query_tokens_total") == 16
    assert value(r2, "tiered_cache_query_tokens_total") == 12
    assert value(r1, "tiered_cache_hit_tokens_total", tier="gpu") == 8
    assert value(r2, "tiered_cache_hit_tokens_total", tier="gpu") == 0
    assert value(r1, "tiered_cache_capacity_blocks", tier="gpu") == 16
    assert value(r2, "tiered_cache_capacity_blocks", tier="gpu") == 32


def test_no_registry_registers_nothing_globally():
    before = prometheus_client.REGISTRY.get_sample_value("tiered_cache_query_tokens_total")
    cache = make_cache(storage="none")
    request(cache, tokens(8), None)
    assert cache.registry is None
    assert prometheus_client.REGISTRY.get_sample_value("tiered_cache_query_tokens_total") == before
