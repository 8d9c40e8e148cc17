"""core/copies.py: `set_slots` (a promotion's device copies, set at once) leaves exactly the state
`set_slot` one block at a time does: slots, owners, resident-children counts, candidacy, pin
counts, and what every policy then offers, in the same order."""

from __future__ import annotations

import numpy as np
import pytest

from tests.helpers import make_cache, tokens
from tiered_cache.core.invariants import check_invariants
from tiered_cache.core.tier import DEVICE


def _host_chains(policy: str):
    """A metadata cache (gpu 8, host 32 blocks, 3-block prompts A, B, C, D): A was evicted to
    host whole, B's last block too (its parent stays an unpinned device leaf: a candidate the
    promotion must take back). C and D are invalidated, so the device has free slots for the
    promotion and allocating them evicts nothing."""
    cache = make_cache(gpu_blocks=8, host_blocks=32, storage="none", policy=policy)
    prompts = [tokens(12, 100 * i) for i in range(4)]
    for p in prompts:
        s = cache.open(p)
        cache.mark_computed(s)
        cache.close(s)
    for p in prompts[2:]:
        cache.invalidate(p)
    idx = cache.index
    host_only = [b for b in range(len(idx._key)) if idx._key[b] is not None
                 and idx.blocks.fastest_tier(b) == 1]
    tier = idx.tiers[DEVICE]
    assert tier.capacity_blocks - tier.allocator.num_used >= len(host_only)
    assert any(idx._parent[b] >= 0 and idx._cand[idx._parent[b]] & 1 for b in host_only)
    return cache, host_only


def _state(cache, victims: bool = True) -> dict:
    """NOTE: `victims` takes the candidates out of every policy: last, after the checks."""
    idx = cache.index
    out = {
        "slots": [list(s) for s in idx._slots],
        "kids": [list(k) for k in idx._kids],
        "cand": list(idx._cand),
        "pinned": [t.pinned_blocks for t in idx.tiers],
        "owner": [list(t.owner) for t in idx.tiers],
    }
    if victims:
        out["victims"] = [t.policy.victims(64) for t in idx.tiers]
    return out


@pytest.mark.no_invariants          # the policies' candidates are taken out at the end
@pytest.mark.parametrize("policy", ["lru", "adaptive"])
@pytest.mark.parametrize("chain", [None, "A", "B"])
def test_set_slots_is_set_slot_for_each_block(policy, chain, monkeypatch):
    """Block by block, in bulk, and in bulk with the ids (one chain: the compiled pass,
    `chains.gain_chain`; A's three blocks, or B's last, whose parent is a device candidate
    the promotion takes back; A and B together: it refuses them, the bulk pass runs)."""
    from tiered_cache.core import copies as copies_mod

    real, compiled = copies_mod.chains.gain_chain, []

    def spy(*args):
        got = real(*args)
        compiled.append(got[0] >= 0)
        return got
    monkeypatch.setattr(copies_mod.chains, "gain_chain", spy)
    states = []
    for mode in ("each", "bulk", "ids"):
        cache, blocks = _host_chains(policy)
        assert len(blocks) == 4, blocks             # A, and B's last block
        if chain:
            blocks = blocks[:3] if chain == "A" else blocks[3:]
        idx = cache.index
        with idx.lock:
            slots = idx.space.allocate(DEVICE, len(blocks))
            for b in blocks:                        # what _plan_promotion does first
                idx._flight[b] += 1
            if mode == "ids":
                idx.copies.set_slots(blocks, DEVICE, slots, np.asarray(blocks, np.intp))
            elif mode == "bulk":
                idx.copies.set_slots(blocks, DEVICE, slots)
            else:
                for b, s in zip(blocks, slots):
                    idx.copies.set_slot(b, DEVICE, s)
            mid = _state(cache, victims=False)
            for b in blocks:                        # the copy landed: commit_promotion's part
                idx._flight[b] -= 1
                idx._refresh(b)
        check_invariants(idx)
        states.append((mid, _state(cache)))
        cache.shutdown()
    assert states[0] == states[1] == states[2]
    assert compiled == [chain is not None]


def test_a_promotion_after_an_eviction_to_host_reads_back_cached():
    """End to end through open(): the promoted chain is served, the invariants hold."""
    cache, blocks = _host_chains("adaptive")
    s = cache.open(tokens(12, 0))
    assert s.num_cached_tokens == 12
    assert s.cached_tokens_by_tier.get("host", 0) > 0
    assert np.all(np.asarray([cache.index._slots[DEVICE][b] for b in s.blocks]) >= 0)
    cache.close(s)
    check_invariants(cache.index)
    cache.shutdown()
