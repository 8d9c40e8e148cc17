"""cache.attention / cache.prefill_attention over the cache's real block tables, including blocks
read zero-copy from host while their promotion is still in flight."""

from __future__ import annotations

import os
import shutil
import time

if not shutil.which("nvidia-smi"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

from tiered_cache import TieredKVCache
from tiered_cache.config import CacheConfig
from tiered_cache.core.invariants import check_invariants
from tiered_cache.errors import DTypeError, ShapeError, StorageDisabledError

L, HKV, HQ, D, BS = 2, 2, 8, 16, 4


def make(backend: str = "torch", missing: str = "zero_copy", gpu: int = 12) -> TieredKVCache:
    return TieredKVCache(CacheConfig.from_dict({
        "block_size": BS,
        "model": {"num_layers": L, "num_kv_heads": HKV, "head_dim": D, "num_q_heads": HQ},
        "tiers": {"gpu": {"num_blocks": gpu}, "host": {"num_blocks": 64}},
        "kernels": {"attention_backend": backend, "missing_blocks": missing},
        "compactor": {"enabled": False},
        "migrator": {"promotion_chunk_bytes": 0},   # layer by layer, so one can be in flight
    }))


def kv_for(tokens: list[int], layer: int):
    """Per-position KV that depends only on (position, token, layer), so a prefix's KV is the
    same inside any longer prompt."""
    rows_k, rows_v = [], []
    for i, t in enumerate(tokens):
        g = torch.Generator().manual_seed((i * 1_000_003 + t * 7919 + layer) % 2**31)
        rows_k.append(torch.randn(HKV, D, generator=g))
        rows_v.append(torch.randn(HKV, D, generator=g))
    return torch.stack(rows_k), torch.stack(rows_v)


def reference(q, k, v, causal_from: int | None = None):
    """float64 softmax attention; q [n, HQ, D] over k/v [T, HKV, D]."""
    q64, k64, v64 = (x.double() for x in (q, k, v))
    k64 = k64.repeat_interleave(HQ // HKV, dim=1)
    v64 = v64.repeat_interleave(HQ // HKV, dim=1)
    scores = torch.einsum("qhd,thd->qht", q64, k64) * D ** -0.5
    if causal_from is not None:
        pos = torch.arange(causal_from, causal_from + q.shape[0])
        mask = torch.arange(k.shape[0])[None, :] > pos[:, None]
        scores = scores.masked_fill(mask[:, None, :], float("-inf"))
    return torch.einsum("qht,thd->qhd", scores.softmax(-1), v64)


def rel_err(out, ref):
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def open_written(cache, tokens):
    seq = cache.open(tokens)
    start = seq.num_cached_tokens
    for layer in range(L):
        k, v = kv_for(tokens, layer)
        cache.write(seq, layer, k[start:], v[start:])
    return seq


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_decode_over_several_sequences(backend):
    cache = make(backend)
    prompts = [list(range(n)) for n in (1, BS - 1, BS, BS + 1, 3 * BS + 2)]
    seqs = [open_written(cache, [t + 100 * i for t in p]) for i, p in enumerate(prompts)]
    q = torch.randn(len(seqs), HQ, D)
    for layer in range(L):
        out = cache.attention(q, seqs, layer)
        for i, seq in enumerate(seqs):
            k, v = kv_for(seq.token_ids.tolist(), layer)
            assert rel_err(out[i:i + 1], reference(q[i:i + 1], k, v)) < 1e-5
    for seq in seqs:
        cache.close(seq)
    cache.shutdown()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_over_cached_prefix(backend):
    cache = make(backend)
    prefix = list(range(3 * BS))
    seq = open_written(cache, prefix)
    cache.close(seq)
    tokens = prefix + [500, 501, 502]
    seq = open_written(cache, tokens)
    assert seq.num_cached_tokens == 3 * BS
    q = torch.randn(3, HQ, D)
    for layer in range(L):
        out = cache.prefill_attention(q, seq, layer)
        k, v = kv_for(tokens, layer)
        assert rel_err(out, reference(q, k, v, causal_from=len(tokens) - 3)) < 1e-5
    cache.close(seq)
    cache.shutdown()


@pytest.mark.parametrize("missing", ["zero_copy", "wait"])
def test_in_flight_promotion_reads_host_or_waits(missing):
    cache = make("torch", missing, gpu=8)
    prompt = list(range(4 * BS))
    seq = open_written(cache, prompt)
    cache.close(seq)
    for p in range(3):                              # push the prompt down to host
        other = [1000 + 100 * p + i for i in range(4 * BS)]
        cache.close(open_written(cache, other))
    cache.migrator.drain()
    time.sleep(0.05)
    cache.migrator.drain()

    def slow(kind, attempt):
        if kind == "promotion":
            time.sleep(0.2)
    cache.migrator.fault_hook = slow
    seq = cache.open(prompt + [7])
    assert seq.cached_tokens_by_tier["host"] > 0 and seq.pending
    for layer in range(L):
        k, v = kv_for(prompt + [7], layer)
        cache.write(seq, layer, k[-1:], v[-1:])
    q = torch.randn(1, HQ, D)
    t0 = time.perf_counter()
    out = cache.attention(q, [seq], L - 1)          # the last layer has not landed yet
    took = time.perf_counter() - t0
    k, v = kv_for(prompt + [7], L - 1)
    assert rel_err(out, reference(q, k, v)) < 1e-5
    if missing == "zero_copy":
        assert took < 0.15                          # read from host, no stall
    else:
        assert took >= 0.15                         # waited for the layer
    cache.migrator.fault_hook = None
    cache.close(seq)
    cache.migrator.drain()
    check_invariants(cache)
    cache.shutdown()


def test_bad_inputs_are_rejected_and_change_nothing():
    cache = make()
    seq = open_written(cache, list(range(6)))
    before = cache.stats()
    with pytest.raises(ShapeError, match="q: expected"):
        cache.attention(torch.randn(2, HQ, D), [seq], 0)        # batch mismatch
    with pytest.raises(ShapeError, match="num_q_heads"):
        cache.attention(torch.randn(1, 3, D), [seq], 0)
    with pytest.raises(ShapeError, match="num_q_heads"):       # a multiple of kv heads, but
        cache.attention(torch.randn(1, HQ // 2, D), [seq], 0)  # not the model's query heads
    with pytest.raises(DTypeError, match="expected dtype torch.float32"):
        cache.attention(torch.ones(1, HQ, D, dtype=torch.int64), [seq], 0)
    with pytest.raises(DTypeError, match="expected dtype torch.float32"):
        cache.attention(torch.randn(1, HQ, D, dtype=torch.float64), [seq], 0)
    with pytest.raises(DTypeError, match="requires grad"):
        cache.attention(torch.randn(1, HQ, D, requires_grad=True), [seq], 0)
    with pytest.raises(ShapeError, match="last n written"):
        cache.prefill_attention(torch.randn(7, HQ, D), seq, 0)
    after = cache.stats()
    assert {k: v for k, v in before.items() if k not in ("lock_hold", "threads")} == \
        {k: v for k, v in after.items() if k not in ("lock_hold", "threads")}
    check_invariants(cache)
    cache.close(seq)
    meta = TieredKVCache(CacheConfig.from_dict({"storage": "none"}))
    s = meta.open([1, 2, 3])
    with pytest.raises(StorageDisabledError):
        meta.attention(torch.randn(1, 2, 64), [s], 0)
