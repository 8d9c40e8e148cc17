"""In-flight prefix sharing (`share_inflight: true`, core/inflight.py): open() takes the prompt
blocks another open sequence is computing, waits for them layer by layer, and gets
PrefixAbortedError, never stale or empty KV, when the writer closes first."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest
import torch

from tests.helpers import check_invariants, check_pattern, make_cache, pattern_kv, write_pattern
from tiered_cache.errors import PrefixAbortedError, PromotionTimeout, TransferError

BS = 4
LAYERS = 3


def cache_for(**kw):
    kw.setdefault("gpu_blocks", 64)
    kw.setdefault("host_blocks", 0)
    return make_cache(block_size=BS, num_layers=LAYERS, num_kv_heads=1, head_dim=4,
                      share_inflight=True, **kw)


PROMPT = list(range(100, 132))                  # 8 full blocks


def used(cache, tier="gpu") -> int:
    return cache.stats()["tiers"][tier]["used_blocks"]


def test_waiter_takes_the_blocks_being_computed_and_reads_the_writers_kv():
    with cache_for() as cache:
        w = cache.open(PROMPT)
        assert w.num_cached_tokens == 0
        b = cache.open(PROMPT + [7, 7, 7, 7, 7])   # 8 shared blocks, 2 of its own
        assert b.num_cached_tokens == 32
        assert b.cached_tokens_by_tier["gpu"] == 32
        assert b.block_ids[:8] == w.block_ids
        assert used(cache) == 8 + 2                # one copy of the prefix
        check_invariants(cache)
        s = cache.stats()
        assert s["inflight_hit_tokens"] == 32 and s["hit_tokens"] == 32
        with pytest.raises(PromotionTimeout):
            cache.wait(b, 0, timeout=0.05)          # the writer has not written layer 0
        for layer in range(LAYERS):
            write_pattern(cache, w, layer)
            cache.wait(b, layer, timeout=0)         # ready as soon as the writer wrote it
        check_pattern(cache, b)                    # the writer's KV, exactly
        for layer in range(LAYERS):
            write_pattern(cache, b, layer)
        check_pattern(cache, b)
        cache.close(w)
        cache.close(b)
        # Both published: the writer's blocks, then the waiter's own under them.
        again = cache.open(PROMPT + [7, 7, 7, 7, 7, 1])
        assert again.num_cached_tokens == 36
        check_pattern(cache, again)
        cache.close(again)
        check_invariants(cache)


def test_wait_returns_layer_by_layer_while_the_writer_writes_on_another_thread():
    with cache_for() as cache:
        w = cache.open(PROMPT)
        b = cache.open(PROMPT[:16])
        assert b.num_cached_tokens == 16
        seen = []

        def waiter():
            for layer in range(LAYERS):
                cache.wait(b, layer, timeout=30)
                seen.append((layer, w.written[layer]))

        t = threading.Thread(target=waiter)
        t.start()
        for layer in range(LAYERS):
            write_pattern(cache, w, layer, 8)       # half the shared tokens of each layer
        for layer in range(LAYERS):
            write_pattern(cache, w, layer, 8)       # ... then the rest
        t.join(30)
        assert not t.is_alive()
        # Each layer was released in order, once the writer covered the 16 shared tokens.
        assert [layer for layer, _ in seen] == [0, 1, 2]
        assert all(n >= 16 for _, n in seen)
        check_pattern(cache, b)
        for layer in range(LAYERS):
            write_pattern(cache, w, layer)
        cache.close(b)
        cache.close(w)
        check_invariants(cache)


def test_wait_is_released_as_soon_as_the_writer_covers_the_shared_blocks():
    with cache_for() as cache:
        w = cache.open(PROMPT)
        b = cache.open(PROMPT[:8] + [9, 9, 9, 9])
        assert b.num_cached_tokens == 8
        write_pattern(cache, w, 0, 4)
        with pytest.raises(PromotionTimeout):
            cache.wait(b, 0, timeout=0.02)          # one of its two blocks written
        write_pattern(cache, w, 0, 4)
        cache.wait(b, 0, timeout=0)
        with pytest.raises(PromotionTimeout):
            cache.wait(b, 1, timeout=0.02)
        check_pattern(cache, b, 0)
        cache.close(b)
        cache.close(w)


def test_writer_that_closes_first_aborts_the_missing_layers_only():
    with cache_for() as cache:
        w = cache.open(PROMPT)
        b = cache.open(PROMPT + [5, 5, 5, 5])
        write_pattern(cache, w, 0)                  # layer 0 only
        cache.close(w)                              # ... then the writer gives up
        assert cache.stats()["inflight_aborts"] == 1
        cache.wait(b, 0, timeout=0)
        check_pattern(cache, b, 0)                  # what was written stays right
        with pytest.raises(PrefixAbortedError, match="compute those tokens yourself"):
            cache.wait(b, 1, timeout=5)
        assert issubclass(PrefixAbortedError, TransferError)
        with pytest.raises(PrefixAbortedError):
            cache.gather(b, 1)
        q = torch.zeros(1, 1, 4)
        with pytest.raises(PrefixAbortedError):
            cache.attention(q, [b], 1)
        check_invariants(cache)
        cache.close(b)
        # Nothing of it was published; every slot is back.
        assert cache.stats()["cached_blocks"] == 0 and used(cache) == 0
        again = cache.open(PROMPT)
        assert again.num_cached_tokens == 0        # the engine computes them itself now
        cache.close(again)
        check_invariants(cache)


def test_waiter_closing_early_leaves_the_writer_alone():
    with cache_for() as cache:
        w = cache.open(PROMPT)
        b = cache.open(PROMPT)
        cache.close(b)
        for layer in range(LAYERS):
            write_pattern(cache, w, layer)
        check_pattern(cache, w)
        cache.close(w)
        assert cache.stats()["cached_blocks"] == 8
        check_invariants(cache)


def test_a_chain_of_writers_each_waits_on_the_one_before():
    with cache_for() as cache:
        a = cache.open(PROMPT[:16])
        b = cache.open(PROMPT[:24])                 # takes a's 4 blocks, computes 2
        c = cache.open(PROMPT)                      # takes a's 4 and b's 2, computes 2
        assert (a.num_cached_tokens, b.num_cached_tokens, c.num_cached_tokens) == (0, 16, 24)
        assert len(c.pending) == 2
        assert used(cache) == 8
        for layer in range(LAYERS):
            write_pattern(cache, b, layer)          # b's own part first: c still waits on a
        with pytest.raises(PromotionTimeout):
            cache.wait(c, 0, timeout=0.02)
        for layer in range(LAYERS):
            write_pattern(cache, a, layer)
        check_pattern(cache, c)
        for layer in range(LAYERS):
            write_pattern(cache, c, layer)
        for s in (a, b, c):
            cache.close(s)
        assert cache.stats()["cached_blocks"] == 8  # a's published, then b's and c's under it
        check_invariants(cache)


def test_an_aborted_writer_fails_the_wait_at_once_while_an_earlier_one_still_computes():
    """c takes blocks from a (still open, nothing written) and from b; b closes. Reading c
    must raise PrefixAbortedError now, not first wait out a's blocks (found by the state
    machine: a single-threaded engine would hang for wait_timeout_s, then get a timeout)."""
    with cache_for() as cache:
        a = cache.open(PROMPT[:16])
        b = cache.open(PROMPT[:24])                 # takes a's 4 blocks, computes 2
        c = cache.open(PROMPT)                      # waits on a (first) and on b
        assert len(c.pending) == 2
        cache.close(b)
        t0 = time.monotonic()
        for read in (lambda: cache.wait(c, 0, timeout=5),
                     lambda: cache.gather(c, 0),
                     lambda: cache.attention(torch.zeros(1, 1, 4), [c], 0)):
            with pytest.raises(PrefixAbortedError):
                read()
        assert time.monotonic() - t0 < 2.5         # (each would wait 5 s / the default)
        for layer in range(LAYERS):
            write_pattern(cache, a, layer)
        with pytest.raises(PrefixAbortedError):     # a's part landed; b's never will
            cache.gather(c, 0)
        cache.close(c)
        check_pattern(cache, a)
        cache.close(a)
        check_invariants(cache)


def test_tenants_and_adapters_never_share():
    with cache_for() as cache:
        w = cache.open(PROMPT, salt="tenant-a")
        for kw in ({"salt": "tenant-b"}, {}, {"salt": "tenant-a", "adapter_id": "lora-1"}):
            other = cache.open(PROMPT, **kw)
            assert other.num_cached_tokens == 0, kw
            cache.close(other)
        same = cache.open(PROMPT, salt="tenant-a")
        assert same.num_cached_tokens == 32
        cache.close(same)
        cache.close(w)


def test_colliding_key_with_other_tokens_is_not_taken():
    def weak(data: bytes) -> bytes:
        return b"k" + bytes([len(data) % 7])        # every block of a depth collides
    with cache_for() as cache, make_cache(block_size=BS, num_layers=LAYERS, num_kv_heads=1,
                                          head_dim=4, gpu_blocks=64, host_blocks=0,
                                          share_inflight=True, hash_fn=weak) as weak_cache:
        for c in (cache, weak_cache):
            w = c.open(PROMPT)
            other = c.open([1] * 32)
            assert other.num_cached_tokens == 0
            if c is weak_cache:
                assert c.stats()["collisions"] >= 1
            c.close(other)
            c.close(w)


def test_reserve_last_keeps_the_last_token_uncached():
    with cache_for() as cache:
        w = cache.open(PROMPT)
        b = cache.open(PROMPT, reserve_last=True)
        assert b.num_cached_tokens == 28
        cache.close(b)
        cache.close(w)
        check_invariants(cache)


def test_off_by_default():
    with make_cache(block_size=BS, num_layers=LAYERS, num_kv_heads=1, head_dim=4) as cache:
        w = cache.open(PROMPT)
        b = cache.open(PROMPT)
        assert b.num_cached_tokens == 0
        cache.close(b)
        cache.close(w)


def test_k_concurrent_cold_sequences_pin_the_prefix_once():
    k, prefix_blocks, own = 64, 128, 4
    prefix = list(range(prefix_blocks * BS))
    with make_cache(block_size=BS, num_layers=1, storage="none", gpu_blocks=prefix_blocks
                    + own * k, host_blocks=0, share_inflight=True) as cache:
        seqs = [cache.open(prefix + [10_000 + i] * (own * BS)) for i in range(k)]
        assert used(cache) == prefix_blocks + own * k
        computed = sum(s.num_tokens - s.num_cached_tokens for s in seqs)
        assert computed == prefix_blocks * BS + k * own * BS
        for s in seqs[::-1]:                        # waiters publish once the writer has
            cache.mark_computed(s)
        for s in seqs:
            cache.close(s)
        assert cache.stats()["cached_blocks"] == prefix_blocks + own * k
        check_invariants(cache)


# ------------------------------------------------------------------------ a concurrency stress
def _expected(cache, seq, layer, n):
    return pattern_kv(cache, seq.salt, seq.token_ids, 0, n, layer)


def test_stress_writers_waiters_and_aborts_on_threads_never_serve_wrong_kv():
    """Four threads open overlapping prompts (two tenants), compute them layer by layer with
    random pauses, abandon a third of them half way, and often invalidate what they computed
    (so the next ones find it cold, being computed). Every gather is checked against the
    pattern of its own tokens; PrefixAbortedError is the only allowed failure, after which the
    request opens again and computes for itself."""
    rng0 = random.Random(7)
    stems = [[rng0.randrange(3) for _ in range(rng0.choice([16, 24]))] for _ in range(2)]
    errors: list[BaseException] = []
    aborted = [0]
    with cache_for(gpu_blocks=160, host_blocks=32) as cache:
        def worker(seed: int) -> None:
            rng = random.Random(seed)
            try:
                for _ in range(25):
                    prompt = rng.choice(stems) + [rng.randrange(3) for _ in range(rng.randrange(6))]
                    salt = rng.choice([None, "t2"])
                    for _attempt in range(4):
                        seq = cache.open(prompt, salt=salt)
                        try:
                            give_up = rng.random() < 0.3
                            for layer in range(LAYERS):
                                time.sleep(rng.uniform(0, 0.004))   # others open meanwhile
                                if give_up and layer == 1:
                                    break
                                cache.wait(seq, layer, timeout=20)
                                write_pattern(cache, seq, layer)
                                k, v = cache.gather(seq, layer)
                                ek, ev = _expected(cache, seq, layer, seq.written[layer])
                                assert torch.equal(k, ek) and torch.equal(v, ev), "wrong KV"
                        except PrefixAbortedError:
                            aborted[0] += 1
                            continue                # open again: compute it ourselves
                        finally:
                            cache.close(seq)
                        if rng.random() < 0.5:      # cold again: the next ones compute it
                            cache.invalidate(prompt[:BS], salt=salt)
                        break
            except BaseException as exc:            # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors[0]
        check_invariants(cache)
        s = cache.stats()
        assert s["open_sequences"] == 0
        assert s["inflight_hit_tokens"] > 0 and s["inflight_aborts"] > 0   # it did share
        assert aborted[0] <= s["inflight_aborts"]
        # Whatever is cached now is exactly its tokens' KV.
        for stem in stems:
            for salt in (None, "t2"):
                seq = cache.open(stem, salt=salt)
                for layer in range(LAYERS):
                    k, v = cache.gather(seq, layer)
                    n = seq.num_cached_tokens
                    ek, ev = _expected(cache, seq, layer, n)
                    assert torch.equal(k[:n], ek) and torch.equal(v[:n], ev)
                cache.close(seq)
        assert np.all(np.asarray([t["pinned_blocks"] for t in s["tiers"].values()]) == 0)


@pytest.mark.slow
def test_benchmark_quick(tmp_path):
    """benchmarks/inflight.py --quick runs, prints its tables and meets its bound (counts, not
    times)."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    out = tmp_path / "inflight.json"
    proc = subprocess.run([sys.executable, str(repo / "benchmarks" / "inflight.py"), "--quick",
                           "--out", str(out)], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "K concurrent cold requests" in proc.stdout
    data = json.loads(out.read_text())
    assert data["targets_met"] is True
    for r in data["rows"]:
        assert r["pinned_on"] == 128 + 4 * r["K"]
        assert r["pinned_off"] == 132 * r["K"]
