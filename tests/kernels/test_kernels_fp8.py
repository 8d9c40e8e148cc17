"""FP8 (e4m3) per-block quantization on write and dequantization."""

import os
import shutil

# Decide before anything imports triton: without a GPU driver, run Triton kernels interpreted.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tiered_cache.kernels import dequantize_fp8, quantize_fp8  # noqa: E402
from tiered_cache.kernels.testing import backend_params, seed_for  # noqa: E402

FP8 = torch.float8_e4m3fn


def _blocks(dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    n = 6
    mags = 10.0 ** torch.linspace(-3, 3, n)  # block magnitudes from 1e-3 to 1e3
    x = torch.randn(n, 16, 2, 64, generator=gen) * mags.view(n, 1, 1, 1)
    x[1] = 0.0  # an all-zero block
    x[2, 0, 0, :4] = torch.tensor([1e-9, -1e-9, 0.0, -0.0])  # values far below the block's amax
    return x.to(dtype)


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_quantize_error_bound(backend, dtype):
    x = _blocks(dtype, seed_for("fp8", dtype))
    q, scale = quantize_fp8(x, backend=backend)
    assert q.dtype == FP8 and q.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == (x.shape[0],)
    amax = x.float().abs().flatten(1).amax(1)
    expected = torch.where(amax > 0, amax / 448, torch.ones_like(amax))
    assert torch.allclose(scale, expected, rtol=1e-6)
    back = dequantize_fp8(q, scale, torch.float32)
    assert torch.isfinite(back).all()
    err = (back - x.float()).abs()
    # e4m3: 3 mantissa bits -> rounding error <= 2**-4 relative for normals; below the smallest
    # normal (2**-6, in units of the scale) the spacing is 2**-9, so <= 2**-10 * scale absolute.
    bound = torch.maximum(x.float().abs() * 2**-4, scale.view(-1, 1, 1, 1) * 2**-10)
    assert (err <= bound * (1 + 1e-6)).all()
    assert (err.flatten(1).amax(1) <= amax * 2**-4 + 1e-30).all()  # per block, vs its amax
    assert torch.equal(back[1], torch.zeros_like(back[1]))
    assert scale[1] == 1.0


def test_triton_quantize_matches_twin_bit_for_bit():
    pytest.importorskip("triton")
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs TRITON_INTERPRET=1 (the GPU test covers CUDA)")
    x = _blocks(torch.float32, 5)
    # Values straddling exponent boundaries and subnormal ties after scaling by amax/448 = 1.
    edge = torch.tensor([448.0, -447.9, 127.2, -31.6, 2**-9, 3 * 2**-10, -(2**-10), 0.0146])
    x = torch.cat([x, torch.nn.functional.pad(edge, (0, x[0].numel() - edge.numel()))
                   .view(1, *x.shape[1:])])
    a, sa = quantize_fp8(x, backend="torch")
    b, sb = quantize_fp8(x, backend="triton")
    assert torch.equal(sa, sb)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_dequantize_to_dtype_and_validation():
    x = _blocks(torch.float32, 1)
    q, s = quantize_fp8(x, backend="torch")
    assert dequantize_fp8(q, s, torch.bfloat16).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="scale"):
        dequantize_fp8(q, s[:2])
    with pytest.raises(TypeError, match="x_fp8"):
        dequantize_fp8(x, s)
    with pytest.raises(TypeError, match="x"):
        quantize_fp8(x.to(torch.int32))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_quantize_gpu_matches_twin(dtype):
    x = _blocks(dtype, 2).cuda()
    a, sa = quantize_fp8(x, backend="triton")
    b, sb = quantize_fp8(x, backend="torch")
    assert torch.equal(sa, sb)
    assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
