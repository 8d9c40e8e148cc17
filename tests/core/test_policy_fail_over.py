"""A policy that raises or lies cannot break the cache (core/tier.py `TierState.fail_over`,
and the checks of its answers at the call sites: core/eviction.py, core/tree.py, core/batch.py).

The user policy is loaded by path, as a user's would be (`tests/policies/flaky.py`). Every test
checks what a user would: the KV served for every hit is the KV written for those tokens
(`check_pattern`), the failure is counted and logged once, the tier goes on with LRU, and the
core invariants hold when the test ends (tests/conftest.py).
"""

from __future__ import annotations

import logging
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.helpers import check_invariants, check_pattern, make_cache, tokens, write_pattern_all
from tests.policies import flaky
from tiered_cache.errors import CapacityError
from tiered_cache.metrics import CacheCollector
from tiered_cache.policies import LRUPolicy

PATH = "tests.policies.flaky:FlakyPolicy"
OFFER_PATH = "tests.policies.flaky:FlakyOfferPolicy"      # offer, not offer_run


def path_for(hook: str) -> str:
    return OFFER_PATH if hook == "offer" else PATH
POLICY_LOG = "tiered_cache.policy"


def flaky_cache(path: str = PATH, **kw):
    return make_cache(policy=path, gpu_blocks=12, host_blocks=0, **kw)


def prompts(n: int, length: int = 10, shared: int = 4) -> list[list[int]]:
    """n prompts of `length` tokens (2 full blocks and a part), the first `shared` tokens
    common to all (one shared block)."""
    return [tokens(shared, start=0) + tokens(length - shared, start=1000 + 100 * i)
            for i in range(n)]


def serve(cache, p) -> None:
    """One request: hits are checked against the pattern, the rest written."""
    s = cache.open(p)
    try:
        if s.num_cached_tokens:
            check_pattern(cache, s)
            # the rest of the prompt is computed
        write_pattern_all(cache, s)
        check_pattern(cache, s)
    finally:
        cache.close(s)


def workload(cache, rounds: int = 3) -> None:
    """Fills the device tier past its capacity (evictions, leaves then parents), reuses
    prompts (hits: access_many), keeps one sequence open across the pressure, and resizes."""
    ps = prompts(8)
    for _ in range(rounds):
        for p in ps:
            serve(cache, p)
    kept = cache.open(ps[0])
    write_pattern_all(cache, kept)
    flaky.PLAN.open_blocks = list(kept.blocks)
    for p in prompts(6, shared=0, length=9)[::-1]:
        try:
            serve(cache, [t + 50_000 for t in p])
        except CapacityError:
            pass
    check_pattern(cache, kept)
    cache.close(kept)
    cache.resize("gpu", 10)
    for p in ps[:4]:
        serve(cache, p)
    cache.resize("gpu", 12)
    # what a background demotion asks (core/eviction.py take_victims): victims(n)
    for _ in range(2):
        with cache.locked():
            for v in cache.index.space.take_victims(0, 2):
                cache.index.space.recheck(v)
    for p in ps[4:6]:
        serve(cache, p)
    for _ in range(2):
        cache.stats()                   # evictable_blocks: len(policy)


@pytest.fixture(autouse=True)
def fresh_plan():
    flaky.reset()
    yield
    flaky.reset()


def test_a_policy_is_used_as_given_until_it_fails():
    """No wrapper on the hot path: the tier holds the configured policy itself, a user's
    or a built-in one, and nothing is counted before a failure."""
    cache = make_cache(policy="adaptive")
    assert type(cache.index.tiers[0].policy).__name__ == "AdaptivePolicy"
    cache = flaky_cache()
    pol = cache.index.tiers[0].policy
    assert type(pol) is flaky.FlakyPolicy
    assert pol.name == "flaky" and pol.offers_runs
    tier = cache.index.tiers[0]
    assert tier.policy_failures == 0 and tier.failed_policy is None


def test_the_workload_reaches_every_hook():
    """So that each parametrised case below makes its hook fail for real."""
    for hook in flaky.HOOKS:
        flaky.reset()
        cache = flaky_cache(path_for(hook))
        workload(cache)
        assert flaky.PLAN.calls[hook] >= 2, (hook, flaky.PLAN.calls)
        assert cache.stats()["tiers"]["gpu"]["policy_failures"] == 0


@pytest.mark.parametrize("hook", flaky.HOOKS)
def test_a_hook_that_raises_falls_back_to_lru(hook, caplog):
    flaky.reset(hook=hook, at=2)
    cache = flaky_cache(path_for(hook))
    with caplog.at_level(logging.ERROR, logger=POLICY_LOG):
        workload(cache)
    assert flaky.PLAN.raised == 1
    tier = cache.index.tiers[0]
    assert type(tier.policy) is LRUPolicy
    assert tier.failed_policy == type(flaky_cache(path_for(hook)).index.tiers[0].policy
                                      ).__qualname__
    st_ = cache.stats()["tiers"]["gpu"]
    assert st_["policy_failures"] == 1
    errors = [r for r in caplog.records if r.name == POLICY_LOG]
    assert len(errors) == 1 and hook in errors[0].getMessage()
    assert errors[0].exc_info is not None       # the traceback is in the log
    check_invariants(cache)
    # and the cache goes on serving
    workload(cache, rounds=1)
    check_invariants(cache)


