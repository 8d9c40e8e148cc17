"""tiered_cache/xxh3.py: the compiled chained keys are exactly xxhash's xxh3-128 digests, for
every block size it takes (every input length it handles), random and extreme token ids,
parents of every kind; and the index takes this path only for the default hash function."""

from __future__ import annotations

import os

import numpy as np
import pytest
import xxhash

from tiered_cache import xxh3
from tiered_cache.hashing import BlockHasher, Namespace


def reference(parent: bytes, tokens: np.ndarray, bs: int, n: int) -> bytes:
    data = tokens.astype("<i4").tobytes()
    key, out = parent, []
    for i in range(n):
        key = xxhash.xxh3_128_digest(key + data[4 * bs * i:4 * bs * (i + 1)])
        out.append(key)
    return b"".join(out)


@pytest.mark.parametrize("bs", [b for b in range(0, 40) if xxh3.fits(b)])
def test_every_block_size_it_takes(bs):
    assert 17 <= 16 + 4 * bs <= 128
    rng = np.random.default_rng(bs)
    for trial in range(60):
        n = int(rng.integers(1, 40))
        if trial % 3 == 0:          # extreme ids: 0, the largest, and sign-bit patterns
            toks = rng.choice(np.array([0, 1, 2**31 - 1, 2**30, 255, 256], np.int64), n * bs)
        else:
            toks = rng.integers(0, 2**31 - 1, n * bs, dtype=np.int64)
        toks = toks.astype(np.int32)
        parent = [bytes(16), b"\xff" * 16, os.urandom(16)][trial % 3]
        assert xxh3.chain_keys(parent, toks, bs, n) == reference(parent, toks, bs, n)


def test_what_it_does_not_take():
    assert [b for b in range(64) if xxh3.fits(b)] == list(range(2, 29, 2))


def test_the_hasher_uses_it_only_for_the_default_hash():
    ns = Namespace("m", "float16", 2, 1, 4, 16)
    fast = BlockHasher(ns)
    slow = BlockHasher(ns, hash_fn=lambda b: xxhash.xxh3_128_digest(b))
    odd = BlockHasher(Namespace("m", "float16", 2, 1, 4, 15))
    assert fast.compiled and not slow.compiled and not odd.compiled
    toks = np.arange(16 * 9, dtype=np.int32)
    root = fast.root()[0]
    want = reference(root, toks, 16, 9)
    for h in (fast, slow):
        assert h.keys(root, toks, 0, 9) == want
        assert h.keys(want[32:48], toks, 3, 6) == want[48:]


def test_a_built_stack_has_compiled_its_hasher(tmp_path):
    """The kernel compiles (or loads) as the tiers are built, not at the first lookup: a fresh
    daemon's first lookup paid about 200 ms for it, past a 50 ms lookup deadline."""
    from tiered_cache.config import CacheConfig
    from tiered_cache.daemon.partition import Partition

    cfg = CacheConfig.from_dict({"model": {"name": "m", "num_layers": 2, "num_kv_heads": 1,
                                           "head_dim": 4, "dtype": "float32"},
                                 "block_size": 16, "tiers": {"host": {"num_blocks": 4}},
                                 "daemon": {"socket": str(tmp_path / "d.sock")}})
    part = Partition("t", cfg)
    try:
        assert part.hasher._compiled is True
    finally:
        part.close()
