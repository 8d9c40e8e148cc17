"""Attention over the cache's block tables (the wiring between the control plane and kernels/).

A block table entry names a slot and the tier it is read from. Blocks whose promotion has not
yet landed for this layer are read where they are:

- `missing_blocks: zero_copy` (default): straight from the host pool (on a GPU, through the
  pinned pool's device-visible address), so decoding never stalls on a partly promoted prefix;
  the host copy is held in flight (not evictable) until the kernel has been issued.
- `missing_blocks: wait`: wait for this layer of every pending promotion, then read the device
  pool only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from tiered_cache.block import NO_SLOT, Block
from tiered_cache.errors import DTypeError, ShapeError, TransferError

if TYPE_CHECKING:
    from tiered_cache.cache import TieredKVCache
    from tiered_cache.sequence import Sequence

GPU, HOST = 0, 1


def decode(cache: TieredKVCache, q: torch.Tensor, seqs: list[Sequence], layer: int,
           scale: float | None) -> torch.Tensor:
    from tiered_cache import kernels

    _check_q(cache, q, len(seqs), "[len(seqs), num_q_heads, head_dim]")
    tables, tiers, lens, held = _tables(cache, seqs, layer, q.device)
    try:
        k_pools, v_pools, k_scales, v_scales = _pools(cache, layer)
        return kernels.paged_decode_attention(
            q, k_pools, v_pools, tables, tiers, lens, scale=scale, k_scales=k_scales,
            v_scales=v_scales, backend=cache.config.kernels.attention_backend)
    finally:
        _release(cache, held)


def prefill(cache: TieredKVCache, q: torch.Tensor, seq: Sequence, layer: int,
            scale: float | None) -> torch.Tensor:
    from tiered_cache import kernels

    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ShapeError("q: expected a tensor [n, num_q_heads, head_dim] for the last n "
                         f"written tokens, got {getattr(q, 'shape', type(q).__name__)}")
    n = q.shape[0]
    if not 1 <= n <= seq.written[layer]:
        raise ShapeError(f"q: {n} queries, but layer {layer} has {seq.written[layer]} tokens "
                         "written (queries are the last n written tokens)")
    _check_q(cache, q, n, "[n, num_q_heads, head_dim]")
    tables, tiers, lens, held = _tables(cache, [seq], layer, q.device)
    try:
        k_pools, v_pools, k_scales, v_scales = _pools(cache, layer)
        return kernels.prefill_attention(
            q, k_pools, v_pools, tables[0], tiers[0], int(lens[0]), scale=scale,
            k_scales=k_scales, v_scales=v_scales,
            backend=cache.config.kernels.attention_backend)
    finally:
        _release(cache, held)


def _check_q(cache: TieredKVCache, q, batch: int, shape_doc: str) -> None:
    if not isinstance(q, torch.Tensor):
        raise DTypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if (q.dim() != 3 or q.shape[0] != batch or q.shape[2] != cache.head_dim
            or q.shape[1] % cache.num_kv_heads):
        raise ShapeError(f"q: expected {shape_doc} with head_dim {cache.head_dim} and a "
                         f"multiple of {cache.num_kv_heads} query heads, got {list(q.shape)}")
    if not q.is_floating_point():
        raise DTypeError(f"q: expected a floating-point tensor, got {q.dtype}")
    pool_device = cache.tiers[GPU].pool.kv.device
    if q.device != pool_device:
        raise DTypeError(f"q: expected a tensor on {pool_device} (the device tier), "
                         f"got {q.device}")


def _pools(cache: TieredKVCache, layer: int):
    """(k_pools, v_pools, k_scales, v_scales) of one layer; scales are None unless FP8."""
    gpu = cache.tiers[GPU].pool
    host = cache.tiers[HOST].pool if len(cache.tiers) > 1 else None
    gk, gv = gpu.layer(layer)
    hk, hv = host.layer(layer) if host is not None else (None, None)
    if gpu.scales is None:
        return (gk, hk), (gv, hv), None, None
    gks, gvs = gpu.layer_scales(layer)
    hks, hvs = host.layer_scales(layer) if host is not None else (None, None)
    return (gk, hk), (gv, hv), (gks, hks), (gvs, hvs)


def _tables(cache: TieredKVCache, seqs: list[Sequence], layer: int, device: torch.device):
    """Block tables of `seqs` for one layer, built under the lock.

    Returns (tables [B, max_blocks] int32, tiers [B, max_blocks] int8, lens [B] int32, held):
    `held` are the blocks read from host, kept in flight until `_release`.
    """
    for seq in seqs:
        cache._check_open(seq)
    cache._check_layer(layer)
    if cache.config.kernels.missing_blocks == "wait":
        for seq in seqs:
            cache.wait(seq, layer)
    width = max([len(s.blocks) for s in seqs] + [1])
    tables = torch.zeros((len(seqs), width), dtype=torch.int32)
    tiers = torch.zeros((len(seqs), width), dtype=torch.int8)
    lens = torch.zeros(len(seqs), dtype=torch.int32)
    held: list[Block] = []
    with cache._lock:
        for seq in seqs:
            cache._check_open(seq)
        for i, seq in enumerate(seqs):
            row, tier_row = [], []
            for b in seq.blocks:
                r = b.pending
                if r is not None and r.ready_layers <= layer:
                    if r.error is not None or b.slots[HOST] == NO_SLOT:
                        _release(cache, held)
                        raise TransferError(f"promotion of a block of sequence {seq.id} "
                                            f"failed: {r.error}")
                    row.append(b.slots[HOST])
                    tier_row.append(HOST)
                    b.in_flight += 1
                    held.append(b)
                else:
                    row.append(b.slots[GPU])
                    tier_row.append(GPU)
            tables[i, :len(row)] = torch.tensor(row, dtype=torch.int32)
            tiers[i, :len(tier_row)] = torch.tensor(tier_row, dtype=torch.int8)
            lens[i] = seq.written[layer]
        for b in held:
            cache._refresh(b)
    return tables.to(device), tiers.to(device), lens.to(device), held


def _release(cache: TieredKVCache, held: list[Block]) -> None:
    if not held:
        return
    with cache._lock:
        for b in held:
            b.in_flight -= 1
            if b.key is None and b.ref_count == 0 and b.in_flight == 0:
                cache._release(b)
            else:
                cache._refresh(b)
