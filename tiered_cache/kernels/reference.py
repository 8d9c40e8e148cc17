"""Pure-torch twins of every kernel: the CPU path and the oracle the Triton kernels are tested
against. Inputs are assumed validated by the public functions in ``kernels/api.py``.

Conventions shared with the Triton kernels:

- Pools: a layer's K (or V) is a pair ``(gpu_view, host_view_or_None)``, each
  ``[num_slots, block_size, num_kv_heads, head_dim]``, any strides.
- A block-table entry ``(slot, tier)`` names ``gpu_view[slot]`` when ``tier == 0`` and
  ``host_view[slot]`` otherwise. Entries at or past a sequence's ``cdiv(seq_len, block_size)``
  blocks are never dereferenced (they may hold garbage).
- Attention states are ``(o, lse)``: ``o`` the softmax-normalized output over some key set and
  ``lse`` the natural-log log-sum-exp of the *scaled* scores over that set. A state over no keys
  has ``lse = -inf`` (its ``o`` is ignored, even if NaN).
- Arithmetic runs in float32 (float64 when q is float64); outputs are cast back to q's dtype.
"""

from __future__ import annotations

import math

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn value

# The twins work through the context in chunks of about this many tokens so the gathered K/V
# of one chunk stays cache-sized (and memory stays bounded for long contexts).
DECODE_CHUNK_TOKENS = 1024
# Prefill: at most this many score elements per (query chunk x context) product.
PREFILL_MAX_SCORES = 1 << 24

Pools = tuple[torch.Tensor, "torch.Tensor | None"]


def compute_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# merge
# ---------------------------------------------------------------------------------------------


def merge_states(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint key sets.

    o1, o2: ``[..., H, D]``; lse1, lse2: ``[..., H]`` (natural log). Returns ``(o, lse)`` with
    ``o`` in o1's dtype and ``lse`` in lse1's dtype:
    ``lse = log(exp(lse1) + exp(lse2))``, ``o = (exp(lse1 - lse) o1 + exp(lse2 - lse) o2)``.
    """
    cdt = torch.float64 if torch.float64 in (o1.dtype, lse1.dtype) else torch.float32
    l1, l2 = lse1.to(cdt), lse2.to(cdt)
    m = torch.maximum(l1, l2)
    # NOTE: both parts empty gives m = -inf, and exp(-inf - -inf) would be NaN: subtract 0
    # instead, so both weights are exp(-inf) = 0 and the result is (o=0, lse=-inf).
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)
    w1, w2 = torch.exp(l1 - m), torch.exp(l2 - m)
    total = w1 + w2
    # NOTE: an empty part's o may be anything (uninitialized, NaN): mask it, don't multiply.
    t1 = torch.where(w1[..., None] > 0, o1.to(cdt) * w1[..., None], 0.0)
    t2 = torch.where(w2[..., None] > 0, o2.to(cdt) * w2[..., None], 0.0)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    o = (t1 + t2) / safe[..., None]
    lse = torch.where(total > 0, m + torch.log(safe), -math.inf)
    return o.to(o1.dtype), lse.to(lse1.dtype)


def merge_splits(
    o_parts: torch.Tensor, lse_parts: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``S`` states stacked on the second-to-last dim of o: o_parts ``[..., S, D]``,
    lse_parts ``[..., S]`` -> ``(o [..., D], lse [...])`` (the split-K reduction)."""
    cdt = torch.float64 if o_parts.dtype == torch.float64 else torch.float32
    lse = lse_parts.to(cdt)
    m = lse.amax(dim=-1, keepdim=True)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)  # NOTE: see merge_states
    w = torch.exp(lse - m)
    terms = torch.where(w[..., None] > 0, o_parts.to(cdt) * w[..., None], 0.0)
    total = w.sum(dim=-1)
    safe = torch.where(total > 0, total, torch.ones_like(total))
    o = terms.sum(dim=-2) / safe[..., None]
    out_lse = torch.where(total > 0, m.squeeze(-1) + torch.log(safe), -math.inf)
    return o.to(o_parts.dtype), out_lse.to(lse_parts.dtype)


