"""Reading vLLM's per-layer KV tensors (integrations/vllm/layout.py): each backend's form
element by element against its own reading of the tensor, other physical layouts through their
strides, and every layout the connector must refuse."""

from __future__ import annotations

import pytest
import torch

from tiered_cache.integrations.vllm.layout import (
    INTERLEAVED,
    PLANAR,
    SPLIT,
    LayoutError,
    blocks_view,
    canonical,
    describe,
)

B, H, N, D = 5, 3, 8, 4


def layout_of(kv, backend="CPU_ATTN", **kw):
    args = dict(num_blocks=B, block_size=N, num_kv_heads=H, head_dim=D, dtype=torch.float32)
    args.update(kw)
    return describe(kv, backend, **args)


def test_cpu_backend_reads_k_rows_then_v_rows_per_block_and_head():
    kv = torch.randn(B, H, N, 2 * D)
    lay = layout_of(kv)
    assert lay.form == PLANAR
    # cpu_attn.py: kv.view(B, H, 2 * N, D).chunk(2, dim=2)
    k, v = kv.view(B, H, 2 * N, D).chunk(2, dim=2)
    c = canonical(kv, lay)                               # [B, 2, N, H, D]
    assert torch.equal(c[:, 0], k.permute(0, 2, 1, 3))
    assert torch.equal(c[:, 1], v.permute(0, 2, 1, 3))


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (0, 2, 1, 3), (1, 0, 2, 3)])
def test_gpu_backends_read_k_then_v_per_token_whatever_the_strides(order):
    """FLASH_ATTN / TRITON_ATTN: kv.transpose(1, 2).split(head_size, -1); the physical order
    of the axes (LBHNC, LBNHC, a block-outer layout's view) is read from the strides."""
    shape = (B, H, N, 2 * D)
    phys = torch.randn([shape[i] for i in order])
    kv = phys.permute(*[order.index(i) for i in range(4)])
    assert tuple(kv.shape) == shape
    lay = layout_of(kv, "FLASH_ATTN")
    assert lay.form == INTERLEAVED
    k, v = kv.transpose(1, 2).split(D, dim=-1)           # [B, N, H, D] each
    c = canonical(kv, lay)
    assert torch.equal(c[:, 0], k) and torch.equal(c[:, 1], v)


def test_split_planes_of_older_releases():
    kv = torch.randn(2, B, N, H, D)
    lay = layout_of(kv, "FLASH_ATTN")
    assert lay.form == SPLIT
    c = canonical(kv, lay)
    assert torch.equal(c[:, 0], kv[0]) and torch.equal(c[:, 1], kv[1])


def test_blocks_view_cuts_a_vllm_block_into_ours_and_writes_through():
    kv = torch.randn(B, H, N, 2 * D)
    lay = layout_of(kv)
    view = blocks_view(kv, lay, 2)                       # [B, 4, 2, 2, H, D]
    assert tuple(view.shape) == (B, 4, 2, 2, H, D)
    c = canonical(kv, lay)
    assert torch.equal(view[3, 1], c[3, :, 2:4])
    view[torch.tensor([2]), torch.tensor([3])] = torch.ones(1, 2, 2, H, D)
    assert torch.equal(canonical(kv, lay)[2, :, 6:8], torch.ones(2, 2, H, D))
    assert canonical(kv, lay)[2, :, :6].ne(1).any()


@pytest.mark.parametrize("case", ["backend", "shape", "dtype", "strides", "dims",
                                  "kernel_blocks"])
def test_refused_layouts(case):
    kv = torch.randn(B, H, N, 2 * D)
    backend, kw = "CPU_ATTN", {}
    if case == "backend":
        backend = "FLASHMLA"
    elif case == "shape":
        kv = torch.randn(B, H, N, 2 * D + 2)
    elif case == "dtype":
        kv = kv.to(torch.float16)
    elif case == "strides":
        kv = torch.randn(B, H, 2 * D, N).transpose(2, 3)     # [N, C] not contiguous
    elif case == "dims":
        kv = torch.randn(B, H, N, 2, D)
    elif case == "kernel_blocks":
        kv = torch.randn(2 * B, H, N // 2, 2 * D)
    with pytest.raises(LayoutError) as e:
        layout_of(kv, backend, **kw)
    assert str(e.value)
    if case == "kernel_blocks":
        assert "kernel block" in str(e.value)
