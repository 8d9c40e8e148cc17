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


class DevicePool:
    layout = "layer_major"

    def __init__(self, num_slots: int, num_layers: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str) -> None:
        self.device = torch.device(device)
        self.kv = torch.zeros((num_layers, 2, num_slots, block_size, num_kv_heads, head_dim),
                              dtype=dtype, device=self.device)
        self.block_size = block_size

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[layer, 0], self.kv[layer, 1]

    def write_tokens(self, layer: int, flat_index: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor) -> None:
        """Scatter tokens to flat positions `slot * block_size + offset` of one layer."""
        k, v = self.layer(layer)
        k.view(-1, *k.shape[2:]).index_copy_(0, flat_index, key)
        v.view(-1, *v.shape[2:]).index_copy_(0, flat_index, value)

    def read_tokens(self, layer: int,
                    flat_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.layer(layer)
        return (k.reshape(-1, *k.shape[2:]).index_select(0, flat_index),
                v.reshape(-1, *v.shape[2:]).index_select(0, flat_index))


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

    def layer(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.kv[:, layer, 0], self.kv[:, layer, 1]


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
