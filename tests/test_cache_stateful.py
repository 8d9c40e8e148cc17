"""Stateful property tests of TieredKVCache (hypothesis `RuleBasedStateMachine`).

Tiny capacities and a two-letter token alphabet, so prompts share prefixes, tiers fill up,
blocks are demoted, promoted, evicted for good and invalidated under open readers all the time.

`TieredMachine` runs the same rules on every kind of tier at once, with the migrator's threads:
gpu + host + disk (real record files in a temp dir) + a keyed tier (`memkv`, the test-only
kind of tests/tier_kinds.py, a store shared by name like a Redis), plus rules that settle the
migrator, resize the slot tiers and restart the cache (shutdown, then a new cache on the same
directory and store: what it finds there must be the pattern too).

The KV written for a position is a pattern of (tenant salt, tokens up to that position, layer),
what a causal model's KV depends on, so the expected value of every gathered element is known
whichever sequence computed it and whichever tiers it travelled through. After every step
`check_invariants` (cache.py's docstring lists them). CapacityError is allowed where the device
tier is full of pinned blocks, and must leave the cache exactly as it was.
"""

from __future__ import annotations

import shutil
import tempfile
import uuid

import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from tests import tier_kinds
from tests.helpers import (
    cached_prefix_blocks,
    check_invariants,
    check_pattern,
    make_cache,
    pattern_kv,
    snapshot,
    write_pattern,
)
from tiered_cache.errors import CapacityError, PrefixAbortedError, TierUnavailableError
from tiered_cache.policies import POLICIES

BLOCK = 4
ALPHABET = st.integers(0, 1)
SALTS = [None, "tenant-b"]
DTYPES = ["float32", "float16", "bfloat16"]
WRITE_POLICIES = ["write_back", "write_through"]

prompt_st = st.lists(ALPHABET, min_size=0, max_size=14)