@pytest.mark.parametrize("hook,lie", [
    ("victim", "pinned"), ("victim", "out_of_range"), ("victim", "not_int"),
    ("victim", "empty"), ("victims", "pinned"), ("victims", "duplicate"),
    ("victims", "empty"), ("offer", "not_bool"), ("offer_run", "too_many")])
def test_a_lie_is_caught_before_the_index_acts_on_it(hook, lie):
    """A victim that is pinned (an open sequence reads it), out of range or not an int, or
    "none left" while candidates exist, a repeated victim, a non-bool offer, an offer_run
    count past the run: refused, counted, and the tier goes on with LRU. The open
    sequence's KV stays its own (its blocks are never evicted under it)."""
    cache = flaky_cache(path_for(hook))
    ps = prompts(5)
    for p in ps:
        serve(cache, p)
    kept = cache.open(ps[0])
    write_pattern_all(cache, kept)
    flaky.reset(hook=hook, at=1, lie=lie)
    flaky.PLAN.open_blocks = list(kept.blocks)
    if hook == "victims":
        # victims(n) is what a background demotion asks for (core/eviction.py take_victims)
        with cache.locked():
            got = cache.index.space.take_victims(0, 2)
            for v in got:
                cache.index.space.recheck(v)
        assert all(v not in kept.blocks for v in got)
    else:
        for p in prompts(6, shared=0)[::-1]:
            try:
                serve(cache, [t + 70_000 for t in p])
            except CapacityError:
                pass
    assert flaky.PLAN.calls[hook] >= 1
    check_pattern(cache, kept)
    cache.close(kept)
    s = cache.open(ps[0])
    assert s.num_cached_tokens > 0
    check_pattern(cache, s)
    cache.close(s)
    pol = cache.index.tiers[0].policy
    assert cache.stats()["tiers"]["gpu"]["policy_failures"] == 1
    assert type(pol) is LRUPolicy


def test_failures_are_a_metric():
    flaky.reset(hook="insert", at=3)
    cache = flaky_cache()
    workload(cache, rounds=1)
    families = CacheCollector(cache.stats, cache.index).collect()
    text = "\n".join(f"{m.name} {s.labels} {s.value}" for m in families for s in m.samples
                     if m.name.startswith("tiered_cache_policy_failures"))
    assert "{'tier': 'gpu'} 1" in text, text


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), rate=st.sampled_from([0.01, 0.05, 0.2]),
       order=st.permutations(range(8)))
def test_random_failures_never_serve_wrong_kv(seed, rate, order):
    """Any hook fails at random (after the first failure the tier is LRU, ours): every hit
    is still the KV of its tokens, and the invariants hold after each request."""
    flaky.reset(rate=rate, seed=seed)
    cache = flaky_cache()
    ps = prompts(8)
    for i in order + order[:4]:
        try:
            serve(cache, ps[i])
        except CapacityError:
            pass
        check_invariants(cache)
    # (after its first failure the tier's policy is LRU: the flaky one is never called again)
    assert flaky.PLAN.raised <= 1
    assert cache.stats()["tiers"]["gpu"]["policy_failures"] == flaky.PLAN.raised


# ---------------------------------------------------------------- built-in policies
# The same call sites, the same checks: a built-in policy that fails is met as a user's is.

BUILTIN_HOOKS = ("insert", "remove", "access_many", "victim", "offer_run", "victims", "resize")
"""The hooks this workload reaches on both built-ins (`offer` is reached through `offer_run`
only, and LRU's device tier never hears `access_many`: it keys candidates only)."""


def break_hook(policy, hook: str, at: int, lie=None) -> dict:
    """Make `policy`'s `hook` (an instance attribute over the bound method, which every call
    site reads) raise, or answer `lie(policy)`, at its at-th call; returns the call count."""
    real = getattr(policy, hook)
    seen = {"calls": 0}

    def broken(*args, **kwargs):
        seen["calls"] += 1
        if seen["calls"] == at:
            if lie is not None:
                return lie(policy)
            real(*args, **kwargs)           # its state changed, then it raises
            raise flaky.PolicyBug(f"built-in {hook}: call {at}")
        return real(*args, **kwargs)

    setattr(policy, hook, broken)
    return seen


@pytest.mark.parametrize("name,hook", [(n, h) for n in ("lru", "adaptive")
                                       for h in BUILTIN_HOOKS
                                       if (n, h) != ("lru", "access_many")])
