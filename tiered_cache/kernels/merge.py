"""Triton merges of attention states ``(o, lse)`` (natural-log LSE over scaled scores).

- ``merge_splits_triton``: the split-K reduction of the decode kernel, ``S`` states per row.
- ``merge_two_triton``: two states over disjoint key sets (e.g. a GPU part and a host part,
  or cached prefix and new tokens computed separately).

Merging: ``lse = m + log(sum_i exp(lse_i - m))`` with ``m = max_i lse_i``, and
``o = sum_i exp(lse_i - lse) o_i``.

NOTE on -inf: a state over no keys has ``lse = -inf``. If every part is empty, ``m = -inf`` and
``lse_i - m`` is NaN, so ``m`` is replaced by 0 (weights become exp(-inf) = 0, result o = 0,
lse = -inf). An empty part's ``o`` is masked out of the load instead of multiplied by its zero
weight, so even a NaN there cannot leak.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import cdiv, next_pow2


@triton.jit
def _merge_splits_kernel(
    po_ptr, s_pb, s_ph, s_ps, s_pd,
    pl_ptr, s_lb, s_lh, s_ls,
    o_ptr, s_ob, s_oh, s_od,
    NUM_SPLITS: tl.constexpr, S_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    smask = s < NUM_SPLITS
    dmask = d < HEAD_DIM
    lse = tl.load(pl_ptr + b * s_lb + h * s_lh + s * s_ls, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp(lse - m)
    total = tl.sum(w, 0)
    live = w > 0
    o = tl.load(po_ptr + b * s_pb + h * s_ph + s[:, None] * s_ps + d[None, :] * s_pd,
                mask=live[:, None] & dmask[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(o_ptr + b * s_ob + h * s_oh + d * s_od, out.to(o_ptr.dtype.element_ty), mask=dmask)


def merge_splits_triton(part_o: torch.Tensor, part_lse: torch.Tensor, out: torch.Tensor) -> None:
    """part_o ``[B, H, S, D]`` float32, part_lse ``[B, H, S]`` -> out ``[B, H, D]`` (written)."""
    b, h, s, d = part_o.shape
    _merge_splits_kernel[(b, h)](
        part_o, *part_o.stride(), part_lse, *part_lse.stride(), out, *out.stride(),
        NUM_SPLITS=s, S_PAD=next_pow2(s), HEAD_DIM=d, D_PAD=next_pow2(d), num_warps=4,
    )


@triton.jit
def _merge_two_kernel(
    o1_ptr, l1_ptr, o2_ptr, l2_ptr, o_ptr, l_ptr, rows,
    HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr, BLOCK_R: tl.constexpr,
):
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.arange(0, D_PAD)
    rmask = r < rows
    dmask = d < HEAD_DIM
    l1 = tl.load(l1_ptr + r, mask=rmask, other=float("-inf")).to(tl.float32)
    l2 = tl.load(l2_ptr + r, mask=rmask, other=float("-inf")).to(tl.float32)
    m = tl.maximum(l1, l2)
    m = tl.where(m == float("-inf"), 0.0, m)
    w1 = tl.exp(l1 - m)
    w2 = tl.exp(l2 - m)
    total = w1 + w2
    offs = r.to(tl.int64)[:, None] * HEAD_DIM + d[None, :]
    io = rmask[:, None] & dmask[None, :]
    o1 = tl.load(o1_ptr + offs, mask=io & (w1 > 0)[:, None], other=0.0).to(tl.float32)
    o2 = tl.load(o2_ptr + offs, mask=io & (w2 > 0)[:, None], other=0.0).to(tl.float32)
    safe = tl.where(total > 0, total, 1.0)
    o = (o1 * w1[:, None] + o2 * w2[:, None]) / safe[:, None]
    lse = tl.where(total > 0, m + tl.log(safe), float("-inf"))
    tl.store(o_ptr + offs, o.to(o_ptr.dtype.element_ty), mask=io)
    tl.store(l_ptr + r, lse.to(l_ptr.dtype.element_ty), mask=rmask)


def merge_two_triton(
    o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor, lse2: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """o ``[..., H, D]``, lse ``[..., H]`` (validated: same shapes) -> merged ``(o, lse)``."""
    d = o1.shape[-1]
    rows = lse1.numel()
    a1, a2 = o1.reshape(rows, d).contiguous(), o2.reshape(rows, d).contiguous()
    b1, b2 = lse1.reshape(rows).contiguous(), lse2.reshape(rows).contiguous()
    o = torch.empty(o1.shape, dtype=o1.dtype, device=o1.device)
    lse = torch.empty(lse1.shape, dtype=lse1.dtype, device=lse1.device)
    if rows:
        block_r = 16
        _merge_two_kernel[(cdiv(rows, block_r),)](
            a1, b1, a2, b2, o, lse, rows,
            HEAD_DIM=d, D_PAD=next_pow2(d), BLOCK_R=block_r, num_warps=4,
        )
    return o, lse