class CacheMachine(RuleBasedStateMachine):
    """Shared rules. Subclasses decide storage (tensors or none) and the configuration."""

    storage = "tensors"

    def __init__(self) -> None:
        super().__init__()
        self.cache = None
        self.seqs: list = []
        self.pool: list[list[int]] = []

    def build(self, **cfg) -> None:
        self.cache = make_cache(block_size=BLOCK, num_layers=2, num_kv_heads=1, head_dim=4,
                                storage=self.storage, **cfg)

    # -------------------------------------------------------------------- helpers
    def expect_unchanged(self, fn) -> bool:
        """Run fn; on CapacityError check that the cache is exactly as before. True if it ran."""
        before = snapshot(self.cache)
        try:
            fn()
        except CapacityError:
            assert snapshot(self.cache) == before
            return False
        return True

    def check_opened(self, seq, prompt, reserve_last) -> None:
        c = seq.num_cached_tokens
        assert c % BLOCK == 0 and 0 <= c <= len(prompt)
        assert sum(seq.cached_tokens_by_tier.values()) == c
        assert set(seq.cached_tokens_by_tier) == {t.name for t in self.cache.tiers}
        if reserve_last and prompt:
            assert c < len(prompt)
        assert seq.written == [c] * self.cache.num_layers
        assert seq.token_ids.tolist() == prompt

    def check(self, seq) -> None:
        """Every gathered element of every layer is the pattern of its position."""
        check_pattern(self.cache, seq)

    # -------------------------------------------------------------------- rules
    @rule(i=st.integers(0, 63), salt=st.sampled_from(SALTS), reserve_last=st.booleans(),
          extra=st.lists(ALPHABET, max_size=3))
    def open(self, i, salt, reserve_last, extra):
        prompt = self.pool[i % len(self.pool)] + extra
        out = []
        if self.expect_unchanged(lambda: out.append(
                self.cache.open(prompt, salt=salt, reserve_last=reserve_last))):
            seq = out[0]
            self.check_opened(seq, prompt, reserve_last)
            self.seqs.append(seq)
            if self.storage == "tensors":
                self.check(seq)        # the cached prefix is this tenant's KV

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 63), layer=st.integers(0, 1), n=st.integers(0, 12))
    def write(self, i, layer, n):
        seq = self.seqs[i % len(self.seqs)]
        n = min(n, seq.num_tokens - seq.written[layer])
        before = seq.written[layer]
        if self.storage == "tensors":
            write_pattern(self.cache, seq, layer, n)
        else:
            k, v = pattern_kv(self.cache, seq.salt, seq.token_ids, before, before + n, layer)
            self.cache.write(seq, layer, k, v)
        assert seq.written[layer] == before + n

    def fill(self, seq) -> None:
        """Write every declared token of every layer (a prefill), or mark_computed."""
        if self.storage == "tensors":
            for layer in range(self.cache.num_layers):
                write_pattern(self.cache, seq, layer)
        else:
            self.cache.mark_computed(seq)
        assert seq.written == [seq.num_tokens] * self.cache.num_layers

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 63))
    def prefill(self, i):
        self.fill(self.seqs[i % len(self.seqs)])

    @rule(i=st.integers(0, 63), salt=st.sampled_from(SALTS), extra=st.lists(ALPHABET, max_size=3))
    def request(self, i, salt, extra):
        """A whole request in one step: open, check the hit, prefill, check, close."""
        prompt = self.pool[i % len(self.pool)] + extra
        out = []
        if not self.expect_unchanged(lambda: out.append(self.cache.open(prompt, salt=salt))):
            return
        seq = out[0]
        self.check_opened(seq, prompt, False)
        self.fill(seq)
        if self.storage == "tensors":
            self.check(seq)
        self.cache.close(seq)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 63), new=st.lists(ALPHABET, min_size=1, max_size=6))
    def append(self, i, new):
        seq = self.seqs[i % len(self.seqs)]
        before = seq.token_ids.tolist()
        if self.expect_unchanged(lambda: self.cache.append(seq, new)):
            assert seq.token_ids.tolist() == before + new
        else:
            assert seq.token_ids.tolist() == before

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 63))
    def close(self, i):
        seq = self.seqs.pop(i % len(self.seqs))
        self.cache.close(seq)
        assert seq.closed

    @rule(i=st.integers(0, 63), salt=st.sampled_from(SALTS))
    def invalidate(self, i, salt):
        prompt = self.pool[i % len(self.pool)]
        cached = self.cache.stats()["cached_blocks"]
        n = self.cache.invalidate(prompt, salt=salt)
        assert n >= 0
        assert self.cache.stats()["cached_blocks"] == cached - n
        if len(prompt) >= BLOCK:
            assert cached_prefix_blocks(self.cache, prompt, salt) == 0

    @precondition(lambda self: self.seqs and self.storage == "tensors")
    @rule(i=st.integers(0, 63))
    def gather_and_check(self, i):
        self.check(self.seqs[i % len(self.seqs)])

    # -------------------------------------------------------------------- invariants
    @invariant()
    def invariants_hold(self):
        if self.cache is None:
            return
        check_invariants(self.cache)
        s = self.cache.stats()
        assert s["open_sequences"] == len(self.seqs)
        assert s["hit_tokens"] <= s["query_tokens"]
        assert s["hit_tokens"] == sum(s["hit_tokens_by_tier"].values())
        for t in s["tiers"].values():
            assert 0 <= t["pinned_blocks"] <= t["used_blocks"] <= t["capacity_blocks"]

    def teardown(self):
        if self.cache is None:
            return
        if self.storage == "tensors":
            for seq in self.seqs:
                self.check(seq)
        self.cache.shutdown()
        check_invariants(self.cache)
        s = self.cache.stats()
        assert s["open_sequences"] == 0
        for t in s["tiers"].values():
            assert t["pinned_blocks"] == 0
        # Only published blocks hold slots once nothing is open.
        used = sum(t["used_blocks"] for t in s["tiers"].values())
        idx = self.cache.index
        copies = sum(sum(1 for x in idx.blocks.copies(b) if x >= 0) for b in idx.prefix.values())
        assert used == copies


pool_st = st.lists(prompt_st, min_size=2, max_size=6)


