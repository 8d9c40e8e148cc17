"""The load-vs-recompute cost model, on numbers worked out by hand."""

from __future__ import annotations

import math
import threading

import pytest

from tiered_cache.costs import (
    DEFAULT_MARGIN,
    DEFAULT_PREFILL_TFLOPS,
    MIN_TRANSFER_FRACTION,
    CostModel,
    ModelFlops,
    TierCost,
)

MiB = 1 << 20
LLAMA_70B = ModelFlops(num_params=70.6e9, num_layers=80, num_q_heads=64, head_dim=128)
BLOCK_70B = 5 * MiB         # 80 layers x 8 KV heads x 128 x (K, V) x 2 B x 16 tokens


def test_block_bytes_of_the_70b_example():
    assert 80 * 8 * 128 * 2 * 2 * 16 == BLOCK_70B


def test_prefill_flops_small_model():
    m = ModelFlops(num_params=1e9, num_layers=2, num_q_heads=4, head_dim=8)
    assert m.hidden == 32
    assert m.linear_flops(10) == 2e10
    # 10 tokens after 5: token i sees 5 + i + 1 keys -> 6 + 7 + ... + 15 = 105 pairs
    assert m.attention_flops(10, 5) == 4 * 2 * 32 * 105
    assert m.prefill_flops(10, 5) == 2e10 + 4 * 2 * 32 * 105
    assert m.prefill_flops(0, 1000) == 0
    # one token after 99: 100 pairs
    assert m.attention_flops(1, 99) == 4 * 2 * 32 * 100


def test_model_and_counts_are_validated():
    with pytest.raises(ValueError, match="num_layers"):
        ModelFlops(num_params=1e9, num_layers=0, num_q_heads=4, head_dim=8)
    with pytest.raises(ValueError, match="token counts"):
        LLAMA_70B.prefill_flops(-1)
    with pytest.raises(ValueError, match="prefill_tflops"):
        CostModel(LLAMA_70B, prefill_tflops=0)
    with pytest.raises(ValueError, match="alpha"):
        TierCost("x", latency_s=0, bandwidth_bps=1, alpha=0)
    with pytest.raises(ValueError, match="bandwidth"):
        TierCost("x", latency_s=0, bandwidth_bps=0)


def test_recompute_seconds_70b():
    cm = CostModel(LLAMA_70B, prefill_tflops=400)
    linear = 2 * 70.6e9 * 16
    attn0 = 4 * 80 * 8192 * (16 * 17 / 2)
    assert cm.recompute_seconds(16) == pytest.approx((linear + attn0) / 400e12, rel=1e-12)
    assert cm.recompute_seconds(16) == pytest.approx(5.649e-3, rel=1e-3)
    attn_deep = 4 * 80 * 8192 * (16 * 100_000 + 16 * 17 / 2)
    assert cm.recompute_seconds(16, 100_000) == pytest.approx((linear + attn_deep) / 400e12)
    assert cm.recompute_seconds(16, 100_000) == pytest.approx(16.13e-3, rel=1e-3)
    assert DEFAULT_PREFILL_TFLOPS == 400.0


def test_tier_priors_until_samples():
    t = TierCost("remote", latency_s=1e-3, bandwidth_bps=1e9)
    assert t.load_seconds(1, BLOCK_70B) == pytest.approx(1e-3 + BLOCK_70B / 1e9)
    assert t.load_seconds(0, 0) == 0.0
    assert t.snapshot()["latency_samples"] == 0


def test_latency_mean_then_ewma():
    t = TierCost("remote", latency_s=1e-3, bandwidth_bps=1e9, alpha=0.25)
    t.observe(0, 3e-3)                     # the first sample replaces the prior
    assert t.latency_s == pytest.approx(3e-3)
    t.observe(0, 5e-3)                     # mean of the samples while n <= 1 / alpha
    assert t.latency_s == pytest.approx(4e-3)
    t.observe(0, 7e-3)
    t.observe(0, 1e-3)
    assert t.latency_s == pytest.approx(4e-3)                       # (3 + 5 + 7 + 1) / 4
    t.observe(0, 8e-3)                     # n = 5 > 1 / alpha: EWMA with alpha
    assert t.latency_s == pytest.approx(4e-3 + 0.25 * (8e-3 - 4e-3))
    assert t.bandwidth_bps == 1e9          # lookups say nothing about bandwidth
    assert t.latency_samples == 5


