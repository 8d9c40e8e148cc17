"""Device memory reserved once and mapped segment by segment: the CUDA virtual memory API.

The resizable device pool (`tiers.gpu.resizable: true`) lies over one range of device virtual
addresses (`cuMemAddressReserve`, no memory). Backing a range creates physical memory
(`cuMemCreate`), maps it there (`cuMemMap`) and makes it readable and writable by the device
(`cuMemSetAccess`); releasing unmaps and frees it. Kernels see one tensor whose base pointer never
changes. Ranges are multiples of `granularity(device)` (2 MiB on current GPUs).

Needs the `cuda` extra (cuda-python's driver bindings). NOTE: written against the driver API
documentation; no GPU was available when it was written, so it is opt-in and covered only by the
`gpu`-marked tests (benchmarks/gpu_suite.sh).
"""

from __future__ import annotations

import threading

import torch

from tiered_cache.errors import TierUnavailableError, install_hint


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        try:
            from cuda import cuda as driver  # cuda-python < 12.6
        except ImportError as exc:
            raise TierUnavailableError(
                "tiers.gpu.resizable: the CUDA virtual memory API needs cuda-python; install "
                f"the 'cuda' extra ({install_hint('cuda')})") from exc
    return driver


def _check(result):
    """cuda-python returns (CUresult, *values): raise on an error, return the values."""
    err, *values = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise TierUnavailableError(f"CUDA driver call failed: {err}")
    return values[0] if len(values) == 1 else values


def _props(cu, device: int):
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    return prop, access


def granularity(device: torch.device) -> int:
    """Bytes every mapped range must be a multiple of."""
    cu = _driver()
    index = _index(device)
    prop, _ = _props(cu, index)
    flag = cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED
    return int(_check(cu.cuMemGetAllocationGranularity(prop, flag)))


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


class _ArrayInterface:
    """What torch.as_tensor needs to view raw device memory (kept alive by the tensor)."""

    def __init__(self, ptr: int, nbytes: int, owner: CudaReservation) -> None:
        self.owner = owner
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None}


class CudaReservation:
    """`nbytes` of reserved device address space; the same interface as HostReservation."""

    def __init__(self, nbytes: int, *, device: torch.device) -> None:
        self._cu = cu = _driver()
        self.device = device
        self._index = _index(device)
        torch.zeros(1, device=device)        # the primary context exists and is current
        self._prop, self._access = _props(cu, self._index)
        self.align = granularity(device)
        self._nbytes = nbytes
        self._size = -(-nbytes // self.align) * self.align
        self._ptr = int(_check(cu.cuMemAddressReserve(self._size, self.align, 0, 0)))
        self._mapped: dict[int, tuple[object, int]] = {}    # start -> (handle, length)
        self._lock = threading.Lock()
        self._bytes: torch.Tensor | None = None

    @property
    def bytes(self) -> torch.Tensor:
        if self._bytes is None:
            view = _ArrayInterface(self._ptr, self._nbytes, self)
            self._bytes = torch.as_tensor(view, device=self.device)
        return self._bytes

    def back(self, start: int, length: int) -> None:
        if length == 0:
            return
        cu = self._cu
        with self._lock:
            handle = _check(cu.cuMemCreate(length, self._prop, 0))
            try:
                _check(cu.cuMemMap(self._ptr + start, length, 0, handle, 0))
                try:
                    _check(cu.cuMemSetAccess(self._ptr + start, length, [self._access], 1))
                except BaseException:
                    cu.cuMemUnmap(self._ptr + start, length)
                    raise
            except BaseException:
                cu.cuMemRelease(handle)
                raise
            self._mapped[start] = (handle, length)
            _check(cu.cuMemsetD8(self._ptr + start, 0, length))

    def release(self, start: int, length: int) -> None:
        with self._lock:
            entry = self._mapped.pop(start, None)
            if entry is None:
                return
            # NOTE: kernels already queued may still read the range: wait for them first.
            torch.cuda.synchronize(self.device)
            handle, mapped = entry
            _check(self._cu.cuMemUnmap(self._ptr + start, mapped))
            _check(self._cu.cuMemRelease(handle))

    def __del__(self) -> None:
        cu = getattr(self, "_cu", None)
        if cu is None or not getattr(self, "_ptr", 0):
            return
        try:
            torch.cuda.synchronize(self.device)
            for start, (handle, length) in list(self._mapped.items()):
                cu.cuMemUnmap(self._ptr + start, length)
                cu.cuMemRelease(handle)
            cu.cuMemAddressFree(self._ptr, self._size)
        except Exception:  # noqa: BLE001 - interpreter shutdown: the driver may be gone
            pass
