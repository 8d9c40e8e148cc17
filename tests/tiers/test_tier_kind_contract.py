"""A tier kind that only the tests know (tests/tier_kinds.py) works end to end through the
public API, with no edit of cache.py, daemon/partition.py, core/ or migrator/:

- its section `tiers.memkv` is accepted by `CacheConfig.from_dict` (and refused with key
  paths when wrong), and its needs are checked with the built-in kinds' messages' shape;
- blocks move into it through its copy handlers (host -> memkv puts, by the migrator) and out
  of it (memkv -> host -> device loads), and `open()` finds them in it from another cache;
- `stats()` and the Prometheus metrics name it; a damaged record is a miss, never data;
- a device tier the owner hands over (`handed`) takes the place of `gpu` in `build_stack`.

KV is the pattern of tests/helpers.py, so a block loaded from the kind is checked wherever it
was computed.
"""

from __future__ import annotations

import pytest
import torch
from prometheus_client import CollectorRegistry

from tests import tier_kinds
from tests.helpers import (
    check_pattern,
    make_cache,
    make_config,
    write_pattern_all,
)
from tests.oracles import wait_for
from tiered_cache import CacheConfig
from tiered_cache.core.transfer import Transfer
from tiered_cache.errors import ConfigError, TransferError

BS = 4


@pytest.fixture(autouse=True)
def kinds():
    tier_kinds.register()
    yield
    tier_kinds.unregister()


def memkv_cache(name="shared", *, gpu=8, host=8, write="on_host", registry=None, **kw):
    return make_cache(gpu_blocks=gpu, host_blocks=host, registry=registry,
                      migrator={"enabled": True, "wait_timeout_s": 20.0},
                      extra={"tiers": {"memkv": {"name": name, "write": write}}}, **kw)


def prompt(i: int, blocks: int = 3) -> list[int]:
    return [i * 1000 + j for j in range(blocks * BS)]


def serve(cache, tokens) -> dict[str, int]:
    seq = cache.open(tokens)
    for layer in range(cache.num_layers):
        cache.wait(seq, layer)
    check_pattern(cache, seq)          # what came from the cache is exactly this prompt's
    write_pattern_all(cache, seq)
    got = dict(seq.cached_tokens_by_tier)
    cache.close(seq)
    return got


def publish(cache, prompts) -> None:
    """Serve each prompt, then push the cache's blocks down so that they reach host (and are
    put to the store)."""
    for p in prompts:
        serve(cache, p)
    cache.migrator.settle()


def test_its_section_is_config_like_any_other():
    cfg = CacheConfig.from_dict({"tiers": {"memkv": {"name": "a", "lookahead_blocks": 8}}})
    assert cfg.tiers.memkv.name == "a" and cfg.tiers.memkv.lookahead_blocks == 8
    assert CacheConfig.from_dict(cfg.to_dict()) == cfg
    assert CacheConfig.default().tiers.memkv is None            # optional: absent is None
    with pytest.raises(ConfigError, match=r"tiers\.memkv\.write: expected one of"):
        CacheConfig.from_dict({"tiers": {"memkv": {"write": "always"}}})
    with pytest.raises(ConfigError, match=r"tiers\.memkv\.nmae: unknown key; did you mean "
                                          r"'name'"):
        CacheConfig.from_dict({"tiers": {"memkv": {"nmae": "a"}}})
    with pytest.raises(ConfigError, match=r"tiers\.memkvv: unknown key; did you mean 'memkv'"):
        CacheConfig.from_dict({"tiers": {"memkvv": {}}})


def test_unregistered_its_section_is_an_unknown_key():
    tier_kinds.unregister()
    try:
        with pytest.raises(ConfigError, match=r"tiers\.memkv: unknown key"):
            CacheConfig.from_dict({"tiers": {"memkv": {}}})
    finally:
        tier_kinds.register()


def test_its_needs_are_checked_by_the_stack_builder():
    with pytest.raises(ConfigError, match=r"tiers\.memkv: needs a host tier"):
        memkv_cache(host=0)
    with pytest.raises(ConfigError, match=r"tiers\.memkv: needs the migrator"):
        make_cache(extra={"tiers": {"memkv": {}}})
    with pytest.raises(ConfigError, match=r"tiers\.memkv: needs storage: tensors"):
        make_cache(storage="none", extra={"tiers": {"memkv": {}}})


def test_blocks_move_through_it_and_open_finds_them_from_another_cache():
    a = memkv_cache()
    ps = [prompt(i) for i in range(10)]
    publish(a, ps)
    store = a.stores[0].store
    assert len(store.keys()) > 0, "nothing was put through the host -> memkv handler"
    assert a.stats()["tiers"]["memkv"]["put_blocks"] == len(store.keys())
    b = memkv_cache()                                       # a cold cache, same store
    got = [serve(b, p) for p in ps]
    loaded = sum(g.get("memkv", 0) for g in got)
    assert loaded > 0                                       # found in it, checked by serve()
    s = b.stats()["tiers"]["memkv"]
    assert s["loaded_blocks"] * BS == s["hit_tokens"] == loaded
    assert s["store"]["gets"] >= s["loaded_blocks"]
    a.shutdown()
    b.shutdown()


