"""Tier storage: preallocated tensors that hold the KV of every slot of a tier.

- `DevicePool` (the `gpu` tier): layer-major `[num_layers, 2, num_slots, block_size, H, D]`, the
  layout attention reads: layer l's K is one contiguous `[num_slots, block_size, H, D]` tensor.
  On a machine without CUDA it lives in CPU memory so every code path runs here.
- `HostPool` (the `host` tier): block-major `[num_slots, num_layers, 2, block_size, H, D]`, so all
  layers of a block are contiguous and a demotion of a run of slots is one large copy. Pinned when
  CUDA is present (and `memory: pinned`), CUDA managed memory through cupy for `memory: managed`,
  pageable otherwise.

Pools in host memory (the host tier, and the device tier without CUDA) are resizable: their
tensors lie over address space reserved for `max_slots` and are backed segment by segment
(`tiered_cache.data.segments`), so `resize` neither moves nor copies a slot. A CUDA device pool is
resizable the same way with `tiers.gpu.resizable: true` (the CUDA virtual memory API,
`tiered_cache.data.cuda_vmm`), and one allocation otherwise; a `managed` host pool is fixed.

The pools execute copies; they never decide what to copy (that is the control plane's job).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from functools import partial

import torch

from tiered_cache.data.segments import (
    PAGE,
    SegmentedTensor,
    default_max_slots,
    default_segment_slots,
)
from tiered_cache.errors import CapacityError, TierUnavailableError

log = logging.getLogger(__name__)

TORCH_DTYPES = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "fp8_e4m3": torch.float8_e4m3fn,
}
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0             # largest finite e4m3 value


class _Pool:
    """What both pools share: the slot count and, when the memory is reserved, resizing."""

    where = "tiers"
    # (attribute, SegmentedTensor, fill value of new slots) per resizable tensor of the pool
    _segmented: list[tuple[str, SegmentedTensor, float]]

    def _reserve(self, outer: tuple[int, ...], inner: tuple[int, ...], num_slots: int,
                 max_slots: int | None, segment_slots: int | None, pinned: bool = False,
                 device: torch.device | None = None) -> None:
        """Lay the pool over reserved memory (see segments.py): host memory, or with `device`
        the CUDA virtual memory API."""
        slot_bytes = _prod(outer) * _prod(inner) * self.kv_dtype.itemsize
        # NOTE: pinned segments are page-locked one by one (cudaHostRegister), and two
        # registrations must not share a page: their ranges are whole pages.
        reserve, align = None, (PAGE if pinned else 1)
        if device is not None:
            from tiered_cache.data import cuda_vmm
            reserve = partial(cuda_vmm.CudaReservation, device=device)
            align = cuda_vmm.granularity(device)
            total = torch.cuda.get_device_properties(device).total_memory
            default_max = max(num_slots, total // max(1, slot_bytes))
        else:
            default_max = default_max_slots(slot_bytes, num_slots)
        self.max_slots = default_max if max_slots is None else max_slots
        seg = segment_slots or default_segment_slots(slot_bytes, num_slots)

        def reserve_kv(max_slots: int) -> SegmentedTensor:
            return SegmentedTensor(outer, inner, self.kv_dtype, num_slots=num_slots,
                                   max_slots=max_slots, segment_slots=seg, pinned=pinned,
                                   reserve=reserve, align=align, where=self.where)

        try:
            kv = reserve_kv(self.max_slots)
        except OSError as exc:
            if max_slots is not None or self.max_slots == num_slots:
                raise TierUnavailableError(f"{self.where}: cannot reserve address space for "
                                           f"{self.max_slots:,} blocks ({exc})") from exc
            # Strict overcommit (vm.overcommit_memory=2) refuses a large reservation: fall back
            # to the starting size, which can still shrink and grow back.
            log.warning("%s: cannot reserve %d blocks of address space (%s); max_num_blocks "
                        "falls back to %d", self.where, self.max_slots, exc, num_slots)
            kv = reserve_kv(num_slots)
        self.max_slots = kv.max_slots          # rounded up to whole segments on CUDA
        self._segmented = [("kv", kv, 0.0)]
        if self.kv_dtype == FP8:
            # FP8: one float32 scale per (layer, K|V, slot), laid out like the pool
            dims = (outer, ()) if outer else ((), inner[:2])
            if device is not None:
                # NOTE: 4 bytes per plane and slot cannot fill 2 MiB mapping units in useful
                # steps; at 1/8192 of the KV bytes the scales are simply allocated for
                # max_slots up front.
                scales = WholeTensor(torch.ones((*dims[0], self.max_slots, *dims[1]),
                                                dtype=torch.float32, device=device),
                                     len(dims[0]))
            else:
                scales = SegmentedTensor(dims[0], dims[1], torch.float32, num_slots=num_slots,
                                         max_slots=self.max_slots, segment_slots=kv.segment_slots,
                                         pinned=pinned, align=align, where=self.where)
            self._segmented.append(("scales", scales, 1.0))
        self._set_views(num_slots, fill_from=0)

    @property
    def resizable(self) -> bool:
        return bool(self._segmented)

    @property
    def num_slots(self) -> int:
        return self.kv.shape[self._slot_dim]

    def check_resize(self, num_slots: int) -> None:
        """Raise unless `resize(num_slots)` can succeed: the pool is resizable, `num_slots` is
        within max_slots and the machine has the memory to back it."""
        if not self.resizable:
            raise TierUnavailableError(
                f"{self.where}: this pool has a fixed size ({self._fixed_reason})")
        if num_slots > self.max_slots:
            raise CapacityError(f"{self.where}: {num_slots:,} blocks exceed max_num_blocks "
                                f"{self.max_slots:,}")
        need = sum(mem.bytes_for(num_slots) for _, mem, _ in self._segmented)
        if need:
            avail = _available_bytes(self.kv.device)
            if need > avail:
                raise CapacityError(f"{self.where}: growing to {num_slots:,} blocks needs "
                                    f"{need:,} more bytes of memory but only {avail:,} are "
                                    "available")

    def resize(self, num_slots: int) -> None:
        """Grow (back new segments, then show the slots) or shrink (hide the slots, then give
        their memory back). The caller guarantees nothing reads the slots cut off."""
        self.check_resize(num_slots)
        old = self.num_slots
        if num_slots > old:
            done = []
            try:
                for _, mem, _ in self._segmented:
                    mem.grow(num_slots)
                    done.append(mem)
            except BaseException:
                for mem in done:
                    mem.shrink(old)
                raise
            self._set_views(num_slots, fill_from=old)
        elif num_slots < old:
            self._set_views(num_slots, fill_from=num_slots)
            for _, mem, _ in self._segmented:
                mem.shrink(num_slots)

    def _set_views(self, num_slots: int, fill_from: int) -> None:
        views = {}
        for attr, mem, fill in self._segmented:
            view = mem.view(num_slots)
            if fill and num_slots > fill_from:
                idx = (slice(None),) * self._slot_dim + (slice(fill_from, num_slots),)
                view[idx].fill_(fill)
            views[attr] = view
        # NOTE: readers outside the lock (attention) pair the KV with its scales: both come
        # from `_views`, replaced in one assignment, so they always have the same size.
        self._views = (views["kv"], views.get("scales"))
        for attr, view in views.items():
            setattr(self, attr, view)

    def views(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(kv, scales) of one size, even while another thread resizes the pool."""
        views = getattr(self, "_views", None)
        return views if views is not None else (self.kv, self.scales)

    def layer_views(self, layer: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None,
                                               torch.Tensor | None]:
        """(k, v, k_scales, v_scales) of one layer from one `views()` snapshot (scales None
        unless FP8)."""
        kv, scales = self.views()
        d = self._slot_dim
        k, v = (kv[layer, 0], kv[layer, 1]) if d else (kv[:, layer, 0], kv[:, layer, 1])
        if scales is None:
            return k, v, None, None
        if d:
            return k, v, scales[layer, 0], scales[layer, 1]
        return k, v, scales[:, layer, 0], scales[:, layer, 1]


