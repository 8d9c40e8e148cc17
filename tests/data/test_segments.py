"""Segmented pool memory: reserve once, back and free segments, never move a slot."""

from __future__ import annotations

import psutil
import pytest
import torch

from tiered_cache.data.pools import make_pool
from tiered_cache.data.segments import SegmentedTensor, default_max_slots, default_segment_slots
from tiered_cache.errors import CapacityError


def layer_major(num_slots: int = 10, max_slots: int = 64, seg: int = 4) -> SegmentedTensor:
    return SegmentedTensor((3, 2), (4, 2, 8), torch.float32, num_slots=num_slots,
                           max_slots=max_slots, segment_slots=seg, pinned=False, where="tiers.x")


def test_view_shape_segments_and_planes():
    st = layer_major()
    assert st.view(10).shape == (3, 2, 10, 4, 2, 8)
    assert st.backed_segments == 3 and st.backed_slots == 12    # 10 slots -> 3 segments of 4
    assert st.planes == 6 and st.slot_bytes == 4 * 2 * 8 * 4
    assert st.bytes_for(12) == 0 and st.bytes_for(13) == 4 * st.slot_bytes * st.planes
    # a segment is one range per plane, plane_stride apart
    ranges = st._ranges(1)
    assert len(ranges) == 6 and ranges[1][0] - ranges[0][0] == st.plane_stride


def test_grow_and_shrink_keep_the_slots_below_and_never_move_them():
    st = layer_major()
    v = st.view(10)
    v[:, :, 3].fill_(7.0)
    ptr = v.data_ptr()
    st.grow(40)
    big = st.view(40)
    assert big.data_ptr() == ptr and bool((big[:, :, 3] == 7).all())
    big[:, :, 30].fill_(5.0)
    st.shrink(8)
    assert st.backed_segments == 2
    st.grow(40)                                  # freed segments come back as zeros
    again = st.view(40)
    assert bool((again[:, :, 3] == 7).all()) and bool((again[:, :, 30] == 0).all())


def test_growing_past_max_slots_is_refused():
    st = layer_major(max_slots=16)
    with pytest.raises(CapacityError, match="exceed max_num_blocks 16"):
        st.grow(17)
    assert st.backed_segments == 3
    with pytest.raises(CapacityError, match="max_num_blocks 8 is below num_blocks 10"):
        layer_major(max_slots=8)


def test_a_failed_grow_backs_nothing(monkeypatch):
    st = layer_major()
    calls = []
    real = st.reservation.back

    def flaky(start: int, length: int) -> None:
        calls.append(start)
        if len(calls) == 5:
            raise OSError("no memory")
        real(start, length)

    released = []
    monkeypatch.setattr(st.reservation, "back", flaky)
    monkeypatch.setattr(st.reservation, "release", lambda s, n: released.append(s))
    with pytest.raises(OSError, match="no memory"):
        st.grow(30)
    assert st.backed_segments == 3
    assert released == calls[:4]                 # what was backed before the failure


def test_shrink_returns_memory_to_the_system():
    mib = 1 << 20
    st = SegmentedTensor((), (mib,), torch.uint8, num_slots=256, max_slots=512,
                         segment_slots=32, pinned=False, where="tiers.x")
    st.view(256).fill_(1)
    proc = psutil.Process()
    before = proc.memory_info().rss
    st.shrink(32)
    freed = before - proc.memory_info().rss
    assert freed > 150 * mib, f"only {freed / mib:.0f} MiB of 224 MiB went back"


@pytest.mark.parametrize("layout", ["layer_major", "block_major"])
def test_fp8_pools_resize_their_scales_with_new_slots_at_one(layout):
    pool = make_pool(layout, 8, num_layers=2, block_size=4, num_kv_heads=1, head_dim=4,
                     dtype="fp8_e4m3", memory="pageable", segment_slots=4)
    assert pool.resizable and pool.num_slots == 8
    pool.scales.fill_(3.0)
    pool.resize(20)
    dim = 2 if layout == "layer_major" else 0
    assert pool.kv.shape[dim] == 20 and pool.scales.shape[dim] == 20
    low = pool.scales.narrow(dim, 0, 8)
    new = pool.scales.narrow(dim, 8, 12)
    assert bool((low == 3).all()) and bool((new == 1).all())
    pool.resize(6)
    assert pool.kv.shape[dim] == 6 and pool.scales.shape[dim] == 6


def test_defaults():
    assert default_segment_slots(1 << 20, 1000) == 64       # 64 MiB of 1 MiB blocks
    assert default_segment_slots(1 << 20, 10) == 10         # never more than the pool holds
    assert default_segment_slots(1 << 30, 10) == 1
    total = psutil.virtual_memory().total
    assert default_max_slots(1 << 20, 4) == max(4, total >> 20)


