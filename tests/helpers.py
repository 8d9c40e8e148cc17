"""Small builders shared by the cache tests: tiny configs, deterministic KV, state snapshots.

Import from a test module with `from tests.helpers import ...` (pytest's importlib import mode
resolves `tests` as a namespace package under the rootdir).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch
import xxhash

# NOTE: the fixture is tests/conftest.py's (autouse for every test); the name stays importable
# from here for modules written before that: importing it changes nothing.
from tests.conftest import invariants_after_test  # noqa: F401
from tiered_cache import TieredKVCache
from tiered_cache.config import CacheConfig
from tiered_cache.core.invariants import check_invariants

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16}

# Shortcuts accepted by make_config / make_cache besides the top-level CacheConfig keys.
_MODEL_KEYS = {"name", "num_layers", "num_kv_heads", "head_dim", "num_q_heads", "dtype",
               "num_params"}
_SHORTCUTS = {"gpu_blocks": ("tiers", "gpu", "num_blocks"),
              "host_blocks": ("tiers", "host", "num_blocks"),
              "host_memory": ("tiers", "host", "memory"),
              "device": ("tiers", "gpu", "device")}


def base_config_dict() -> dict[str, Any]:
    """Tiny geometry: 2 layers, 2 KV heads, head_dim 4, block_size 4, 16 gpu / 32 host blocks."""
    return {
        "model": {"name": "test-model", "num_layers": 2, "num_kv_heads": 2, "head_dim": 4,
                  "dtype": "float32"},
        "block_size": 4,
        "tiers": {"gpu": {"device": "cpu", "num_blocks": 16},
                  "host": {"num_blocks": 32, "memory": "pageable"}},
        "policy": "lru",
        "write_policy": "write_back",
        "storage": "tensors",
        "migrator": {"enabled": False},
        "compactor": {"enabled": False},
    }


def deep_merge(base: dict, extra: Mapping) -> dict:
    out = copy.deepcopy(base)
    for k, v in extra.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def config_dict(**overrides: Any) -> dict[str, Any]:
    """`base_config_dict()` with overrides: model keys (`dtype=`, `num_layers=` ...), the
    shortcuts `gpu_blocks`, `host_blocks`, `host_memory`, `device`, any top-level key
    (`block_size=`, `write_policy=`, `storage=` ...), and `extra={...}` deep-merged last."""
    d = base_config_dict()
    extra = overrides.pop("extra", None)
    for key, value in overrides.items():
        if key in _MODEL_KEYS:
            d["model"][key] = value
        elif key in _SHORTCUTS:
            a, b, c = _SHORTCUTS[key]
            d[a][b][c] = value
        else:
            d[key] = value
    if extra:
        d = deep_merge(d, extra)
    return d


def make_config(**overrides: Any) -> CacheConfig:
    return CacheConfig.from_dict(config_dict(**overrides))


def make_cache(*, hash_fn=None, registry=None, **overrides: Any) -> TieredKVCache:
    kw: dict[str, Any] = {}
    if hash_fn is not None:
        kw["hash_fn"] = hash_fn
    if registry is not None:
        kw["registry"] = registry
    return TieredKVCache(make_config(**overrides), **kw)


# ---------------------------------------------------------------------------- KV data


def torch_dtype(cache: TieredKVCache) -> torch.dtype:
    return TORCH_DTYPES[cache.config.model.dtype]


def random_kv(cache: TieredKVCache, n: int, gen: torch.Generator,
              dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    shape = (n, cache.num_kv_heads, cache.head_dim)
    dtype = dtype or torch_dtype(cache)
    k = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    v = torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
    return k, v


def write_random(cache: TieredKVCache, seq, gen: torch.Generator, n: int | None = None,
                 layers=None) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Write `n` (default: all remaining) tokens of random KV to each layer; returns what was
    written per layer."""
    out = []
    for layer in (range(cache.num_layers) if layers is None else layers):
        m = seq.num_tokens - seq.written[layer] if n is None else n
        k, v = random_kv(cache, m, gen)
        cache.write(seq, layer, k, v)
        out.append((k, v))
    return out


