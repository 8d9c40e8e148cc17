"""Prefill attention in Triton over a cached prefix plus the new tokens of one sequence.

The ``n`` new tokens are already written to the pool as the sequence's last ``n`` positions, so
keys are simply the first ``seq_len`` tokens of the block table and causality is one rule:
query at position ``p`` sees keys ``<= p`` (full over the prefix, causal among the new tokens).

Grid ``(cdiv(n, BLOCK_M), Hkv)``. A program's rows are ``BLOCK_M`` query tokens times the
``G`` query heads of one KV head (row r = token ``r // G_PAD``, head ``r % G_PAD``), so each
K/V tile is read once per group, as in decode. It stops at the last key its tokens can see.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._tile import LOG2E, dot, load_kv_tile, to_dot
from .decode import block_n, dot_kind, pool_args, scale_args
from .dispatch import cdiv, next_pow2


@triton.jit
def _prefill_kernel(
    q_ptr, s_qn, s_qh, s_qd,
    kg_ptr, s_kgs, s_kgt, s_kgh, s_kgd,
    kh_ptr, s_khs, s_kht, s_khh, s_khd,
    vg_ptr, s_vgs, s_vgt, s_vgh, s_vgd,
    vh_ptr, s_vhs, s_vht, s_vhh, s_vhd,
    ksg_ptr, s_ksg, ksh_ptr, s_ksh,
    vsg_ptr, s_vsg, vsh_ptr, s_vsh,
    bt_ptr, s_bt, tier_ptr, s_t,
    o_ptr, s_on, s_oh, s_od,
    seq_len, n_new, qk_scale,
    BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
    GROUP: tl.constexpr, G_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_HOST: tl.constexpr, IS_FP8: tl.constexpr, DOT_KIND: tl.constexpr,
):
    mblk = tl.program_id(0)
    kvh = tl.program_id(1)
    r = tl.arange(0, BLOCK_M * G_PAD)
    i = mblk * BLOCK_M + r // G_PAD  # new-token index
    gg = r % G_PAD
    rmask = (i < n_new) & (gg < GROUP)
    heads = kvh * GROUP + gg
    qpos = seq_len - n_new + i
    d = tl.arange(0, D_PAD)
    dmask = d < HEAD_DIM
    q = tl.load(q_ptr + i[:, None] * s_qn + heads[:, None] * s_qh + d[None, :] * s_qd,
                mask=rmask[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    q = to_dot(q * qk_scale, DOT_KIND)  # scores in base 2, see decode.py

    m = tl.full([BLOCK_M * G_PAD], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M * G_PAD], tl.float32)
    acc = tl.zeros([BLOCK_M * G_PAD, D_PAD], tl.float32)
    kv_end = tl.minimum(seq_len, seq_len - n_new + (mblk + 1) * BLOCK_M)
    for t0 in range(0, kv_end, BLOCK_N):
        t = t0 + tl.arange(0, BLOCK_N)
        tmask = t < kv_end
        j = t // BLOCK_SIZE
        off = t % BLOCK_SIZE
        slot = tl.load(bt_ptr + j * s_bt, mask=tmask, other=0)
        if HAS_HOST:
            tier = tl.load(tier_ptr + j * s_t, mask=tmask, other=0)
            on_gpu = tmask & (tier == 0)
            on_host = tmask & (tier != 0)
        else:
            on_gpu = tmask
            on_host = tmask & False
        k = load_kv_tile(kg_ptr, s_kgs, s_kgt, s_kgh, s_kgd, kh_ptr, s_khs, s_kht, s_khh, s_khd,
                         ksg_ptr, s_ksg, ksh_ptr, s_ksh, slot, off, kvh, on_gpu, on_host, d,
                         dmask, HAS_HOST, IS_FP8, DOT_KIND)
        s = dot(q, tl.trans(k), DOT_KIND)
        s = tl.where(tmask[None, :] & (t[None, :] <= qpos[:, None]), s, float("-inf"))
        # NOTE: the first tile holds key 0, which every row may see, so m is finite from the first
        # iteration on; a later tile fully past a row's position gives p = exp2(-inf) = 0 there.
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, 1)
        v = load_kv_tile(vg_ptr, s_vgs, s_vgt, s_vgh, s_vgd, vh_ptr, s_vhs, s_vht, s_vhh, s_vhd,
                         vsg_ptr, s_vsg, vsh_ptr, s_vsh, slot, off, kvh, on_gpu, on_host, d,
                         dmask, HAS_HOST, IS_FP8, DOT_KIND)
        acc = acc * alpha[:, None] + dot(to_dot(p, DOT_KIND), v, DOT_KIND)
        m = m_new

    o = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(o_ptr + i[:, None] * s_on + heads[:, None] * s_oh + d[None, :] * s_od,
             o.to(o_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])


def prefill_meta(
    *, q_dtype: torch.dtype, kv_dtype: torch.dtype, group: int, head_dim: int, block_size: int,
    has_host: bool, interpreted: bool,
) -> dict:
    """Compile-time parameters (constexprs and num_warps) of one prefill launch."""
    kind = dot_kind(q_dtype, kv_dtype, interpreted)
    g_pad = next_pow2(group)
    block_m = max(1, (64 if head_dim <= 128 else 32) // g_pad)
    if not interpreted:
        block_m = max(block_m, cdiv(16, g_pad))  # tl.dot needs M >= 16
    return dict(
        BLOCK_SIZE=block_size, HEAD_DIM=head_dim, D_PAD=max(16, next_pow2(head_dim)),
        GROUP=group, G_PAD=g_pad, BLOCK_M=block_m, BLOCK_N=block_n(head_dim, kind, interpreted),
        HAS_HOST=has_host, IS_FP8=kv_dtype == torch.float8_e4m3fn, DOT_KIND=kind, num_warps=4,
    )


def prefill_triton(
    q: torch.Tensor,
    k_pools: tuple[torch.Tensor, torch.Tensor | None],
    v_pools: tuple[torch.Tensor, torch.Tensor | None],
    block_table: torch.Tensor,
    block_tier: torch.Tensor,
    seq_len: int,
    *,
    scale: float,
    k_scales: tuple[torch.Tensor, torch.Tensor | None] | None,
    v_scales: tuple[torch.Tensor, torch.Tensor | None] | None,
    interpreted: bool,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the prefill kernel. q ``[n, Hq, D]`` -> ``[n, Hq, D]`` in q's dtype."""
    n, hq, d = q.shape
    gpu_k, host_k = k_pools
    bs, hkv = gpu_k.shape[1], gpu_k.shape[2]
    group = hq // hkv
    out = torch.empty_like(q) if out is None else out
    if n == 0:
        return out
    meta = prefill_meta(q_dtype=q.dtype, kv_dtype=gpu_k.dtype, group=group, head_dim=d,
                        block_size=bs, has_host=host_k is not None, interpreted=interpreted)
    dummy = torch.empty(1, dtype=torch.float32, device=q.device)
    _prefill_kernel[(cdiv(n, meta["BLOCK_M"]), hkv)](
        q, *q.stride(),
        *pool_args(gpu_k, host_k),
        *pool_args(*v_pools),
        *scale_args(k_scales, dummy),
        *scale_args(v_scales, dummy),
        block_table, block_table.stride(0), block_tier, block_tier.stride(0),
        out, *out.stride(),
        int(seq_len), n, float(scale) * LOG2E,
        **meta,
    )
    return out
