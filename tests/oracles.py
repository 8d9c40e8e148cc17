"""Oracles and probes of the exception-safety, race and fault tests (test_interrupts,
test_races, test_faults, test_api_misuse): float64 reference attention over pattern KV, a probe
of the control-plane lock from another thread, and small waits.

Import with `from tests.oracles import ...`, like tests.helpers.
"""

from __future__ import annotations

import threading
import time

import torch

from tests.helpers import keys_of, pattern_kv
from tiered_cache import TieredKVCache

ATTENTION_TOL = {"rtol": 1e-4, "atol": 1e-3}
"""Tolerance of an attention output (the kernels compute in float32) against the float64
references below, for `query()` queries over pattern KV: float32 rounding stays below 1e-4,
while a single block of another prompt moves the output by whole units."""


def query(cache: TieredKVCache, n: int, seed: int = 0, dtype: torch.dtype = torch.float32,
          heads: int | None = None) -> torch.Tensor:
    """Deterministic queries `[n, heads (num_q_heads), head_dim]` of a small norm (0.1 *
    N(0, 1)): the softmax over pattern KV stays smooth, so float32 rounding cannot flip which
    key dominates (randn-sized queries against keys of magnitude ~100 are near one-hot)."""
    g = torch.Generator().manual_seed(seed)
    h = cache.num_q_heads if heads is None else heads
    return (0.1 * torch.randn(n, h, cache.head_dim, generator=g)).to(dtype)


def ref_decode_attention(q: torch.Tensor, keys: list[torch.Tensor], values: list[torch.Tensor],
                         scale: float | None = None) -> torch.Tensor:
    """Plain torch decode attention (float64): `q` `[B, Hq, D]`, one query per sequence over
    that sequence's `keys[i]` / `values[i]` `[n_i, Hkv, D]`; q head h reads kv head
    h // (Hq // Hkv). A sequence with no tokens gives zeros (as the kernels do)."""
    b, hq, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    out = torch.zeros(b, hq, d, dtype=torch.float64)
    for i in range(b):
        k, v = keys[i].double(), values[i].double()
        if not len(k):
            continue
        g = hq // k.shape[1]
        k = k.repeat_interleave(g, dim=1)               # [n, Hq, D]
        v = v.repeat_interleave(g, dim=1)
        s = torch.einsum("hd,nhd->hn", q[i].double() * scale, k)
        out[i] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v)
    return out


def ref_prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                          scale: float | None = None) -> torch.Tensor:
    """Plain torch causal attention (float64) of the last `n` positions (`q` `[n, Hq, D]`)
    over all `len(k)` keys `[N, Hkv, D]`: query j sits at position N - n + j."""
    n, hq, d = q.shape
    total = k.shape[0]
    scale = d ** -0.5 if scale is None else scale
    g = hq // k.shape[1]
    kk = k.double().repeat_interleave(g, dim=1)
    vv = v.double().repeat_interleave(g, dim=1)
    s = torch.einsum("qhd,nhd->hqn", q.double() * scale, kk)
    qpos = torch.arange(total - n, total)[:, None]
    mask = torch.arange(total)[None, :] <= qpos
    s = s.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hqn,nhd->qhd", torch.softmax(s, dim=-1), vv)


def expected_attention(cache: TieredKVCache, q: torch.Tensor, seqs, layer: int) -> torch.Tensor:
    """What `cache.attention(q, seqs, layer)` must return when every sequence's written tokens
    hold their pattern (write_pattern), computed from the pattern alone."""
    ks, vs = [], []
    for s in seqs:
        k, v = pattern_kv(cache, s.salt, s.token_ids, 0, s.written[layer], layer)
        ks.append(k)
        vs.append(v)
    return ref_decode_attention(q, ks, vs)


def lock_usable(cache: TieredKVCache, timeout: float = 10.0) -> bool:
    """Whether another thread can take the control-plane lock (`cache.index.lock`) within
    `timeout` seconds. (The lock is re-entrant: one leaked by the calling thread would still
    let the caller itself in.) A probe that never gets the lock stays blocked on its daemon
    thread; the test fails anyway."""
    got = threading.Event()

    def probe() -> None:
        with cache.index.lock:
            got.set()

    threading.Thread(target=probe, name="lock-probe", daemon=True).start()
    return got.wait(timeout)


def needs_promotion(cache: TieredKVCache, token_ids, salt=None) -> bool:
    """Whether every full block of `token_ids` is cached, none has a copy under way, and at
    least one has no device copy but a host copy: an open of it must promote."""
    with cache.locked():
        ids = [cache.index.lookup(k) for k in keys_of(cache, token_ids, salt)]
        t = cache.index.blocks
        if not ids or any(b is None or t.in_flight[b] for b in ids):
            return False
        return any(t.slots[0][b] == -1 and t.slots[1][b] >= 0 for b in ids)


def wait_for(cond, what: str, timeout: float = 20.0, interval: float = 0.002) -> None:
    """Poll `cond()` every `interval` seconds until it holds; fail after `timeout` seconds (a
    bound, not a measure)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(interval)


__all__ = ["ATTENTION_TOL", "expected_attention", "lock_usable", "needs_promotion", "query",
           "ref_decode_attention", "ref_prefill_attention", "wait_for"]