class TensorMachine(CacheMachine):
    storage = "tensors"
    dtype = "float32"
    write_policy = "write_back"

    @initialize(gpu=st.integers(6, 10), host=st.integers(0, 8), stems=pool_st,
                suffixes=pool_st, policy=st.sampled_from(["lru", "s3fifo", "cost_aware"]))
    def setup(self, gpu, host, stems, suffixes, policy):
        self.build(gpu_blocks=gpu, host_blocks=host, dtype=self.dtype, policy=policy,
                   write_policy=self.write_policy)
        # Prompts share stems, so their prefixes (and blocks) overlap.
        self.pool = [stem + suf for stem in stems for suf in suffixes][:12]


class TieredMachine(TensorMachine):
    """gpu + host + disk + memkv, the migrator running (demotions, promotions, puts and loads on
    its threads while the rules run), and rules to settle it, resize, and restart.

    NOTE: with background copies the state moves between two calls, so a refused call is
    checked by what the caller sees (no sequence, no token change, invariants), not by a
    snapshot of the whole state (TensorMachine checks that, without threads)."""

    def __init__(self) -> None:
        super().__init__()
        self.dir: str | None = None
        self.cfg: dict = {}
        self.since_restart = 0

    @initialize(gpu=st.integers(6, 10), host=st.integers(4, 10), disk=st.integers(8, 40),
                stems=pool_st, suffixes=pool_st, policy=st.sampled_from(["lru", "s3fifo"]),
                write_policy=st.sampled_from(WRITE_POLICIES), admit=st.integers(0, 1),
                memkv=st.booleans())
    def setup(self, gpu, host, disk, stems, suffixes, policy, write_policy, admit, memkv):
        self.dir = tempfile.mkdtemp(prefix="tc-sm-")
        tiers = {"disk": {"path": self.dir, "num_blocks": disk, "admit_min_hits": admit}}
        if memkv:
            tiers["memkv"] = {"name": "sm" + uuid.uuid4().hex}
        self.cfg = dict(gpu_blocks=gpu, host_blocks=host, policy=policy,
                        write_policy=write_policy,
                        migrator={"enabled": True, "wait_timeout_s": 10.0,
                                  "high_watermark": 0.8, "low_watermark": 0.5},
                        extra={"tiers": tiers})
        self.build(**self.cfg)
        self.pool = [stem + suf for stem in stems for suf in suffixes][:12]

    # -------------------------------------------------------------------- overrides
    def expect_unchanged(self, fn) -> bool:
        seqs = len(self.cache.open_sequences())
        try:
            fn()
        except CapacityError:
            assert len(self.cache.open_sequences()) == seqs
            return False
        return True

    def check_opened(self, seq, prompt, reserve_last) -> None:
        c = seq.num_cached_tokens
        assert c % BLOCK == 0 and 0 <= c <= len(prompt)
        assert sum(seq.cached_tokens_by_tier.values()) == c
        names = {t.name for t in self.cache.tiers} | {k.name for k in self.cache.index.keyed.tiers}
        assert set(seq.cached_tokens_by_tier) <= names
        for name, n in seq.cached_tokens_by_tier.items():
            if n:
                event(f"a hit from {name}")     # (--hypothesis-show-statistics)
        if reserve_last and prompt:
            assert c < len(prompt)
        assert seq.token_ids.tolist() == prompt

    def check(self, seq) -> None:
        for layer in range(self.cache.num_layers):
            self.cache.wait(seq, layer)        # a promotion or a load may still be landing
        check_pattern(self.cache, seq)

    @rule(i=st.integers(0, 63), salt=st.sampled_from(SALTS))
    def invalidate(self, i, salt):
        """The count also holds what the keyed store deleted (cache.invalidate), so the index
        loses at most that many; none of the prompt's blocks is found afterwards."""
        assert self.cache.migrator.settle()     # no eviction runs beside the count below
        prompt = self.pool[i % len(self.pool)]
        cached = self.cache.stats()["cached_blocks"]
        n = self.cache.invalidate(prompt, salt=salt)
        assert cached - n <= self.cache.stats()["cached_blocks"] <= cached
        if len(prompt) >= BLOCK:
            assert cached_prefix_blocks(self.cache, prompt, salt) == 0
            out = []                            # nor in the disk or the keyed store
            if self.expect_unchanged(lambda: out.append(self.cache.open(prompt, salt=salt))):
                assert out[0].num_cached_tokens == 0, out[0].cached_tokens_by_tier
                self.cache.close(out[0])

    # -------------------------------------------------------------------- new rules
    @rule()
    def settle(self):
        assert self.cache.migrator.settle()
        check_invariants(self.cache)
        for seq in self.seqs:
            self.check(seq)

    @precondition(lambda self: self.since_restart >= 8)     # (time to cache something first)
    @rule()
    def restart(self):
        """Shut down (open sequences are closed; memory goes to disk) and reopen on the same
        directory and store: the new cache rebuilds its index from the records."""
        self.cache.shutdown()
        check_invariants(self.cache)
        self.seqs = []
        self.since_restart = 0
        self.build(**self.cfg)

    @rule(tier=st.sampled_from(["gpu", "host", "disk"]), n=st.integers(4, 16))
    def resize(self, tier, n):
        state = self.cache.tier(tier)
        old = state.capacity_blocks
        if tier == "gpu":
            n = max(n, 6)
        try:
            assert self.cache.resize(tier, n, timeout=0.2) == n
        except (CapacityError, TierUnavailableError) as exc:
            event(f"resize {tier} refused: {type(exc).__name__}")
            # pinned blocks in the tail that did not leave in time, or a disk shrink (refused
            # while serving): the tier keeps its size and nothing is lost
            assert state.capacity_blocks == old
            assert tier == "disk" and n < old or tier != "disk"
        else:
            event(f"resize {tier} {'down' if n < old else 'up' if n > old else 'same'}")
            assert state.capacity_blocks == n
        for seq in self.seqs:
            self.check(seq)                     # open sequences keep their KV

    @rule(i=st.integers(0, 63), salt=st.sampled_from(SALTS))
    def reread(self, i, salt):
        """Open a pool prompt after the migrator settled: whatever tiers its blocks sit in
        (disk records, the keyed store, host), the hit is that prompt's KV."""
        assert self.cache.migrator.settle()
        prompt = self.pool[i % len(self.pool)]
        out = []
        if self.expect_unchanged(lambda: out.append(self.cache.open(prompt, salt=salt))):
            seq = out[0]
            self.check_opened(seq, prompt, False)
            self.check(seq)
            self.cache.close(seq)

    # -------------------------------------------------------------------- invariants
    @invariant()
    def invariants_hold(self):
        if self.cache is None:
            return
        self.since_restart += 1
        check_invariants(self.cache)
        s = self.cache.stats()
        assert s["open_sequences"] == len(self.seqs)
        assert s["hit_tokens"] <= s["query_tokens"]
        for t in self.cache.tiers:
            u = s["tiers"][t.name]
            assert 0 <= u["pinned_blocks"] <= u["used_blocks"] <= u["capacity_blocks"]

    def teardown(self):
        try:
            if self.cache is not None:
                for seq in self.seqs:
                    self.check(seq)
                self.cache.shutdown()
                check_invariants(self.cache)
                assert self.cache.stats()["open_sequences"] == 0
        finally:
            if self.dir is not None:
                shutil.rmtree(self.dir, ignore_errors=True)