class DevicePool(_Pool):
    layout = "layer_major"
    where = "tiers.gpu"
    _slot_dim = 2

    def __init__(self, num_slots: int, num_layers: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: str, *,
                 max_slots: int | None = None, segment_slots: int | None = None,
                 resizable: bool = False) -> None:
        self.device = torch.device(device)
        self.block_size = block_size
        self.kv_dtype = dtype
        self.scales = None
        self._segmented = []
        geometry = ((num_layers, 2), (block_size, num_kv_heads, head_dim), num_slots,
                    max_slots, segment_slots)
        if self.device.type == "cpu":
            self._reserve(*geometry)
            return
        if resizable:                   # the CUDA virtual memory API (cuda_vmm.py)
            self._reserve(*geometry, device=self.device)
            return
        self._fixed_reason = ("a CUDA device pool is allocated once unless tiers.gpu.resizable "
                              "is true")
        self.max_slots = num_slots
        self.kv = torch.zeros((num_layers, 2, num_slots, block_size, num_kv_heads, head_dim),
                              dtype=dtype, device=self.device)
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


class HostPool(_Pool):
    layout = "block_major"
    where = "tiers.host"
    _slot_dim = 0

    def __init__(self, num_slots: int, num_layers: int, block_size: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, memory: str, *,
                 max_slots: int | None = None, segment_slots: int | None = None) -> None:
        self.memory = memory
        self.block_size = block_size
        self.kv_dtype = dtype
        self.scales = None
        self._segmented = []
        if memory == "managed":
            shape = (num_slots, num_layers, 2, block_size, num_kv_heads, head_dim)
            self._fixed_reason = "managed memory is allocated once"
            self.max_slots = num_slots
            self.kv = _managed_tensor(shape, dtype)
            if dtype == FP8:
                self.scales = torch.ones((num_slots, num_layers, 2), dtype=torch.float32)
            return
        pinned = memory == "pinned" and torch.cuda.is_available()
        # NOTE: `pinned` without CUDA falls back to pageable memory: pinning needs a driver.
        self.memory = "pinned" if pinned else "pageable"
        self._reserve((), (num_layers, 2, block_size, num_kv_heads, head_dim), num_slots,
                      max_slots, segment_slots, pinned=pinned)

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


