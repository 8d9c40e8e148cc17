"""Triton building blocks shared by the attention kernels (imported only on a Triton path).

``load_kv_tile`` gathers a tile of tokens from the two pools: every token row carries its own
(slot, tier), so a tile may span several blocks and mix tiers. Both loads are predicated:
a masked-off row issues no memory access, so a GPU-only tile never touches the host pool.
"""

from __future__ import annotations

import triton
import triton.language as tl

# DOT_KIND values: the dtype the two tl.dot operands are cast to.
DOT_F32 = 0  # float32 with input_precision="ieee" (interpreter, fp32 KV, mixed q/KV dtypes)
DOT_F16 = 1
DOT_BF16 = 2

LOG2E = 1.4426950408889634
LN2 = tl.constexpr(0.6931471805599453)  # used inside kernels: must be a constexpr global


@triton.jit
def to_dot(x, DOT_KIND: tl.constexpr):
    """Cast a tile to the dot operand dtype (a no-op when it already is)."""
    if DOT_KIND == 1:
        return x.to(tl.float16)
    elif DOT_KIND == 2:
        return x.to(tl.bfloat16)
    else:
        return x.to(tl.float32)


@triton.jit
def dot(a, b, DOT_KIND: tl.constexpr):
    """``a @ b`` accumulated in float32; fp32 operands use exact IEEE products (no TF32)."""
    if DOT_KIND == 0:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def load_kv_tile(
    gpu_ptr, s_gs, s_gt, s_gh, s_gd,
    host_ptr, s_hs, s_ht, s_hh, s_hd,
    gscale_ptr, s_gsc, hscale_ptr, s_hsc,
    slot, off, head, on_gpu, on_host, d, dmask,
    HAS_HOST: tl.constexpr, IS_FP8: tl.constexpr, DOT_KIND: tl.constexpr,
):
    """One ``[rows, D_PAD]`` tile in the dot operand dtype: row r is token ``off[r]`` of block
    ``slot[r]`` of KV head ``head``, from the GPU pool where ``on_gpu[r]``, the host pool where
    ``on_host[r]``, zero elsewhere. FP8 rows are dequantized (float32 times the block's scale)
    before the cast; 16-bit rows go straight to the dot dtype (no float32 round trip)."""
    slot64 = slot.to(tl.int64)  # NOTE: slot * slot_stride overflows int32 on big host pools
    ptr = gpu_ptr + slot64[:, None] * s_gs + off[:, None] * s_gt + head * s_gh + d[None, :] * s_gd
    x = tl.load(ptr, mask=on_gpu[:, None] & dmask[None, :], other=0.0)
    if IS_FP8:
        sc = tl.load(gscale_ptr + slot64 * s_gsc, mask=on_gpu, other=0.0)
        x = x.to(tl.float32) * sc[:, None]
    x = to_dot(x, DOT_KIND)
    if HAS_HOST:
        hptr = (host_ptr + slot64[:, None] * s_hs + off[:, None] * s_ht + head * s_hh
                + d[None, :] * s_hd)
        xh = tl.load(hptr, mask=on_host[:, None] & dmask[None, :], other=0.0)
        if IS_FP8:
            hsc = tl.load(hscale_ptr + slot64 * s_hsc, mask=on_host, other=0.0)
            xh = xh.to(tl.float32) * hsc[:, None]
        x = tl.where(on_host[:, None], to_dot(xh, DOT_KIND), x)
    return x
