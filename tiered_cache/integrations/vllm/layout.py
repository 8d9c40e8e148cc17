"""Where each element of a block's K and V sits in vLLM's per-layer KV tensor, read from the
tensor's shape and strides and from the attention backend's name; views in our block layout.

vLLM 0.32 hands each layer's KV to a connector as a 4-D logical view `[B, H, N, C]` (blocks,
KV heads, tokens per block, content; C = 2 x head size) whose strides encode the physical
layout (LBHNC, LBNHC, BLHNC, ...: any of them is read from the strides). What C means is the
backend's business:

- `planar` (CPU_ATTN, cpu_attn.py `kv_cache.view(B, H, 2 * N, D).chunk(2, dim=2)`): per block
  and head, the N x C cells hold K's N rows of D, then V's N rows; needs [N, C] contiguous.
- `interleaved` (FLASH_ATTN, TRITON_ATTN: `kv_cache.transpose(1, 2).split(head_size, -1)`):
  cell (b, h, n) holds token n's K (D values) then its V.
- `split` (older vLLM releases, 5-D `[2, B, N, H, D]`): K and V as two planes.

Any other backend, a quantized or MLA cache, or a kernel block size that differs from the
block size is refused at start with `LayoutError`: a layout we guessed wrong would load
another token's or another head's KV, and that is never allowed.

`blocks_view` is a strided view (no copy) `[B, k, 2, bs, H, D]`: vLLM block b's sub-block j,
in tiered-cache's per-layer block layout `[2, bs, H, D]` (what the daemon's pool holds per
layer), so a load is `view[b, j] = pool[slots, layer]` and a save the other way round.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tiered_cache.errors import TieredCacheError

PLANAR = "planar"
INTERLEAVED = "interleaved"
SPLIT = "split"

BACKEND_FORMS = {
    "CPU_ATTN": PLANAR,
    "FLASH_ATTN": INTERLEAVED,
    "TRITON_ATTN": INTERLEAVED,
}
"""Backends whose reading of C is known (checked against vLLM 0.32's sources; CPU_ATTN also by
tests/vllm against the engine itself). Add one only after reading its forward()."""
SPLIT_BACKENDS = ("FLASH_ATTN", "TRITON_ATTN", "FLASHINFER", "XFORMERS")
"""Backends of older vLLM releases that handed out `[2, B, N, H, D]` tensors."""


class LayoutError(TieredCacheError, ValueError):
    """vLLM's KV cache is laid out in a way the connector does not read."""


@dataclass(frozen=True)
class LayerLayout:
    form: str
    num_blocks: int
    block_size: int             # vLLM's
    num_kv_heads: int
    head_dim: int


def describe(kv: torch.Tensor, backend: str, *, num_blocks: int, block_size: int,
             num_kv_heads: int, head_dim: int, dtype: torch.dtype, name: str = "") -> LayerLayout:
    """Check one layer's tensor against what vLLM's config says and name its form."""
    where = f"layer {name!r}" if name else "a layer"
    if kv.dtype != dtype:
        raise LayoutError(f"{where}: KV of {kv.dtype}, expected {dtype} (quantized KV is not "
                          "supported by the connector)")
    if kv.dim() == 4:
        form = BACKEND_FORMS.get(backend)
        if form is None:
            raise LayoutError(f"{where}: attention backend {backend!r} is not one whose KV "
                              f"layout the connector knows ({', '.join(sorted(BACKEND_FORMS))})")
        want = (num_blocks, num_kv_heads, block_size, 2 * head_dim)
        if tuple(kv.shape) != want:
            hint = (" (a kernel block size other than the block size: set the block size to the "
                    "kernel's)" if kv.shape[0] != num_blocks else "")
            raise LayoutError(f"{where}: shape {tuple(kv.shape)}, expected [B, H, N, C] = "
                              f"{want}{hint}")
        if form == PLANAR and (kv.stride(3) != 1 or kv.stride(2) != 2 * head_dim):
            raise LayoutError(f"{where}: {backend} reads each block's [N, C] cells as K rows "
                              f"then V rows, but strides {kv.stride()} do not keep them "
                              "contiguous")
        return LayerLayout(form, num_blocks, block_size, num_kv_heads, head_dim)
    if kv.dim() == 5 and backend in SPLIT_BACKENDS:
        want = (2, num_blocks, block_size, num_kv_heads, head_dim)
        if tuple(kv.shape) != want:
            raise LayoutError(f"{where}: shape {tuple(kv.shape)}, expected [2, B, N, H, D] = "
                              f"{want}")
        return LayerLayout(SPLIT, num_blocks, block_size, num_kv_heads, head_dim)
    raise LayoutError(f"{where}: a {kv.dim()}-D KV tensor {tuple(kv.shape)} of backend "
                      f"{backend!r}: not a layout the connector reads")


def canonical(kv: torch.Tensor, layout: LayerLayout) -> torch.Tensor:
    """`[B, 2, N, H, D]` view of one layer (element [b, kv, n, h, d] = K (kv 0) or V (kv 1) of
    token n of block b, head h)."""
    B, N, H, D = layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim
    if layout.form == SPLIT:
        return kv.permute(1, 0, 2, 3, 4)
    s = kv.stride()
    if layout.form == PLANAR:
        strides = (s[0], N * D * s[3], D * s[3], s[1], s[3])
    else:                                   # INTERLEAVED
        strides = (s[0], D * s[3], s[2], s[1], s[3])
    return kv.as_strided((B, 2, N, H, D), strides, kv.storage_offset())


def blocks_view(kv: torch.Tensor, layout: LayerLayout, block_size: int) -> torch.Tensor:
    """`[B, k, 2, bs, H, D]` view: vLLM block b's j-th block of `block_size` tokens."""
    N = layout.block_size
    if N % block_size:
        raise LayoutError(f"block size {block_size} does not divide vLLM's {N}")
    k = N // block_size
    c = canonical(kv, layout)
    sb, skv, sn, sh, sd = c.stride()
    return c.as_strided((layout.num_blocks, k, 2, block_size, layout.num_kv_heads,
                         layout.head_dim), (sb, sn * block_size, skv, sn, sh, sd),
                        c.storage_offset())