def test_a_damaged_record_is_a_miss_never_data():
    a = memkv_cache(name="damaged", write_policy="write_through")    # a host copy at once
    p = prompt(7, blocks=2)
    publish(a, [p])
    store = a.stores[0].store
    keys = store.keys()
    assert keys
    for root, key in keys:
        store.corrupt(root, key)
    b = memkv_cache(name="damaged")
    seq = b.open(p)
    assert seq.cached_tokens_by_tier.get("memkv", 0) > 0    # it said it had them ...
    with pytest.raises(TransferError):                      # ... but none passes verification
        for layer in range(b.num_layers):
            b.wait(seq, layer)
    b.close(seq)
    assert b.stats()["tiers"]["memkv"]["load_failures"] >= 1
    assert b.stats()["tiers"]["memkv"]["store"]["corrupt"] >= 1
    got = serve(b, p)                       # the engine computes them: a miss, never data
    assert got.get("memkv", 0) == 0
    a.shutdown()
    b.shutdown()


def test_stats_and_metrics_name_it():
    registry = CollectorRegistry()
    a = memkv_cache(name="metrics")
    publish(a, [prompt(i) for i in range(6)])
    b = memkv_cache(name="metrics", registry=registry)
    for i in range(6):
        serve(b, prompt(i))
    b.migrator.settle()
    stats = b.stats()
    assert "memkv" in stats["tiers"] and stats["tiers"]["memkv"]["store"]["available"]
    loaded = registry.get_sample_value("tiered_cache_loaded_blocks_total", {"tier": "memkv"})
    assert loaded == stats["tiers"]["memkv"]["loaded_blocks"] > 0
    hits = registry.get_sample_value("tiered_cache_hit_tokens_total", {"tier": "memkv"})
    assert hits == stats["tiers"]["memkv"]["hit_tokens"]
    assert registry.get_sample_value("tiered_cache_store_available", {"tier": "memkv"}) == 1.0
    # NOTE: puts may still go out on the store's thread: the two readings meet once it is idle
    wait_for(lambda: registry.get_sample_value("tiered_cache_put_blocks_total", {"tier": "memkv"})
             == b.stats()["tiers"]["memkv"]["put_blocks"], "put_blocks in the metrics")
    a.shutdown()
    b.shutdown()


def test_invalidate_reaches_it():
    a = memkv_cache(name="inval", write_policy="write_through")
    p = prompt(3)
    publish(a, [p])
    assert a.stores[0].store.keys()
    a.invalidate(p)
    assert not a.stores[0].store.keys()
    a.shutdown()


def test_a_handed_over_device_pool_takes_the_place_of_gpu():
    """The shape of an engine-owned device tier: `build_stack` gets the pool from its owner
    (`provided`), the kind's handlers move blocks between it and the host tier."""
    from tiered_cache.data.pools import DevicePool, make_pool
    from tiered_cache.hashing import BlockHasher, Namespace
    from tiered_cache.tiers import ENGINE
    from tiered_cache.tiers.stack import build_stack

    cfg = make_config(gpu_blocks=8, host_blocks=8, extra={"tiers": {"handed": {"num_blocks": 6}}})
    m = cfg.model
    pool = make_pool(DevicePool.layout, 6, num_layers=m.num_layers, block_size=BS,
                     num_kv_heads=m.num_kv_heads, head_dim=m.head_dim, dtype=m.dtype)
    hasher = BlockHasher(Namespace(m.name, m.dtype, m.num_layers, m.num_kv_heads, m.head_dim,
                                   BS, None))
    with pytest.raises(ConfigError, match=r"tiers\.handed: needs the owner's pool"):
        build_stack(cfg, ENGINE, hasher=hasher)
    stack = build_stack(cfg, ENGINE, hasher=hasher, provided={"handed": pool})
    try:
        assert [s.kind for s in stack.specs] == ["handed", "host"]   # gpu is replaced
        assert stack.pools[0] is pool and stack.index.tiers[0].capacity_blocks == 6
        pool.kv[:, :, 2].fill_(3.0)
        stack.executor.run([Transfer(0, 0, 2, 1, 5)])               # handed -> host
        assert torch.all(stack.pools[1].kv[5] == 3.0)
        stack.executor.run([Transfer(0, 1, 5, 0, 4)])               # host -> handed
        assert torch.all(pool.kv[:, :, 4] == 3.0)
    finally:
        stack.stop_workers()
        stack.close()


def test_the_capacity_planner_lists_it_beneath_by_its_own_word():
    """`tiered-cache plan` asks the kind where its blocks live (`TierKind.where`): the default
    for a kind that says nothing, its section's name."""
    from tiered_cache.tools import planner

    cfg = CacheConfig.from_dict({"tiers": {"host": {"num_blocks": 16},
                                           "memkv": {"name": "a", "write": "on_host"}}})
    (memkv,) = planner.make_plan(cfg).beneath
    assert (memkv.name, memkv.where, memkv.write) == ("memkv", "tiers.memkv", "on_host")
