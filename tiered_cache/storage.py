"""Tier storage: preallocated tensors that hold the KV of every slot of a tier.

- `DevicePool` (the `gpu` tier): layer-major `[num_layers, 2, num_slots, block_size, H, D]`, the
  layout attention reads: layer l's K is one contiguous `[num_slots, block_size, H, D]` tensor.
  On a machine without CUDA it lives in CPU memory so every code path runs here.
- `HostPool` (the `host` tier): block-major `[num_slots, num_layers, 2, block_size, H, D]`, so all
  layers of a block are contiguous and a demotion of a run of slots is one large copy. Pinned when
  CUDA is present (and `memory: pinned`), CUDA managed memory through cupy for `memory: managed`,
  pageable otherwise.

The pools execute copies; they never decide what to copy (that is the control plane's job).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from tiered_cache.errors import TierUnavailableError

log = logging.getLogger(__name__)

TORCH_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
}
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0             # largest finite e4m3 value


class DevicePool:
    layout = "layer_major"

    def __init__(self, num_slots: int, num_layers: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str) -> None:
        self.device = torch.device(device)
        self.kv = torch.zeros((num_layers, 2, num_slots, block_size, num_kv_heads, head_dim),
                              dtype=dtype, device=self.device)
        self.block_size = block_size
        # FP8: one float32 scale per (layer, K|V, slot); value = scale * fp8.
        self.scales = (torch.ones((num_layers, 2, num_slots), dtype=torch.float32,
                                  device=self.device) if dtype == FP8 else None)

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[layer, 0], self.kv[layer, 1]

    def layer_scales(self, layer: int):
        return self.scales[layer, 0], self.scales[layer, 1]

    def write_tokens(self, layer: int, flat_index: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor) -> None:
        """Scatter tokens to flat positions `slot * block_size + offset` of one layer."""
        if self.scales is not None:
            self._write_fp8(layer, flat_index, key, value)
            return
        k, v = self.layer(layer)
        k.view(-1, *k.shape[2:]).index_copy_(0, flat_index, key)
        v.view(-1, *v.shape[2:]).index_copy_(0, flat_index, value)

    def read_tokens(self, layer: int,
                    flat_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Gather tokens; FP8 pools return them dequantized to float32."""
        out = []
        for which in (0, 1):
            data = self.kv[layer, which]
            if self.scales is None:
                out.append(data.reshape(-1, *data.shape[2:]).index_select(0, flat_index))
                continue
            raw = data.view(torch.uint8).reshape(-1, *data.shape[2:]).index_select(0, flat_index)
            scale = self.scales[layer, which][flat_index // self.block_size]
            out.append(raw.view(FP8).float() * scale[:, None, None])
        return out[0], out[1]

    def _write_fp8(self, layer: int, flat: torch.Tensor, key: torch.Tensor,
                   value: torch.Tensor) -> None:
        """Quantize on write with per-block scales.

        NOTE: a block's scale only grows. A write that starts a block (offset 0) sets a fresh
        scale from its own amax; a write into a partly filled block whose amax exceeds the
        current scale requantizes that block's earlier tokens to the new scale first (at most
        block_size tokens each), so every token of a block shares one scale, as attention
        expects.
        """
        bs = self.block_size
        slot, offset = flat // bs, flat % bs
        blocks, inv = torch.unique(slot, return_inverse=True)
        fresh = torch.zeros(len(blocks), dtype=torch.bool, device=flat.device)
        fresh[inv[offset == 0]] = True
        for which, x in ((0, key), (1, value)):
            data = self.kv[layer, which].view(torch.uint8)          # [S, bs, H, D]
            scales = self.scales[layer, which]
            x = x.float()
            amax = torch.zeros(len(blocks), device=x.device).scatter_reduce(
                0, inv, x.abs().amax(dim=(1, 2)), "amax")
            old = torch.where(fresh, torch.zeros_like(amax), scales[blocks])
            new = torch.maximum(old, amax / FP8_MAX).clamp_min(1e-12)
            grow = ~fresh & (new > old)
            if bool(grow.any()):
                g = blocks[grow]
                ratio = (old[grow] / new[grow])[:, None, None, None]
                data[g] = (data[g].view(FP8).float() * ratio).to(FP8).view(torch.uint8)
            scales[blocks] = new
            q = (x / new[inv][:, None, None]).to(FP8).view(torch.uint8)
            data.view(-1, *data.shape[2:]).index_copy_(0, flat, q)


class HostPool:
    layout = "block_major"

    def __init__(self, num_slots: int, num_layers: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, memory: str) -> None:
        shape = (num_slots, num_layers, 2, block_size, num_kv_heads, head_dim)
        self.memory = memory
        if memory == "managed":
            self.kv = _managed_tensor(shape, dtype)
        elif memory == "pinned" and torch.cuda.is_available():
            self.kv = torch.zeros(shape, dtype=dtype, pin_memory=True)
        else:
            # NOTE: `pinned` without CUDA falls back to pageable memory: pinning needs a driver.
            self.memory = "pageable"
            self.kv = torch.zeros(shape, dtype=dtype)
        self.block_size = block_size
        self.scales = None
        if dtype == FP8:
            self.scales = torch.ones((num_slots, num_layers, 2), dtype=torch.float32,
                                     pin_memory=self.kv.is_pinned())

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[:, layer, 0], self.kv[:, layer, 1]

    def layer_scales(self, layer: int):
        return self.scales[:, layer, 0], self.scales[:, layer, 1]


def _managed_tensor(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """CUDA managed (unified) memory through cupy, viewed as a torch tensor."""
    if not torch.cuda.is_available():
        raise TierUnavailableError("tiers.host.memory: 'managed' needs CUDA, which is not "
                                   "available here; use 'pinned' or 'pageable'")
    try:
        import cupy
    except ImportError as exc:
        raise TierUnavailableError("tiers.host.memory: 'managed' needs cupy; install the "
                                   "'cuda' extra (pip install tiered-cache[cuda])") from exc
    nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
    free, _ = torch.cuda.mem_get_info()
    # NOTE: never ask for more managed memory than the card has free: oversubscription thrashes.
    if nbytes > free:
        raise TierUnavailableError(f"tiers.host: managed memory of {nbytes} bytes exceeds the "
                                   f"{free} bytes free on the device")
    mem = cupy.cuda.malloc_managed(nbytes)
    buf = cupy.ndarray((nbytes,), dtype=cupy.uint8, memptr=mem)
    return torch.as_tensor(buf, device="cuda").view(dtype).view(*shape)


def make_pool(kind: str, num_slots: int, *, num_layers: int, block_size: int, num_kv_heads: int,
              head_dim: int, dtype: str, device: str = "cpu", memory: str = "pageable"):
    torch_dtype = TORCH_DTYPES[dtype]
    if kind == "gpu":
        return DevicePool(num_slots, num_layers, block_size, num_kv_heads, head_dim, torch_dtype,
                          device)
    return HostPool(num_slots, num_layers, block_size, num_kv_heads, head_dim, torch_dtype, memory)
