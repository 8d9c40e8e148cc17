"""Replay and sweep: request records served by the real control plane, hits counted.

Every request is served by a `TieredKVCache` built with `storage: none` (metadata only, no
tensors): `open` matches its longest cached prefix in any tier (promoting host blocks),
`mark_computed` publishes its blocks, `close` leaves them cached. Nothing is simulated on the
side: hits, evictions, promotions and demotions are the cache's own, read from its public API
(`open`, `mark_computed`, `close`, `stats()`) and, for the tier names and the Belady oracle,
`cache.tiers[i].name` and `cache.tiers[i].policy`; nothing else of the cache's inside.

- Tokens. Trace ids are already prefix-chained, so block j of a request is made of
  `block_size` tokens that all equal `hash_ids[j]`: equal ids give equal tokens and hence equal
  chained keys. A request is `len(hash_ids) * block_size` tokens: the trace counts whole blocks
  (the last one is usually partial in the real prompt) and so do the reference simulators;
  output tokens are not added. Token hit rate = hit blocks / requested blocks.
- Requests larger than the device tier cannot be served by this cache in one piece (every block
  of an open sequence lives in the device tier); they are counted as requested, missed and
  `oversized`, and change nothing.
- Belady (`policy="belady"`) gets a `NextUseOracle` over the whole trace, advanced before each
  request.

Speed: block operations = requested blocks (each is looked up or hashed and published) + blocks
published; reported per second of replay wall time.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from tiered_cache.errors import CapacityError, ConfigError
from tiered_cache.tools import extras
from tiered_cache.tools.replay.costs import MODEL_70B, CostModel

if TYPE_CHECKING:
    from tiered_cache.cache import TieredKVCache
    from tiered_cache.config import CacheConfig
    from tiered_cache.policies.belady import NextUseOracle

DEFAULT_POLICY = "adaptive"
"""The policy `replay` uses unless told otherwise (tiered_cache.policies.adaptive), the cache's
own default too."""

DEFAULT_CAPACITIES = (500, 1000, 2000, 3000, 5000, 10000, 20000)
DEFAULT_SWEEP_POLICIES = ("lru", "lfu", "arc", "s3fifo", "cost_aware", "class_credit",
                          "hit_density", DEFAULT_POLICY, "belady")
BASELINE_POLICY = "lru"
"""The policy every sweep row is divided by (`vs_lru`)."""


def replay_config(*, block_size: int, gpu_blocks: int, host_blocks: int, policy: str,
                  model: dict[str, Any] | None = None,
                  write_policy: str = "write_back", disk_blocks: int = 0,
                  disk_admit_min_hits: int = 1) -> CacheConfig:
    """The config of a storage-free cache for replay (ConfigError naming the key if a value is
    bad). A disk tier needs a host tier above it."""
    from tiered_cache.config import CacheConfig

    tiers: dict[str, Any] = {"gpu": {"num_blocks": gpu_blocks, "device": "cpu"},
                             "host": {"num_blocks": host_blocks}}
    if disk_blocks:
        tiers["disk"] = {"num_blocks": disk_blocks, "admit_min_hits": disk_admit_min_hits}
    return CacheConfig.from_dict({
        "storage": "none", "block_size": block_size, "policy": policy,
        "write_policy": write_policy, "model": dict(model or MODEL_70B), "tiers": tiers,
        "migrator": {"enabled": False}, "compactor": {"enabled": False},
    })


def build_cache(*, block_size: int, gpu_blocks: int, host_blocks: int, policy: str,
                model: dict[str, Any] | None = None,
                write_policy: str = "write_back") -> TieredKVCache:
    """A storage-free TieredKVCache for replay."""
    from tiered_cache.cache import TieredKVCache

    return TieredKVCache(replay_config(block_size=block_size, gpu_blocks=gpu_blocks,
                                       host_blocks=host_blocks, policy=policy, model=model,
                                       write_policy=write_policy))


def attach_oracle(cache: TieredKVCache,
                  requests: Sequence[dict[str, Any]]) -> NextUseOracle | None:
    """Give every tier policy that wants the future (`set_oracle`) a NextUseOracle."""
    wants = [t.policy for t in cache.tiers if hasattr(t.policy, "set_oracle")]
    if not wants:
        return None
    from tiered_cache.policies.belady import NextUseOracle

    oracle = NextUseOracle(r["hash_ids"] for r in requests)
    for p in wants:
        p.set_oracle(oracle)
    return oracle


def replay(requests: Sequence[dict[str, Any]], *, gpu_blocks: int, host_blocks: int = 0,
           block_size: int = 512, policy: str = DEFAULT_POLICY,
           model: dict[str, Any] | None = None, write_policy: str = "write_back",
           cost: CostModel | None = None, progress: bool = False,
           disk_blocks: int = 0) -> dict[str, Any]:
    """Replay `requests` (dicts with `hash_ids`) through a storage-free cache; return the
    report (see `tiered-cache replay --help` and docs/replay.md for the keys)."""
    model = dict(model or MODEL_70B)
    config = replay_config(block_size=block_size, gpu_blocks=gpu_blocks,
                           host_blocks=host_blocks, policy=policy, model=model,
                           write_policy=write_policy, disk_blocks=disk_blocks)
    cost = cost or CostModel.for_model(model)
    from tiered_cache.cache import TieredKVCache

    cache = TieredKVCache(config)
    try:
        return _replay(cache, config, requests, policy, model, cost, progress)
    finally:
        cache.shutdown()


def _replay(cache: TieredKVCache, config: CacheConfig, requests: Sequence[dict[str, Any]],
            policy: str, model: dict[str, Any], cost: CostModel,
            progress: bool) -> dict[str, Any]:
    oracle = attach_oracle(cache, requests)
    tier_names = [t.name for t in cache.tiers]
    bs = config.block_size
    gpu_blocks = config.tiers.gpu.num_blocks
    requested = hit = oversized = oversized_blocks = 0
    hit_by_tier = dict.fromkeys(tier_names, 0)
    saved_s = compute_saved_s = transfer_s = 0.0
    bar = extras.progress_bar(len(requests), f"replay {policy}", unit="req", enabled=progress)
    t0 = time.perf_counter()
    for i, rec in enumerate(requests):
        if oracle is not None:
            oracle.advance(i)
        ids = rec["hash_ids"]
        n = len(ids)
        requested += n
        if n == 0:
            continue
        if n > gpu_blocks:
            oversized += 1
            oversized_blocks += n
            continue
        tokens = np.repeat(np.asarray(ids, dtype=np.int32), bs)
        try:
            seq = cache.open(tokens)
        except CapacityError:          # cannot happen with one sequence open; count, go on
            oversized += 1
            oversized_blocks += n
            continue
        k = seq.num_cached_tokens // bs
        if k:
            hit += k
            host_tokens = 0
            for name, tok in seq.cached_tokens_by_tier.items():
                hit_by_tier[name] += tok // bs
                if name != tier_names[0]:
                    host_tokens += tok
            c = cost.compute_seconds(k * bs)
            x = cost.transfer_seconds(host_tokens)
            compute_saved_s += c
            transfer_s += x
            saved_s += c - x
        cache.mark_computed(seq)
        cache.close(seq)
        if (i & 63) == 63:
            bar.update(64)
    elapsed = time.perf_counter() - t0
    bar.update(len(requests) - bar.n)
    bar.close()
    stats = cache.stats()
    published = requested - hit - oversized_blocks
    ops = requested + published
    block_bytes = config.block_bytes
    tiers = {}
    for name in tier_names:
        s = stats["tiers"][name]
        tiers[name] = {"capacity_blocks": s["capacity_blocks"], "used_blocks": s["used_blocks"],
                       "evictions": s["evictions"], "hit_blocks": hit_by_tier[name]}
    demotions, promotions = stats["demotions"], stats["promotions"]
    return {
        "policy": policy,
        "block_size": bs,
        "gpu_blocks": gpu_blocks,
        "host_blocks": config.tiers.host.num_blocks if "host" in tier_names else 0,
        "disk_blocks": config.tiers.disk.num_blocks if "disk" in tier_names else 0,
        "write_policy": config.write_policy,
        "requests": len(requests),
        "requested_blocks": requested,
        "hit_blocks": hit,
        "token_hit_rate": hit / requested if requested else 0.0,
        "hit_rate_by_tier": {name: (hit_by_tier[name] / requested if requested else 0.0)
                             for name in tier_names},
        "hit_tokens_by_tier": {name: hit_by_tier[name] * bs for name in tier_names},
        "oversized_requests": oversized,
        "tiers": tiers,
        "evictions": {name: tiers[name]["evictions"] for name in tier_names},
        "dropped_blocks": stats["dropped_blocks"],
        "promotions": {"blocks": promotions, "bytes": promotions * block_bytes},
        "demotions": {"blocks": demotions, "bytes": demotions * block_bytes},
        "write_through": {"blocks": stats["write_through_blocks"],
                          "bytes": stats["write_through_blocks"] * block_bytes},
        "bytes_moved": (promotions + demotions + stats["write_through_blocks"]) * block_bytes,
        "block_bytes": block_bytes,
        "prefill_seconds_saved": saved_s,
        "prefill_compute_seconds_saved": compute_saved_s,
        "host_transfer_seconds": transfer_s,
        "cost_model": asdict(cost),
        "model": model,
        "replay_seconds": elapsed,
        "block_ops": ops,
        "block_ops_per_s": ops / elapsed if elapsed > 0 else float("inf"),
        "requests_per_s": len(requests) / elapsed if elapsed > 0 else float("inf"),
    }


# ---------------------------------------------------------------------------------------------
# sweep


@dataclass
class SweepSpec:
    """What a sweep replays: every layout x capacity x policy."""

    capacities: Sequence[int] = DEFAULT_CAPACITIES
    policies: Sequence[str] = DEFAULT_SWEEP_POLICIES
    gpu_fraction: float = 0.25
    tiers: Sequence[str] = ("single", "two")
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.capacities or any(not isinstance(c, int) or isinstance(c, bool) or c < 1
                                      for c in self.capacities):
            raise ConfigError("capacities", f"expected positive ints, got "
                                            f"{list(self.capacities)!r}")
        if not self.policies:
            raise ConfigError("policies", "expected at least one policy")
        if not self.tiers or set(self.tiers) - {"single", "two"}:
            raise ConfigError("tiers", f"expected 'single', 'two' or both, got "
                                       f"{list(self.tiers)!r}")
        if (isinstance(self.gpu_fraction, bool) or not isinstance(self.gpu_fraction, (int, float))
                or not 0 < self.gpu_fraction <= 1):
            raise ConfigError("gpu_fraction", f"expected a number in (0, 1], got "
                                              f"{self.gpu_fraction!r}")


def split_capacity(total: int, gpu_fraction: float, largest_request: int) -> tuple[int, int]:
    """(gpu, host) for a two-tier run of `total` blocks: `gpu_fraction` of it on the device,
    but never less than the largest request (the device tier must hold a whole sequence)."""
    gpu = max(1, math.ceil(total * gpu_fraction), largest_request)
    gpu = min(gpu, total)
    return gpu, total - gpu


def sweep(requests: Sequence[dict[str, Any]], spec: SweepSpec, *, block_size: int = 512,
          model: dict[str, Any] | None = None, progress: bool = True,
          **replay_kw: Any) -> dict[str, Any]:
    """Replay every (tiers, capacity, policy) combination; rows keep the headline numbers and
    `vs_lru`, the hit rate divided by LRU's at the same layout and capacity (None without an
    LRU run or when LRU hit nothing)."""
    largest = max((len(r["hash_ids"]) for r in requests), default=0)
    runs = [(mode, cap, pol) for mode in spec.tiers for cap in spec.capacities
            for pol in spec.policies]
    bar = extras.progress_bar(len(runs), "sweep", unit="run", enabled=progress)
    rows: list[dict[str, Any]] = []
    for mode, cap, pol in runs:
        bar.set_postfix_str(f"{mode} {cap} {pol}")
        gpu, host = (cap, 0) if mode == "single" else split_capacity(
            cap, spec.gpu_fraction, largest)
        r = replay(requests, gpu_blocks=gpu, host_blocks=host, block_size=block_size,
                   policy=pol, model=model, **replay_kw)
        rows.append({
            "tiers": mode, "capacity": cap, "policy": pol, "gpu_blocks": gpu,
            "host_blocks": host, "token_hit_rate": r["token_hit_rate"],
            "hit_rate_by_tier": r["hit_rate_by_tier"], "evictions": r["evictions"],
            "promotions": r["promotions"]["blocks"], "demotions": r["demotions"]["blocks"],
            "bytes_moved": r["bytes_moved"], "prefill_seconds_saved": r["prefill_seconds_saved"],
            "oversized_requests": r["oversized_requests"],
            "block_ops_per_s": r["block_ops_per_s"],
        })
        bar.update(1)
    bar.close()
    base = {(r["tiers"], r["capacity"]): r["token_hit_rate"] for r in rows
            if r["policy"] == BASELINE_POLICY}
    for r in rows:
        b = base.get((r["tiers"], r["capacity"]))
        r["vs_lru"] = r["token_hit_rate"] / b if b else None
    return {"block_size": block_size, "gpu_fraction": spec.gpu_fraction,
            "largest_request_blocks": largest, "capacities": list(spec.capacities),
            "policies": list(spec.policies), "tiers": list(spec.tiers), "rows": rows}
