"""The tiers beneath the engine's slot tiers that other processes share: the remote store
(Redis/Valkey, `tiers.remote`) and the node daemon (`tiers.daemon`). How the facade builds
them and how `open()` loads from them after the local match. Internal to `TieredKVCache`.
"""

from __future__ import annotations

import logging

from tiered_cache.config import CacheConfig
from tiered_cache.core.keyed import leading
from tiered_cache.core.sequence import Sequence
from tiered_cache.core.tier import TierSpec
from tiered_cache.errors import ConfigError

log = logging.getLogger("tiered_cache.cache")

DEVICE = 0
"""How long the daemon may take to bring blocks up from its disk for one fetch."""


def build(cache, config: CacheConfig, specs: list[TierSpec]) -> tuple[list, list]:
    """(specs, pools) of the keyed tiers configured: the daemon's, or the remote store's."""
    if config.tiers.daemon is not None:
        return _daemon(cache, config)
    if config.tiers.remote is not None:
        return _remote(cache, config, specs)
    return [], []


def _daemon(cache, config: CacheConfig) -> tuple[list, list]:
    d = config.tiers.daemon
    if not cache.has_storage:
        raise ConfigError("tiers.daemon", "needs storage: tensors (a metadata-only cache has "
                                          "no KV to share)")
    if config.tiers.disk is not None or config.tiers.remote is not None:
        raise ConfigError("tiers.daemon", "an engine attached to the node daemon uses the "
                                          "daemon's tiers: configure tiers.disk and "
                                          "tiers.remote in the daemon's config, not here")
    if not config.migrator.enabled:
        raise ConfigError("tiers.daemon", "needs the migrator (migrator.enabled: true): only "
                                          "its background threads copy to and from the daemon")
    model = config.model
    if model.dtype not in ("float32", "float16", "bfloat16"):
        raise ConfigError("model.dtype", f"{model.dtype!r} KV cannot go through the daemon yet "
                                         "(its pool has no per-block scales): use float16 or "
                                         "bfloat16, or no tiers.daemon")
    from tiered_cache.daemon.shm import PoolGeometry
    from tiered_cache.data.daemon_tier import DaemonTier

    geometry = PoolGeometry(1, model.num_layers, cache.block_size, model.num_kv_heads,
                            model.head_dim, model.dtype)
    pool = DaemonTier(d.socket, timeout_s=d.timeout_s, geometry=geometry,
                      namespace=cache.hasher.namespace_digest(),
                      gpu=cache.pools[DEVICE])
    put_from = DEVICE if d.write == "on_compute" else None
    return [TierSpec("daemon", "daemon", 0, staged=False, put_from=put_from)], [pool]


def load(cache, seq: Sequence) -> None:
    """After the local match: load what a keyed tier has of the next blocks."""
    if cache.config.tiers.daemon is not None:
        _load_daemon(cache, seq)
    else:
        _load_remote(cache, seq)


def note_open(cache, seq: Sequence) -> None:
    """A sequence was opened: the daemon tier learns how its root was derived."""
    if cache.config.tiers.daemon is not None:
        adapter = seq.adapter_id if seq.adapter_id is not None else cache.config.adapter_id
        cache.stores[0].note_root(seq.root, seq.salt, adapter)


def _chain(cache, seq: Sequence, m: int, last: bytes, n: int) -> list[bytes]:
    bs = cache.block_size
    return cache.hasher.chain(last, seq.token_ids[m * bs:(m + n) * bs])


def _load_daemon(cache, seq: Sequence) -> None:
    """Ask the daemon to pin the next blocks (one round trip); extend the sequence over what
    it found; the load handler copies them out of the shared pool and releases the pins."""
    from tiered_cache.daemon.ops import MAX_BLOCKS

    m, last, n = cache.index.keyed.loadable(seq)
    n = min(n, MAX_BLOCKS)
    daemon = cache.stores[0]
    if not n or not daemon.available:
        return
    bs = cache.block_size
    handle, slots = daemon.fetch(seq.root, last, seq.token_ids[m * bs:(m + n) * bs],
                                 int(cache.config.tiers.daemon.lookup_deadline_ms))
    if not handle:
        return
    taken = 0
    try:
        keys = _chain(cache, seq, m, last, len(slots))
        taken = cache.index.keyed.extend(seq, 0, keys, cache._promote, slots=slots, ticket=handle)
    finally:
        if not taken:
            # NOTE: nothing will copy under this handle (extend took nothing, or raised before
            # handing the plan on), so it is released here; a copy still queued would find
            # it gone and fail its blocks, never read slots the daemon has reused.
            daemon.release(handle)


def _remote(cache, config: CacheConfig, specs: list[TierSpec]) -> tuple[list, list]:
    """The remote tier (a shared Redis/Valkey store)."""
    remote = config.tiers.remote
    if not cache.has_storage:
        raise ConfigError("tiers.remote", "needs storage: tensors (a metadata-only cache "
                                          "has no KV to share)")
    if len(specs) < 2 or specs[1].kind != "host":
        raise ConfigError("tiers.remote", "needs a host tier (tiers.host with num_blocks > "
                                          "0): records are staged through it")
    if not config.migrator.enabled:
        raise ConfigError("tiers.remote", "needs the migrator (migrator.enabled: true): "
                                          "only its background threads load and store")
    from tiered_cache.data.remote_tier import RemoteTier, connect

    host = cache.pools[1]
    store = connect(remote, namespace=cache.hasher.namespace_digest(),
                    num_tokens=cache.block_size, payload_bytes=cache.block_bytes,
                    cost=cache.costs.tiers.get("remote") if cache.costs is not None else None)
    pool = RemoteTier(store, host_kv=host.kv, host_scales=host.scales,
                      namespace=cache.hasher.namespace_digest())
    put_from = 1 if remote.write == "on_host" else None     # off: this cache only reads
    return [TierSpec("remote", "remote", 0, put_from=put_from)], [pool]


def _load_remote(cache, seq: Sequence) -> None:
    """After the local match: which of the next blocks the shared store holds (under the
    lookup deadline, outside the lock), and, if loading them beats recomputing, load them
    (`BlockIndex.keyed.extend`). A slow, dead or empty store costs at most the deadline."""
    m, last, n = cache.index.keyed.loadable(seq)
    remote = cache.config.tiers.remote
    n = min(n, remote.lookahead_blocks)
    if not n:
        return
    keys = _chain(cache, seq, m, last, n)
    for k, store in enumerate(cache.stores):
        # NOTE: asked even while its breaker is open: it answers "absent" at once then,
        # and lets one probe through after each backoff, which is how it comes back.
        r = leading(store.exists(seq.root, keys, remote.lookup_deadline_ms / 1e3))
        if not r:
            continue
        if cache.costs is not None and not cache._worth(cache.index.keyed.tiers[k].index, r, m):
            cache.index.keyed.note_skipped(k)
            continue
        if cache.index.keyed.extend(seq, k, keys[:r], cache._promote):
            return



def daemon_stats(daemon, out: dict) -> None:
    """The daemon's tiers (this tenant's partition), under their own names beneath ours:
    `daemon.host`, `daemon.disk`. Asked at most once a second."""
    import time

    now = time.monotonic()
    cached = getattr(daemon, "_stats_cache", None)
    if cached is None or now - cached[0] > 1.0:
        cached = (now, daemon.daemon_stats() if daemon.available else None)
        daemon._stats_cache = cached
    theirs = cached[1]
    if not theirs:
        return
    part = theirs["partition"]
    for name, tier in part["tiers"].items():
        out["tiers"][f"daemon.{name}"] = tier
