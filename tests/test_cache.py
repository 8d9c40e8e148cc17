"""TieredKVCache end to end on tiny geometry: round trips, prefix reuse, sharing across requests
and tiers, write policies, eviction, tenants, invalidation, capacity errors.

Every test ends with `check_invariants` on every cache it built (autouse fixture).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import (
    BlockView,
    assert_same_data,
    block_at,
    cached_prefix_blocks,
    check_invariants,
    gathered,
    in_index,
    indexed,
    keys_of,
    make_cache,
    make_config,
    random_kv,
    seq_blocks,
    snapshot,
    tokens,
    write_random,
)
from tiered_cache import TieredKVCache
from tiered_cache.core.blocks import NO_SLOT
from tiered_cache.errors import CapacityError
from tiered_cache.policies import POLICIES

GPU, HOST = 0, 1
DTYPES = ["float32", "float16", "bfloat16"]


def gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def cat(parts):
    return torch.cat(parts, dim=0)


# ---------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_exact(dtype):
    cache = make_cache(dtype=dtype)
    g = gen(1)
    prompt = tokens(10)                                   # 2 full blocks + 2 tokens
    seq = cache.open(prompt)
    assert seq.num_tokens == 10
    assert seq.num_cached_tokens == 0
    assert seq.cached_tokens_by_tier == {"gpu": 0, "host": 0}
    written = []
    for layer in range(cache.num_layers):
        k1, v1 = random_kv(cache, 7, g)                   # two uneven chunks
        k2, v2 = random_kv(cache, 3, g)
        cache.write(seq, layer, k1, v1)
        cache.write(seq, layer, k2, v2)
        written.append((cat([k1, k2]), cat([v1, v2])))
    for layer, (k, v) in enumerate(written):
        gk, gv = cache.gather(seq, layer)
        assert gk.dtype == k.dtype == getattr(torch, dtype)
        assert torch.equal(gk, k) and torch.equal(gv, v)
    cache.close(seq)
    assert seq.closed

    again = cache.open(prompt)
    assert again.num_tokens == 10
    assert again.num_cached_tokens == 8                   # the partial block is never cached
    assert again.cached_tokens_by_tier == {"gpu": 8, "host": 0}
    for layer, (k, v) in enumerate(written):
        gk, gv = cache.gather(again, layer)
        assert torch.equal(gk, k[:8]) and torch.equal(gv, v[:8])
    for layer, (k, v) in enumerate(written):
        cache.write(again, layer, k[8:], v[8:])
        gk, gv = cache.gather(again, layer)
        assert torch.equal(gk, k) and torch.equal(gv, v)
    cache.close(again)
    s = cache.stats()
    assert s["query_tokens"] == 20 and s["hit_tokens"] == 8
    assert s["hit_tokens_by_tier"] == {"gpu": 8, "host": 0}
    assert s["cached_blocks"] == 2 and s["open_sequences"] == 0


def test_partial_block_never_cached():
    cache = make_cache()
    seq = cache.open(tokens(6))
    write_random(cache, seq, gen())
    cache.close(seq)
    assert cache.stats()["cached_blocks"] == 1
    assert cache.open(tokens(6)).num_cached_tokens == 4
    assert cache.open(tokens(4) + [99, 98, 97, 96]).num_cached_tokens == 4
    short = cache.open(tokens(3))                         # shorter than one block
    assert short.num_cached_tokens == 0
    assert cache.open(tokens(3, start=1) + [5]).num_cached_tokens == 0   # block differs
    cache.shutdown()
    assert cache.stats()["cached_blocks"] == 1
    assert cache.tier("gpu").used_blocks == 1


def test_reserve_last_never_covers_last_token():
    cache = make_cache()
    seq = cache.open(tokens(8))
    write_random(cache, seq, gen())
    cache.close(seq)
    full = cache.open(tokens(8), reserve_last=True)       # 2 full cached blocks; last held back
    assert full.num_cached_tokens == 4
    assert full.num_cached_tokens < full.num_tokens
    assert full.cached_tokens_by_tier == {"gpu": 4, "host": 0}
    assert full.written == [4] * cache.num_layers
    write_random(cache, full, gen(2))                     # the engine computes tokens 4..7
    cache.close(full)
    longer = cache.open(tokens(9), reserve_last=True)     # last token is in a partial block
    assert longer.num_cached_tokens == 8
    plain = cache.open(tokens(8))
    assert plain.num_cached_tokens == 8
    assert cache.open([], reserve_last=True).num_cached_tokens == 0
    cache.shutdown()


@pytest.mark.parametrize("num_layers", [1, 3])
def test_publish_only_when_every_layer_wrote(num_layers):
    cache = make_cache(num_layers=num_layers)
    g = gen(3)
    prompt = tokens(8)
    seq = cache.open(prompt)
    for layer in range(num_layers - 1):
        cache.write(seq, layer, *random_kv(cache, 8, g))
        other = cache.open(prompt)
        assert other.num_cached_tokens == 0
        cache.close(other)
    assert cache.stats()["cached_blocks"] == 0
    last = num_layers - 1
    cache.write(seq, last, *random_kv(cache, 4, g))       # the last layer: first block only
    other = cache.open(prompt)
    assert other.num_cached_tokens == 4
    cache.close(other)
    cache.write(seq, last, *random_kv(cache, 4, g))
    other = cache.open(prompt)
    assert other.num_cached_tokens == 8
    assert cache.stats()["cached_blocks"] == 2
    cache.shutdown()


def test_append_decode_and_next_turn():
    cache = make_cache(gpu_blocks=32)
    g = gen(4)
    prompt = tokens(6, start=100)
    seq = cache.open(prompt)
    per_layer = [([k], [v]) for k, v in write_random(cache, seq, g)]
    all_tokens = list(prompt)
    for step in range(7):                                 # decode, token by token
        tok = 500 + step
        cache.append(seq, [tok])
        all_tokens.append(tok)
        assert seq.num_tokens == len(all_tokens)
        for layer in range(cache.num_layers):
            k, v = random_kv(cache, 1, g)
            cache.write(seq, layer, k, v)
            per_layer[layer][0].append(k)
            per_layer[layer][1].append(v)
    turn = tokens(9, start=900)                           # the next turn, as one chunk
    cache.append(seq, turn)
    all_tokens += turn
    for layer in range(cache.num_layers):
        for n in (5, 4):
            k, v = random_kv(cache, n, g)
            cache.write(seq, layer, k, v)
            per_layer[layer][0].append(k)
            per_layer[layer][1].append(v)
    assert seq.token_ids.tolist() == all_tokens
    for layer in range(cache.num_layers):
        gk, gv = cache.gather(seq, layer)
        assert gk.shape[0] == len(all_tokens) == 22
        assert torch.equal(gk, cat(per_layer[layer][0]))
        assert torch.equal(gv, cat(per_layer[layer][1]))
    cache.close(seq)
    assert cache.stats()["cached_blocks"] == 5            # 22 tokens: 5 full blocks
    again = cache.open(all_tokens)
    assert again.num_cached_tokens == 20
    for layer in range(cache.num_layers):
        gk, gv = cache.gather(again, layer)
        assert torch.equal(gk, cat(per_layer[layer][0])[:20])
        assert torch.equal(gv, cat(per_layer[layer][1])[:20])
    cache.close(again)


def test_append_to_cached_sequence_then_write():
    cache = make_cache()
    g = gen(5)
    seq = cache.open(tokens(8))
    first = write_random(cache, seq, g)
    cache.close(seq)
    seq = cache.open(tokens(8))
    assert seq.num_cached_tokens == 8 and seq.written == [8, 8]
    cache.append(seq, [77, 78])
    more = write_random(cache, seq, g)
    for layer in range(cache.num_layers):
        gk, gv = cache.gather(seq, layer)
        assert torch.equal(gk, cat([first[layer][0], more[layer][0]]))
        assert torch.equal(gv, cat([first[layer][1], more[layer][1]]))
    cache.close(seq)


# ---------------------------------------------------------------------------- sharing


SYSTEM = tokens(12, start=1000)                           # 3 full blocks


def _system_cache():
    return make_cache(gpu_blocks=128, host_blocks=64)


def test_one_device_copy_of_a_shared_prompt():
    cache = _system_cache()
    g = gen(6)
    first = cache.open(SYSTEM + [0, 0])
    sys_kv = write_random(cache, first, g)
    seqs = [first]
    suffix_kv = {first.id: [(k[12:], v[12:]) for k, v in sys_kv]}
    for i in range(1, 100):
        s = cache.open(SYSTEM + [i, i])
        assert s.num_cached_tokens == 12
        assert s.cached_tokens_by_tier == {"gpu": 12, "host": 0}
        suffix_kv[s.id] = write_random(cache, s, g)
        seqs.append(s)
    prompt_slots = {b.slots[GPU] for s in seqs for b in seq_blocks(cache, s)[:3]}
    assert len(prompt_slots) == 3
    assert len({s.blocks[0] for s in seqs}) == 1
    assert cache.stats()["tiers"]["gpu"]["used_blocks"] == 3 + 100
    assert cache.stats()["tiers"]["gpu"]["pinned_blocks"] == 3 + 100
    assert all(b.ref_count == 100 for b in seq_blocks(cache, first)[:3])
    for s in seqs[::17]:
        for layer in range(cache.num_layers):
            gk, gv = cache.gather(s, layer)
            assert torch.equal(gk[:12], sys_kv[layer][0][:12])
            assert torch.equal(gv[:12], sys_kv[layer][1][:12])
            assert torch.equal(gk[12:], suffix_kv[s.id][layer][0])
            assert torch.equal(gv[12:], suffix_kv[s.id][layer][1])
    for s in seqs:
        cache.close(s)
    s = cache.stats()
    assert s["tiers"]["gpu"]["used_blocks"] == 3           # private suffix blocks freed
    assert s["tiers"]["gpu"]["pinned_blocks"] == 0
    assert s["hit_tokens"] == 99 * 12


@pytest.mark.parametrize("dtype", DTYPES)
def test_shared_prompt_demoted_to_host_and_back(dtype):
    cache = make_cache(gpu_blocks=128, host_blocks=64, dtype=dtype)
    g = gen(7)
    first = cache.open(SYSTEM + [0, 0])
    sys_kv = write_random(cache, first, g)
    original = [cache.gather(first, layer) for layer in range(cache.num_layers)]
    seqs = [first] + [cache.open(SYSTEM + [i, i]) for i in range(1, 100)]
    for s in seqs[1:]:
        write_random(cache, s, g)
    for s in seqs:
        cache.close(s)
    # Push the prompt out of the device tier with other prompts (4 blocks each). It is the
    # least recently used chain, so it leaves once the device is full (see
    # test_lru_evicts_a_stale_chain_before_fresher_leaves for how fast it should leave).
    sys_blocks = [block_at(cache, k) for k in keys_of(cache, SYSTEM)]
    for i in range(64):
        s = cache.open(tokens(16, start=10_000 + 100 * i))
        write_random(cache, s, g)
        cache.close(s)
        if all(b.slots[GPU] == NO_SLOT for b in sys_blocks):
            break
    stats = cache.stats()
    assert stats["demotions"] >= 3
    assert stats["demotion_bytes"] == stats["demotions"] * cache.block_bytes
    assert stats["tiers"]["gpu"]["evictions"] >= 3
    assert all(b.slots[GPU] == NO_SLOT and b.slots[HOST] != NO_SLOT for b in sys_blocks)
    again = cache.open(SYSTEM + [7, 7])
    assert again.num_cached_tokens == 12
    assert again.cached_tokens_by_tier == {"gpu": 0, "host": 12}
    assert cache.stats()["promotions"] == 3
    assert cache.stats()["hit_tokens_by_tier"]["host"] == 12
    for layer in range(cache.num_layers):
        gk, gv = cache.gather(again, layer)
        assert torch.equal(gk, original[layer][0][:12])
        assert torch.equal(gv, original[layer][1][:12])
        assert torch.equal(gk, sys_kv[layer][0][:12])
    assert all(b.slots[GPU] != NO_SLOT for b in seq_blocks(cache, again))
    cache.close(again)
    # Now resident in both tiers; the next open is a device hit.
    assert cache.open(SYSTEM).cached_tokens_by_tier == {"gpu": 12, "host": 0}
    cache.shutdown()


# ---------------------------------------------------------------------------- write policies


def _fill_device(cache, g, start=50_000, blocks=None):
    n = cache.tier("gpu").capacity_blocks if blocks is None else blocks
    s = cache.open(tokens(n * cache.block_size, start=start))
    write_random(cache, s, g)
    cache.close(s)


@pytest.mark.parametrize("policy", ["write_back", "write_through"])
def test_write_policy(policy):
    cache = make_cache(gpu_blocks=4, host_blocks=16, write_policy=policy)
    g = gen(8)
    prompt = tokens(9)                                    # 2 full blocks + 1
    seq = cache.open(prompt)
    written = write_random(cache, seq, g)
    s = cache.stats()
    through = policy == "write_through"
    assert s["write_through_blocks"] == (2 if through else 0)
    assert s["tiers"]["host"]["used_blocks"] == (2 if through else 0)
    assert all((b.slots[HOST] != NO_SLOT) == through for b in seq_blocks(cache, seq)[:2])
    assert seq_blocks(cache, seq)[2].slots[HOST] == NO_SLOT          # the partial block is private
    cache.close(seq)
    _fill_device(cache, g)                                # evicts the prompt from gpu
    s = cache.stats()
    blocks = [block_at(cache, k) for k in keys_of(cache, prompt)]
    assert all(b.slots[GPU] == NO_SLOT and b.slots[HOST] != NO_SLOT for b in blocks)
    assert s["tiers"]["gpu"]["evictions"] >= 2
    if through:
        assert s["demotions"] == 0 and s["demotion_bytes"] == 0
        assert s["write_through_blocks"] == 2 + 4
    else:
        assert s["demotions"] == 2
    again = cache.open(prompt)
    assert again.cached_tokens_by_tier == {"gpu": 0, "host": 8}
    for layer in range(cache.num_layers):
        gk, gv = cache.gather(again, layer)
        assert torch.equal(gk, written[layer][0][:8])
        assert torch.equal(gv, written[layer][1][:8])
    cache.close(again)


def test_write_through_without_host_room_never_fails_a_write():
    """Host full of copies of blocks open sequences use: the next published blocks may go
    without a host copy (write_back behaviour) but the write succeeds, and their later
    eviction from the device demotes them."""
    cache = make_cache(gpu_blocks=4, host_blocks=2, write_policy="write_through",
                       storage="none")
    a = cache.open(tokens(8))
    cache.mark_computed(a)                                # 2 blocks with host copies
    assert cache.stats()["write_through_blocks"] == 2
    b = cache.open(tokens(8, start=100))
    cache.mark_computed(b)
    assert cache.stats()["write_through_blocks"] in (2, 4)
    check_invariants(cache)
    cache.close(b)
    cache.close(a)
    c = cache.open(tokens(16, start=200))                 # pushes a and b off the device
    cache.mark_computed(c)
    check_invariants(cache)
    cache.close(c)
    s = cache.stats()
    assert s["cached_blocks"] >= 4
    assert s["tiers"]["host"]["used_blocks"] == 2


# ---------------------------------------------------------------------------- eviction


@pytest.mark.parametrize("storage", ["none", "tensors"])
def test_host_full_evicts_for_good(storage):
    cache = make_cache(gpu_blocks=4, host_blocks=4, storage=storage)
    g = gen(9)
    prompts = [tokens(16, start=1000 * (i + 1)) for i in range(3)]
    data = {}
    for i, p in enumerate(prompts):
        s = cache.open(p)
        if storage == "none":
            cache.mark_computed(s)
        else:
            data[i] = write_random(cache, s, g)
        cache.close(s)
    s = cache.stats()
    # A was demoted by B, then evicted from host for good by C's demotion of B.
    assert s["demotions"] == 8
    assert s["dropped_blocks"] == 4
    assert s["tiers"]["host"]["evictions"] == 4
    assert s["cached_blocks"] == 8
    assert cached_prefix_blocks(cache, prompts[0]) == 0
    assert not any(in_index(cache, k) for k in keys_of(cache, prompts[0]))
    for k in keys_of(cache, prompts[1]):
        assert block_at(cache, k).slots == [NO_SLOT, block_at(cache, k).slots[HOST]]
        assert block_at(cache, k).slots[HOST] != NO_SLOT
    for k in keys_of(cache, prompts[2]):
        b = block_at(cache, k)
        assert b.slots[GPU] != NO_SLOT and b.slots[HOST] == NO_SLOT
    if storage == "tensors":
        again = cache.open(prompts[1])
        assert again.cached_tokens_by_tier["host"] == 16
        for layer in range(cache.num_layers):
            gk, gv = cache.gather(again, layer)
            assert torch.equal(gk, data[1][layer][0]) and torch.equal(gv, data[1][layer][1])
        cache.close(again)
    assert cache.open(prompts[0]).num_cached_tokens == 0
    cache.shutdown()


def test_lru_evicts_a_stale_chain_before_fresher_leaves():
    """Eviction is by the policy among every block that eviction can reach: once A's leaf is
    gone, A's first block is the least recently used block and must go before B or C.

    BUG (cache.py `_evict`): victims are asked for in one batch, `policy.victims(k)`, while only
    the current leaves are candidates; a parent that becomes a candidate when its child leaves
    is not considered for the rest of the batch, so fresher leaves of other chains go first."""
    cache = make_cache(gpu_blocks=4, host_blocks=0, storage="none", policy="lru")
    a, b, c = tokens(8, start=100), tokens(4, start=200), tokens(4, start=300)
    for p in (a, b, c):
        s = cache.open(p)
        cache.mark_computed(s)
        cache.close(s)
    d = cache.open(tokens(8, start=400))                  # needs 2 of 4 full slots
    cache.mark_computed(d)
    cache.close(d)
    remaining = {name: cached_prefix_blocks(cache, p)
                 for name, p in (("a", a), ("b", b), ("c", c))}
    assert remaining == {"a": 0, "b": 1, "c": 1}


def test_host_policy_picks_the_victim():
    """The host tier's own policy decides who leaves for good: a host copy reused lately
    survives an older one."""
    cache = make_cache(gpu_blocks=2, host_blocks=4, storage="none")
    a, b, c = (tokens(8, start=1000 * i) for i in (1, 2, 3))
    for p in (a, b):
        s = cache.open(p)
        cache.mark_computed(s)
        cache.close(s)
    # a went to host when b came. Reuse a from host (promotion), which demotes b.
    s = cache.open(a)
    assert s.cached_tokens_by_tier == {"gpu": 0, "host": 8}
    cache.close(s)
    s = cache.open(c)                                     # demotes a again? a has a host copy
    cache.mark_computed(s)
    cache.close(s)
    s = cache.open(tokens(8, start=4000))
    cache.mark_computed(s)
    cache.close(s)
    # host holds 4 slots: the least recently used there (b) is gone before a.
    assert cached_prefix_blocks(cache, b) == 0
    assert cached_prefix_blocks(cache, a) == 2


def _chain_cache(policy, gpu_blocks=6):
    cache = make_cache(gpu_blocks=gpu_blocks, host_blocks=0, storage="none", policy=policy)
    chain = tokens(4 * cache.block_size, start=7000)      # 4 blocks, one chain
    s = cache.open(chain)
    cache.mark_computed(s)
    cache.close(s)
    return cache, chain


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_leaves_first_chain(policy):
    cache, chain = _chain_cache(policy)
    keys = keys_of(cache, chain)
    for need, remain in ((3, 3), (4, 2), (5, 1), (6, 0)):
        s = cache.open(tokens(need * cache.block_size, start=100_000 + need * 1000))
        present = [in_index(cache, k) for k in keys]
        # What remains of the chain is always a prefix of it: the leaf went first.
        assert present == [True] * remain + [False] * (4 - remain), present
        check_invariants(cache)
        cache.close(s)
        # drop the filler so that only the chain competes next round
        cache.invalidate(s.token_ids)


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("host_blocks", [0, 6])
def test_victims_are_always_leaves_of_their_tier(policy, host_blocks):
    """Watch every victim every policy hands out under branching traffic: none has a child with
    a copy in that tier at that moment."""
    import random

    cache = make_cache(gpu_blocks=8, host_blocks=host_blocks, storage="none", policy=policy)
    seen = {"victims": 0}
    for tier in cache.tiers:
        many, one = tier.policy.victims, tier.policy.victim

        def check(b, _t=tier.index):
            v = BlockView(cache, b)
            kids = [c for c in v.children if c.slots[_t] != NO_SLOT]
            assert not kids, f"victim {v} of tier {_t} has resident children {kids}"
            assert v.ref_count == 0 or any(s != NO_SLOT for s in v.slots[:_t])
            seen["victims"] += 1

        def checked_many(n, _many=many, _check=check):
            out = _many(n)
            for b in out:
                _check(b)
            return out

        def checked_one(_one=one, _check=check):
            b = _one()
            if b >= 0:
                _check(b)
            return b

        tier.policy.victims, tier.policy.victim = checked_many, checked_one
    rng = random.Random(policy)
    stems = [tokens(8, start=i * 100) for i in range(4)]
    for _ in range(300):
        p = rng.choice(stems) + [rng.randrange(6) for _ in range(rng.randrange(0, 13))]
        s = cache.open(p)
        cache.mark_computed(s)
        if rng.random() < 0.3:
            cache.append(s, [rng.randrange(6) for _ in range(rng.randrange(1, 5))])
            cache.mark_computed(s)
        cache.close(s)
        check_invariants(cache)
    assert seen["victims"] > 50


# ---------------------------------------------------------------------------- tenants


def test_tenant_salt_isolation():
    cache = make_cache()
    g = gen(10)
    prompt = tokens(8)
    seq = cache.open(prompt, salt="tenant-a")
    a_kv = write_random(cache, seq, g)
    cache.close(seq)
    b = cache.open(prompt, salt="tenant-b")
    assert b.num_cached_tokens == 0
    b_kv = write_random(cache, b, g)
    cache.close(b)
    assert cache.open(prompt).num_cached_tokens == 0      # no salt is a tenant too
    for salt, kv in (("tenant-a", a_kv), ("tenant-b", b_kv)):
        s = cache.open(prompt, salt=salt)
        assert s.num_cached_tokens == 8
        for layer in range(cache.num_layers):
            gk, gv = cache.gather(s, layer)
            assert torch.equal(gk, kv[layer][0]) and torch.equal(gv, kv[layer][1])
    assert cache.open(prompt, salt=b"tenant-a").num_cached_tokens == 8   # bytes == its str
    cache.shutdown()
    assert cache.stats()["cached_blocks"] == 4


def test_adapter_isolation():
    cache = make_cache(storage="none")
    s = cache.open(tokens(8), adapter_id="lora-1")
    cache.mark_computed(s)
    cache.close(s)
    assert cache.open(tokens(8), adapter_id="lora-2").num_cached_tokens == 0
    assert cache.open(tokens(8)).num_cached_tokens == 0
    assert cache.open(tokens(8), adapter_id="lora-1").num_cached_tokens == 8
    cache.shutdown()


# ---------------------------------------------------------------------------- invalidate


def test_invalidate_drops_subtree_from_every_tier():
    cache = make_cache(gpu_blocks=8, host_blocks=16, storage="none")
    stem = tokens(8, start=300)
    branches = [stem + tokens(8, start=400), stem + tokens(4, start=500), stem + [1, 2, 3]]
    other = tokens(8, start=600)
    for p in branches + [other]:
        s = cache.open(p)
        cache.mark_computed(s)
        cache.close(s)
    # 2 stem + 2 + 1 (+0: partial) + 2 other = 7 blocks. Push some of them to host.
    before = cache.stats()
    assert before["cached_blocks"] == 7
    # 4 filler blocks: 3 must leave the device. LRU takes the stalest leaves (the branches'),
    # so the stem stays on the device while its branches go to host.
    filler = cache.open(tokens(16, start=9000))
    cache.mark_computed(filler)
    cache.close(filler)
    before = cache.stats()
    assert before["tiers"]["host"]["used_blocks"] == 3
    assert before["cached_blocks"] == 7 + 4
    stem_blocks = [b for k, b in indexed(cache).items()
                   if k in set(keys_of(cache, branches[0]) + keys_of(cache, branches[1]))]
    assert len(stem_blocks) == 5
    assert {b.fastest_tier() for b in stem_blocks} == {GPU, HOST}    # spread over both tiers
    n = cache.invalidate(stem + tokens(8, start=400))     # the first block's whole subtree
    assert n == 5
    after = cache.stats()
    assert after["cached_blocks"] == 11 - 5
    assert after["invalidated_blocks"] == 5
    used = after["tiers"]["gpu"]["used_blocks"] + after["tiers"]["host"]["used_blocks"]
    assert used == before["tiers"]["gpu"]["used_blocks"] + \
        before["tiers"]["host"]["used_blocks"] - 5
    assert all(b.slots == [NO_SLOT, NO_SLOT] and b.key is None for b in stem_blocks)
    for p in branches:
        s = cache.open(p)
        assert s.num_cached_tokens == 0
        cache.close(s)
    s = cache.open(other)
    assert s.num_cached_tokens == 8
    cache.close(s)
    assert cache.invalidate(stem) == 0                    # already gone
    assert cache.invalidate(tokens(3, start=300)) == 0    # shorter than a block
    assert cache.invalidate(tokens(8, start=31_000)) == 0  # never cached
    assert cache.invalidate(other, salt="someone-else") == 0
    assert cache.invalidate(other) == 2


def test_invalidate_from_a_deeper_block_keeps_the_prefix_reachable():
    """invalidate() starts at the first block of the given prefix (documented: it drops every
    cached continuation of that block)."""
    cache = make_cache(storage="none")
    s = cache.open(tokens(12))
    cache.mark_computed(s)
    cache.close(s)
    assert cache.invalidate(tokens(12)) == 3
    assert cache.stats()["cached_blocks"] == 0


def test_invalidate_while_open():
    cache = make_cache(gpu_blocks=16, host_blocks=16)
    g = gen(11)
    prompt = tokens(8, start=40)
    s = cache.open(prompt)
    kv = write_random(cache, s, g)
    cache.close(s)
    reader = cache.open(prompt + [1, 2, 3, 4, 5])          # hits 2 blocks, 2 new blocks
    assert reader.num_cached_tokens == 8
    more = write_random(cache, reader, g)                 # publishes block 2
    assert cache.stats()["cached_blocks"] == 3
    used_open = cache.stats()["tiers"]["gpu"]["used_blocks"]
    assert cache.invalidate(prompt) == 3
    assert cache.stats()["cached_blocks"] == 0
    assert cache.stats()["tiers"]["gpu"]["used_blocks"] == used_open   # still read
    for layer in range(cache.num_layers):                 # the reader keeps its data
        gk, gv = cache.gather(reader, layer)
        assert torch.equal(gk, cat([kv[layer][0], more[layer][0]]))
        assert torch.equal(gv, cat([kv[layer][1], more[layer][1]]))
    check_invariants(cache)
    late = cache.open(prompt)                             # no new sequence hits them
    assert late.num_cached_tokens == 0
    cache.append(reader, [6, 7, 8])                       # fills block 3: stays private
    write_random(cache, reader, g)
    assert cache.stats()["cached_blocks"] == 0
    check_invariants(cache)
    cache.close(reader)
    assert cache.stats()["tiers"]["gpu"]["used_blocks"] == 2            # only `late`'s blocks
    late_kv = write_random(cache, late, g)
    cache.close(late)
    s = cache.stats()
    assert s["tiers"]["gpu"]["used_blocks"] == 2 and s["tiers"]["gpu"]["pinned_blocks"] == 0
    again = cache.open(prompt)                            # republished from `late`
    assert again.num_cached_tokens == 8
    gk, _ = cache.gather(again, 0)
    assert torch.equal(gk, late_kv[0][0])
    cache.close(again)


def test_invalidate_a_block_shared_by_two_open_sequences():
    cache = make_cache(storage="none")
    s = cache.open(tokens(8))
    cache.mark_computed(s)
    cache.close(s)
    a, b = cache.open(tokens(8)), cache.open(tokens(8))
    assert cache.invalidate(tokens(4)) == 2
    cache.close(a)
    assert cache.stats()["tiers"]["gpu"]["used_blocks"] == 2
    check_invariants(cache)
    cache.close(b)
    assert cache.stats()["tiers"]["gpu"]["used_blocks"] == 0


# ---------------------------------------------------------------------------- capacity


def test_capacity_error_leaves_cache_unchanged():
    cache = make_cache(gpu_blocks=4, host_blocks=4)
    g = gen(12)
    cached = cache.open(tokens(8, start=800))
    write_random(cache, cached, g)
    cache.close(cached)
    holder = cache.open(tokens(14, start=900))            # 4 blocks: evicts the cached prompt
    write_random(cache, holder, g)
    before, data = snapshot(cache), gathered(cache)
    with pytest.raises(CapacityError, match="gpu"):
        cache.open(tokens(1, start=5))
    with pytest.raises(CapacityError, match="gpu"):
        cache.open(tokens(8, start=800))                  # a host hit that cannot be promoted
    with pytest.raises(CapacityError):
        cache.append(holder, [1, 2, 3])                   # needs a fifth block
    assert not cache.can_open(1)
    assert snapshot(cache) == before
    assert_same_data(gathered(cache), data)
    check_invariants(cache)
    cache.close(holder)
    assert cache.can_open(4)
    s = cache.open(tokens(8, start=800))
    assert s.cached_tokens_by_tier == {"gpu": 0, "host": 8}
    cache.close(s)


def test_capacity_error_with_a_partial_hit_rolls_back_pins():
    cache = make_cache(gpu_blocks=4, host_blocks=0, storage="none")
    s = cache.open(tokens(8))
    cache.mark_computed(s)
    cache.close(s)
    pin = cache.open(tokens(4, start=50))                 # 1 pinned block
    before = snapshot(cache)
    with pytest.raises(CapacityError):
        cache.open(tokens(8) + tokens(8, start=60))       # hit 2, needs 2 more of 1 free
    assert snapshot(cache) == before
    cache.close(pin)
    assert cache.open(tokens(8) + tokens(8, start=60)).num_cached_tokens == 8


@pytest.mark.parametrize("policy", sorted(POLICIES))
def test_failed_open_does_not_change_later_evictions(policy):
    """Twin caches fed the same traffic, one of them also failing an open: every later step
    agrees (a raised error leaves the cache exactly as it was, policy order included).

    BUG (cache.py `open`): the matched blocks are pinned before the capacity check and unpinned
    on CapacityError. Pin/unpin is remove/insert in the tier policies, which is not neutral:
    cost_aware re-keys the block at the current GreedyDual clock, s3fifo and arc put it back at
    the tail / MRU end. So a failed open refreshes the blocks it matched."""
    def traffic(cache, fail):
        out = []
        prompts = [tokens(8, start=1000 * i) for i in range(6)]
        for p in prompts[:3]:
            s = cache.open(p)
            cache.mark_computed(s)
            cache.close(s)
        hold = cache.open(tokens(8, start=77_000))
        cache.mark_computed(hold)
        if fail:
            with pytest.raises(CapacityError):
                cache.open(prompts[0] + tokens(16, start=88_000))
        for p in prompts[3:] + prompts[:3]:
            s = cache.open(p)
            out.append((s.num_cached_tokens, tuple(sorted(s.cached_tokens_by_tier.items()))))
            cache.mark_computed(s)
            cache.close(s)
        return out, sorted(cache.index.prefix)

    a = traffic(make_cache(gpu_blocks=6, host_blocks=4, storage="none", policy=policy), False)
    b = traffic(make_cache(gpu_blocks=6, host_blocks=4, storage="none", policy=policy), True)
    assert a == b


# ---------------------------------------------------------------------------- lifecycle


def test_context_manager_closes_open_sequences():
    with TieredKVCache(make_config()) as cache:
        a = cache.open(tokens(8))
        write_random(cache, a, gen(13))
        b = cache.open(tokens(5, start=20))
        assert cache.stats()["open_sequences"] == 2
    assert a.closed and b.closed
    s = cache.stats()
    assert s["open_sequences"] == 0
    assert s["cached_blocks"] == 2
    assert s["tiers"]["gpu"]["used_blocks"] == 2 and s["tiers"]["gpu"]["pinned_blocks"] == 0


def test_context_manager_closes_on_error():
    with pytest.raises(RuntimeError, match="boom"):
        with TieredKVCache(make_config()) as cache:
            cache.open(tokens(8))
            raise RuntimeError("boom")
    assert cache.stats()["open_sequences"] == 0
    assert cache.stats()["tiers"]["gpu"]["used_blocks"] == 0


@pytest.mark.parametrize("storage", ["none", "tensors"])
def test_device_only_cache(storage):
    cache = make_cache(gpu_blocks=4, host_blocks=0, storage=storage)
    assert [t.name for t in cache.tiers] == ["gpu"]
    assert "host" not in cache.stats()["tiers"]
    g = gen(14)
    a, b = tokens(8, start=100), tokens(12, start=200)
    data = {}
    for p in (a, b):
        s = cache.open(p)
        assert s.cached_tokens_by_tier == {"gpu": 0}
        if storage == "none":
            cache.mark_computed(s)
        else:
            data[len(p)] = write_random(cache, s, g)
        cache.close(s)
    s = cache.stats()
    assert s["dropped_blocks"] == 1 and s["demotions"] == 0
    assert s["tiers"]["gpu"]["evictions"] == 1
    assert cached_prefix_blocks(cache, a) == 1            # a's leaf went first
    assert cached_prefix_blocks(cache, b) == 3
    s = cache.open(b)
    assert s.num_cached_tokens == 12
    if storage == "tensors":
        for layer in range(cache.num_layers):
            gk, gv = cache.gather(s, layer)
            assert torch.equal(gk, data[12][layer][0]) and torch.equal(gv, data[12][layer][1])
    cache.close(s)
    with pytest.raises(CapacityError):
        cache.open(tokens(20, start=999))


def test_close_frees_private_blocks_and_keeps_published():
    cache = make_cache()
    s = cache.open(tokens(10))
    write_random(cache, s, gen(15), n=6)                   # block 0 published, block 1 half
    assert cache.stats()["cached_blocks"] == 1
    cache.close(s)
    st = cache.stats()
    assert st["tiers"]["gpu"]["used_blocks"] == 1 and st["cached_blocks"] == 1
    assert st["tiers"]["gpu"]["evictable_blocks"] == 1


def test_two_sequences_racing_on_the_same_prompt():
    """Both miss, both write: the first publishes; the second's copy is a duplicate, so the
    second sequence switches to the published blocks (same tokens, same KV) and its own copies
    are freed at once."""
    cache = make_cache()
    g = gen(16)
    a, b = cache.open(tokens(8)), cache.open(tokens(8))
    a_kv = write_random(cache, a, g)
    used = cache.stats()["tiers"]["gpu"]["used_blocks"]
    write_random(cache, b, g)
    assert cache.stats()["duplicates"] >= 1
    assert b.blocks == a.blocks
    assert cache.stats()["tiers"]["gpu"]["used_blocks"] == used - 2     # b's copies freed
    for s in (a, b):
        gk, _ = cache.gather(s, 0)
        assert torch.equal(gk, a_kv[0][0])
    cache.close(a)
    cache.close(b)
    assert cache.stats()["tiers"]["gpu"]["used_blocks"] == 2
    c = cache.open(tokens(8))
    gk, _ = cache.gather(c, 1)
    assert torch.equal(gk, a_kv[1][0])
    cache.close(c)


def test_duplicate_prefix_does_not_stop_publishing_the_rest():
    """Two requests with the same 1-block system prompt prefill at once; the second one's own
    continuation is full and written in every layer, so it must be published.

    BUG (cache.py `_publish_ready`): the second sequence's copy of the shared block is a
    duplicate and stays private, and every later block of that sequence then sees a private
    parent (`parent.key is None: continue`) and is never published."""
    cache = make_cache(storage="none")
    system = tokens(4, start=10)
    a = cache.open(system + tokens(4, start=100))
    b = cache.open(system + tokens(8, start=200))
    cache.mark_computed(a)
    cache.mark_computed(b)
    cache.close(a)
    cache.close(b)
    s = cache.open(system + tokens(8, start=200))
    assert s.num_cached_tokens == 12
    cache.close(s)


@pytest.mark.parametrize("write_policy", ["write_back", "write_through"])
def test_round_trip_through_host_with_background_migrator(write_policy):
    """The default configuration runs a background migrator: promotions land asynchronously and
    gather() waits for them. The data must still be exactly what was written."""
    cache = make_cache(gpu_blocks=16, host_blocks=256, write_policy=write_policy,
                       extra={"migrator": {"enabled": True}})
    try:
        g = gen(17)
        prompt = tokens(12, start=3000)
        s = cache.open(prompt)
        written = write_random(cache, s, g)
        cache.close(s)
        blocks = [block_at(cache, k) for k in keys_of(cache, prompt)]
        for i in range(40):                               # push it to host
            f = cache.open(tokens(8, start=40_000 + 100 * i))
            write_random(cache, f, g)
            cache.close(f)
            cache.migrator.drain()
            if all(b.slots[GPU] == NO_SLOT for b in blocks):
                break
        assert all(b.slots[GPU] == NO_SLOT and b.slots[HOST] != NO_SLOT for b in blocks)
        assert all(cache.index.lookup(b.key) == b.id for b in blocks)
        again = cache.open(prompt)
        assert again.num_cached_tokens == 12
        assert again.cached_tokens_by_tier["host"] == 12
        for layer in range(cache.num_layers):
            gk, gv = cache.gather(again, layer)
            assert torch.equal(gk, written[layer][0]) and torch.equal(gv, written[layer][1])
        cache.close(again)
        cache.migrator.drain()                            # counters move when copies commit
        assert cache.stats()["promotions"] == 3
        check_invariants(cache)
    finally:
        cache.shutdown()


def test_empty_prompt_then_append():
    cache = make_cache()
    s = cache.open([])
    assert s.num_tokens == 0 and s.blocks == [] and s.cached_tokens_by_tier["gpu"] == 0
    assert cache.gather(s, 0)[0].shape == (0, cache.num_kv_heads, cache.head_dim)
    cache.append(s, [1, 2, 3, 4, 5])
    cache.append(s, [])
    kv = write_random(cache, s, gen(18))
    gk, _ = cache.gather(s, 1)
    assert torch.equal(gk, kv[1][0])
    cache.close(s)
    assert cache.stats()["cached_blocks"] == 1


def test_token_forms_hit_the_same_blocks():
    import numpy as np

    cache = make_cache(storage="none")
    s = cache.open(list(range(8)))
    cache.mark_computed(s)
    cache.close(s)
    for form in (tuple(range(8)), range(8), np.arange(8, dtype=np.int64),
                 np.arange(8, dtype=np.uint32), torch.arange(8)):
        s = cache.open(form)
        assert s.num_cached_tokens == 8, type(form)
        cache.close(s)


# ---------------------------------------------------------------------------- threads


def _race_with_close(cache, seq, call):
    """Run `call` in a thread that gets past argument checks and then waits for the lock,
    which this thread holds while it closes `seq`. Returns what the call raised (or None)."""
    import threading
    import time

    out = []

    def worker():
        try:
            call()
            out.append(None)
        except Exception as exc:                          # noqa: BLE001 - reported below
            out.append(exc)

    with cache.locked():
        t = threading.Thread(target=worker)
        t.start()
        time.sleep(0.2)                                   # the call is now waiting for the lock
        cache.close(seq)
    t.join(10)
    assert not t.is_alive()
    return out[0]


@pytest.mark.parametrize("op", ["append", "write", "mark_computed", "close"])
def test_call_racing_with_close_of_its_sequence(op):
    """A call on a sequence that another thread closes while the call waits for the lock must
    fail with SequenceClosedError and leave no trace.

    BUG (cache.py `append`/`write`/`mark_computed`/`close`): `_check_open(seq)` runs before the
    lock is taken and is not repeated under it, so the call then works on a closed sequence:
    append allocates device blocks into it (they stay pinned forever: a leak), write and
    close fail with an IndexError/KeyError instead of the typed error."""
    from tiered_cache.errors import SequenceClosedError

    storage = "none" if op == "mark_computed" else "tensors"
    cache = make_cache(storage=storage)
    seq = cache.open(tokens(6))
    k, v = random_kv(cache, 2, gen(19))
    call = {
        "append": lambda: cache.append(seq, [1, 2, 3]),
        "write": lambda: cache.write(seq, 0, k, v),
        "mark_computed": lambda: cache.mark_computed(seq),
        "close": lambda: cache.close(seq),
    }[op]
    used = cache.stats()["tiers"]["gpu"]["used_blocks"]
    exc = _race_with_close(cache, seq, call)
    check_invariants(cache)
    assert isinstance(exc, SequenceClosedError), repr(exc)
    assert cache.stats()["tiers"]["gpu"]["used_blocks"] <= used
    assert cache.stats()["tiers"]["gpu"]["pinned_blocks"] == 0


def test_write_copies_without_the_lock_and_refuses_racing_writers(monkeypatch):
    """While a write copies, other threads use the cache; the same layer written twice at once
    or a close meanwhile is refused with nothing changed."""
    import threading

    from tiered_cache.errors import BusySequenceError

    cache = make_cache()
    pool = cache.pools[0]
    real = pool.write_tokens
    entered, release = threading.Event(), threading.Event()

    def slow(layer, index, key, value):
        entered.set()
        release.wait(10)
        real(layer, index, key, value)

    tokens = list(range(2 * cache.block_size))
    seq = cache.open(tokens)
    gen = torch.Generator().manual_seed(0)
    kvs = [random_kv(cache, len(tokens), gen) for _ in range(cache.num_layers)]
    monkeypatch.setattr(pool, "write_tokens", slow)
    writer = threading.Thread(target=cache.write, args=(seq, 0, *kvs[0]))
    writer.start()
    assert entered.wait(10)
    other = cache.open([9000 + i for i in range(cache.block_size)])   # the lock is free
    cache.close(other)
    with pytest.raises(BusySequenceError, match="layer 0 .* being written"):
        cache.write(seq, 0, *kvs[0])
    with pytest.raises(BusySequenceError, match="close: sequence"):
        cache.close(seq)
    assert seq.written[0] == 0
    release.set()
    writer.join()
    monkeypatch.setattr(pool, "write_tokens", real)
    assert seq.written[0] == len(tokens) and not seq.writing
    for layer in range(1, cache.num_layers):
        cache.write(seq, layer, *kvs[layer])
    for layer in range(cache.num_layers):
        k, v = cache.gather(seq, layer)
        assert torch.equal(k, kvs[layer][0]) and torch.equal(v, kvs[layer][1])
    cache.close(seq)
    seq = cache.open(tokens)
    assert seq.num_cached_tokens == len(tokens)
    cache.close(seq)
    check_invariants(cache)


def test_layers_written_from_parallel_threads_publish_once_all_land():
    import threading

    cache = make_cache(num_layers=4)
    tokens = list(range(3 * cache.block_size))
    seq = cache.open(tokens)
    gen = torch.Generator().manual_seed(1)
    kvs = [random_kv(cache, len(tokens), gen) for _ in range(cache.num_layers)]
    threads = [threading.Thread(target=cache.write, args=(seq, layer, *kvs[layer]))
               for layer in range(cache.num_layers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert seq.num_published == 3
    for layer in range(cache.num_layers):
        assert torch.equal(cache.gather(seq, layer)[0], kvs[layer][0])
    cache.close(seq)
    check_invariants(cache)
