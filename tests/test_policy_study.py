"""The study policy in benchmarks/policy_study (not shipped; docs/replay.md quotes its figures):
it honours the policy contract through the real cache, and its age-aware density does what LRU
cannot on a loop."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks" / "policy_study"))

from tests.test_policy_lab import per_request_hits, trace  # noqa: E402
from tiered_cache.invariants import check_invariants  # noqa: E402

HD = "hit_density:HitDensityPolicy"


def test_hit_density_cuts_chains_from_the_tail():
    got, cache = per_request_hits(trace([1, 2, 3], [4, 5, 6], [1, 2, 3]), HD, gpu=4)
    assert got == [0, 0, 1]
    check_invariants(cache)


def test_hit_density_keeps_part_of_a_loop_larger_than_the_cache():
    # Five one-block requests in a loop through 4 slots: LRU always evicts the block needed
    # next (0 hits). Once the reuse distance (5 requests) is measured from ghost returns, the
    # block just used is the one furthest from its next use (lowest density at age 0), so the
    # others stay: at least 3 of every 5 requests hit, as Belady's 4-in-5 bound allows.
    loop = trace(*([[i] for i in range(1, 6)] * 60))
    lru, _ = per_request_hits(loop, "lru", gpu=4)
    got, cache = per_request_hits(loop, HD, gpu=4)
    assert sum(lru) == 0
    assert sum(got[-100:]) >= 60
    check_invariants(cache)
