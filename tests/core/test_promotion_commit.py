"""core/tree.py: a landed promotion's commit in one compiled call (`_landed`, `chains.landed`)
leaves exactly the state the general pass of `commit_promotion` does: slots, flights, pins,
candidacy, pending promotions, counters, and what every policy then offers, in the same order.

Two metadata caches (gpu + host) take the same random requests in lockstep: one commits as it
does, the other with `_landed` turned off. Promotions are handed to a callback and committed
later, in a random order, landed or given up, after their sequence closed or while it is open,
with invalidations and evictions in between, so that every case the fast path must refuse
(unpublished since, its device slot gone, not in flight) comes up too."""

from __future__ import annotations

import random

import numpy as np
import pytest

from tests.helpers import make_cache
from tiered_cache.core.index import BlockIndex
from tiered_cache.core.invariants import check_invariants
from tiered_cache.core.tier import DEVICE
from tiered_cache.errors import TransferError

BS = 4


def _prompt(rng: random.Random) -> np.ndarray:
    """One of a few families of prompts that share prefixes."""
    family = rng.randrange(6)
    n = rng.randrange(1, 7) * BS + rng.choice([0, 0, 1])
    return (np.arange(n, dtype=np.int32) + 1000 * family + 1).astype(np.int32)


def _state(cache) -> dict:
    idx = cache.index
    return {
        "prefix": dict(idx.prefix),
        "slots": [list(s) for s in idx._slots],
        "kids": [list(k) for k in idx._kids],
        "cand": list(idx._cand),
        "flight": list(idx._flight),
        "ref": list(idx._ref),
        "pending": sorted(idx.pending),
        "pinned": [t.pinned_blocks for t in idx.tiers],
        "counters": (idx.counters.promotions, idx.counters.promotion_bytes,
                     idx.counters.dropped_blocks),
        "sizes": [len(t.policy) for t in idx.tiers],
    }


class _Run:
    def __init__(self, policy: str) -> None:
        self.cache = make_cache(block_size=BS, gpu_blocks=24, host_blocks=64, storage="none",
                                policy=policy, migrator={"enabled": False})
        self.idx = self.cache.index
        self.open: list = []
        self.plans: list = []

    def promote(self, plan, readiness) -> None:
        self.plans.append((plan, readiness))


def _step(rng: random.Random, run: _Run, op: int, arg: int, toks: np.ndarray) -> None:
    idx = run.idx
    if op == 0 or not (run.open or run.plans):
        try:
            seq = idx.open(toks, promote=run.promote)
        except Exception:               # no room: refused, nothing changed (both alike)
            return
        idx.mark_computed(seq)
        run.open.append(seq)
    elif op == 1 and run.open:
        idx.close(run.open.pop(arg % len(run.open)))
    elif op == 2 and run.plans:
        plan, readiness = run.plans.pop(arg % len(run.plans))
        ok = arg % 5 != 0                                   # now and then, given up
        if not ok:                      # (its readers hear first, as from the migrator)
            readiness.fail(TransferError("given up"))
        idx.commit_promotion(plan, ok)
    elif op == 3:
        idx.invalidate(toks)
    elif op == 4:
        with idx.lock:
            n = min(arg % 16 + 1, idx.tiers[DEVICE].num_candidates())
            if n:
                idx.space.evict(DEVICE, n)


@pytest.mark.no_invariants          # the policies' candidates are taken out at the end
@pytest.mark.parametrize("policy", ["lru", "adaptive"])
@pytest.mark.parametrize("seed", range(6))
def test_the_landed_commit_is_the_general_pass(policy, seed, monkeypatch):
    fast, general = _Run(policy), _Run(policy)
    real, landed = BlockIndex._landed, [0]

    def landed_or_not(self, plan):     # (BlockIndex has __slots__: patched on the class)
        if self is general.idx:
            return False
        ok = real(self, plan)
        landed[0] += ok
        return ok
    monkeypatch.setattr(BlockIndex, "_landed", landed_or_not)
    rng = random.Random(seed)
    for n in range(400):
        op, arg, toks = rng.choice([0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 4, 4, 4]), rng.randrange(1000), \
            _prompt(rng)
        for run in (fast, general):
            _step(rng, run, op, arg, toks)
        assert _state(fast.cache) == _state(general.cache), (n, op)
        if n % 50 == 0:
            check_invariants(fast.idx)
    for run in (fast, general):
        while run.plans:
            run.idx.commit_promotion(run.plans.pop()[0], True)
        while run.open:
            run.idx.close(run.open.pop())
    assert _state(fast.cache) == _state(general.cache)
    check_invariants(fast.idx)
    assert landed[0] >= 8, landed[0]                   # the fast path was taken
    # what each policy offers next, in order (takes the candidates out: last)
    assert [t.policy.victims(256) for t in fast.idx.tiers] == \
        [t.policy.victims(256) for t in general.idx.tiers]