# ---------------------------------------------------------------------------------------------
# gather from the two pools
# ---------------------------------------------------------------------------------------------


def _take(
    pool: torch.Tensor, scales: torch.Tensor | None, slots: torch.Tensor, device: torch.device,
    cdt: torch.dtype,
) -> torch.Tensor:
    """pool[slots] (on pool's device) -> device, dequantized to cdt."""
    idx = slots.to(pool.device)
    blocks = pool[idx].to(device)
    out = blocks.to(cdt)
    if scales is not None:
        s = scales[idx].to(device, cdt)
        out = out * s.view(-1, *([1] * (out.dim() - 1)))
    return out


def gather_blocks(
    pools: Pools,
    scales: tuple[torch.Tensor, torch.Tensor | None] | None,
    slots: torch.Tensor,
    tiers: torch.Tensor,
    valid: torch.Tensor,
    device: torch.device,
    cdt: torch.dtype,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """Gather blocks named by ``(slots, tiers)`` ``[B, n]`` into ``[B, n, block_size, H, D]``.

    Entries where ``valid`` is False are read as slot 0 of the GPU pool (never their garbage
    slot id); callers mask those positions out of the scores. ``workspace``: an optional flat
    buffer of dtype cdt and at least ``B * n`` blocks, reused across chunks.
    """
    gpu, host = pools
    gs, hs = scales if scales is not None else (None, None)
    slots = slots.to(device, torch.int64)
    tiers = tiers.to(device)
    on_host = valid & (tiers != 0)
    gpu_slots = torch.where(valid & ~on_host, slots, torch.zeros_like(slots))
    b, n = slots.shape
    shape = (b * n, *gpu.shape[1:])
    if workspace is not None and gs is None and gpu.dtype == cdt and gpu.device == device:
        # NOTE: gathering into a reused buffer matters on CPU: a fresh multi-MB tensor per chunk
        # is a fresh mmap, and its page faults cost more than the copy itself.
        out = workspace[: math.prod(shape)].view(shape)
        torch.index_select(gpu, 0, gpu_slots.reshape(-1), out=out)
        out = out.view(b, n, *gpu.shape[1:])
    else:
        out = _take(gpu, gs, gpu_slots.reshape(-1), device, cdt).view(b, n, *gpu.shape[1:])
    if host is not None and bool(on_host.any()):
        out[on_host] = _take(host, hs, slots[on_host], device, cdt)
    return out


# ---------------------------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------------------------


def _attend(
    qg: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked softmax attention of one chunk, as a state.

    qg ``[B, Hkv, R, D]`` (already scaled; R = the G query heads of a KV head times the query
    rows), k/v ``[B, T, Hkv, D]``, mask broadcastable to ``[B, Hkv, R, T]`` (True = attend).
    Returns ``o [B, Hkv, R, D]``, ``lse [B, Hkv, R]``.
    """
    # NOTE: the G query heads of a KV head are rows of one matmul against that head's K, so K/V
    # are never repeated per query head (what a naive GQA implementation does). One bmm per
    # sequence over its Hkv heads reads K/V in the pool's [T, Hkv, D] layout as strided
    # matrices (row stride Hkv * D); a single matmul over [B, Hkv] would first copy K/V into a
    # head-major layout, which costs more than the attention itself on CPU.
    b, t, hkv, _ = k.shape
    scores = qg.new_empty(b, hkv, qg.shape[2], t)
    for i in range(b):
        torch.bmm(qg[i], k[i].permute(1, 2, 0), out=scores[i])  # [Hkv, R, T]
    scores.masked_fill_(~mask, -math.inf)
    m = scores.amax(dim=-1, keepdim=True)
    m = torch.where(m == -math.inf, torch.zeros_like(m), m)  # rows with no key: p = 0, no NaN
    p = torch.exp(scores - m)
    total = p.sum(dim=-1)
    o = qg.new_empty(qg.shape)
    for i in range(b):
        torch.bmm(p[i], v[i].permute(1, 0, 2), out=o[i])  # [Hkv, R, D]
    safe = torch.where(total > 0, total, torch.ones_like(total))
    o = o / safe[..., None]
    lse = torch.where(total > 0, m.squeeze(-1) + torch.log(safe), -math.inf)
    return o, lse


def paged_decode(
    q: torch.Tensor,
    k_pools: Pools,
    v_pools: Pools,
    block_tables: torch.Tensor,
    block_tiers: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    k_scales: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    v_scales: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Twin of the split-K paged decode kernel plus its merge. q ``[B, Hq, D]`` -> ``[B, Hq, D]``.

    The context is cut into ``num_splits`` chunks of whole blocks (default: chunks of about
    ``DECODE_CHUNK_TOKENS``); each chunk gives a state and the states are merged with
    ``merge_splits``. A sequence of length 0 gives zeros.
    """
    b, hq, d = q.shape
    gpu_k = k_pools[0]
    bs, hkv = gpu_k.shape[1], gpu_k.shape[2]
    g = hq // hkv
    device, cdt = q.device, compute_dtype(q)
    lens = seq_lens.to(device, torch.int64)
    nblk = (lens + bs - 1) // bs
    max_nb = int(nblk.max()) if b else 0
    if max_nb == 0:
        return torch.zeros_like(q)
    if num_splits is None:
        num_splits = max(1, -(-max_nb * bs // DECODE_CHUNK_TOKENS))
    chunk = -(-max_nb // min(num_splits, max_nb))
    qg = (q.to(cdt) * scale).view(b, hkv, g, d)
    ws_k = torch.empty(b * chunk * bs * hkv * d, dtype=cdt, device=device)
    ws_v = torch.empty_like(ws_k)
    outs, lses = [], []
    for c0 in range(0, max_nb, chunk):
        c1 = min(c0 + chunk, max_nb)
        slots = block_tables[:, c0:c1]
        tiers = block_tiers[:, c0:c1]
        valid = torch.arange(c0, c1, device=device)[None, :] < nblk[:, None]
        k = gather_blocks(k_pools, k_scales, slots, tiers, valid, device, cdt, ws_k)
        v = gather_blocks(v_pools, v_scales, slots, tiers, valid, device, cdt, ws_v)
        t = (c1 - c0) * bs
        pos = torch.arange(c0 * bs, c1 * bs, device=device)
        mask = (pos[None, :] < lens[:, None]).view(b, 1, 1, t)
        o, lse = _attend(qg, k.view(b, t, hkv, d), v.view(b, t, hkv, d), mask)
        outs.append(o.view(b, hq, d))
        lses.append(lse.view(b, hq))
    o, _ = merge_splits(torch.stack(outs, dim=-2), torch.stack(lses, dim=-1))
    return o.to(q.dtype)


def prefill(
    q: torch.Tensor,
    k_pools: Pools,
    v_pools: Pools,
    block_table: torch.Tensor,
    block_tier: torch.Tensor,
    seq_len: int,
    *,
    scale: float,
    k_scales: tuple[torch.Tensor, torch.Tensor | None] | None = None,
    v_scales: tuple[torch.Tensor, torch.Tensor | None] | None = None,
) -> torch.Tensor:
    """Twin of the prefill kernel. q ``[n, Hq, D]`` holds positions ``seq_len-n .. seq_len-1``;
    keys are the sequence's first ``seq_len`` tokens, causal: query i sees keys ``<= its pos``.
    Returns ``[n, Hq, D]`` in q's dtype."""
    n, hq, d = q.shape
    gpu_k = k_pools[0]
    bs, hkv = gpu_k.shape[1], gpu_k.shape[2]
    g = hq // hkv
    device, cdt = q.device, compute_dtype(q)
    if n == 0:
        return torch.empty_like(q)
    nb = -(-seq_len // bs)
    slots = block_table[None, :nb]
    tiers = block_tier[None, :nb]
    valid = torch.ones(1, nb, dtype=torch.bool, device=device)
    k = gather_blocks(k_pools, k_scales, slots, tiers, valid, device, cdt)
    v = gather_blocks(v_pools, v_scales, slots, tiers, valid, device, cdt)
    k = k.view(1, nb * bs, hkv, d)[:, :seq_len]
    v = v.view(1, nb * bs, hkv, d)[:, :seq_len]
    qg = (q.to(cdt) * scale).permute(1, 0, 2).reshape(1, hkv, g, n, d)  # head h = kvh * G + j
    kpos = torch.arange(seq_len, device=device)
    qpos = torch.arange(seq_len - n, seq_len, device=device)
    rows = max(1, PREFILL_MAX_SCORES // max(1, seq_len * hq))
    out = torch.empty(1, hkv, g, n, d, dtype=cdt, device=device)
    for i0 in range(0, n, rows):
        i1 = min(i0 + rows, n)
        m = i1 - i0
        mask = (kpos[None, :] <= qpos[i0:i1, None]).expand(g, m, seq_len).reshape(g * m, seq_len)
        o, _ = _attend(qg[:, :, :, i0:i1].reshape(1, hkv, g * m, d), k, v, mask)
        out[:, :, :, i0:i1] = o.view(1, hkv, g, m, d)
    return out.view(hq, n, d).permute(1, 0, 2).to(q.dtype)


# ---------------------------------------------------------------------------------------------
# block copies (layer-major GPU pool <-> block-major host pool)
# ---------------------------------------------------------------------------------------------

# NOTE: runs of at least this many adjacent (src, dst) slot pairs become one slice copy each;
# shorter runs are batched into one index_select/index_copy_ pair. A slice copy moves the bytes
# once; the index pair moves them twice but costs two ops for any number of blocks.
MIN_RUN = 2


def slot_runs(src: torch.Tensor, dst: torch.Tensor) -> list[tuple[int, int, int]]:
    """Maximal runs where both slot lists advance by one: ``[(src_start, dst_start, length)]``."""
    n = int(src.numel())
    if n == 0:
        return []
    brk = ((src[1:] - src[:-1]) != 1) | ((dst[1:] - dst[:-1]) != 1)
    starts = [0, *(torch.nonzero(brk).flatten() + 1).tolist()]
    ends = [*starts[1:], n]
    s_list, d_list = src.tolist(), dst.tolist()
    return [(s_list[a], d_list[a], b - a) for a, b in zip(starts, ends)]


def layer_runs(layers: list[int]) -> list[tuple[int, int]]:
    """Sorted distinct layer ids -> half-open ranges ``[(l0, l1)]`` of consecutive layers."""
    runs: list[tuple[int, int]] = []
    for layer in layers:
        if runs and runs[-1][1] == layer:
            runs[-1] = (runs[-1][0], layer + 1)
        else:
            runs.append((layer, layer + 1))
    return runs


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """Reinterpret as a same-size integer dtype: copies move bits, and several copy ops have
    no float8 implementation."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.view(bits[t.element_size()])


def _split_runs(
    src: torch.Tensor, dst: torch.Tensor, cross: bool
) -> tuple[list[tuple[int, int, int]], torch.Tensor, torch.Tensor]:
    runs = slot_runs(src, dst)
    long_runs = [r for r in runs if r[2] >= MIN_RUN]
    short = [r for r in runs if r[2] < MIN_RUN]
    # NOTE: within one device a slice copy per block (~20 GB/s on CPU) beats index_select over
    # the 6-D pool (~0.2 GB/s); index pairs only pay off when they save bus transfers.
    if not cross or len(short) == 1:
        return runs, src[:0], dst[:0]
    s_idx = torch.tensor([r[0] + i for r in short for i in range(r[2])], dtype=torch.int64)
    d_idx = torch.tensor([r[1] + i for r in short for i in range(r[2])], dtype=torch.int64)
    return long_runs, s_idx, d_idx


def copy_to_host(
    gpu_kv: torch.Tensor,
    gpu_slots: torch.Tensor,
    host_kv: torch.Tensor,
    host_slots: torch.Tensor,
    *,
    non_blocking: bool = False,
) -> None:
    """``host_kv[host_slots[i]] = gpu_kv[:, :, gpu_slots[i]]`` for all layers.

    gpu_kv ``[L, 2, S, *block]`` (layer-major), host_kv ``[S_h, L, 2, *block]`` (block-major);
    slot lists are int64 CPU tensors. Cross-device: the layout change runs on the GPU side, so
    each run crosses the bus as one contiguous transfer.
    """
    src, dst = as_bits(gpu_kv), as_bits(host_kv)
    cross = src.device != dst.device
    runs, s_idx, d_idx = _split_runs(gpu_slots, host_slots, cross)
    for s, d, n in runs:
        block_major = src[:, :, s : s + n].permute(2, 0, 1, *range(3, src.dim()))
        if cross:
            block_major = block_major.contiguous()
        dst[d : d + n].copy_(block_major, non_blocking=non_blocking)
    if s_idx.numel():
        picked = src.index_select(2, s_idx.to(src.device))
        picked = picked.permute(2, 0, 1, *range(3, src.dim())).contiguous().to(dst.device)
        dst.index_copy_(0, d_idx.to(dst.device), picked)


def copy_to_gpu(
    host_kv: torch.Tensor,
    host_slots: torch.Tensor,
    gpu_kv: torch.Tensor,
    gpu_slots: torch.Tensor,
    *,
    layers: list[int] | None = None,
    non_blocking: bool = False,
) -> None:
    """``gpu_kv[l, :, gpu_slots[i]] = host_kv[host_slots[i], l]`` for l in layers (default all).

    Cross-device: each run is moved in the host layout (one contiguous transfer per run when
    all layers are copied) and the layout change runs on the destination.
    """
    src, dst = as_bits(host_kv), as_bits(gpu_kv)
    cross = src.device != dst.device
    lr = layer_runs(layers) if layers is not None else [(0, dst.shape[0])]
    runs, s_idx, d_idx = _split_runs(host_slots, gpu_slots, cross)
    rest = tuple(range(3, src.dim()))
    for l0, l1 in lr:
        for s, d, n in runs:
            part = src[s : s + n, l0:l1]
            if cross:
                part = part.to(dst.device, non_blocking=non_blocking)
            dst[l0:l1, :, d : d + n].copy_(part.permute(1, 2, 0, *rest), non_blocking=non_blocking)
        if s_idx.numel():
            picked = src[:, l0:l1].index_select(0, s_idx.to(src.device)).to(dst.device)
            dst[l0:l1].index_copy_(2, d_idx.to(dst.device), picked.permute(1, 2, 0, *rest))


# ---------------------------------------------------------------------------------------------
# fp8
# ---------------------------------------------------------------------------------------------


def quantize_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block e4m3 quantization: x ``[N, ...]`` -> (fp8 ``[N, ...]``, float32 scale ``[N]``)
    with ``scale = amax(|x[i]|) / 448`` (1.0 for an all-zero block) and ``x ~= scale * fp8``."""
    xf = x.to(torch.float32)
    amax = xf.abs().reshape(x.shape[0], -1).amax(dim=1) if x.numel() else xf.new_zeros(x.shape[0])
    # NOTE: an all-zero block would get scale 0 and 0/0 = NaN: give it scale 1 instead.
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    view = scale.view(-1, *([1] * (x.dim() - 1)))
    # NOTE: clamp: x/scale can round a hair past 448, and torch's cast does not saturate.
    q = (xf / view).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale


def dequantize_fp8(
    x_fp8: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Inverse of ``quantize_fp8``: ``scale[i] * x_fp8[i]`` as ``dtype``."""
    view = scale.to(torch.float32).view(-1, *([1] * (x_fp8.dim() - 1)))
    return (x_fp8.to(torch.float32) * view).to(dtype)
