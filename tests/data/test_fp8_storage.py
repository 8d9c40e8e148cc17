"""FP8 (e4m3) KV storage in the cache: quantized on write with per-block scales that travel with
their blocks across tiers, dequantized by gather and inside attention."""

from __future__ import annotations

import time

import pytest
import torch

from tiered_cache import TieredKVCache
from tiered_cache.config import CacheConfig
from tiered_cache.core.invariants import check_invariants
from tiered_cache.errors import DTypeError, KVValueError

L, H, HQ, D, BS = 2, 2, 4, 16, 4


def make(gpu: int = 16) -> TieredKVCache:
    return TieredKVCache(CacheConfig.from_dict({
        "block_size": BS,
        "model": {"num_layers": L, "num_kv_heads": H, "head_dim": D, "num_q_heads": HQ,
                  "dtype": "fp8_e4m3"},
        "tiers": {"gpu": {"num_blocks": gpu}, "host": {"num_blocks": 64}},
        "kernels": {"attention_backend": "torch"},
        "compactor": {"enabled": False},
    }))


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def test_token_by_token_writes_share_one_growing_scale():
    cache = make()
    g = torch.Generator().manual_seed(1)
    k = torch.randn(3 * BS + 1, H, D, generator=g)
    k[BS + 2] *= 50                          # a late outlier forces a requantize of its block
    seq = cache.open(list(range(len(k))))
    for i in range(len(k)):
        for layer in range(L):
            cache.write(seq, layer, k[i:i + 1], -k[i:i + 1])
    for layer in range(L):
        gk, gv = cache.gather(seq, layer)
        assert gk.dtype == torch.float32
        assert rel(gk, k) < 5e-2 and rel(gv, -k) < 5e-2
        block = k[BS:2 * BS]                 # the requantized block is still accurate
        assert rel(gk[BS:2 * BS], block) < 5e-2
    cache.close(seq)
    cache.shutdown()


def test_scales_travel_with_demotion_and_promotion_and_attention_dequantizes():
    cache = make(gpu=8)
    g = torch.Generator().manual_seed(2)
    prompt = list(range(4 * BS))
    kv = [(torch.randn(len(prompt), H, D, generator=g),
           torch.randn(len(prompt), H, D, generator=g)) for layer in range(L)]
    seq = cache.open(prompt)
    for layer in range(L):
        cache.write(seq, layer, *kv[layer])
    cache.close(seq)
    for p in range(3):                       # push the prompt to host
        other = [100 * (p + 1) + i for i in range(4 * BS)]
        s = cache.open(other)
        for layer in range(L):
            cache.write(s, layer, torch.randn(4 * BS, H, D, generator=g) * 100,
                        torch.randn(4 * BS, H, D, generator=g))
        cache.close(s)
    cache.migrator.drain()
    time.sleep(0.05)
    cache.migrator.drain()
    seq = cache.open(prompt)
    assert seq.cached_tokens_by_tier["host"] > 0
    q = torch.randn(1, HQ, D, generator=g)
    for layer in range(L):
        k, v = kv[layer]
        gk, gv = cache.gather(seq, layer)
        assert rel(gk, k) < 5e-2 and rel(gv, v) < 5e-2
        out = cache.attention(q, [seq], layer)
        # The kernel dequantizes exactly what gather returns (the fp8 error is the storage's,
        # bounded above); attention over it must match to float32 precision.
        kk = gk.repeat_interleave(HQ // H, 1).double()
        vv = gv.repeat_interleave(HQ // H, 1).double()
        p = (torch.einsum("hd,thd->ht", q[0].double(), kk) * D ** -0.5).softmax(-1)
        ref = torch.einsum("ht,thd->hd", p, vv)
        assert rel(out[0], ref) < 1e-5
    cache.close(seq)
    check_invariants(cache)
    cache.shutdown()


def test_fp8_rejects_integer_and_non_finite_kv_without_change():
    cache = make()
    seq = cache.open(list(range(BS)))
    bad = torch.zeros(BS, H, D)
    bad[0, 0, 0] = float("nan")
    with pytest.raises(KVValueError, match="NaN or inf.*fp8_e4m3 storage needs finite"):
        cache.write(seq, 0, bad, bad)
    with pytest.raises(DTypeError, match="float16, bfloat16 or float32"):
        cache.write(seq, 0, torch.zeros(BS, H, D, dtype=torch.int32),
                    torch.zeros(BS, H, D, dtype=torch.int32))
    assert seq.written == [0] * L
    cache.close(seq)
    cache.shutdown()