class InflightTensorMachine(TensorMachine):
    """`share_inflight: true`: open() takes blocks other open sequences are computing. One
    thread runs every rule, so a layer a writer has not written yet is skipped (waiting would
    never end); a layer ready is checked, an aborted one must raise PrefixAbortedError."""

    @initialize(gpu=st.integers(6, 12), host=st.integers(0, 8), stems=pool_st,
                suffixes=pool_st, policy=st.sampled_from(["lru", "s3fifo"]))
    def setup(self, gpu, host, stems, suffixes, policy):
        self.build(gpu_blocks=gpu, host_blocks=host, dtype=self.dtype, policy=policy,
                   share_inflight=True)
        self.pool = [stem + suf for stem in stems for suf in suffixes][:12]

    def check(self, seq) -> None:
        for layer in range(self.cache.num_layers):
            waits = [r for r in seq.pending if r.inflight and r.ready_layers <= layer]
            if any(r.error is not None for r in waits):
                with pytest.raises(PrefixAbortedError):
                    self.cache.gather(seq, layer)
            elif not waits:
                check_pattern(self.cache, seq, layer)


class MetadataMachine(CacheMachine):
    """Storage-free (`storage: none`): larger tiers and runs, every policy, mark_computed."""

    storage = "none"

    @initialize(gpu=st.integers(6, 40), host=st.integers(0, 40), stems=pool_st,
                suffixes=pool_st, policy=st.sampled_from(sorted(POLICIES)),
                write_policy=st.sampled_from(WRITE_POLICIES),
                verify=st.booleans(), inflight=st.booleans())
    def setup(self, gpu, host, stems, suffixes, policy, write_policy, verify, inflight):
        # inflight: open() takes blocks open sequences are computing (core/inflight.py).
        self.build(gpu_blocks=gpu, host_blocks=host, policy=policy, write_policy=write_policy,
                   verify_tokens=verify, share_inflight=inflight)
        self.pool = [stem + suf for stem in stems for suf in suffixes][:20]

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 63))
    def mark_computed(self, i):
        seq = self.seqs[i % len(self.seqs)]
        self.cache.mark_computed(seq)
        assert seq.written == [seq.num_tokens] * self.cache.num_layers