class WholeTensor:
    """A tensor allocated for max_slots at once, with SegmentedTensor's interface (for the
    small per-slot tables that ride along with a segmented pool)."""

    def __init__(self, full: torch.Tensor, slot_dim: int) -> None:
        self.full, self.slot_dim = full, slot_dim

    def view(self, slots: int) -> torch.Tensor:
        return self.full.narrow(self.slot_dim, 0, slots)

    def bytes_for(self, slots: int) -> int:
        return 0

    def grow(self, slots: int) -> None:
        pass                            # nothing to back: allocated whole

    def shrink(self, slots: int) -> None:
        pass


def _prod(xs: Sequence[int]) -> int:
    out = 1
    for x in xs:
        out *= x
    return out


def _available_bytes(device: torch.device) -> int:
    """Memory a grow may take: free device memory for a CUDA pool, else available host RAM."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    import psutil
    return psutil.virtual_memory().available


def make_pool(layout: str, num_slots: int, *, num_layers: int, block_size: int,
              num_kv_heads: int, head_dim: int, dtype: str, device: str = "cpu",
              memory: str = "pageable", max_slots: int | None = None,
              segment_slots: int | None = None, resizable: bool = False):
    """A `DevicePool` (layout `layer_major`, on `device`) or a `HostPool` (`block_major`, in
    `memory`) of `num_slots` slots; `dtype` is a KV dtype name (TORCH_DTYPES)."""
    if layout not in (DevicePool.layout, HostPool.layout):
        raise ValueError(f"layout: expected {DevicePool.layout!r} or {HostPool.layout!r}, "
                         f"got {layout!r}")
    torch_dtype = TORCH_DTYPES[dtype]
    if layout == DevicePool.layout:
        return DevicePool(num_slots, num_layers, block_size, num_kv_heads, head_dim, torch_dtype,
                          device, max_slots=max_slots, segment_slots=segment_slots,
                          resizable=resizable)
    return HostPool(num_slots, num_layers, block_size, num_kv_heads, head_dim, torch_dtype, memory,
                    max_slots=max_slots, segment_slots=segment_slots)


class SharedHostPool:
    """The node daemon's host tier: a block-major pool over shared memory that engines map
    (`tiered_cache.wire.shm.SharedPool`); fixed size, no FP8 scales."""

    layout = HostPool.layout
    where = "tiers.host"
    scales = None
    resizable = False

    def __init__(self, shared) -> None:
        self.shared = shared
        self.kv = shared.kv
        self.num_slots = shared.geometry.num_slots

    def close(self) -> None:
        self.shared.close()
