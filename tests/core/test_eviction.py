"""Eviction's fast paths choose the same victims as the plain loop.

Eviction drops a chain leaf first; when the parent a victim leaves behind is the policy's very
next victim (`CachePolicy.offer`), it follows at once instead of a round trip through the
policy. A cache whose policies always answer "no" (the default `offer`: insert, then the loop
asks `victim()`) is the reference: driven by the same requests, both must hold the same blocks
in the same slots after every step.
"""

from __future__ import annotations

import types

import numpy as np
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


# ---------------------------------------------------------------- transient shortages
#
# A shortage that copies under way will end is transient (`CapacityError.transient`: the facade
# waits for those copies, bounded by `migrator.wait_timeout_s`); one that stays after every copy
# has ended is refused at once, with the numbers. Metadata-only caches (`storage: none`) drive
# the moves by hand here (core/moves.py: plan, then commit), so nothing runs in the background.


def _moving_cache():
    """gpu 4, host 4, disk 8 (metadata only). Prompt A (2 blocks) is in the host tier only
    and its copy to disk is under way (planned, not committed); then A is opened again (its
    blocks are promoted to the device while that copy still runs) and closed."""
    from tiered_cache.core import moves

    cache = make_cache(gpu_blocks=4, host_blocks=4, storage="none",
                       extra={"tiers": {"disk": {"num_blocks": 8, "admit_min_hits": 0}}})
    idx = cache.index
    a = list(range(2 * cache.block_size))
    s = cache.open(a)
    cache.mark_computed(s)
    cache.close(s)
    moves.commit_demotion(idx, moves.plan_demotion(idx, 0, 1, 2), True)     # A: host only
    to_disk = moves.plan_demotion(idx, 1, 2, 2)                           # A: host -> disk
    assert len(to_disk) == 2
    s = cache.open(a)                       # promoted back while the disk copy runs
    assert s.num_cached_tokens == len(a)
    cache.close(s)
    return cache, to_disk


def test_a_block_promoted_while_its_copy_runs_is_busy_on_the_device_too():
    """Room never counts a copy that cannot be evicted before its move ends: A's device
    copies are busy (invariant 1 and `check_invariants`' busy count)."""
    cache, to_disk = _moving_cache()
    dev = cache.tiers[0]
    assert dev.busy == 2 and cache.index.space.room(0) == 2
    check_invariants(cache)
    cache.shutdown()


def test_a_shortage_copies_under_way_will_end_is_transient_then_met():
    """(Regression: A's device copies were counted as evictable, the eviction found no
    candidate and refused with "no evictable block left", not transient: the request failed
    although the copy was about to end.)"""
    from tiered_cache.core import moves

    cache, to_disk = _moving_cache()
    b = list(range(1000, 1000 + 4 * cache.block_size))       # needs all 4 device slots
    with pytest.raises(CapacityError) as err:
        cache.index.open(np.asarray(b, dtype=np.int32))
    assert err.value.transient, err.value
    assert "2 held by copies under way" in str(err.value)
    check_invariants(cache)
    moves.commit_demotion(cache.index, to_disk, True)        # the copy ends
    s = cache.open(b)                                         # now it fits (A is evicted)
    assert len(s.blocks) == 4
    cache.close(s)
    check_invariants(cache)
    cache.shutdown()


def test_a_real_shortage_is_refused_at_once_with_the_numbers():
    """Pinned blocks stay pinned whatever copies end: not transient, and the facade does not
    wait for it (wait_timeout_s is 30 s here)."""
    import time

    cache = make_cache(gpu_blocks=4, host_blocks=4, storage="none",
                       migrator={"wait_timeout_s": 30.0})
    held = cache.open(list(range(3 * cache.block_size)))
    t0 = time.monotonic()
    with pytest.raises(CapacityError) as err:
        cache.open(list(range(500, 500 + 2 * cache.block_size)))
    assert time.monotonic() - t0 < 5.0
    assert not err.value.transient
    assert str(err.value) == ("tier 'gpu' cannot provide 2 blocks: 1 free, 3 pinned, "
                              "0 held by copies under way, of 4")
    cache.close(held)
    cache.shutdown()


def test_no_evictable_block_is_transient_only_while_copies_hold_the_tier():
    """The eviction loop's own refusal ("no evictable block left": room counted a block that
    is no candidate yet) is transient exactly when a copy under way holds the tier."""
    cache, to_disk = _moving_cache()
    space = cache.index.space
    assert space.copies_hold(0) and space.copies_hold(1)
    from tiered_cache.core import moves

    moves.commit_demotion(cache.index, to_disk, True)
    assert not space.copies_hold(0) and not space.copies_hold(1)
    cache.shutdown()


def test_reopening_a_chain_being_demoted_counts_its_busy_blocks_once():
    """gpu 8. Prompt A (4 blocks): a2, a3 in the host tier only, a0, a1 on the device with
    their copy to host under way (busy); B (4 blocks) open and pinned; 2 slots free. Opening A
    again pins a0, a1 and promotes a2, a3 into the 2 free slots: it fits now, whatever the
    copy does. (Regression: a0, a1 were subtracted from room twice, as busy and as blocks the
    open pins: refused as transient, and the request waited for a copy it did not need.)"""
    from tiered_cache.core import moves

    cache = make_cache(gpu_blocks=8, host_blocks=8, storage="none")
    idx = cache.index
    bs = cache.block_size
    a, b = list(range(4 * bs)), list(range(100, 100 + 4 * bs))
    s = cache.open(a)
    cache.mark_computed(s)
    cache.close(s)
    held = cache.open(b)
    cache.mark_computed(held)
    moves.commit_demotion(idx, moves.plan_demotion(idx, 0, 1, 2), True)    # a3, a2 to host
    moving = moves.plan_demotion(idx, 0, 1, 2)                           # a1, a0: under way
    assert len(moving) == 2 and idx.tiers[0].busy == 2
    assert idx.tiers[0].allocator.num_free == 2
    s = cache.open(a)
    assert s.num_cached_tokens == len(a)
    check_invariants(cache)
    moves.commit_demotion(idx, moving, True)        # pinned meanwhile: they keep the device copy
    cache.close(s)
    cache.close(held)
    check_invariants(cache)
    cache.shutdown()