def pattern_value(salt, tokens: np.ndarray, pos: int, layer: int) -> int:
    """A small integer (exact in bfloat16) determined by the tenant, the tokens up to and
    including `pos`, and the layer: what a causal model's KV at `pos` depends on."""
    h = xxhash.xxh3_64()
    h.update(repr(salt).encode())
    h.update(np.asarray(tokens[:pos + 1], dtype=np.int32).tobytes())
    h.update(layer.to_bytes(2, "little"))
    return h.intdigest() % 201 - 100


def pattern_kv(cache: TieredKVCache, salt, tokens: np.ndarray, start: int, end: int,
               layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic K/V of positions [start, end): K = c + j, V = -c - 2j (j: element index
    within [H, D]), c = pattern_value(...). Integers below 256 in magnitude, exact in every
    float dtype tested."""
    H, D = cache.num_kv_heads, cache.head_dim
    j = torch.arange(H * D, dtype=torch.float32).view(H, D)
    codes = torch.tensor([pattern_value(salt, tokens, p, layer) for p in range(start, end)],
                         dtype=torch.float32).view(-1, 1, 1)
    dtype = torch_dtype(cache)
    return (codes + j).to(dtype), (-codes - 2 * j).to(dtype)


def write_pattern(cache: TieredKVCache, seq, layer: int, n: int | None = None) -> None:
    start = seq.written[layer]
    end = seq.num_tokens if n is None else start + n
    k, v = pattern_kv(cache, seq.salt, seq.token_ids, start, end, layer)
    cache.write(seq, layer, k, v)


def write_pattern_all(cache: TieredKVCache, seq) -> None:
    for layer in range(cache.num_layers):
        write_pattern(cache, seq, layer)


def check_pattern(cache: TieredKVCache, seq, layer: int | None = None) -> None:
    """Every gathered element equals the pattern of its position."""
    for lyr in (range(cache.num_layers) if layer is None else [layer]):
        k, v = cache.gather(seq, lyr)
        n = seq.written[lyr]
        ek, ev = pattern_kv(cache, seq.salt, seq.token_ids, 0, n, lyr)
        assert k.shape == ek.shape and v.shape == ev.shape
        assert torch.equal(k, ek), f"layer {lyr}: key differs from the pattern"
        assert torch.equal(v, ev), f"layer {lyr}: value differs from the pattern"


# ---------------------------------------------------------------------------- state


def free_slots(cache: TieredKVCache, tier: int) -> list[int]:
    alloc = cache.tiers[tier].allocator
    return [s for s in range(alloc.num_slots) if alloc.is_free(s)]


TIMING_STATS = ("lock_hold", "lookup", "threads")


def stable_stats(cache: TieredKVCache) -> dict[str, Any]:
    """`cache.stats()` without the timing fields (lock hold times change on every call)."""
    return {k: v for k, v in cache.stats().items() if k not in TIMING_STATS}


def snapshot(cache: TieredKVCache) -> dict[str, Any]:
    """Everything observable about the control plane, for before/after comparisons."""
    idx = cache.index
    with cache.locked():
        blocks = {}
        for key, b in idx.prefix.items():
            i = idx.info(b)
            blocks[key] = (i.id, i.slots, i.ref_count, i.hits, i.last_access, i.candidate,
                           i.resident_children, i.parent)
        seqs = {}
        for s in cache.open_sequences():
            seqs[s.id] = (s.num_tokens, tuple(s.token_ids.tolist()), tuple(s.written),
                          s.num_cached_tokens, s.num_published, tuple(s.keys),
                          tuple((b, idx.info(b).slots, idx.info(b).ref_count, idx.info(b).key)
                                for b in s.blocks))
        return {
            "stats": stable_stats(cache),
            "blocks": blocks,
            "seqs": seqs,
            "free": [free_slots(cache, t.index) for t in cache.tiers],
            "pinned": [t.pinned_blocks for t in cache.tiers],
            "policy_len": [len(t.policy) for t in cache.tiers],
            "clock": idx.clock,
        }


class BlockView:
    """A live, read-only view of one block of a cache's index (tests poll it as copies move).
    Once the block is freed (its row recycled) it reads as dropped: no copies, no key."""

    def __init__(self, cache: TieredKVCache, b: int) -> None:
        self.cache, self.id = cache, b
        self.gen = cache.index.blocks.gen[b]

    @property
    def gone(self) -> bool:
        return self.cache.index.blocks.gen[self.id] != self.gen

    @property
    def slots(self) -> list[int]:
        t = self.cache.index.blocks
        return [-1] * t.num_tiers if self.gone else t.copies(self.id)

    @property
    def key(self):
        return None if self.gone else self.cache.index.blocks.key[self.id]

    @property
    def ref_count(self) -> int:
        return 0 if self.gone else self.cache.index.blocks.ref_count[self.id]

    @property
    def children(self) -> list[BlockView]:
        if self.gone:
            return []
        return [BlockView(self.cache, c) for c in self.cache.index.blocks.children(self.id)]

    def fastest_tier(self) -> int:
        return -1 if self.gone else self.cache.index.blocks.fastest_tier(self.id)

    def __eq__(self, other) -> bool:
        return isinstance(other, BlockView) and (self.id, self.gen) == (other.id, other.gen)

    def __hash__(self) -> int:
        return hash((self.id, self.gen))

    def __repr__(self) -> str:
        return f"BlockView({self.id}, slots={self.slots}, key={'set' if self.key else None})"


def block_at(cache: TieredKVCache, key: bytes) -> BlockView:
    b = cache.index.lookup(key)
    assert b is not None, "no block with that key in the index"
    return BlockView(cache, b)


def seq_blocks(cache: TieredKVCache, seq) -> list[BlockView]:
    return [BlockView(cache, b) for b in seq.blocks]


def indexed(cache: TieredKVCache) -> dict[bytes, BlockView]:
    """Every published block, by key."""
    with cache.locked():
        return {k: BlockView(cache, b) for k, b in cache.index.prefix.items()}


def in_index(cache: TieredKVCache, key: bytes) -> bool:
    return cache.index.lookup(key) is not None


def gathered(cache: TieredKVCache) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """Every open sequence's gathered K/V, every layer (tensor storage only)."""
    return {s.id: [cache.gather(s, layer) for layer in range(cache.num_layers)]
            for s in cache.open_sequences()}


def assert_same_data(a, b) -> None:
    assert a.keys() == b.keys()
    for sid in a:
        for (k1, v1), (k2, v2) in zip(a[sid], b[sid]):
            assert torch.equal(k1, k2) and torch.equal(v1, v2)


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def keys_of(cache: TieredKVCache, token_ids, salt=None, adapter_id=None) -> list[bytes]:
    """Chained keys of the full blocks of `token_ids` under this cache's namespace."""
    key, _ = cache.hasher.root(salt, adapter_id)
    arr = np.asarray(token_ids, dtype=np.int32)
    bs = cache.block_size
    out = []
    for i in range(len(arr) // bs):
        key = cache.hasher.key(key, arr[i * bs:(i + 1) * bs].tobytes())
        out.append(key)
    return out


def cached_prefix_blocks(cache: TieredKVCache, token_ids, salt=None) -> int:
    """How many leading full blocks of `token_ids` are in the index."""
    n = 0
    for key in keys_of(cache, token_ids, salt):
        if cache.index.lookup(key) is None:
            break
        n += 1
    return n


def track_caches(monkeypatch) -> list[TieredKVCache]:
    """Record every TieredKVCache built while the test runs (tests/conftest.py's
    `invariants_after_test` checks each one when the test ends)."""
    made: list[TieredKVCache] = []
    init = TieredKVCache.__init__

    def tracking_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(TieredKVCache, "__init__", tracking_init)
    return made


__all__ = ["BlockView", "block_at", "seq_blocks", "indexed", "in_index", "check_invariants",
           "make_cache", "make_config", "config_dict", "snapshot",
           "random_kv", "write_random", "pattern_kv", "write_pattern", "write_pattern_all",
           "check_pattern", "gathered", "assert_same_data", "free_slots", "tokens", "keys_of",
           "cached_prefix_blocks", "track_caches"]
