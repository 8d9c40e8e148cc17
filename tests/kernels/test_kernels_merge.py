"""Merging attention states (o, lse) over disjoint key sets."""

import math
import os
import shutil

# Decide before anything imports triton: without a GPU driver, run Triton kernels interpreted.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tiered_cache.kernels import merge_attention_states  # noqa: E402
from tiered_cache.kernels.testing import backend_params, relative_error, seed_for  # noqa: E402

BASE_SEED = int(os.environ.get("TC_TEST_SEED", "0"))


def _state(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """float64 (o, lse) of q ``[B, H, D]`` over keys ``[B, T, H, D]``; T = 0 gives (NaN, -inf)."""
    if k.shape[1] == 0:
        return torch.full(q.shape, float("nan"), dtype=torch.float64), torch.full(
            q.shape[:-1], -math.inf, dtype=torch.float64
        )
    s = torch.einsum("bhd,bthd->bht", q.double(), k.double()) * scale
    lse = torch.logsumexp(s, dim=-1)
    o = torch.einsum("bht,bthd->bhd", torch.softmax(s, dim=-1), v.double())
    return o, lse


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("split", [0, 7, 20])  # 0 and 20: one part holds no key
def test_merge_equals_attention_over_the_union(backend, dtype, split):
    gen = torch.Generator().manual_seed(seed_for("merge", dtype, split, base=BASE_SEED))
    b, t, h, d = 3, 20, 4, 64
    q, k, v = (torch.randn(b, n, h, d, generator=gen) for n in (1, t, t))
    q = q[:, 0]
    scale = d**-0.5
    full_o, full_lse = _state(q, k, v, scale)
    o1, l1 = _state(q, k[:, :split], v[:, :split], scale)
    o2, l2 = _state(q, k[:, split:], v[:, split:], scale)
    o, lse = merge_attention_states(o1.to(dtype), l1.float(), o2.to(dtype), l2.float(),
                                    backend=backend)
    assert o.dtype == dtype and lse.dtype == torch.float32
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    assert relative_error(o, full_o) < tol
    assert (lse.double() - full_lse).abs().max() < 1e-5 * full_lse.abs().max()


@pytest.mark.parametrize("backend", backend_params())
def test_merge_two_empty_parts_is_zero_and_minus_inf(backend):
    o = torch.full((2, 3, 16), float("nan"))
    lse = torch.full((2, 3), -math.inf)
    mo, ml = merge_attention_states(o, lse, o.clone(), lse.clone(), backend=backend)
    assert torch.equal(mo, torch.zeros_like(mo))
    assert torch.isneginf(ml).all()


def test_merge_rejects_bad_shapes():
    o, lse = torch.randn(2, 3, 16), torch.randn(2, 3)
    with pytest.raises(ValueError, match="o1/o2"):
        merge_attention_states(o, lse, o[:1], lse)
    with pytest.raises(ValueError, match="lse1/lse2"):
        merge_attention_states(o, lse[:, :2], o, lse)
    with pytest.raises(TypeError, match="lse2"):
        merge_attention_states(o, lse, o, lse.int())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_merge_gpu_matches_twin():
    o1, o2 = (torch.randn(64, 32, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    l1, l2 = (torch.randn(64, 32, device="cuda") * 5 for _ in range(2))
    l2[::3] = -math.inf
    a = merge_attention_states(o1, l1, o2, l2, backend="triton")
    b = merge_attention_states(o1, l1, o2, l2, backend="torch")
    assert relative_error(a[0].float().cpu(), b[0].double().cpu()) < 1e-2
    assert torch.allclose(a[1], b[1], atol=1e-5)
