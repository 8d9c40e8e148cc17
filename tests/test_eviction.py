"""Eviction's fast paths choose the same victims as the plain loop.

Eviction drops a chain leaf first; when the parent a victim leaves behind is the policy's very
next victim (`CachePolicy.offer`), it follows at once instead of a round trip through the
policy. A cache whose policies always answer "no" (the default `offer`: insert, then the loop
asks `victim()`) is the reference: driven by the same requests, both must hold the same blocks
in the same slots after every step.
"""

from __future__ import annotations

import types

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.helpers import make_cache
from tiered_cache.core.invariants import check_invariants
from tiered_cache.errors import CapacityError
from tiered_cache.policies import POLICIES, CachePolicy

# A request: (stem, length in blocks, suffix): prompts share stems, so chains branch.
REQUESTS = st.lists(st.tuples(st.integers(0, 3), st.integers(1, 6), st.integers(0, 4)),
                    min_size=1, max_size=40)


def _state(cache) -> tuple:
    idx = cache.index
    return (dict(idx.prefix), [list(s) for s in idx.blocks.slots],
            [(t.evictions, len(t.policy)) for t in idx.tiers], idx.counters.dropped_blocks)


def _prompt(stem: int, blocks: int, suffix: int, bs: int) -> list[int]:
    head = [1000 * stem + i for i in range(bs * min(blocks, 3))]
    tail = [100_000 + 1000 * suffix + 10 * stem + i for i in range(bs * max(0, blocks - 3))]
    return head + tail


@pytest.mark.parametrize("policy", sorted(POLICIES))
@pytest.mark.parametrize("host", [0, 6])
@settings(max_examples=40, deadline=None)
@given(requests=REQUESTS, hold=st.lists(st.booleans(), max_size=40))
def test_offer_fast_path_evicts_what_the_plain_loop_does(policy, host, requests, hold):
    fast = make_cache(gpu_blocks=8, host_blocks=host, storage="none", policy=policy)
    slow = make_cache(gpu_blocks=8, host_blocks=host, storage="none", policy=policy)
    for tier in slow.index.tiers:
        tier.policy.offer = types.MethodType(CachePolicy.offer, tier.policy)
    held: list = []
    for i, (stem, blocks, suffix) in enumerate(requests):
        p = _prompt(stem, blocks, suffix, fast.block_size)
        keep = i < len(hold) and hold[i] and len(held) < 1
        refused = []
        for cache in (fast, slow):
            try:
                s = cache.open(p)
            except CapacityError:                 # the held sequence leaves too little room
                refused.append(cache)
                continue
            cache.mark_computed(s)
            if keep:
                held.append((cache, s))
            else:
                cache.close(s)
        assert refused in ([], [fast, slow])
        assert _state(fast) == _state(slow)
        check_invariants(fast)
        if len(held) == 2 and not keep:
            for cache, s in held:
                cache.close(s)
            held.clear()
