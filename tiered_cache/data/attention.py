"""Attention over block tables the control plane built (the kernels' side of the wiring).

`BlockIndex.begin_read` builds, under the lock, one row per sequence of (slot, tier) entries and
holds what the kernel will read; this module turns the rows into the kernels' index tensors and
runs the kernel outside the lock; the facade calls `end_read` afterwards. Entries name the tier
a block is read from: the device pool, or (a promotion that has not landed this layer yet) the
host pool, read zero-copy through its device-visible address.
"""

from __future__ import annotations

import torch

from tiered_cache.errors import DTypeError, ShapeError


def check_q(q, batch: int, num_q_heads: int, head_dim: int, dtypes: tuple[torch.dtype, ...],
            device: torch.device, shape_doc: str) -> None:
    """Queries: `[batch, num_q_heads, head_dim]` floating point, on the device tier's device,
    of the cache's compute dtype (a wider q than the cache's KV would return a wider output
    than every other path)."""
    if not isinstance(q, torch.Tensor):
        raise DTypeError(f"q: expected a torch.Tensor, got {type(q).__name__}")
    if q.is_nested or q.layout != torch.strided:
        raise DTypeError("q: expected a dense (strided) tensor, got "
                         f"{'a nested tensor' if q.is_nested else q.layout}")
    if q.dim() != 3 or q.shape[0] != batch or q.shape[1] != num_q_heads \
            or q.shape[2] != head_dim:
        raise ShapeError(f"q: expected {shape_doc} = [{batch}, {num_q_heads}, {head_dim}], "
                         f"got {list(q.shape)}")
    if q.dtype not in dtypes:
        what = " or ".join(str(d) for d in dtypes)
        raise DTypeError(f"q: expected dtype {what} (the cache's compute dtype), got {q.dtype}")
    if q.device != device:
        raise DTypeError(f"q: expected a tensor on {device} (the device tier), got {q.device}")
    if q.requires_grad:
        raise DTypeError("q: requires grad; attention over the cache is inference only "
                         "(pass q.detach())")


def tables(rows: list, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block_tables [B, W] int32, block_tiers [B, W] int8, seq_lens [B] int32)."""
    width = max([len(r[0]) for r in rows] + [1])
    bt = torch.zeros((len(rows), width), dtype=torch.int32)
    tiers = torch.zeros((len(rows), width), dtype=torch.int8)
    lens = torch.zeros(len(rows), dtype=torch.int32)
    for i, (slots, where, n) in enumerate(rows):
        if slots:
            bt[i, :len(slots)] = torch.tensor(slots, dtype=torch.int32)
            tiers[i, :len(where)] = torch.tensor(where, dtype=torch.int8)
        lens[i] = n
    return bt.to(device), tiers.to(device), lens.to(device)


def layer_pools(pools: list, layer: int):
    """(k_pools, v_pools, k_scales, v_scales) of one layer for the kernels: the device pool and
    the host pool (tier 1) if there is one; scales are None unless FP8."""
    gpu = pools[0]
    host = pools[1] if len(pools) > 1 and getattr(pools[1], "layout", None) == "block_major" \
        else None
    # NOTE: each pool's KV and scales come from one snapshot: a resize on another thread
    # swaps both views, and a pair of different sizes is refused by the kernels.
    gk, gv, gks, gvs = gpu.layer_views(layer)
    hk, hv, hks, hvs = host.layer_views(layer) if host is not None else (None,) * 4
    if gks is None:
        return (gk, hk), (gv, hv), None, None
    return (gk, hk), (gv, hv), (gks, hks), (gvs, hvs)


def decode(q: torch.Tensor, pools: list, rows: list, layer: int, scale: float | None,
           backend: str) -> torch.Tensor:
    from tiered_cache import kernels

    bt, tiers, lens = tables(rows, q.device)
    k_pools, v_pools, k_scales, v_scales = layer_pools(pools, layer)
    return kernels.paged_decode_attention(q, k_pools, v_pools, bt, tiers, lens, scale=scale,
                                          k_scales=k_scales, v_scales=v_scales,
                                          backend=backend)


def prefill(q: torch.Tensor, pools: list, rows: list, layer: int, scale: float | None,
            backend: str) -> torch.Tensor:
    from tiered_cache import kernels

    bt, tiers, lens = tables(rows, q.device)
    k_pools, v_pools, k_scales, v_scales = layer_pools(pools, layer)
    return kernels.prefill_attention(q, k_pools, v_pools, bt[0], tiers[0], int(lens[0]),
                                     scale=scale, k_scales=k_scales, v_scales=v_scales,
                                     backend=backend)