def test_bandwidth_ewma_takes_latency_out():
    t = TierCost("remote", latency_s=1e-3, bandwidth_bps=1e9, alpha=1.0)
    # 10 MB in 6 ms with 1 ms of latency: 10e6 / 5e-3 = 2 GB/s
    t.observe(10_000_000, 6e-3, nblocks=2)
    assert t.bandwidth_bps == pytest.approx(2e9)
    assert t.latency_s == 1e-3
    assert t.blocks_observed == 2
    t2 = TierCost("remote", latency_s=1e-3, bandwidth_bps=1e9, alpha=0.5)
    t2.observe(10_000_000, 6e-3)           # first sample: 2 GB/s, the prior is gone
    t2.observe(10_000_000, 11e-3)          # 1 GB/s: mean 1.5
    t2.observe(10_000_000, 3.5e-3)         # 4 GB/s with weight alpha = 0.5: 2.75
    assert t2.bandwidth_bps == pytest.approx(2.75e9)


def test_bandwidth_floor_when_latency_exceeds_the_sample():
    t = TierCost("disk", latency_s=10e-3, bandwidth_bps=1e9, alpha=1.0)
    t.observe(1_000_000, 2e-3)            # faster than the latency estimate says is possible
    assert t.bandwidth_bps == pytest.approx(1_000_000 / (2e-3 * MIN_TRANSFER_FRACTION))
    assert math.isfinite(t.bandwidth_bps)
    t.observe(1_000_000, -1.0)            # nonsense samples are ignored
    t.observe(1_000_000, 0.0)
    assert math.isfinite(t.bandwidth_bps) and t.bandwidth_samples == 1


def test_decision_70b_bandwidth_and_latency():
    cm = CostModel(LLAMA_70B, prefill_tflops=400)     # default margin 1.1
    assert cm.margin == DEFAULT_MARGIN
    slow = cm.add_tier(TierCost("slow", latency_s=1e-3, bandwidth_bps=1e9))
    fast = cm.add_tier(TierCost("fast", latency_s=1e-3, bandwidth_bps=10e9))
    far = cm.add_tier(TierCost("far", latency_s=20e-3, bandwidth_bps=10e9))
    one = dict(nblocks=1, nbytes=BLOCK_70B, num_tokens=16)
    # 6.24 ms to load vs 5.65 ms to recompute at the start of a prompt: recompute
    d = cm.decide("slow", **one)
    assert d.load_s == pytest.approx(1e-3 + BLOCK_70B / 1e9) and not d.load
    assert not cm.worth_loading(slow, **one)
    # 1.52 ms: load
    assert cm.worth_loading(fast, **one)
    # 20 ms of latency loses to recompute at the start ...
    assert not cm.worth_loading(far, **one)
    # ... but a 64-block run amortises it: 20 + 33.6 ms vs 361 ms + attention
    assert cm.worth_loading(far, nblocks=64, nbytes=64 * BLOCK_70B, num_tokens=64 * 16)
    # deep in a 100K context the same block costs 16.1 ms to recompute: even 1 GB/s loads
    assert cm.worth_loading("slow", **one, context_tokens=100_000)


def test_margin_boundary():
    m = ModelFlops(num_params=1e9, num_layers=1, num_q_heads=1, head_dim=1)
    cm = CostModel(m, prefill_tflops=1e-3, margin=2.0)   # 1e9 FLOP/s
    # recompute 1 token: 2e9 + 4 * 1 FLOPs -> 2.000000004 s
    t = cm.add_tier(TierCost("t", latency_s=1.0, bandwidth_bps=1e9))
    assert cm.decide(t, nblocks=1, nbytes=0, num_tokens=1).load      # 1 s * 2 <= 2.000000004
    t2 = cm.add_tier(TierCost("t2", latency_s=1.0, bandwidth_bps=1e9))
    assert not cm.decide(t2, nblocks=1, nbytes=10, num_tokens=1).load  # (1 + 1e-8) * 2 > ...


def test_observe_is_thread_safe():
    t = TierCost("t", latency_s=0.0, bandwidth_bps=1e9, alpha=0.01)

    def work() -> None:
        for _ in range(2000):
            t.observe(0, 1e-3, 1)

    threads = [threading.Thread(target=work) for _ in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert t.latency_samples == 8000 and t.blocks_observed == 8000
    assert 0 < t.latency_s <= 1e-3
