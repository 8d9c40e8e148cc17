"""Paged decode attention: the torch twin and the Triton kernel (interpreted on CPU) against a
float64 reference that gathers each sequence's blocks one by one."""

import os
import shutil

# Decide before anything imports triton: without a GPU driver, run Triton kernels interpreted.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from tiered_cache.kernels import paged_decode_attention  # noqa: E402
from tiered_cache.kernels.testing import (  # noqa: E402
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
LENS = [1, BS - 1, BS, BS + 1, 8 * BS]  # the last one is the "long" context
BASE_SEED = int(os.environ.get("TC_TEST_SEED", "0"))


@pytest.fixture
def poison_scratch(monkeypatch):
    """NaN-fill the split-K scratch so an unwritten partial state fails the test."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        from tiered_cache.kernels import decode

        monkeypatch.setattr(decode, "POISON_SCRATCH", True)


def _q_dtype(kv_dtype: torch.dtype) -> torch.dtype:
    return torch.float16 if kv_dtype == torch.float16 else torch.float32


def _run(case: PagedCase, q: torch.Tensor, backend: str, **kw) -> torch.Tensor:
    out = torch.full_like(q, float("nan"))  # poison: every element must be written
    res = paged_decode_attention(
        q, case.pools(0), case.pools(1), case.block_tables, case.block_tiers, case.seq_lens,
        k_scales=case.scales(0), v_scales=case.scales(1), backend=backend, out=out, **kw,
    )
    assert res is out
    assert torch.isfinite(out).all(), "NaN/inf in the output"
    return out


def _check(case: PagedCase, q: torch.Tensor, out: torch.Tensor, tol: float, scale: float) -> None:
    """Per sequence: relative error against float64 attention over the stored (dequantized)
    blocks, gathered one by one from the table."""
    for b, n in enumerate(case.seq_lens.tolist()):
        k, v = gather_dequantized(case, b, 0), gather_dequantized(case, b, 1)
        ref = reference_attention(q[b : b + 1], k, v, torch.tensor([n - 1]), scale)
        err = relative_error(out[b : b + 1], ref)
        assert err < tol, f"sequence {b} (len {n}): relative error {err:.2e} >= {tol:.0e}"


def _check_fp8_noise(case: PagedCase, q: torch.Tensor, out: torch.Tensor, scale: float) -> None:
    """Against the K/V *before* quantization the error is e4m3 noise (3 mantissa bits, up to
    2**-4 per element), not kernel error: bound it batch-wide in norm (typically 3%, 10% is
    far from a wrong scale, which gives ~100%)."""
    refs = [
        reference_attention(q[b : b + 1], case.keys[b], case.values[b], torch.tensor([n - 1]),
                            scale)
        for b, n in enumerate(case.seq_lens.tolist())
    ]
    ref = torch.cat(refs)
    err = float((out.double() - ref).norm() / ref.norm())
    assert err < 0.1, f"FP8 output vs unquantized K/V: relative norm error {err:.3f}"


CASES = [
    # kv dtype, GQA group, head_dim, num_splits, host fraction
    (torch.float32, 1, 64, 1, 0.5),
    (torch.float32, 4, 64, 3, 0.5),
    (torch.float32, 8, 64, 1, 0.5),
    (torch.float32, 8, 128, 2, 0.5),
    (torch.float32, 4, 64, None, 1.0),
    (torch.float16, 4, 64, 3, 0.5),
    (torch.bfloat16, 4, 64, 2, 0.5),
    (FP8, 4, 64, 1, 0.5),
    (FP8, 8, 64, 3, 0.5),
]


@pytest.mark.parametrize("backend", backend_params())
@pytest.mark.parametrize("kv_dtype,group,head_dim,num_splits,host_fraction", CASES)
def test_decode_matches_reference(
    backend, kv_dtype, group, head_dim, num_splits, host_fraction, poison_scratch
):
    seed = seed_for("decode", kv_dtype, group, head_dim, num_splits, host_fraction, base=BASE_SEED)
    case = make_paged_case(
        LENS, block_size=BS, num_kv_heads=HKV, head_dim=head_dim, dtype=kv_dtype,
        host_fraction=host_fraction, seed=seed,
    )
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(len(LENS), HKV * group, head_dim, generator=gen).to(_q_dtype(kv_dtype))
    out = _run(case, q, backend, num_splits=num_splits)
    scale = head_dim**-0.5
    if kv_dtype == FP8:
        # float32 q and float32 math on the dequantized values: as exact as float32 storage.
        _check(case, q, out, TOLERANCE[torch.float32], scale)
        _check_fp8_noise(case, q, out, scale)
    else:
        _check(case, q, out, TOLERANCE[kv_dtype], scale)


@pytest.mark.parametrize("backend", backend_params())
def test_decode_more_splits_than_blocks(backend, poison_scratch):
    """Empty splits (lse = -inf) must merge as no-ops; an explicit scale is honoured."""
    lens = [1, 17, 40]
    case = make_paged_case(lens, block_size=BS, num_kv_heads=HKV, head_dim=64,
                           dtype=torch.float32, host_fraction=0.5, seed=seed_for("splits"))
    q = torch.randn(len(lens), HKV * 4, 64, generator=torch.Generator().manual_seed(3))
    out = _run(case, q, backend, num_splits=8, scale=0.3)
    _check(case, q, out, TOLERANCE[torch.float32], 0.3)


@pytest.mark.parametrize("backend", backend_params())
def test_decode_without_host_pool_and_empty_sequence(backend, poison_scratch):
    """No host view at all; a zero-length sequence gives zeros; q may be non-contiguous."""
    lens = [0, 5, 33]
    case = make_paged_case(lens, block_size=BS, num_kv_heads=HKV, head_dim=64,
                           dtype=torch.float32, host_fraction=0.0, seed=seed_for("gpu-only"))
    case.block_tiers.zero_()  # no host tier referenced anywhere (garbage entries included)
    q = torch.randn(HKV * 4, len(lens), 64, generator=torch.Generator().manual_seed(4))
    q = q.transpose(0, 1)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(
        q, (case.pools(0)[0], None), (case.pools(1)[0], None), case.block_tables,
        case.block_tiers, case.seq_lens, backend=backend, num_splits=2, out=out,
    )
    assert torch.isfinite(out).all()
    assert torch.equal(out[0], torch.zeros_like(out[0]))
    for b in (1, 2):
        n = lens[b]
        ref = reference_attention(q[b : b + 1], gather_dequantized(case, b, 0),
                                  gather_dequantized(case, b, 1), torch.tensor([n - 1]), 64**-0.5)
        assert relative_error(out[b : b + 1], ref) < TOLERANCE[torch.float32]


def _small_case() -> tuple[PagedCase, torch.Tensor]:
    case = make_paged_case([5, 20], block_size=BS, num_kv_heads=HKV, head_dim=64,
                           dtype=torch.float32, host_fraction=0.5, seed=1)
    return case, torch.randn(2, 4, 64)


def _call(case: PagedCase, q: torch.Tensor, **kw):
    args = dict(k_pools=case.pools(0), v_pools=case.pools(1), block_tables=case.block_tables,
                block_tiers=case.block_tiers, seq_lens=case.seq_lens)
    args.update(kw)
    return paged_decode_attention(q, **args)


def test_decode_rejects_bad_inputs():
    case, q = _small_case()
    with pytest.raises(ValueError, match="q"):
        _call(case, q[0])
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        _call(case, torch.randn(2, 3, 64))
    with pytest.raises(ValueError, match="head_dim"):
        _call(case, torch.randn(2, 4, 32))
    with pytest.raises(TypeError, match="q"):
        _call(case, q.to(torch.int32))
    with pytest.raises(ValueError, match="block_tables"):
        _call(case, q, block_tables=case.block_tables[:1])
    with pytest.raises(ValueError, match="seq_lens"):
        _call(case, q, seq_lens=torch.tensor([5, 10**6], dtype=torch.int32))
    with pytest.raises(ValueError, match="no host view"):
        _call(case, q, k_pools=(case.pools(0)[0], None), v_pools=(case.pools(1)[0], None),
              block_tiers=torch.ones_like(case.block_tiers))
    bad = case.block_tables.clone()
    bad[1, 0] = 10**5
    with pytest.raises(ValueError, match="slot ids"):
        _call(case, q, block_tables=bad)
    with pytest.raises(TypeError, match="k_scales"):
        _call(case, q, k_scales=(torch.ones(3), None))
    with pytest.raises(ValueError, match="backend"):
        _call(case, q, backend="cuda")
    with pytest.raises(ValueError, match="num_splits"):
        _call(case, q, num_splits=0)
    with pytest.raises(ValueError, match="out"):
        _call(case, q, out=torch.empty(2, 4, 63))


def test_decode_fp8_requires_scales():
    case = make_paged_case([5], block_size=BS, num_kv_heads=HKV, head_dim=64, dtype=FP8,
                           host_fraction=0.5, seed=2)
    q = torch.randn(1, 4, 64)
    with pytest.raises(TypeError, match="scales"):
        paged_decode_attention(q, case.pools(0), case.pools(1), case.block_tables,
                               case.block_tiers, case.seq_lens)


# ------------------------------------------------------------------------------------------
# GPU: compiled kernels against the twin, host pool pinned and read zero-copy
# ------------------------------------------------------------------------------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _to_cuda(case: PagedCase) -> PagedCase:
    dev = torch.device("cuda")
    return PagedCase(
        case.gpu_kv.to(dev), case.host_kv.pin_memory(),
        None if case.gpu_scales is None else case.gpu_scales.to(dev),
        None if case.host_scales is None else case.host_scales.pin_memory(),
        case.block_tables.to(dev), case.block_tiers.to(dev), case.seq_lens.to(dev),
        case.keys, case.values,
    )


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(
    "kv_dtype,q_dtype,tol",
    [
        (torch.bfloat16, torch.bfloat16, 2e-2),
        (torch.float16, torch.float16, 2e-3),
        (torch.float32, torch.float32, 1e-5),
        (FP8, torch.bfloat16, 2e-2),
    ],
)
@pytest.mark.parametrize("num_splits", [1, 4, None])
def test_decode_gpu_matches_twin(kv_dtype, q_dtype, tol, num_splits):
    lens = [1, 15, 16, 17, 1000, 4096]
    cpu_case = make_paged_case(lens, block_size=16, num_kv_heads=8, head_dim=128,
                               dtype=kv_dtype, host_fraction=0.3, seed=seed_for("gpu", kv_dtype))
    case = _to_cuda(cpu_case)
    q = torch.randn(len(lens), 64, 128, device="cuda").to(q_dtype)
    kw = dict(k_scales=case.scales(0), v_scales=case.scales(1), num_splits=num_splits)
    args = (case.pools(0), case.pools(1), case.block_tables, case.block_tiers, case.seq_lens)
    out = paged_decode_attention(q, *args, backend="triton", **kw)
    twin = paged_decode_attention(q, *args, backend="torch", **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()
    assert relative_error(out.cpu(), twin.cpu().double()) < tol
    _check(cpu_case, q.cpu(), out.cpu(), TOLERANCE[FP8] if kv_dtype == FP8 else tol, 128**-0.5)