def test_a_builtin_hook_that_raises_falls_back_to_lru(name, hook, caplog):
    cache = make_cache(policy=name, gpu_blocks=12, host_blocks=0)
    pol = cache.index.tiers[0].policy
    assert type(pol) is not flaky.FlakyPolicy
    seen = break_hook(pol, hook, at=2)
    with caplog.at_level(logging.ERROR, logger=POLICY_LOG):
        workload(cache)
    assert seen["calls"] >= 2, f"{name} reached {hook} {seen['calls']} times"
    now = cache.index.tiers[0].policy
    assert now is not pol and type(now) is LRUPolicy
    assert cache.stats()["tiers"]["gpu"]["policy_failures"] == 1
    assert [r for r in caplog.records if r.name == POLICY_LOG][0].exc_info is not None
    check_invariants(cache)
    workload(cache, rounds=1)


@pytest.mark.parametrize("name", ["lru", "adaptive"])
def test_a_builtin_victim_that_is_pinned_is_refused(name):
    """Should a built-in policy ever name a pinned block, it is not evicted under its
    reader: the index checks the candidate bit of every victim before acting on it."""
    cache = make_cache(policy=name, gpu_blocks=12, host_blocks=0)
    ps = prompts(5)
    for p in ps:
        serve(cache, p)
    kept = cache.open(ps[0])
    write_pattern_all(cache, kept)
    pinned = kept.blocks[0]
    seen = break_hook(cache.index.tiers[0].policy, "victim", at=1, lie=lambda _: pinned)
    for p in prompts(6, shared=0)[::-1]:
        try:
            serve(cache, [t + 70_000 for t in p])
        except CapacityError:
            pass
    assert seen["calls"] >= 1
    check_pattern(cache, kept)
    cache.close(kept)
    assert cache.stats()["tiers"]["gpu"]["policy_failures"] == 1


def test_a_failure_inside_open_leaves_no_pin_behind():
    """The case that used to leak: access_many raising inside open(), after the pins. The
    open now succeeds (LRU hears the chain), and closing it unpins every block."""
    cache = make_cache(policy="adaptive", gpu_blocks=12, host_blocks=0)
    p = prompts(1)[0]
    serve(cache, p)
    break_hook(cache.index.tiers[0].policy, "access_many", at=1)
    s = cache.open(p)
    assert s.num_cached_tokens == 8
    check_pattern(cache, s)
    cache.close(s)
    assert cache.stats()["tiers"]["gpu"]["pinned_blocks"] == 0
    check_invariants(cache)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(["lru", "adaptive"]), seed=st.integers(0, 2**32 - 1),
       rate=st.sampled_from([0.02, 0.1, 0.3]), order=st.permutations(range(8)))
def test_random_builtin_failures_never_serve_wrong_kv(name, seed, rate, order):
    """A built-in policy's hooks fail at random: wherever the first failure lands (in a
    refresh, in the middle of an eviction's chain walk), the replacement is the one every
    later call reaches (no call site keeps the failed policy), every hit is the KV of its
    tokens and the invariants hold after each request."""
    rng = random.Random(seed)
    cache = make_cache(policy=name, gpu_blocks=12, host_blocks=0)
    pol = cache.index.tiers[0].policy
    for hook in BUILTIN_HOOKS + ("offer",):
        real = getattr(pol, hook)

        def broken(*args, _real=real, _hook=hook, **kwargs):
            if rng.random() < rate:
                raise flaky.PolicyBug(f"built-in {_hook}: random failure")
            return _real(*args, **kwargs)

        setattr(pol, hook, broken)
    # short prompts sharing a block, and long ones that evict several chains at once
    ps = prompts(8) + [tokens(22, start=90_000 + 1000 * i) for i in range(4)]
    for i in order + [8, 9] + order[:4] + [10, 11] + order[4:]:
        try:
            serve(cache, ps[i])
        except CapacityError:
            pass
        check_invariants(cache)
    assert cache.stats()["tiers"]["gpu"]["policy_failures"] <= 1


@pytest.mark.parametrize("name", ["lru", "adaptive"])
def test_after_a_fail_over_mid_eviction_the_failed_policy_is_never_asked_again(name):
    """An eviction that needs several chains: the first chain's `offer_run` raises (the
    policy is replaced inside `_leave_run`), and the victims after it, in the same eviction,
    come from the replacement, not from a method of the failed one kept by the loop."""
    cache = make_cache(policy=name, gpu_blocks=12, host_blocks=0)
    for i in range(4):
        serve(cache, tokens(12, start=10_000 * (i + 1)))        # 4 chains of 3 blocks
    pol = cache.index.tiers[0].policy
    calls = {"after": 0}
    failed = {"yes": False}
    real_victim, real_offer = pol.victim, pol.offer

    def offer_run(run):
        failed["yes"] = True
        raise flaky.PolicyBug("offer_run")

    def victim():
        calls["after"] += failed["yes"]
        return real_victim()

    def offer(b):
        calls["after"] += failed["yes"]
        return real_offer(b)

    pol.offer_run, pol.victim, pol.offer = offer_run, victim, offer
    serve(cache, tokens(36, start=900_000))                      # evicts 9 blocks at once
    assert failed["yes"] and calls["after"] == 0
    assert cache.stats()["tiers"]["gpu"]["policy_failures"] == 1
    check_invariants(cache)
