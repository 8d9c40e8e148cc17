"""Triton block copies between the layer-major GPU pool and the block-major host pool.

Both pools hold, per (slot, layer, K/V), one contiguous chunk of ``prod(block_shape)`` elements
(``block_size * H * D`` for KV, 1 for scale tensors); only where that chunk sits differs:

- GPU pool ``[L, 2, S, *block]``: chunk at ``layer * sL + kv * s2 + slot * sS``
- host pool ``[S_h, L, 2, *block]``: chunk at ``slot * sS + layer * sL + kv * s2``

So one kernel does both directions: grid ``(num_blocks, num_layers * 2)``, one program per
chunk, strides say which layout is which. Scattered slot lists cost nothing extra: the slot ids
are loaded per program. Data moves as same-size integers (bits; FP8 included).

On CUDA the host pool must be pinned and is addressed through UVA (``dispatch.device_view``), so
SMs read/write host memory directly. The torch twin (``reference.copy_to_*``) uses copy
engines instead, which overlaps better with compute on a side stream.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import next_pow2
from .reference import as_bits


@triton.jit
def _copy_chunks_kernel(
    src_ptr, dst_ptr, src_slots_ptr, dst_slots_ptr, layers_ptr,
    s_src_slot, s_src_layer, s_src_kv, s_dst_slot, s_dst_layer, s_dst_kv,
    CHUNK: tl.constexpr, BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    j = tl.program_id(1)
    layer = tl.load(layers_ptr + j // 2).to(tl.int64)
    kv = j % 2
    src_slot = tl.load(src_slots_ptr + i).to(tl.int64)
    dst_slot = tl.load(dst_slots_ptr + i).to(tl.int64)
    src = src_ptr + src_slot * s_src_slot + layer * s_src_layer + kv * s_src_kv
    dst = dst_ptr + dst_slot * s_dst_slot + layer * s_dst_layer + kv * s_dst_kv
    for c in range(0, CHUNK, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        mask = offs < CHUNK
        tl.store(dst + offs, tl.load(src + offs, mask=mask), mask=mask)


def _launch(
    src: torch.Tensor, src_slots: torch.Tensor, src_strides: tuple[int, int, int],
    dst: torch.Tensor, dst_slots: torch.Tensor, dst_strides: tuple[int, int, int],
    layers: torch.Tensor, chunk: int,
) -> None:
    n = src_slots.numel()
    if n == 0 or layers.numel() == 0:
        return
    _copy_chunks_kernel[(n, layers.numel() * 2)](
        as_bits(src), as_bits(dst), src_slots, dst_slots, layers,
        *src_strides, *dst_strides,
        CHUNK=chunk, BLOCK=min(4096, max(16, next_pow2(chunk))), num_warps=4,
    )


def copy_to_host_triton(
    gpu_kv: torch.Tensor, gpu_slots: torch.Tensor, host_kv: torch.Tensor, host_slots: torch.Tensor
) -> None:
    """gpu_kv ``[L, 2, S, *block]`` -> host_kv ``[S_h, L, 2, *block]`` (device-visible views);
    slot tensors int32/int64 on the kernel's device."""
    chunk = gpu_kv[0, 0, 0].numel()
    layers = torch.arange(gpu_kv.shape[0], dtype=torch.int32, device=gpu_kv.device)
    g, h = gpu_kv.stride(), host_kv.stride()
    _launch(gpu_kv, gpu_slots, (g[2], g[0], g[1]), host_kv, host_slots, (h[0], h[1], h[2]),
            layers, chunk)


def copy_to_gpu_triton(
    host_kv: torch.Tensor, host_slots: torch.Tensor, gpu_kv: torch.Tensor, gpu_slots: torch.Tensor,
    layers: torch.Tensor,
) -> None:
    """host_kv ``[S_h, L, 2, *block]`` -> gpu_kv ``[L, 2, S, *block]`` for the given layers."""
    chunk = gpu_kv[0, 0, 0].numel()
    g, h = gpu_kv.stride(), host_kv.stride()
    _launch(host_kv, host_slots, (h[0], h[1], h[2]), gpu_kv, gpu_slots, (g[2], g[0], g[1]),
            layers, chunk)
