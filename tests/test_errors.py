"""Bad input raises the typed error with a clear message and leaves the cache exactly as it was:
same stats, same blocks and slots, same open sequences, same data, invariants intact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers import (
    assert_same_data,
    check_invariants,
    config_dict,
    gathered,
    make_cache,
    random_kv,
    snapshot,
    tokens,
    write_random,
)
from tiered_cache import CacheConfig, TieredKVCache
from tiered_cache.errors import (
    ConfigError,
    DTypeError,
    LayerError,
    SequenceClosedError,
    ShapeError,
    StorageDisabledError,
    TieredCacheError,
    TierUnavailableError,
    TokenError,
)

H, D = 2, 4                                               # helpers' geometry


@pytest.fixture
def busy():
    """A cache with history: a cached prompt, an open sequence half written (one block
    published, one private), another open sequence with a hit."""
    cache = make_cache(gpu_blocks=16, host_blocks=8)
    g = torch.Generator().manual_seed(0)
    s = cache.open(tokens(8))
    write_random(cache, s, g)
    cache.close(s)
    half = cache.open(tokens(10, start=100))
    write_random(cache, half, g, n=6)
    hit = cache.open(tokens(9))
    write_random(cache, hit, g, n=1)
    return cache, half, hit


def rejected(cache, exc_type, match, fn):
    """fn() raises exc_type matching `match`; nothing observable changed."""
    before = snapshot(cache)
    data = gathered(cache) if cache.has_storage else None
    with pytest.raises(exc_type, match=match) as info:
        fn()
    assert isinstance(info.value, TieredCacheError) or exc_type is TypeError
    assert snapshot(cache) == before
    if data is not None:
        assert_same_data(gathered(cache), data)
    check_invariants(cache)
    return info.value


def kv(n, dtype=torch.float32, shape=None):
    shape = shape or (n, H, D)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


# ---------------------------------------------------------------------------- write


@pytest.mark.parametrize("shape, match", [
    ((2, H, D + 1), r"key: expected shape \[n, 2, 4\] \(tokens, kv heads, head_dim\), "
                    r"got \[2, 2, 5\]"),
    ((2, H + 1, D), r"key: expected shape \[n, 2, 4\].*got \[2, 3, 4\]"),
    ((2, H * D), r"key: expected shape \[n, 2, 4\].*got \[2, 8\]"),
    ((1, 2, H, D), r"key: expected shape \[n, 2, 4\].*got \[1, 2, 2, 4\]"),
    ((), r"key: expected shape .*got \[\]"),
])
def test_write_wrong_key_shape(busy, shape, match):
    cache, half, _ = busy
    k = torch.zeros(shape)
    rejected(cache, ShapeError, match, lambda: cache.write(half, 0, k, k))


def test_write_wrong_value_shape(busy):
    cache, half, _ = busy
    k, _ = kv(2)
    rejected(cache, ShapeError, r"value: expected shape \[n, 2, 4\].*got \[2, 2, 3\]",
             lambda: cache.write(half, 0, k, torch.zeros(2, H, 3)))


def test_write_mismatched_key_value(busy):
    cache, half, _ = busy
    rejected(cache, ShapeError, r"key and value shapes differ: \[2, 2, 4\] vs \[3, 2, 4\]",
             lambda: cache.write(half, 0, torch.zeros(2, H, D), torch.zeros(3, H, D)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int32])
def test_write_wrong_dtype(busy, dtype):
    cache, half, _ = busy
    k, v = kv(2, dtype)
    rejected(cache, DTypeError, rf"key: expected dtype torch.float32 \(model.dtype\), "
                                rf"got {dtype}", lambda: cache.write(half, 1, k, v))
    good, _ = kv(2)
    rejected(cache, DTypeError, rf"value: expected dtype torch.float32.*got {dtype}",
             lambda: cache.write(half, 1, good, v))


@pytest.mark.parametrize("bad", [np.zeros((2, H, D), np.float32), [[[0.0] * D] * H] * 2, None,
                                 3.0])
def test_write_non_tensor(busy, bad):
    cache, half, _ = busy
    good, _ = kv(2)
    name = type(bad).__name__
    rejected(cache, DTypeError, rf"key: expected a torch.Tensor, got {name}",
             lambda: cache.write(half, 0, bad, good))
    rejected(cache, DTypeError, rf"value: expected a torch.Tensor, got {name}",
             lambda: cache.write(half, 0, good, bad))


@pytest.mark.parametrize("layer, exc, match", [
    (2, LayerError, r"layer: expected 0 <= layer < 2, got 2"),
    (-1, LayerError, r"layer: expected 0 <= layer < 2, got -1"),
    (10**20, LayerError, r"layer: expected 0 <= layer < 2"),
    (True, LayerError, r"layer: expected an int, got bool"),
    (0.0, LayerError, r"layer: expected an int, got float"),
    ("0", LayerError, r"layer: expected an int, got str"),
    (None, LayerError, r"layer: expected an int, got NoneType"),
    (np.float32(0), LayerError, r"layer: expected an int, got float32"),
    (torch.tensor(0), LayerError, r"layer: expected an int, got Tensor"),
])
def test_bad_layer(busy, layer, exc, match):
    cache, half, hit = busy
    k, v = kv(1)
    rejected(cache, exc, match, lambda: cache.write(half, layer, k, v))
    rejected(cache, exc, match, lambda: cache.gather(hit, layer))
    assert issubclass(exc, IndexError)                    # LayerError is an IndexError too


def test_numpy_integer_layer_is_fine(busy):
    cache, half, _ = busy
    k, v = kv(1)
    cache.write(half, np.int64(1), k, v)
    assert half.written[1] == 7


def test_write_past_declared_tokens(busy):
    cache, half, _ = busy
    k, v = kv(5)                                          # 6 of 10 written
    rejected(cache, ShapeError, r"write: layer 0 has 6 of 10 tokens written; 5 more would pass "
                                r"the declared tokens \(append them first\)",
             lambda: cache.write(half, 0, k, v))
    cache.write(half, 0, *kv(4))                          # exactly up to the end is fine
    rejected(cache, ShapeError, r"layer 0 has 10 of 10", lambda: cache.write(half, 0, *kv(1)))


def test_failed_write_publishes_nothing():
    cache = make_cache()
    s = cache.open(tokens(8))
    cache.write(s, 0, *random_kv(cache, 8, torch.Generator().manual_seed(1)))
    k, _ = kv(8)
    rejected(cache, ShapeError, "shapes differ", lambda: cache.write(s, 1, k, torch.zeros(7, H, D)))
    assert cache.stats()["cached_blocks"] == 0
    other = cache.open(tokens(8))
    assert other.num_cached_tokens == 0


# ---------------------------------------------------------------------------- tokens, salt


@pytest.mark.parametrize("bad, match", [
    ([1, -2], r"token_ids\[1\]: expected a token id in \[0, 2\*\*31\), got -2"),
    ([1.5], r"token_ids\[0\]: expected a non-negative int, got 1.5"),
    ([False], r"token_ids\[0\]: expected a non-negative int, got False"),
    (np.ones((2, 2), np.int64), r"token_ids: expected a 1-D sequence"),
    ("12", r"token_ids: expected a list, numpy array or tensor of ints, got str"),
])
def test_bad_token_ids(busy, bad, match):
    cache, half, _ = busy
    rejected(cache, TokenError, match, lambda: cache.open(bad))
    rejected(cache, TokenError, match, lambda: cache.append(half, bad))
    rejected(cache, TokenError, match, lambda: cache.invalidate(bad))
    assert half.num_tokens == 10


@pytest.mark.parametrize("salt", [1, 1.0, ["a"], ("a",), object()])
def test_bad_salt(busy, salt):
    cache, _, _ = busy
    match = rf"salt: expected a str, bytes or None, got {type(salt).__name__}"
    rejected(cache, TokenError, match, lambda: cache.open(tokens(8), salt=salt))
    rejected(cache, TokenError, match, lambda: cache.invalidate(tokens(8), salt=salt))


# ---------------------------------------------------------------------------- sequences


def test_use_after_close(busy):
    cache, half, _ = busy
    cache.close(half)
    k, v = kv(1)
    m = rf"sequence {half.id} is closed"
    rejected(cache, SequenceClosedError, m, lambda: cache.write(half, 0, k, v))
    rejected(cache, SequenceClosedError, m, lambda: cache.gather(half, 0))
    rejected(cache, SequenceClosedError, m, lambda: cache.append(half, [1]))
    rejected(cache, SequenceClosedError, m, lambda: cache.close(half))
    rejected(cache, SequenceClosedError, m, lambda: cache.wait(half, 0))
    assert half.blocks == []


def test_sequence_from_another_cache(busy):
    cache, half, _ = busy
    other = make_cache()
    stranger = other.open(tokens(8))
    k, v = kv(1)
    m = rf"sequence {stranger.id} belongs to another cache"
    rejected(cache, SequenceClosedError, m, lambda: cache.write(stranger, 0, k, v))
    rejected(cache, SequenceClosedError, m, lambda: cache.gather(stranger, 0))
    rejected(cache, SequenceClosedError, m, lambda: cache.append(stranger, [1]))
    rejected(cache, SequenceClosedError, m, lambda: cache.close(stranger))
    rejected(other, SequenceClosedError, rf"sequence {half.id} belongs to another cache",
             lambda: other.close(half))
    other.close(stranger)                                 # its own cache still takes it


@pytest.mark.parametrize("bad", [None, 3, "seq", object()])
def test_not_a_sequence(busy, bad):
    cache, _, _ = busy
    m = rf"expected a Sequence from TieredKVCache.open, got {type(bad).__name__}"
    rejected(cache, TypeError, m, lambda: cache.close(bad))
    rejected(cache, TypeError, m, lambda: cache.gather(bad, 0))
    rejected(cache, TypeError, m, lambda: cache.write(bad, 0, *kv(1)))


# ---------------------------------------------------------------------------- storage modes


def test_storage_none_has_no_data_operations():
    cache = make_cache(storage="none")
    seq = cache.open(tokens(8))
    rejected(cache, StorageDisabledError, r"gather needs tensor storage; this cache has "
                                          r"storage: none", lambda: cache.gather(seq, 0))
    q = torch.zeros(1, H, D)
    rejected(cache, StorageDisabledError, r"attention needs tensor storage",
             lambda: cache.attention(q, [seq], 0))
    rejected(cache, StorageDisabledError, r"prefill_attention needs tensor storage",
             lambda: cache.prefill_attention(q, seq, 0))
    # write() still validates shapes and counts tokens as written (metadata only, any dtype).
    wide = kv(1, shape=(1, H, 9))
    rejected(cache, ShapeError, r"key: expected shape", lambda: cache.write(seq, 0, *wide))
    cache.write(seq, 0, *kv(8, torch.float16))
    cache.write(seq, 1, *kv(8))
    assert seq.written == [8, 8]
    assert cache.stats()["cached_blocks"] == 2
    cache.close(seq)


def test_mark_computed_needs_storage_none(busy):
    cache, half, _ = busy
    rejected(cache, StorageDisabledError, r"mark_computed is only for `storage: none`",
             lambda: cache.mark_computed(half))


def test_mark_computed_after_close():
    cache = make_cache(storage="none")
    seq = cache.open(tokens(8))
    cache.close(seq)
    rejected(cache, SequenceClosedError, "is closed", lambda: cache.mark_computed(seq))


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize("extra, path, match", [
    ({"tiers": {"gpu": {"num_blocks": 0}}}, "tiers.gpu.num_blocks",
     r"^tiers\.gpu\.num_blocks: expected a positive integer, got 0$"),
    ({"tiers": {"host": {"num_blocks": -1}}}, "tiers.host.num_blocks",
     r"^tiers\.host\.num_blocks: expected a non-negative integer, got -1$"),
    ({"tiers": {"gpu": {"num_block": 4}}}, "tiers.gpu.num_block",
     r"^tiers\.gpu\.num_block: unknown key; did you mean 'num_blocks'\?$"),
    ({"tiers": {"host": {"capacity": "lots", "num_blocks": None}}}, "tiers.host.capacity",
     r"^tiers\.host\.capacity: expected a size like '64GiB' or '70%', got 'lots'$"),
    ({"tiers": {"gpu": {"capacity": "1GiB"}}}, "tiers.gpu",
     r"^tiers\.gpu: set exactly one of 'capacity' or 'num_blocks', got both$"),
    ({"tiers": {"gpu": {"device": "tpu"}}}, "tiers.gpu.device",
     r"^tiers\.gpu\.device: expected one of 'auto', 'cpu', 'cuda' or 'cuda:N', got 'tpu'$"),
    ({"tiers": {"host": {"memory": "swap"}}}, "tiers.host.memory",
     r"^tiers\.host\.memory: expected one of 'pinned', 'managed', 'pageable', got 'swap'$"),
    ({"model": {"dtype": "int8"}}, "model.dtype", r"^model\.dtype: expected one of .*'int8'$"),
    ({"model": {"num_layers": 0}}, "model.num_layers",
     r"^model\.num_layers: expected a positive integer, got 0$"),
    ({"model": {"num_q_heads": 3}}, "model.num_q_heads",
     r"^model\.num_q_heads: must be a multiple of num_kv_heads \(2\), got 3$"),
    ({"block_size": 3}, "block_size",
     r"^block_size: expected a power of two in 1\.\.4096 or 'auto', got 3$"),
    ({"write_policy": "sometimes"}, "write_policy",
     r"^write_policy: expected one of 'write_back', 'write_through', got 'sometimes'$"),
    ({"storage": "disk"}, "storage", r"^storage: expected one of 'tensors', 'none', got 'disk'$"),
    ({"verify_tokens": "yes"}, "verify_tokens", r"^verify_tokens: expected true or false"),
    ({"policy": "mru"}, "policy", r"^policy: unknown policy 'mru'"),
    ({"migrator": {"low_watermark": 0.95}}, "migrator.low_watermark",
     r"^migrator\.low_watermark: must be below high_watermark \(0\.9\), got 0\.95$"),
    ({"tiers": "big"}, "tiers", r"^tiers: expected a mapping of keys, got str 'big'$"),
    ({"modle": {}}, "modle", r"^modle: unknown key; did you mean 'model'\?$"),
])
def test_config_errors(extra, path, match):
    with pytest.raises(ConfigError, match=match) as info:
        TieredKVCache(CacheConfig.from_dict(config_dict(extra=extra)))
    assert info.value.path == path
    assert isinstance(info.value, ValueError)


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_tier_unavailable_without_cuda():
    with pytest.raises(TierUnavailableError, match=r"tiers\.gpu\.device is 'cuda' but CUDA is "
                                                   r"not available"):
        make_cache(device="cuda")
    with pytest.raises(TierUnavailableError, match=r"tiers\.host\.memory: 'managed' needs CUDA"):
        make_cache(host_memory="managed")