def test_alignment_rounds_segments_and_planes_to_whole_units():
    # 3 planes of 96-byte slots with 4 KiB mapping units: 128 slots fill a unit exactly
    st = SegmentedTensor((3,), (24,), torch.float32, num_slots=10, max_slots=200,
                         segment_slots=5, where="tiers.x", align=4096)
    assert st.segment_slots == 128 and st.max_slots == 256
    assert st.plane_stride % 4096 == 0
    assert all(start % 4096 == 0 and length % 4096 == 0 for start, length in st._ranges(1))


class FakeDriver:
    """The slice of cuda-python's driver API that cuda_vmm uses, recording every call."""

    class _Obj:
        def __init__(self) -> None:
            self.location = FakeDriver._Loc()

    class _Loc:
        type = id = None

    class _Enum:
        def __getattr__(self, name: str) -> str:
            return name

    CUmemAllocationProp = CUmemAccessDesc = _Obj
    CUmemAllocationType = CUmemLocationType = CUmemAccess_flags = _Enum()
    CUmemAllocationGranularity_flags = _Enum()

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.mapped: dict[int, int] = {}
        self.fail_map = False
        self.handles = 0

    def cuMemGetAllocationGranularity(self, prop, flag):
        return 0, 4096

    def cuMemAddressReserve(self, size, align, addr, flags):
        self.calls.append(("reserve", size))
        return 0, 1 << 40

    def cuMemCreate(self, length, prop, flags):
        self.handles += 1
        self.calls.append(("create", length))
        return 0, self.handles

    def cuMemMap(self, ptr, length, offset, handle, flags):
        if self.fail_map:
            return (2,)                 # CUDA_ERROR_OUT_OF_MEMORY
        self.mapped[ptr] = length
        return (0,)

    def cuMemSetAccess(self, ptr, length, descs, count):
        return (0,)

    def cuMemsetD8(self, ptr, value, length):
        return (0,)

    def cuMemUnmap(self, ptr, length):
        del self.mapped[ptr]
        return (0,)

    def cuMemRelease(self, handle):
        self.calls.append(("release", handle))
        return (0,)

    def cuMemAddressFree(self, ptr, size):
        return (0,)


def test_cuda_reservation_maps_and_unmaps_per_range_and_rolls_back(monkeypatch):
    """The bookkeeping of the CUDA virtual memory path against a fake driver (the real one is
    exercised by the gpu-marked tests)."""
    from tiered_cache.data import cuda_vmm
    from tiered_cache.errors import TierUnavailableError

    fake = FakeDriver()
    monkeypatch.setattr(cuda_vmm, "_driver", lambda: fake)
    monkeypatch.setattr(cuda_vmm, "_index", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    res = cuda_vmm.CudaReservation(10_000, device=torch.device("cpu"))
    assert res.align == 4096 and fake.calls == [("reserve", 12_288)]
    res.back(0, 4096)
    res.back(4096, 8192)
    assert fake.mapped == {1 << 40: 4096, (1 << 40) + 4096: 8192}
    res.release(4096, 8192)
    assert fake.mapped == {1 << 40: 4096} and ("release", 2) in fake.calls
    res.release(4096, 8192)                       # already released: nothing happens
    fake.fail_map = True
    with pytest.raises(TierUnavailableError, match="CUDA driver call failed"):
        res.back(4096, 4096)
    assert ("release", 3) in fake.calls           # the handle of the failed map is freed
    assert fake.mapped == {1 << 40: 4096}


def test_pinned_segments_are_registered_as_whole_pages(monkeypatch):
    """Each pinned segment is page-locked on its own (cudaHostRegister); two registrations
    sharing a page would fail, so segment ranges are whole pages, for KV and FP8 scales."""
    from tiered_cache.data.segments import PAGE

    registered: list[tuple[int, int]] = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):
            registered.append((ptr, size))
            return 0

        def cudaHostUnregister(self, ptr):
            registered[:] = [r for r in registered if r[0] != ptr]
            return 0

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    # 384-byte blocks and 24 bytes of scales per block: neither divides a page
    pool = make_pool("block_major", 16, num_layers=3, block_size=4, num_kv_heads=1, head_dim=4,
                     dtype="fp8_e4m3", memory="pinned", max_slots=4096, segment_slots=16)
    assert pool.memory == "pinned"
    pool.resize(600)
    assert registered and all(p % PAGE == 0 and n % PAGE == 0 for p, n in registered)
    pages = [set(range(p // PAGE, (p + n) // PAGE)) for p, n in registered]
    assert sum(map(len, pages)) == len(set().union(*pages))      # no page registered twice
    pool.resize(16)
    assert len(registered) == 2                   # the first segment of KV and of scales
