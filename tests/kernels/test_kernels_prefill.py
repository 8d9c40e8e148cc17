"""Prefill attention over a cached prefix plus new tokens: torch twin and Triton (interpreted
on CPU) against a float64 causal reference over the gathered blocks."""

import os
import shutil

# Decide before anything imports triton: without a GPU driver, run Triton kernels interpreted.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tiered_cache.kernels import prefill_attention  # noqa: E402
from tiered_cache.kernels.testing import (  # noqa: E402
    LAYER,
    TOLERANCE,
    PagedCase,
    backend_params,
    gather_dequantized,
    make_paged_case,
    reference_attention,
    relative_error,
    seed_for,
)

FP8 = torch.float8_e4m3fn
BS = 16
HKV = 2
BASE_SEED = int(os.environ.get("TC_TEST_SEED", "0"))


def _run(case: PagedCase, q: torch.Tensor, backend: str, **kw) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))  # poison: every element must be written
    res = prefill_attention(
        q, case.pools(0), case.pools(1), case.block_tables[0], case.block_tiers[0],
        int(case.seq_lens[0]), k_scales=case.scales(0), v_scales=case.scales(1),
        backend=backend, out=out, **kw,
    )
    assert res is out
    assert torch.isfinite(out).all(), "NaN/inf in the output"
    return out


def _reference(case: PagedCase, q: torch.Tensor, scale: float) -> torch.Tensor:
    total, n = int(case.seq_lens[0]), q.shape[0]
    k, v = gather_dequantized(case, 0, 0), gather_dequantized(case, 0, 1)
    return reference_attention(q, k, v, torch.arange(total - n, total), scale)


CASES = [
    # prefix tokens, new tokens, kv dtype, GQA group, head_dim
    (0, 5, torch.float32, 4, 64),  # no prefix: plain causal prefill
    (BS - 1, 1, torch.float32, 1, 64),  # one new token = decode through the prefill path
    (BS, BS + 1, torch.float32, 8, 64),
    (37, 20, torch.float32, 4, 128),
    (40, 9, torch.float16, 4, 64),
    (24, 9, FP8, 8, 64),
]


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("prefix,n,kv_dtype,group,head_dim", CASES)
def test_prefill_matches_reference(backend, prefix, n, kv_dtype, group, head_dim):
    seed = seed_for("prefill", prefix, n, kv_dtype, group, head_dim, base=BASE_SEED)
    case = make_paged_case([prefix + n], block_size=BS, num_kv_heads=HKV, head_dim=head_dim,
                           dtype=kv_dtype, host_fraction=0.5, seed=seed)
    q_dtype = torch.float16 if kv_dtype == torch.float16 else torch.float32
    q = torch.randn(n, HKV * group, head_dim, generator=torch.Generator().manual_seed(seed))
    q = q.to(q_dtype)
    out = _run(case, q, backend)
    err = relative_error(out, _reference(case, q, head_dim**-0.5))
    tol = TOLERANCE[torch.float32] if kv_dtype == FP8 else TOLERANCE[kv_dtype]
    assert err < tol, f"relative error {err:.2e} >= {tol:.0e}"


@pytest.mark.parametrize("backend", backend_params())
def test_prefill_is_causal_among_new_tokens(backend):
    """Changing the K/V of the last new token changes only the last query's output; changing a
    prefix token changes every output."""
    prefix, n = 20, 12
    case = make_paged_case([prefix + n], block_size=BS, num_kv_heads=HKV, head_dim=64,
                           dtype=torch.float32, host_fraction=0.5, seed=seed_for("causal"))
    q = torch.randn(n, HKV * 4, 64, generator=torch.Generator().manual_seed(7))
    before = _run(case, q, backend)

    def poke(pos: int) -> None:
        slot, tier = int(case.block_tables[0, pos // BS]), int(case.block_tiers[0, pos // BS])
        for kv in (0, 1):
            if tier:
                case.host_kv[slot, LAYER, kv, pos % BS] += 5.0
            else:
                case.gpu_kv[LAYER, kv, slot, pos % BS] += 5.0

    poke(prefix + n - 1)
    after = _run(case, q, backend)
    assert torch.equal(after[:-1], before[:-1])
    assert not torch.allclose(after[-1], before[-1])
    poke(3)  # a prefix token: visible to every new token
    again = _run(case, q, backend)
    assert not torch.isclose(again, after).all(dim=-1).any()


def test_prefill_rejects_bad_inputs():
    case = make_paged_case([30], block_size=BS, num_kv_heads=HKV, head_dim=64,
                           dtype=torch.float32, host_fraction=0.5, seed=3)
    q = torch.randn(10, 4, 64)
    args = (case.pools(0), case.pools(1), case.block_tables[0], case.block_tiers[0])
    with pytest.raises(ValueError, match="seq_len"):
        prefill_attention(q, *args, 5)  # fewer tokens than new tokens
    with pytest.raises(ValueError, match="seq_len"):
        prefill_attention(q, *args, 10**4)  # longer than the table
    with pytest.raises(TypeError, match="seq_len"):
        prefill_attention(q, *args, 30.0)
    with pytest.raises(ValueError, match="block_tier"):
        prefill_attention(q, case.pools(0), case.pools(1), case.block_tables[0],
                          case.block_tiers[0, :1], 30)
    with pytest.raises(ValueError, match="q"):
        prefill_attention(q[None], *args, 30)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "kv_dtype,q_dtype,tol",
    [(torch.bfloat16, torch.bfloat16, 2e-2), (torch.float16, torch.float16, 2e-3),
     (FP8, torch.bfloat16, TOLERANCE[FP8])],
)
def test_prefill_gpu_matches_twin(kv_dtype, q_dtype, tol):
    prefix, n = 1000, 300
    cpu_case = make_paged_case([prefix + n], block_size=16, num_kv_heads=8, head_dim=128,
                               dtype=kv_dtype, host_fraction=0.3, seed=seed_for("gpu-prefill"))
    dev = torch.device("cuda")
    gs = None if cpu_case.gpu_scales is None else cpu_case.gpu_scales.to(dev)
    hs = None if cpu_case.host_scales is None else cpu_case.host_scales.pin_memory()
    gpu_kv, host_kv = cpu_case.gpu_kv.to(dev), cpu_case.host_kv.pin_memory()
    k_pools = (gpu_kv[LAYER, 0], host_kv[:, LAYER, 0])
    v_pools = (gpu_kv[LAYER, 1], host_kv[:, LAYER, 1])
    scales = (None, None) if gs is None else ((gs[LAYER, 0], hs[:, LAYER, 0]),
                                              (gs[LAYER, 1], hs[:, LAYER, 1]))
    q = torch.randn(n, 64, 128, device=dev).to(q_dtype)
    args = (q, k_pools, v_pools, cpu_case.block_tables[0].to(dev),
            cpu_case.block_tiers[0].to(dev), prefix + n)
    out = prefill_attention(*args, k_scales=scales[0], v_scales=scales[1], backend="triton")
    twin = prefill_attention(*args, k_scales=scales[0], v_scales=scales[1], backend="torch")
    assert torch.isfinite(out).all()
    assert relative_error(out.cpu(), twin.cpu().double()) < tol
    assert relative_error(out.cpu(), _reference(cpu_case, q.cpu(), 128**-0.5)) < tol
