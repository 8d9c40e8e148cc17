"""Test and benchmark helpers: random two-tier pools in the cache's real layouts, and float64
references that literally gather each sequence's blocks and run plain softmax attention.

Used by ``tests/test_kernels_*.py`` and ``benchmarks/attention.py``; nothing here runs in the
serving path.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass

import torch

from .reference import FP8_DTYPE, quantize_fp8

__all__ = [
    "LAYER",
    "TOLERANCE",
    "backend_params",
    "PagedCase",
    "gather_dequantized",
    "make_paged_case",
    "reference_attention",
    "relative_error",
    "seed_for",
]

LAYER = 1  # the layer the attention cases read (not 0, so the layer offset is exercised)


def seed_for(*parts: object, base: int = 0) -> int:
    """A stable per-test seed from the test's parameters (never Python's salted ``hash``)."""
    return (zlib.crc32(repr(parts).encode()) ^ base) & 0x7FFFFFFF


@dataclass
class PagedCase:
    """One layer's view of a random two-tier cache plus the float64 truth.

    gpu_kv ``[L, 2, S, bs, H, D]``; host_kv ``[S_h, L, 2, bs, H, D]``; scales (FP8 only)
    gpu ``[L, 2, S]``, host ``[S_h, L, 2]``. ``keys[b]`` / ``values[b]``: ``[len_b, H, D]``
    float64, the values before FP8 quantization.
    """

    gpu_kv: torch.Tensor
    host_kv: torch.Tensor
    gpu_scales: torch.Tensor | None
    host_scales: torch.Tensor | None
    block_tables: torch.Tensor
    block_tiers: torch.Tensor
    seq_lens: torch.Tensor
    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    def pools(self, kv: int, layer: int = LAYER) -> tuple[torch.Tensor, torch.Tensor]:
        """``(gpu_kv[l, kv], host_kv[:, l, kv])``: the views the cache passes."""
        return self.gpu_kv[layer, kv], self.host_kv[:, layer, kv]

    def scales(self, kv: int, layer: int = LAYER) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self.gpu_scales is None or self.host_scales is None:
            return None
        return self.gpu_scales[layer, kv], self.host_scales[:, layer, kv]


def make_paged_case(
    seq_lens: list[int],
    *,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    host_fraction: float,
    seed: int,
    num_layers: int = 2,
    spare_slots: int = 3,
    device: torch.device | str = "cpu",
) -> PagedCase:
    """Random pools whose blocks are scattered over random slots of both tiers.

    Each block goes to the host pool with probability ``host_fraction``. Table entries past a
    sequence's blocks are filled with out-of-range slot ids and random tiers, so a kernel that
    reads them fails loudly.
    """
    gen = torch.Generator().manual_seed(seed)
    nblk = [-(-n // block_size) for n in seq_lens]
    total = sum(nblk)
    width = max([*nblk, 1]) + 1
    s_gpu, s_host = total + spare_slots, total + spare_slots
    block = (block_size, num_kv_heads, head_dim)
    raw_gpu = torch.randn(num_layers, 2, s_gpu, *block, generator=gen)
    raw_host = torch.randn(s_host, num_layers, 2, *block, generator=gen)
    # Vary the block magnitudes so per-block FP8 scales differ.
    raw_gpu *= torch.rand(num_layers, 2, s_gpu, 1, 1, 1, generator=gen) * 2 + 0.25
    raw_host *= torch.rand(s_host, num_layers, 2, 1, 1, 1, generator=gen) * 2 + 0.25

    gpu_scales = host_scales = None
    if dtype == FP8_DTYPE:
        qg, sg = quantize_fp8(raw_gpu.reshape(-1, *block))
        qh, sh = quantize_fp8(raw_host.reshape(-1, *block))
        gpu_kv, host_kv = qg.view(raw_gpu.shape), qh.view(raw_host.shape)
        gpu_scales = sg.view(num_layers, 2, s_gpu)
        host_scales = sh.view(s_host, num_layers, 2)
    else:
        gpu_kv, host_kv = raw_gpu.to(dtype), raw_host.to(dtype)
        raw_gpu, raw_host = gpu_kv.double(), host_kv.double()  # truth = what is stored

    tables = torch.randint(10**6, 2 * 10**6, (len(seq_lens), width), generator=gen)
    tiers = torch.randint(0, 2, (len(seq_lens), width), generator=gen)
    gpu_free = torch.randperm(s_gpu, generator=gen).tolist()
    host_free = torch.randperm(s_host, generator=gen).tolist()
    keys, values = [], []
    for b, n in enumerate(seq_lens):
        ks, vs = [], []
        for j in range(nblk[b]):
            on_host = bool(torch.rand(1, generator=gen) < host_fraction)
            slot = (host_free if on_host else gpu_free).pop()
            tables[b, j], tiers[b, j] = slot, int(on_host)
            for kv, out in ((0, ks), (1, vs)):
                src = raw_host[slot, LAYER, kv] if on_host else raw_gpu[LAYER, kv, slot]
                out.append(src.double())
        keys.append(torch.cat(ks)[:n] if ks else torch.zeros(0, num_kv_heads, head_dim))
        values.append(torch.cat(vs)[:n] if vs else torch.zeros(0, num_kv_heads, head_dim))
    dev = torch.device(device)
    return PagedCase(
        gpu_kv.to(dev), host_kv.to(dev),
        None if gpu_scales is None else gpu_scales.to(dev),
        None if host_scales is None else host_scales.to(dev),
        tables.to(dev, torch.int32), tiers.to(dev, torch.int8),
        torch.tensor(seq_lens, dtype=torch.int32, device=dev), keys, values,
    )


def gather_dequantized(case: PagedCase, b: int, kv: int, layer: int = LAYER) -> torch.Tensor:
    """Sequence b's K (kv=0) or V (kv=1) as stored, dequantized, float64 ``[len, H, D]``: built
    block by block from the table, the way a naive engine would."""
    n = int(case.seq_lens[b])
    bs = case.gpu_kv.shape[3]
    parts = []
    for j in range(-(-n // bs)):
        slot, tier = int(case.block_tables[b, j]), int(case.block_tiers[b, j])
        if tier:
            blk = case.host_kv[slot, layer, kv].double()
            sc = None if case.host_scales is None else float(case.host_scales[slot, layer, kv])
        else:
            blk = case.gpu_kv[layer, kv, slot].double()
            sc = None if case.gpu_scales is None else float(case.gpu_scales[layer, kv, slot])
        parts.append(blk if sc is None else blk * sc)
    h, d = case.gpu_kv.shape[4], case.gpu_kv.shape[5]
    return torch.cat(parts)[:n] if parts else torch.zeros(0, h, d, dtype=torch.float64)


def reference_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor, scale: float
) -> torch.Tensor:
    """float64 softmax attention with causal positions: q ``[n, Hq, D]`` at positions
    ``q_pos [n]``, k/v ``[T, Hkv, D]`` at positions ``0..T-1``. GQA by repeating K/V per head."""
    hq, hkv = q.shape[1], k.shape[1]
    if k.shape[0] == 0:
        return torch.zeros(q.shape, dtype=torch.float64)
    kr = k.double().repeat_interleave(hq // hkv, dim=1)  # [T, Hq, D]
    vr = v.double().repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("nhd,thd->hnt", q.double(), kr) * scale
    mask = torch.arange(k.shape[0])[None, :] <= q_pos[:, None]
    scores = scores.masked_fill(~mask[None], float("-inf"))
    return torch.einsum("hnt,thd->nhd", torch.softmax(scores, dim=-1), vr)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref| (float64)."""
    return float((out.double() - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


# Relative-error bounds (max abs err / max abs ref) per KV storage dtype, against float64.
TOLERANCE = {
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1e-2,
    FP8_DTYPE: 5e-2,
}


def backend_params() -> list:
    """``["torch", "triton"]`` as pytest params for tests on CPU tensors; "triton" runs only
    under ``TRITON_INTERPRET=1`` (the test modules set it when there is no GPU driver; on a GPU
    machine the compiled kernels are covered by the ``gpu``-marked tests)."""
    import pytest

    from .dispatch import interpret_requested, triton_available

    runnable = triton_available() and interpret_requested()
    return [
        "torch",
        pytest.param(
            "triton", marks=pytest.mark.skipif(not runnable, reason="needs TRITON_INTERPRET=1")
        ),
    ]
