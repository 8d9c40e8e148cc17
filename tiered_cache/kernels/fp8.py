"""Triton FP8 (e4m3) per-block quantization, the write-side twin of ``reference.quantize_fp8``.

One program per block: a first pass takes ``amax(|x|)``, a second writes
``clamp(x / scale, -448, 448)`` as e4m3 with ``scale = amax / 448`` (1.0 for an all-zero
block). Reading back is ``scale * fp8``; the attention kernels do it inline.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .dispatch import next_pow2
from .reference import FP8_DTYPE, FP8_MAX


@triton.jit
def _round_to_e4m3(y):
    """Round float32 ``y`` (|y| <= 448) to the nearest e4m3 value, ties to even, in float32.

    NOTE: the cast to float8 then only sees exact values. Triton's interpreter rounds wrongly
    when rounding carries into the exponent (127.2 -> 64 instead of 128), so the rounding is
    done here, identically on GPU and in the interpreter: normals keep 3 mantissa bits (bit
    arithmetic on the float32 pattern), subnormals (|y| < 2**-6) are multiples of 2**-9 (the
    1.5 * 2**23 trick rounds to an integer, ties to even).
    """
    bits = y.to(tl.int32, bitcast=True)
    rounded = bits + 0x7FFFF + ((bits >> 20) & 1)
    normal = (rounded & -1048576).to(tl.float32, bitcast=True)  # -1048576 = ~0xFFFFF
    magic = 12582912.0  # 1.5 * 2**23
    sub = ((tl.abs(y) * 512.0 + magic) - magic) / 512.0
    sub = tl.where(bits < 0, -sub, sub)  # the sign bit: -0.0 and tiny negatives stay -0.0
    return tl.where(tl.abs(y) < 0.015625, sub, normal)


@triton.jit
def _quantize_fp8_kernel(
    x_ptr, y_ptr, scale_ptr, NUMEL: tl.constexpr, BLOCK: tl.constexpr, FMAX: tl.constexpr
):
    i = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + i * NUMEL
    y_row = y_ptr + i * NUMEL
    amax = tl.zeros([BLOCK], tl.float32)
    for c in range(0, NUMEL, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < NUMEL, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    a = tl.max(amax, 0)
    scale = tl.where(a > 0, tl.div_rn(a, FMAX), 1.0)  # IEEE division, like torch
    tl.store(scale_ptr + i, scale)
    for c in range(0, NUMEL, BLOCK):
        offs = c + tl.arange(0, BLOCK)
        mask = offs < NUMEL
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        # NOTE: IEEE division (div_rn), not the approximate GPU default, so the rounding to e4m3
        # matches the torch twin bit for bit.
        y = _round_to_e4m3(tl.clamp(tl.div_rn(x, scale), -FMAX, FMAX))
        tl.store(y_row + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def quantize_fp8_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[N, ...]`` (float16/bfloat16/float32) -> (fp8 ``[N, ...]``, float32 scales ``[N]``)."""
    n = x.shape[0]
    flat = x.reshape(n, -1).contiguous()
    numel = flat.shape[1]
    y = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(n, dtype=torch.float32, device=x.device)
    if n and numel:
        _quantize_fp8_kernel[(n,)](
            flat, y, scale, NUMEL=numel, BLOCK=min(2048, next_pow2(numel)), FMAX=FP8_MAX,
            num_warps=4,
        )
    elif n:
        scale.fill_(1.0)
    return y, scale
