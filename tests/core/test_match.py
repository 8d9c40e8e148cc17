"""The prefix match of core/index.py (`_match_keys`): compiled key rounds, each looked up from its
deepest key and its chain taken from the parents, checked against a lookup of every key."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.helpers import make_cache
from tiered_cache.core.invariants import check_invariants

BS = 4


def reference_match(cache, prompt: np.ndarray) -> list[int]:
    """The plain match: every block's chained key looked up in turn, up to the first miss,
    each found block the child of the one before it."""
    idx = cache.index
    root = idx.hasher.root(None)[0]
    out: list[int] = []
    parent = -1
    for key in idx.hasher.chain(root, prompt):
        b = idx.prefix.get(key)
        if b is None or idx.blocks.parent[b] != parent:
            break
        out.append(b)
        parent = b
    return out


def publish(cache, prompt: np.ndarray) -> list[int]:
    s = cache.open(prompt)
    cache.mark_computed(s)
    blocks = list(s.blocks)
    cache.close(s)
    return blocks


@pytest.mark.parametrize("seed,policy", [(0, "lru"), (1, "lru"), (2, "adaptive"),
                                         (3, "adaptive")])
def test_the_match_equals_a_lookup_of_every_key(seed, policy):
    """Prompts of up to 300 blocks (rounds of 64, 128, 256 keys) sharing prefixes of every
    length, including a round's edges: every open matches exactly what the per-key lookup
    finds, and the same ids."""
    rng = random.Random(seed)
    cache = make_cache(storage="none", gpu_blocks=4096, host_blocks=0, block_size=BS,
                       policy=policy)
    base = np.arange(300 * BS, dtype=np.int32) + 1000
    publish(cache, base)
    cuts = [0, 1, 2, 63, 64, 65, 127, 128, 191, 192, 193, 255, 256, 299, 300]
    cuts += [rng.randrange(300) for _ in range(10)]
    for cut in cuts:
        p = base.copy()
        if cut < 300:
            p[cut * BS + rng.randrange(BS)] = 7          # diverges in block `cut`
        want = reference_match(cache, p)
        assert len(want) == cut
        s = cache.open(p)
        assert s.blocks[:s.num_cached_tokens // BS] == want
        assert s.num_cached_tokens == BS * cut
        cache.mark_computed(s)
        cache.close(s)
    check_invariants(cache)
    again = cache.open(base)
    assert again.num_cached_tokens == 300 * BS
    cache.close(again)


@pytest.mark.parametrize("verify_tokens", [True, False])
def test_a_deepest_key_naming_another_chain_is_not_taken(verify_tokens, monkeypatch):
    """Prompt B's last key made equal to prompt A's (a collision of the deepest key of a
    round): the chain above A's block is A's, whose keys are not B's, so B matches only what
    its own keys find, with token verification or without."""
    cache = make_cache(storage="none", gpu_blocks=1024, host_blocks=0, block_size=BS,
                       verify_tokens=verify_tokens)
    a = np.arange(40 * BS, dtype=np.int32) + 10
    b = a.copy()
    b[:BS] += 5000                                      # B shares nothing with A
    a_blocks = publish(cache, a)
    idx = cache.index
    genuine = idx.hasher.keys
    a_last = genuine(idx.hasher.root(None)[0], a, 0, 40)[-16:]
    b_bytes = b.tobytes()

    def keys(parent, tokens, first, n):
        kb = genuine(parent, tokens, first, n)
        if tokens[first * BS:(first + n) * BS].tobytes() == b_bytes[first * 4 * BS:
                                                                    (first + n) * 4 * BS]:
            kb = kb[:-16] + a_last                      # B's deepest key collides with A's
        return kb

    monkeypatch.setattr(idx.hasher, "keys", keys)
    s = cache.open(b)
    assert s.num_cached_tokens == 0
    assert not set(s.blocks) & set(a_blocks)
    cache.close(s)
    monkeypatch.undo()
    again = cache.open(a)
    assert again.blocks == a_blocks
    cache.close(again)
    check_invariants(cache)


def test_the_policy_is_handed_the_chain_s_own_keys(monkeypatch):
    """A hit hands the adaptive policy the matched blocks' keys joined, exactly the table's
    keys of the blocks it hears of (multi-round and partial matches included)."""
    cache = make_cache(storage="none", gpu_blocks=2048, host_blocks=0, block_size=BS,
                       policy="adaptive")
    base = np.arange(200 * BS, dtype=np.int32) + 3
    publish(cache, base)
    policy = cache.index.tiers[0].policy
    assert policy.takes_chain_keys
    seen = []
    real = policy.access_many

    def spy(blocks, keys=None):
        seen.append((list(blocks), keys))
        return real(blocks, keys=keys)

    monkeypatch.setattr(policy, "access_many", spy)
    for cut in (200, 130, 64, 10):
        p = base.copy()
        if cut < 200:
            p[cut * BS] = 1
        s = cache.open(p)
        cache.close(s)
        blocks, keys = seen[-1]
        assert len(blocks) == cut
        if keys is not None:
            assert keys == b"".join(cache.index.blocks.key[b] for b in blocks)
    assert any(k is not None for _, k in seen)
    check_invariants(cache)


@pytest.mark.parametrize("cut", [0, 1, 40, 63, 64, 65, 100, 191, 192, 250])
def test_publishing_takes_the_keys_the_match_computed_past_its_miss(cut, monkeypatch):
    """A match that misses in block `cut` leaves the rest of its round's keys to publishing
    (`Sequence.ahead`), which then hashes only past that round: every block is published
    under its own chained key, and the prompt hits whole when opened again."""
    cache = make_cache(storage="none", gpu_blocks=4096, host_blocks=0, block_size=BS)
    idx = cache.index
    base = np.arange(250 * BS, dtype=np.int32) + 77
    publish(cache, base)
    p = base.copy()
    if cut < 250:
        p[cut * BS] = 5                                 # diverges in block `cut`
    hashed = []
    real = idx.hasher.keys

    def keys(parent, tokens, first, n):
        hashed.append((first, n))
        return real(parent, tokens, first, n)

    monkeypatch.setattr(idx.hasher, "keys", keys)
    s = cache.open(p)
    assert s.num_cached_tokens == BS * cut
    matched_to = sum(n for _, n in hashed)              # blocks the match hashed
    del hashed[:]
    cache.mark_computed(s)
    want = list(idx.hasher.chain(idx.hasher.root(None)[0], p))
    assert s.keys == want
    assert all(idx.blocks.key[b] == k for b, k in zip(s.blocks, want))
    assert [f for f, _ in hashed] == ([matched_to] if matched_to < 250 else [])
    cache.close(s)
    again = cache.open(p)
    assert again.num_cached_tokens == 250 * BS
    cache.close(again)
    check_invariants(cache)


def test_keys_past_the_miss_serve_a_prompt_published_a_chunk_at_a_time():
    """Blocks written (and so published) a few at a time take the match's keys past its miss
    from wherever publishing stopped; the published chain is the prompt's own, whole."""
    import torch

    from tests.helpers import write_random

    cache = make_cache(gpu_blocks=1024, host_blocks=0, block_size=BS)
    idx = cache.index
    gen = torch.Generator().manual_seed(0)
    base = np.arange(200 * BS, dtype=np.int32) + 9
    s = cache.open(base)
    write_random(cache, s, gen)
    cache.close(s)
    p = base.copy()
    p[130 * BS] = 3                                     # misses inside the 64..191 round
    s = cache.open(p)
    assert s.num_cached_tokens == 130 * BS
    assert s.ahead_at == 130 and len(s.ahead) == 16 * 62
    want = list(idx.hasher.chain(idx.hasher.root(None)[0], p))
    while s.num_written < s.num_tokens:
        write_random(cache, s, gen, n=min(3 * BS + 1, s.num_tokens - s.num_written))
        done = s.num_written // BS
        assert s.keys[:done] == want[:done]
    assert s.keys == want and s.ahead == b""
    assert all(idx.blocks.key[b] == k for b, k in zip(s.blocks, want))
    cache.close(s)
    again = cache.open(p)
    assert again.num_cached_tokens == 200 * BS
    cache.close(again)
    check_invariants(cache)
