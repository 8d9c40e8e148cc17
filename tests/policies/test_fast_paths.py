"""The fast paths against the plain ones, through real caches, request by request.

Each case serves the same requests through two caches that differ only in the paths taken:
eviction handing a whole chain to the policy (`offer_run`, policies with `offers_runs`) or
offering block by block; for the default policy also its compiled parts (`ArrayDuel`,
`access_many`, the compiled walk, `ghost.take_run`) against its plain ones (`duel.Duel`,
`access` per block, the walk in Python, `offer` per block). After every request both caches
must hold the same blocks in the same slots, with the same candidates, counters and policy
state; the streams branch (runs end where a chain forks), hold sequences open while others
evict (pinned blocks inside runs), invalidate prefixes, shrink a tier (slots in a tail are
retired) and use a host tier (demotions: no runs). The compiled passes of core/chains.py run
in both caches; tests/core/test_chains.py checks them against plain loops.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from tiered_cache.core.invariants import check_invariants
from tiered_cache.errors import CapacityError
from tiered_cache.policies import POLICIES, AdaptivePolicy
from tiered_cache.policies.base import CachePolicy
from tiered_cache.policies.cost_aware import CostAwarePolicy
from tiered_cache.policies.duel import Duel
from tiered_cache.policies.lru import LRUPolicy
from tiered_cache.tools.replay import build_cache

BS = 4


class StepLRU(LRUPolicy):
    name = "lru_steps"
    offers_runs = False


class StepCost(CostAwarePolicy):
    name = "cost_aware_steps"
    offers_runs = False


class PlainAdaptive(AdaptivePolicy):
    """adaptive on its plain paths (as tests/test_policy_adaptive.py's `Plain`)."""

    name = "adaptive_steps"
    duel_class = Duel
    access_many = CachePolicy.access_many
    offer = AdaptivePolicy._offer
    offer_run = CachePolicy.offer_run
    offers_runs = False
    _walk = AdaptivePolicy._walk_each


PAIRS = {"lru": StepLRU, "cost_aware": StepCost, "adaptive": PlainAdaptive}


def requests(seed: int, n: int):
    """Token-id blocks per request: long chains that fork and come back, one-time tails."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        root = rng.randrange(12)
        body = [1000 * root + k for k in range(rng.randrange(0, 12))]
        fork = [50_000 + 100 * root + rng.randrange(4)] if rng.random() < 0.5 else []
        tail = [1_000_000 + 20 * i + k for k in range(rng.randrange(1, 10))]
        out.append([root + 1] + body + fork + tail)
    return out


def state(cache) -> tuple:
    ix = cache.index
    t = ix.blocks
    pol = []
    for tier in cache.tiers:
        p = tier.policy
        entry = (sorted(p._live),)
        if isinstance(p, AdaptivePolicy):
            d = p.duel
            entry += (p._ghost, p.expert.name, p._calls, p._evictions, p._exposed,
                      d.choice, [list(r) for r in d.wins], list(d.hist.items()))
        pol.append(entry)
    return (dict(ix.prefix), [list(s) for s in t.slots], list(t.candidate),
            [(x.evictions, x.pinned_blocks) for x in cache.tiers],
            ix.counters.as_dict(), pol)


@pytest.mark.parametrize("policy", sorted(PAIRS))
@pytest.mark.parametrize("gpu,host,seed", [(60, 0, 0), (150, 0, 1), (40, 0, 2), (60, 120, 3),
                                           (300, 0, 4)])
def test_runs_do_what_steps_do(policy, gpu, host, seed, monkeypatch):
    step = PAIRS[policy]
    monkeypatch.setitem(POLICIES, step.name, step)
    caches = [build_cache(block_size=BS, gpu_blocks=gpu, host_blocks=host, policy=p)
              for p in (policy, step.name)]
    assert type(caches[0].tiers[0].policy).offers_runs
    rng = random.Random(100 + seed)
    held: list[list] = [[], []]
    seen: list[list] = [[], []]
    reqs = requests(seed, 500)

    def resize(cache, size):
        try:
            return cache.resize("gpu", size, timeout=0.0)
        except Exception as exc:    # noqa: BLE001 - both must fail alike
            return type(exc).__name__

    for n, blocks in enumerate(reqs):
        toks = np.repeat(np.asarray(blocks, np.int32), BS)[:(gpu // 5) * BS]
        hold, close_old = rng.random() < 0.15, rng.random() < 0.3
        inval = np.repeat(np.asarray(reqs[rng.randrange(n + 1)][:2], np.int32), BS) \
            if rng.random() < 0.03 else None
        size = rng.choice([gpu - gpu // 4, gpu]) if rng.random() < 0.02 and not host else None
        for i, cache in enumerate(caches):
            try:
                seq = cache.open(toks)
            except CapacityError:
                seen[i].append("full")
                continue
            seen[i].append(seq.num_cached_tokens)
            cache.mark_computed(seq)
            if hold:
                held[i].append(seq)             # pinned while the next ones evict
            else:
                cache.close(seq)
            if len(held[i]) > 2 or (held[i] and close_old):
                cache.close(held[i].pop(0))
            if inval is not None:
                seen[i].append(cache.invalidate(inval))
            if size is not None:
                seen[i].append(resize(cache, size))
        assert seen[0] == seen[1], n
        assert state(caches[0]) == state(caches[1]), n
        if n % 50 == 0:
            for c in caches:
                check_invariants(c)
    assert caches[0].index.counters.dropped_blocks > 0
