"""Paged decode attention in Triton: one query token per sequence, split-K over the context.

Grid ``(B, Hkv, num_splits)``. A program owns one KV head of one sequence and one contiguous
range of its blocks; it loads the ``G = Hq / Hkv`` query heads of that KV head as one tile
``[G_PAD, D]`` and streams the range in tiles of ``BLOCK_N`` tokens, keeping an online softmax
(running max, sum, accumulator). With one split it writes the output directly; otherwise it
writes a partial state ``(o, lse)`` per split and ``merge.merge_splits_triton`` reduces them.

Host-pool blocks are read in place (zero copy) through the host view's device address: on CUDA
that view must be pinned memory seen through UVA (``dispatch.device_view``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _tile
from ._tile import LN2, LOG2E, dot, load_kv_tile, to_dot
from .dispatch import cdiv, next_pow2


@triton.jit
def _decode_kernel(
    q_ptr, s_qb, s_qh, s_qd,
    kg_ptr, s_kgs, s_kgt, s_kgh, s_kgd,
    kh_ptr, s_khs, s_kht, s_khh, s_khd,
    vg_ptr, s_vgs, s_vgt, s_vgh, s_vgd,
    vh_ptr, s_vhs, s_vht, s_vhh, s_vhd,
    ksg_ptr, s_ksg, ksh_ptr, s_ksh,
    vsg_ptr, s_vsg, vsh_ptr, s_vsh,
    bt_ptr, s_btb, s_btj,
    tier_ptr, s_tb, s_tj,
    len_ptr,
    o_ptr, s_ob, s_oh, s_os, s_od,
    lse_ptr, s_lb, s_lh, s_ls,
    qk_scale,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HAS_HOST: tl.constexpr, IS_FP8: tl.constexpr,
    DOT_KIND: tl.constexpr, DIRECT: tl.constexpr,
):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(len_ptr + b).to(tl.int32)
    # Splits cut whole blocks: split s covers blocks [s * per, (s + 1) * per) of this sequence,
    # so each sequence balances its own work without a host-side max over seq_lens.
    per = tl.cdiv(tl.cdiv(seq_len, BLOCK_SIZE), NUM_SPLITS) * BLOCK_SIZE
    t_start = split * per
    t_end = tl.minimum(t_start + per, seq_len)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    gmask = g < GROUP
    dmask = d < HEAD_DIM
    heads = kvh * GROUP + g
    # NOTE: the GQA group is one tile (rows = the G query heads sharing this KV head), so each
    # K/V tile is loaded once and serves all G heads through one tl.dot. Rows past G are padding
    # (tl.dot needs M >= 16 on GPUs); their q is 0 and they are never stored.
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + d[None, :] * s_qd,
                mask=gmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    # NOTE: fold softmax scale and log2(e) into q once: scores come out in base 2 and exp2 is
    # the fast path on GPUs. lse is converted back to natural log on store.
    q = to_dot(q * qk_scale, DOT_KIND)

    m = tl.full([G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    for t0 in range(t_start, t_end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < t_end
        j = t // BLOCK_SIZE
        off = t % BLOCK_SIZE
        slot = tl.load(bt_ptr + b * s_btb + j * s_btj, mask=tmask, other=0)
        if HAS_HOST:
            tier = tl.load(tier_ptr + b * s_tb + j * s_tj, mask=tmask, other=0)
            on_gpu = tmask & (tier == 0)
            on_host = tmask & (tier != 0)
        else:
            on_gpu = tmask
            on_host = tmask & False
        k = load_kv_tile(kg_ptr, s_kgs, s_kgt, s_kgh, s_kgd, kh_ptr, s_khs, s_kht, s_khh, s_khd,
                         ksg_ptr, s_ksg, ksh_ptr, s_ksh, slot, off, kvh, on_gpu, on_host, d,
                         dmask, HAS_HOST, IS_FP8, DOT_KIND)
        s = dot(q, tl.trans(k), DOT_KIND)  # [G_PAD, BLOCK_N], base 2
        s = tl.where(tmask[None, :], s, float("-inf"))
        # Every iteration has >= 1 valid token, so m_new is finite and exp2 never sees -inf - -inf.
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = load_kv_tile(vg_ptr, s_vgs, s_vgt, s_vgh, s_vgd, vh_ptr, s_vhs, s_vht, s_vhh, s_vhd,
                         vsg_ptr, s_vsg, vsh_ptr, s_vsh, slot, off, kvh, on_gpu, on_host, d,
                         dmask, HAS_HOST, IS_FP8, DOT_KIND)
        acc = acc * alpha[:, None] + dot(to_dot(p, DOT_KIND), v, DOT_KIND)
        m = m_new

    # An empty range (split past the sequence's end, or seq_len 0) has l = 0: o = 0, lse = -inf.
    has = l > 0
    safe_l = tl.where(has, l, 1.0)
    o = acc / safe_l[:, None]
    omask = gmask[:, None] & dmask[None, :]
    if DIRECT:
        tl.store(o_ptr + b * s_ob + heads[:, None] * s_oh + d[None, :] * s_od,
                 o.to(o_ptr.dtype.element_ty), mask=omask)
    else:
        tl.store(o_ptr + b * s_ob + heads[:, None] * s_oh + split * s_os + d[None, :] * s_od,
                 o, mask=omask)
        lse = tl.where(has, (m + tl.log2(safe_l)) * LN2, float("-inf"))
        tl.store(lse_ptr + b * s_lb + heads * s_lh + split * s_ls, lse, mask=gmask)


# Tests set this to fill the split-K scratch with NaN first, so an unwritten partial fails.
POISON_SCRATCH = False


def dot_kind(q_dtype: torch.dtype, kv_dtype: torch.dtype, interpreted: bool) -> int:
    """The tl.dot operand dtype: 16-bit tensor-core math when q and KV agree on a 16-bit dtype
    (FP8 KV is dequantized to q's dtype), exact float32 otherwise and under the interpreter
    (which has no bf16 arithmetic)."""
    if interpreted:
        return _tile.DOT_F32
    target = q_dtype if kv_dtype == torch.float8_e4m3fn else kv_dtype
    if q_dtype != target:
        return _tile.DOT_F32
    return {torch.float16: _tile.DOT_F16, torch.bfloat16: _tile.DOT_BF16}.get(
        target, _tile.DOT_F32
    )


def block_n(head_dim: int, kind: int, interpreted: bool) -> int:
    """Tokens per K/V tile. Exact-fp32 dots on a GPU stage far more shared memory per tile
    (~170 KB at 64 x 128), so they take half-size tiles."""
    if interpreted:
        return 64
    if kind == _tile.DOT_F32 or head_dim > 128:
        return 32
    return 64


def decode_meta(
    *, q_dtype: torch.dtype, kv_dtype: torch.dtype, group: int, head_dim: int, block_size: int,
    num_splits: int, has_host: bool, interpreted: bool,
) -> dict:
    """Compile-time parameters (constexprs and num_warps) of one decode launch."""
    kind = dot_kind(q_dtype, kv_dtype, interpreted)
    min_rows = 1 if interpreted else 16  # tl.dot needs M, N, K >= 16 on GPUs
    return dict(
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, D_PAD=max(16, next_pow2(head_dim)),
        GROUP=group, G_PAD=max(min_rows, next_pow2(group)),
        BLOCK_N=block_n(head_dim, kind, interpreted), NUM_SPLITS=num_splits,
        HAS_HOST=has_host, IS_FP8=kv_dtype == torch.float8_e4m3fn, DOT_KIND=kind,
        DIRECT=num_splits == 1, num_warps=4,
    )


def pool_args(gpu: torch.Tensor, host: torch.Tensor | None) -> list:
    """Pointer and 4 strides of each pool view; a missing host view repeats the GPU one (never
    read: HAS_HOST is False)."""
    other = gpu if host is None else host
    return [gpu, *gpu.stride(), other, *other.stride()]


def scale_args(
    scales: tuple[torch.Tensor, torch.Tensor | None] | None, dummy: torch.Tensor
) -> list:
    if scales is None:
        return [dummy, 0, dummy, 0]
    gs, hs = scales
    hs = gs if hs is None else hs
    return [gs, gs.stride(0), hs, hs.stride(0)]


def default_num_splits(batch: int, kv_heads: int, max_tokens: int, device: torch.device) -> int:
    """Enough programs to fill the device about twice, but at least ~512 tokens per split.

    Uses the block table's width as the length bound, so no device sync is needed."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
    else:
        sms = 1
    want = cdiv(2 * sms, max(1, batch * kv_heads))
    cap = max(1, cdiv(max_tokens, 512))
    return max(1, min(want, cap, 64))


def paged_decode_triton(
    q: torch.Tensor,
    k_pools: tuple[torch.Tensor, torch.Tensor | None],
    v_pools: tuple[torch.Tensor, torch.Tensor | None],
    block_tables: torch.Tensor,
    block_tiers: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    scale: float,
    k_scales: tuple[torch.Tensor, torch.Tensor | None] | None,
    v_scales: tuple[torch.Tensor, torch.Tensor | None] | None,
    num_splits: int | None,
    interpreted: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the decode kernel (and the merge when split). Inputs are validated and every
    tensor is device-visible. Returns ``[B, Hq, D]`` in q's dtype."""
    from .merge import merge_splits_triton

    b, hq, d = q.shape
    gpu_k, host_k = k_pools
    bs, hkv = gpu_k.shape[1], gpu_k.shape[2]
    group = hq // hkv
    out = torch.empty_like(q) if out is None else out
    if b == 0:
        return out
    if num_splits is None:
        num_splits = default_num_splits(b, hkv, block_tables.shape[1] * bs, q.device)
    dummy = torch.empty(1, dtype=torch.float32, device=q.device)
    direct = num_splits == 1
    if direct:
        part_o, part_lse = out, dummy
        o_strides = (out.stride(0), out.stride(1), 0, out.stride(2))
        l_strides = (0, 0, 0)
    else:
        part_o = torch.empty(b, hq, num_splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(b, hq, num_splits, dtype=torch.float32, device=q.device)
        if POISON_SCRATCH:
            part_o.fill_(float("nan"))
            part_lse.fill_(float("nan"))
        o_strides = part_o.stride()
        l_strides = part_lse.stride()
    _decode_kernel[(b, hkv, num_splits)](
        q, *q.stride(),
        *pool_args(gpu_k, host_k),
        *pool_args(*v_pools),
        *scale_args(k_scales, dummy),
        *scale_args(v_scales, dummy),
        block_tables, *block_tables.stride(),
        block_tiers, *block_tiers.stride(),
        seq_lens,
        part_o, *o_strides,
        part_lse, *l_strides,
        float(scale) * LOG2E,
        **decode_meta(q_dtype=q.dtype, kv_dtype=gpu_k.dtype, group=group, head_dim=d,
                      block_size=bs, num_splits=num_splits, has_host=host_k is not None,
                      interpreted=interpreted),
    )
    if not direct:
        merge_splits_triton(part_o, part_lse, out)
    return out