TENSOR_SETTINGS = settings(max_examples=60, stateful_step_count=50, deadline=None,
                           suppress_health_check=[HealthCheck.too_slow,
                                                  HealthCheck.filter_too_much])
METADATA_SETTINGS = settings(max_examples=100, stateful_step_count=150, deadline=None,
                             suppress_health_check=[HealthCheck.too_slow,
                                                    HealthCheck.filter_too_much])


QUICK = {"max_examples": 10, "stateful_step_count": 30}
"""`make test-fast`: a few runs of each machine; `make test` (the `slow` ones) the full counts."""


def tensor_machine(dtype: str, write_policy: str) -> type:
    return type(f"TensorMachine_{dtype}_{write_policy}", (TensorMachine,),
                {"dtype": dtype, "write_policy": write_policy})


@pytest.mark.parametrize("dtype,write_policy", [("float32", "write_back"),
                                                ("bfloat16", "write_through")])
def test_tensor_cache_state_machine_quick(dtype, write_policy):
    run_state_machine_as_test(tensor_machine(dtype, write_policy),
                              settings=settings(TENSOR_SETTINGS, **QUICK))


@pytest.mark.slow
@pytest.mark.parametrize("write_policy", WRITE_POLICIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_tensor_cache_state_machine(dtype, write_policy):
    run_state_machine_as_test(tensor_machine(dtype, write_policy), settings=TENSOR_SETTINGS)


def test_tensor_cache_state_machine_sharing_inflight_quick():
    run_state_machine_as_test(InflightTensorMachine, settings=settings(TENSOR_SETTINGS, **QUICK))


@pytest.mark.slow
def test_tensor_cache_state_machine_sharing_inflight():
    run_state_machine_as_test(InflightTensorMachine, settings=TENSOR_SETTINGS)


def test_metadata_cache_state_machine_quick():
    run_state_machine_as_test(MetadataMachine, settings=settings(
        METADATA_SETTINGS, max_examples=15, stateful_step_count=100))


@pytest.mark.slow
def test_metadata_cache_state_machine():
    run_state_machine_as_test(MetadataMachine, settings=METADATA_SETTINGS)


TIERED_SETTINGS = settings(max_examples=12, stateful_step_count=30, deadline=None,
                           suppress_health_check=[HealthCheck.too_slow,
                                                  HealthCheck.filter_too_much])


@pytest.fixture
def memkv():
    tier_kinds.register()
    yield
    tier_kinds.unregister()


def test_tiered_cache_state_machine(memkv):
    run_state_machine_as_test(TieredMachine, settings=TIERED_SETTINGS)


@pytest.mark.slow
def test_tiered_cache_state_machine_long(memkv):
    """More and longer runs of the machine above (`make test`, not `make test-fast`)."""
    run_state_machine_as_test(TieredMachine, settings=settings(
        TIERED_SETTINGS, max_examples=80, stateful_step_count=60))
