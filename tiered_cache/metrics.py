"""Prometheus metrics, `tiered_cache_*`, read from the cache's own counters at scrape time.

NOTE: a custom collector rather than Counter objects bumped on the hot path: the control plane
keeps plain integers (free to update under its lock) and the collector turns them into metric
families only when scraped. Counters stay monotonic, so `rate()` works on them.

The library never starts an HTTP server unless asked (`metrics.http_port`, or `serve_metrics`).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

from tiered_cache.errors import ConfigError
from tiered_cache.locking import BUCKETS

PREFIX = "tiered_cache"


class CacheCollector(Collector):
    """Metric families from a cache's `stats()` (and its index's timing histograms)."""

    def __init__(self, stats: Callable[[], dict], index) -> None:
        self.stats = stats
        self.index = index

    def collect(self):
        s = self.stats()
        query = CounterMetricFamily(f"{PREFIX}_query_tokens", "Prompt tokens looked up by open()")
        query.add_metric([], s["query_tokens"])
        hit = CounterMetricFamily(f"{PREFIX}_hit_tokens",
                                  "Prompt tokens served from the cache, by the tier they came from",
                                  labels=["tier"])
        for tier, n in s["hit_tokens_by_tier"].items():
            hit.add_metric([tier], n)
        inflight = CounterMetricFamily(f"{PREFIX}_inflight_hit_tokens",
                                       "Prompt tokens open() took from blocks other open "
                                       "sequences were computing (share_inflight)")
        inflight.add_metric([], s["inflight_hit_tokens"])
        aborts = CounterMetricFamily(f"{PREFIX}_inflight_aborts",
                                     "Waiters whose writer closed before writing the blocks "
                                     "they took (PrefixAbortedError)")
        aborts.add_metric([], s["inflight_aborts"])
        evictions = CounterMetricFamily(f"{PREFIX}_evictions",
                                        "Block copies that left a tier to make room",
                                        labels=["tier"])
        capacity = GaugeMetricFamily(f"{PREFIX}_capacity_blocks", "Slots in the tier",
                                     labels=["tier"])
        used = GaugeMetricFamily(f"{PREFIX}_used_blocks", "Slots holding a block", labels=["tier"])
        pinned = GaugeMetricFamily(f"{PREFIX}_pinned_blocks",
                                   "Blocks in the tier that open sequences use", labels=["tier"])
        slot_tiers = {name: t for name, t in s["tiers"].items() if "capacity_blocks" in t}
        for name, t in slot_tiers.items():
            evictions.add_metric([name], t["evictions"])
            capacity.add_metric([name], t["capacity_blocks"])
            used.add_metric([name], t["used_blocks"])
            pinned.add_metric([name], t["pinned_blocks"])
        moves = CounterMetricFamily(f"{PREFIX}_migrated_blocks",
                                    "Blocks copied between tiers", labels=["direction"])
        moves.add_metric(["promotion"], s["promotions"])
        moves.add_metric(["demotion"], s["demotions"])
        moves.add_metric(["write_through"], s["write_through_blocks"])
        moved_bytes = CounterMetricFamily(f"{PREFIX}_migrated_bytes",
                                          "Bytes copied between tiers", labels=["direction"])
        moved_bytes.add_metric(["promotion"], s["promotion_bytes"])
        moved_bytes.add_metric(["demotion"], s["demotion_bytes"])
        collisions = CounterMetricFamily(f"{PREFIX}_hash_collisions",
                                         "Key matches whose stored tokens or parent differed")
        collisions.add_metric([], s["collisions"])
        cached = GaugeMetricFamily(f"{PREFIX}_cached_blocks", "Blocks in the prefix index")
        cached.add_metric([], s["cached_blocks"])
        open_seqs = GaugeMetricFamily(f"{PREFIX}_open_sequences", "Sequences open now")
        open_seqs.add_metric([], s["open_sequences"])
        failures = CounterMetricFamily(f"{PREFIX}_transfer_failures",
                                       "Copies given up after their retries (block kept valid "
                                       "in its source tier)")
        failures.add_metric([], s["transfer_failures"])
        retries = CounterMetricFamily(f"{PREFIX}_transfer_retries", "Copies retried")
        retries.add_metric([], s["transfer_retries"])
        sync = CounterMetricFamily(f"{PREFIX}_sync_evictions",
                                   "Device allocations that had to evict on the hot path")
        sync.add_metric([], s["sync_evictions"])
        compaction = CounterMetricFamily(f"{PREFIX}_compaction_moves",
                                         "Blocks moved to lower slots by the compactor")
        compaction.add_metric([], s["compaction_moves"])
        frag = GaugeMetricFamily(f"{PREFIX}_fragmentation",
                                 "Free slots below the highest used slot / used slots",
                                 labels=["tier"])
        for name, t in slot_tiers.items():
            frag.add_metric([name], t["fragmentation"])
        corrupt = CounterMetricFamily(f"{PREFIX}_corrupt_blocks",
                                      "Persisted records that failed verification (dropped: a "
                                      "miss, never data)", labels=["tier"])
        for name, t in slot_tiers.items():
            corrupt.add_metric([name], t["corrupt_blocks"])
        policy_failed = CounterMetricFamily(f"{PREFIX}_policy_failures",
                                            "Failures of the eviction policy (the tier "
                                            "uses LRU after the first)", labels=["tier"])
        for name, t in slot_tiers.items():
            policy_failed.add_metric([name], t["policy_failures"])
        recovered = CounterMetricFamily(f"{PREFIX}_recovered_blocks",
                                        "Blocks rebuilt from persisted records at start-up")
        recovered.add_metric([], s["recovered_blocks"])
        keyed = {name: t for name, t in s["tiers"].items() if "store" in t}
        loaded = CounterMetricFamily(f"{PREFIX}_loaded_blocks",
                                     "Blocks loaded from a shared store (remote)", labels=["tier"])
        load_failed = CounterMetricFamily(f"{PREFIX}_load_failures",
                                          "Blocks a store said it held but could not return "
                                          "whole and verified (a miss)", labels=["tier"])
        skipped = CounterMetricFamily(f"{PREFIX}_skipped_loads",
                                      "Loads not made: recomputing was cheaper (cost model)",
                                      labels=["tier"])
        put = CounterMetricFamily(f"{PREFIX}_put_blocks",
                                  "Blocks handed to a shared store's background writer",
                                  labels=["tier"])
        store_errors = CounterMetricFamily(f"{PREFIX}_store_errors",
                                           "Failed or timed-out calls to a shared store",
                                           labels=["tier"])
        store_up = GaugeMetricFamily(f"{PREFIX}_store_available",
                                     "1 while the store's circuit breaker is closed",
                                     labels=["tier"])
        for name, t in keyed.items():
            loaded.add_metric([name], t["loaded_blocks"])
            load_failed.add_metric([name], t["load_failures"])
            skipped.add_metric([name], t["skipped_loads"])
            put.add_metric([name], t["put_blocks"])
            store_errors.add_metric([name], t["store"]["errors"] + t["store"]["timeouts"])
            store_up.add_metric([name], 1.0 if t["store"]["available"] else 0.0)
        # Prefixes only a persistent tier held, cut from a match: under that tier's name.
        slow = next((t for t in self.index.tiers if t.persistent), None)
        if slow is not None:
            skipped.add_metric([slow.name], s["skipped_loads"])
        degraded = CounterMetricFamily(f"{PREFIX}_degraded_evictions",
                                       "Evicted blocks dropped instead of demoted because the "
                                       "copy down failed (a miss later, never an error)")
        degraded.add_metric([], s["degraded_evictions"])
        background = CounterMetricFamily(f"{PREFIX}_background_errors",
                                         "Exceptions caught (logged, survived) in background "
                                         "threads", labels=["thread"])
        alive = GaugeMetricFamily(f"{PREFIX}_background_thread_alive",
                                  "1 while the background thread runs", labels=["thread"])
        for name, t in s["threads"].items():
            background.add_metric([name], t["errors"])
            alive.add_metric([name], 1.0 if t["alive"] else 0.0)
        index = self.index
        yield from (query, hit, inflight, aborts, evictions, capacity, used, pinned, moves,
                    moved_bytes, collisions, cached, open_seqs, failures, retries, sync,
                    compaction, frag,
                    degraded, background, alive, corrupt, policy_failed, recovered, loaded,
                    load_failed,
                    skipped, put, store_errors, store_up,
                    _histogram("lock_hold_seconds", "Control-plane lock hold time, per hold",
                               index.lock.holds),
                    _histogram("lookup_seconds", "Time of open(): prefix match, pin, reserve",
                               index.lookups))


def _histogram(name: str, doc: str, holds) -> HistogramMetricFamily:
    buckets, seen = [], 0
    for bound, count in zip(BUCKETS, holds.counts):
        seen += count
        buckets.append((repr(bound), seen))
    buckets.append(("+Inf", holds.total))
    hist = HistogramMetricFamily(f"{PREFIX}_{name}", doc)
    hist.add_metric([], buckets, holds.sum)
    return hist


def serve_metrics(registry: CollectorRegistry, port: int, addr: str = "127.0.0.1"):
    """Expose `registry` over HTTP (only when explicitly asked). Returns (server, thread).
    A port in use raises ConfigError naming `metrics.http_port`."""
    try:
        return start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        raise ConfigError("metrics.http_port",
                          f"cannot serve metrics on {addr}:{port} (metrics.http_addr:port): "
                          f"{exc.strerror or exc}") from None
