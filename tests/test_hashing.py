"""Block identity: chained 128-bit keys stable across processes, the namespace, token validation,
and what a weak (colliding) hash can and cannot do to the cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
import xxhash

from tests.helpers import (
    check_invariants,
    keys_of,
    make_cache,
    random_kv,
    snapshot,
    tokens,
    write_random,
)
from tiered_cache.errors import CapacityError, TokenError
from tiered_cache.hashing import BlockHasher, Namespace, as_token_array, xxh3_128

PROMPT = list(range(37)) + [2**31 - 1, 0, 5]             # 10 full blocks of 4


def _keys_in_process(salt="tenant-1"):
    cache = make_cache(storage="none")
    seq = cache.open(PROMPT, salt=salt)
    cache.mark_computed(seq)
    keys = [k.hex() for k in seq.keys]
    cache.close(seq)
    return keys


_SUBPROCESS = textwrap.dedent("""
    import json
    from tests.helpers import make_cache
    cache = make_cache(storage="none")
    seq = cache.open({prompt!r}, salt="tenant-1")
    cache.mark_computed(seq)
    print(json.dumps([k.hex() for k in seq.keys]))
""")


@pytest.mark.slow
@pytest.mark.parametrize("hash_seed", ["0", "12345"])
def test_keys_stable_across_processes(hash_seed):
    here = _keys_in_process()
    assert len(here) == 10 and len(set(here)) == 10
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONHASHSEED=hash_seed,
               PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run([sys.executable, "-c", _SUBPROCESS.format(prompt=PROMPT)],
                         capture_output=True, text=True, env=env, cwd=root, timeout=120,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == here


def test_keys_follow_the_documented_chain():
    """key(i) = xxh3_128(key(i-1) || block i's ids as int32 little-endian), key(-1) =
    xxh3_128(namespace encoding)."""
    ns = Namespace("golden-model", "bfloat16", 80, 8, 128, 16, None)
    h = BlockHasher(ns)
    root, _ = h.root("tenant-1")
    assert root == xxhash.xxh3_128_digest(ns.encode("tenant-1"))
    assert len(root) == 16
    ids = np.arange(32, dtype="<i4")
    k0 = h.key(root, ids[:16].tobytes())
    k1 = h.key(k0, ids[16:].tobytes())
    assert k0 == xxh3_128(root + ids[:16].tobytes())
    assert k1 == xxhash.xxh3_128_digest(k0 + ids[16:].tobytes())
    # Golden values: changing the key format orphans every persisted or shared block, so it
    # must be a deliberate change (bump the version string in hashing.py and these values).
    assert root.hex() == "2f9307aa60c66e48e44979f382b6ca3f"
    assert k0.hex() == "faf70d217f13e180051773c7d80fa750"


def test_cache_keys_match_the_chain():
    cache = make_cache(storage="none")
    seq = cache.open(PROMPT)
    assert seq.keys == []                                 # nothing cached yet
    cache.mark_computed(seq)
    assert seq.keys == keys_of(cache, PROMPT)
    cache.close(seq)
    assert set(cache.index.prefix) == set(keys_of(cache, PROMPT))


def _root(**overrides):
    return make_cache(storage="none", **overrides).hasher.root(None)[0]


def test_every_namespace_field_changes_the_key():
    base = _root()
    variants = {
        "model": _root(name="other-model"),
        "dtype": _root(dtype="float16"),
        "num_layers": _root(num_layers=3),
        "num_kv_heads": _root(num_kv_heads=1),
        "head_dim": _root(head_dim=8),
        "block_size": _root(block_size=8),
        "adapter": _root(adapter_id="lora-7"),
    }
    for field, root in variants.items():
        assert root != base, field
    assert len(set(variants.values())) == len(variants)
    assert _root() == base                                # and it is deterministic

    cache = make_cache(storage="none")
    h = cache.hasher
    salted = {h.root(s)[0] for s in (None, "a", "b", "ab", "a\0")}
    assert len(salted) == 5
    assert h.root("a")[0] == h.root(b"a")[0]              # a str salt is its UTF-8 bytes
    assert h.root(None, "lora-7")[0] == variants["adapter"]   # per-open adapter = config's
    assert h.root("a", "lora-7")[0] not in salted | {variants["adapter"]}
    # Different roots give different keys for the same tokens at every depth.
    a, b = keys_of(cache, PROMPT), keys_of(cache, PROMPT, salt="a")
    assert not set(a) & set(b)


def test_namespace_encoding_cannot_alias():
    ns = Namespace("m", "float32", 1, 1, 4, 4, None)
    # The salt is length-prefixed: no (namespace, salt) pair aliases another.
    assert ns.encode("x") != ns.encode("x\0")
    assert ns.encode("") == ns.encode(None)
    ns2 = Namespace("m", "float32", 1, 1, 4, 4, "")
    assert ns2.encode(None) != ns.encode(None)


# ---------------------------------------------------------------------------- validation


@pytest.mark.parametrize("bad, message", [
    ([1, -1], r"token_ids\[1\]: expected a token id in \[0, 2\*\*31\), got -1"),
    ([2**31], r"token_ids\[0\]: expected a token id in \[0, 2\*\*31\), got 2147483648"),
    (np.array([3, 2**31], dtype=np.int64), r"token_ids\[1\]: .*got 2147483648"),
    (np.array([-5], dtype=np.int32), r"token_ids\[0\]: .*got -5"),
    ([0, 1.0], r"token_ids\[1\]: expected a non-negative int, got 1.0"),
    (np.array([1.0, 2.0]), r"token_ids: expected integer token ids, got dtype float64"),
    (torch.tensor([1.0]), r"token_ids: expected integer token ids, got a tensor of torch.float32"),
    ([True, 2], r"token_ids\[0\]: expected a non-negative int, got True"),
    (np.array([True]), r"token_ids: expected integer token ids, got dtype bool"),
    (torch.tensor([True]), r"expected integer token ids, got a tensor of torch.bool"),
    (np.zeros((2, 2), dtype=np.int64), r"token_ids: expected a 1-D sequence, got shape \(2, 2\)"),
    (torch.zeros((1, 3), dtype=torch.int64), r"expected a 1-D sequence, got shape \(1, 3\)"),
    ([[1, 2], [3, 4]], r"token_ids\[0\]: expected a non-negative int, got \[1, 2\]"),
    ("hello", r"token_ids: expected a list, numpy array or tensor of ints, got str"),
    (["a", "b"], r"token_ids\[0\]: expected a non-negative int, got 'a'"),
    (None, r"got NoneType"),
    (b"\x01\x02", r"got bytes"),
    (np.array(5), r"expected a 1-D sequence, got shape \(\)"),
])
def test_token_validation_errors(bad, message):
    with pytest.raises(TokenError, match=message):
        as_token_array(bad)
    cache = make_cache(storage="none")
    before = snapshot(cache)
    with pytest.raises(TokenError, match=message):
        cache.open(bad)
    assert snapshot(cache) == before


@pytest.mark.parametrize("huge", [2**63, 2**64, -(2**63) - 1, 10**30])
def test_huge_python_ints_are_token_errors(huge):
    """BUG (hashing.py `as_token_array`): a list element outside int64 passes the per-element
    isinstance check and then `np.asarray(..., dtype=np.int64)` raises OverflowError, not the
    typed TokenError naming the element."""
    with pytest.raises(TokenError, match=r"token_ids\[1\]"):
        as_token_array([1, huge])


@pytest.mark.parametrize("good", [
    [0, 1, 2**31 - 1], (5, 6), range(3), np.array([1, 2], dtype=np.int64),
    np.array([1, 2], dtype=np.uint16), torch.tensor([1, 2]), [np.int64(3), np.int32(4)], [],
])
def test_token_forms_accepted(good):
    arr = as_token_array(good)
    assert arr.dtype == np.int32 and arr.ndim == 1
    assert arr.tolist() == [int(x) for x in list(good)]



@pytest.mark.parametrize("dtype", [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16,
                                   np.uint32, np.uint64])
def test_token_range_check_of_every_integer_dtype(dtype):
    """The range check takes one reduction where the dtype allows (hashing._out_of_range):
    every dtype still rejects exactly the ids outside [0, 2**31), naming the first one."""
    info = np.iinfo(dtype)
    good = np.array([0, 1, min(info.max, 2**31 - 1)], dtype=dtype)
    assert as_token_array(good).tolist() == [int(x) for x in good]
    bad = [v for v in (-1, info.min, 2**31, info.max) if info.min <= v <= info.max
           and not 0 <= v < 2**31]
    for v in bad:
        arr = np.array([3, v, 4, v], dtype=dtype)
        with pytest.raises(TokenError, match=rf"token_ids\[1\]: .*got {v}$"):
            as_token_array(arr)


# ---------------------------------------------------------------------------- weak hashes


def constant_hash(data: bytes) -> bytes:
    return b"\0" * 16


def test_constant_hash_never_serves_another_prompts_kv():
    cache = make_cache(hash_fn=constant_hash)
    g = torch.Generator().manual_seed(0)
    a = cache.open(tokens(8, start=10))
    a_kv = write_random(cache, a, g)
    cache.close(a)
    assert cache.stats()["cached_blocks"] == 1            # A's 2nd block collided with its 1st
    b = cache.open(tokens(8, start=20))
    assert b.num_cached_tokens == 0
    assert cache.stats()["collisions"] > 0
    b_kv = write_random(cache, b, g)
    for layer in range(cache.num_layers):
        gk, gv = cache.gather(b, layer)
        assert torch.equal(gk, b_kv[layer][0]) and torch.equal(gv, b_kv[layer][1])
        assert not torch.equal(gk[:4], a_kv[layer][0][:4])
    cache.close(b)
    # A prompt that genuinely shares A's first block gets exactly that block.
    c = cache.open(tokens(4, start=10) + tokens(4, start=90))
    assert c.num_cached_tokens == 4
    c_kv = write_random(cache, c, g)
    for layer in range(cache.num_layers):
        gk, gv = cache.gather(c, layer)
        assert torch.equal(gk[:4], a_kv[layer][0][:4])
        assert torch.equal(gk[4:], c_kv[layer][0])
    cache.close(c)
    check_invariants(cache)


def _collide_on_999(data: bytes) -> bytes:
    """xxh3-128, except that every block containing token 999 gets the same key."""
    if np.frombuffer(data[-16:], dtype="<i4").tolist().count(999):
        return b"\x99" * 16
    return xxh3_128(data)


@pytest.mark.parametrize("verify_tokens", [True, False])
def test_hash_colliding_on_some_blocks(verify_tokens):
    cache = make_cache(hash_fn=_collide_on_999, verify_tokens=verify_tokens)
    g = torch.Generator().manual_seed(1)
    head, other_head = tokens(4, start=100), tokens(4, start=200)
    x, y = [999, 1, 2, 3], [999, 7, 8, 9]
    a = cache.open(head + x)
    a_kv = write_random(cache, a, g)
    cache.close(a)
    assert cache.stats()["cached_blocks"] == 2

    # Same parent, different tokens, same key: only token verification can tell them apart.
    b = cache.open(head + y)
    if verify_tokens:
        assert b.num_cached_tokens == 4
        assert cache.stats()["collisions"] >= 1
        b_kv = write_random(cache, b, g)
        gk, _ = cache.gather(b, 0)
        assert torch.equal(gk[:4], a_kv[0][0][:4]) and torch.equal(gk[4:], b_kv[0][0])
    else:
        assert b.num_cached_tokens == 8                   # documented: verification is off
    cache.close(b)

    # Same tokens, different parent, same key: the parent check holds even without
    # token verification.
    c = cache.open(other_head + x)
    assert c.num_cached_tokens == 0
    c_kv = write_random(cache, c, g)
    cache.close(c)
    d = cache.open(other_head + x)
    assert d.num_cached_tokens == 4                       # C's head only; its x block collided
    for layer in range(cache.num_layers):
        gk, gv = cache.gather(d, layer)
        assert torch.equal(gk, c_kv[layer][0][:4]) and torch.equal(gv, c_kv[layer][1][:4])
    cache.close(d)
    assert cache.stats()["collisions"] >= 2


@pytest.mark.parametrize("verify_tokens", [True, False])
def test_colliding_tenants_stay_isolated(verify_tokens):
    """Constant hash: both tenants' roots and first blocks share one key; the root id stored
    on depth-0 blocks keeps them apart."""
    cache = make_cache(hash_fn=constant_hash, verify_tokens=verify_tokens)
    g = torch.Generator().manual_seed(2)
    p = tokens(4, start=50)
    a = cache.open(p, salt="tenant-a")
    a_kv = write_random(cache, a, g)
    cache.close(a)
    assert cache.hasher.root("tenant-a")[0] == cache.hasher.root("tenant-b")[0]
    assert cache.hasher.root("tenant-a")[1] != cache.hasher.root("tenant-b")[1]
    b = cache.open(p, salt="tenant-b")
    assert b.num_cached_tokens == 0
    assert cache.stats()["collisions"] >= 1
    write_random(cache, b, g)
    cache.close(b)
    assert cache.stats()["cached_blocks"] == 1            # B's block collided: stays private
    again = cache.open(p, salt="tenant-a")
    assert again.num_cached_tokens == 4
    gk, _ = cache.gather(again, 0)
    assert torch.equal(gk, a_kv[0][0])
    cache.close(again)
    assert cache.invalidate(p, salt="tenant-b") == 0      # B cannot drop A's block either
    assert cache.stats()["cached_blocks"] == 1


def test_collision_counter_unchanged_by_a_failed_open():
    """A CapacityError leaves the cache exactly as it was, counters included.

    BUG (cache.py `_match`): collisions are counted while matching, before the capacity check
    of open() can fail, so a failed open bumps `stats()['collisions']`."""
    cache = make_cache(hash_fn=constant_hash, gpu_blocks=2, host_blocks=0, storage="none")
    a = cache.open(tokens(4, start=10))
    cache.mark_computed(a)                                # published under the constant key
    b = cache.open(tokens(4, start=20))                   # collides; both blocks stay pinned
    assert b.num_cached_tokens == 0
    before = snapshot(cache)
    with pytest.raises(CapacityError):
        cache.open(tokens(4, start=30))                   # collides again, then no room
    assert cache.stats()["collisions"] == before["stats"]["collisions"]
    assert snapshot(cache) == before


def test_weak_hash_write_through_and_eviction():
    """Collisions under eviction pressure: data is only ever served for the right prompt."""
    cache = make_cache(hash_fn=lambda b: bytes([sum(b) % 3]) * 16, gpu_blocks=4,
                       host_blocks=4, write_policy="write_through")
    g = torch.Generator().manual_seed(3)
    data = {}
    prompts = [tokens(8, start=s) for s in (0, 3, 6, 9, 12, 15)]
    for p in prompts * 2:
        s = cache.open(p)
        k_all = []
        for layer in range(cache.num_layers):
            k, v = random_kv(cache, s.num_tokens - s.written[layer], g)
            cache.write(s, layer, k, v)
            gk, gv = cache.gather(s, layer)
            k_all.append(gk)
        key = tuple(p)
        if key in data:
            for layer in range(cache.num_layers):
                n = s.num_cached_tokens
                assert torch.equal(k_all[layer][:n], data[key][layer][:n])
        else:
            data[key] = k_all
        cache.close(s)
        check_invariants(cache)


def test_chain_is_the_keys_of_the_whole_blocks_one_after_another():
    h = BlockHasher(Namespace("m", "float16", 2, 2, 8, 4, None))
    root, _ = h.root(None)
    tokens = np.arange(10, 10 + 4 * 3 + 2, dtype=np.int64)     # 3 whole blocks and a tail
    keys, key = [], root
    for i in range(3):
        key = h.key(key, tokens[4 * i:4 * i + 4].astype(np.int32).tobytes())
        keys.append(key)
    assert h.chain(root, tokens) == keys                        # int64 ids as int32 ones
    assert h.chain(keys[0], tokens[4:]) == keys[1:]
    assert h.chain(root, tokens[:3]) == []
