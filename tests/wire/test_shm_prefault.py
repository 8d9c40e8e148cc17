"""SharedPool prefaulting: every page of a mapping is mapped by the `tc-prefault` thread (the
kernel's resident count of that mapping says so), the bytes never change under it, a close
meanwhile stops it without a fault, and a kernel that refuses the advice or an error is logged,
recorded and leaves the pool working."""

from __future__ import annotations

import errno
import logging
import os
import threading

import pytest
import torch

from tiered_cache.wire import shm
from tiered_cache.wire.shm import PoolGeometry, SharedPool

GEO = PoolGeometry(64, 2, 16, 2, 64, "float32")              # 32 KiB slots, 2 MiB


def _resident_kib(addr: int) -> int:
    """Rss of the mapping that holds `addr`, from /proc/self/smaps."""
    found = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= addr < hi
            elif found and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError("mapping not found")


def _supported() -> bool:
    pool = SharedPool.create(GEO)
    try:
        pool.wait_prefault(10)
        return pool.prefaulted == GEO.nbytes
    finally:
        pool.close()


needs_populate = pytest.mark.skipif(not _supported(), reason="kernel without MADV_POPULATE_*")


@needs_populate
@pytest.mark.parametrize("sealed", [False, True])
def test_a_created_pool_is_mapped_whole_by_the_prefault_thread(sealed):
    """(sealed: F_SEAL_FUTURE_WRITE after the creator's mapping, as the daemon's pools are:
    that mapping is still populated writable)"""
    pool = SharedPool.create(GEO, read_only_clients=sealed)
    assert pool.write_sealed == sealed
    try:
        assert pool.wait_prefault(10)
        assert pool.prefaulted == GEO.nbytes and pool.prefault_error is None
        assert _resident_kib(pool.kv.data_ptr()) * 1024 >= GEO.nbytes
    finally:
        pool.close()


@needs_populate
def test_a_pool_created_without_populate_is_left_to_fault():
    pool = SharedPool.create(GEO, populate=False)
    try:
        assert pool.wait_prefault(0) and pool.prefaulted == 0
        assert _resident_kib(pool.kv.data_ptr()) == 0       # the test above can fail
    finally:
        pool.close()


@needs_populate
@pytest.mark.parametrize("writable", [False, True])
def test_an_attached_mapping_is_prefaulted_and_reads_what_the_owner_wrote(writable):
    owner = SharedPool.create(GEO)
    try:
        torch.manual_seed(0)
        data = torch.randn(GEO.shape)
        owner.kv.copy_(data)
        client = SharedPool.attach(owner.client_fd(writable=writable), GEO, writable=writable)
        try:
            assert client.wait_prefault(10) and client.prefaulted == GEO.nbytes
            assert _resident_kib(client.kv.data_ptr()) * 1024 >= GEO.nbytes
            assert torch.equal(client.kv, data)
        finally:
            client.close()
        no = SharedPool.attach(owner.client_fd(writable=False), GEO, writable=False,
                               prefault=False)
        assert no.wait_prefault(0) and no.prefaulted == 0
        no.close()
    finally:
        owner.close()


@needs_populate
def test_a_staging_area_is_not_prefaulted_so_its_unused_slots_take_no_memory():
    """A file with holes (a staging area: `populate=False`) attached writable: prefaulting it
    would allocate every slot, where only those ever written take memory."""
    owner = SharedPool.create(GEO, populate=False)
    try:
        client = SharedPool.attach(owner.client_fd(), GEO)
        try:
            assert client.wait_prefault(10) and client.prefaulted == 0
            client.kv[0].fill_(1.0)                 # the slots written take memory
            assert 0 < os.fstat(owner.fd).st_blocks * 512 < GEO.nbytes
        finally:
            client.close()
    finally:
        owner.close()


@needs_populate
def test_writes_while_the_mapping_is_prefaulted_are_kept(monkeypatch):
    monkeypatch.setattr(shm, "PREFAULT_CHUNK", 4 * shm.PAGE)    # many small steps
    big = PoolGeometry(512, 2, 16, 2, 64, "float32")             # 16 MiB
    pool = SharedPool.create(big)
    try:
        for i in range(big.num_slots):                         # races the thread's chunks
            pool.kv[i].fill_(float(i))
        assert pool.wait_prefault(30)
        want = torch.arange(big.num_slots, dtype=torch.float32).view(-1, 1, 1, 1, 1, 1)
        assert torch.equal(pool.kv, want.expand(big.shape))
    finally:
        pool.close()


def test_a_close_meanwhile_stops_the_thread_without_a_fault(monkeypatch):
    monkeypatch.setattr(shm, "PREFAULT_CHUNK", shm.PAGE)
    big = PoolGeometry(1024, 2, 16, 2, 64, "float32")           # 32 MiB, 8,192 chunks
    pool = SharedPool.create(big)
    pool.close()                                                # likely mid-way
    assert pool.wait_prefault(30)
    assert pool.prefaulted <= big.nbytes and pool.prefault_error is None
    assert pool.fd is None
    with pytest.raises(RuntimeError, match="closed"):
        pool.retain()


class _Refusing:
    """A mapping whose madvise fails as a given kernel would."""

    def __init__(self, code: int) -> None:
        self.code = code

    def madvise(self, *args) -> None:
        raise OSError(self.code, os.strerror(self.code))

    def close(self) -> None:
        pass


def test_a_kernel_without_the_advice_is_logged_once_and_the_pool_works(monkeypatch, caplog):
    monkeypatch.setattr(shm, "_PREFAULT_UNSUPPORTED", [])
    pool = SharedPool.create(GEO, populate=False)
    real = pool._mmap
    try:
        pool._mmap = _Refusing(errno.EINVAL)
        with caplog.at_level(logging.INFO, logger="tiered_cache.wire.shm"):
            pool._run_prefault()
            pool._run_prefault()
        assert sum("cannot prefault" in r.getMessage() for r in caplog.records) == 1
        assert shm._PREFAULT_UNSUPPORTED and pool.prefault_error is None
        pool._mmap = real
        pool.start_prefault()                   # not tried again on this kernel
        assert pool._prefault is None
        pool.kv[0].fill_(1.0)
        assert float(pool.kv[0].sum()) == pool.kv[0].numel()
    finally:
        pool._mmap = real
        pool.close()


def test_another_error_is_logged_and_recorded(monkeypatch, caplog):
    monkeypatch.setattr(shm, "_PREFAULT_UNSUPPORTED", [])
    pool = SharedPool.create(GEO, populate=False)
    real = pool._mmap
    try:
        pool._mmap = _Refusing(errno.ENOMEM)
        with caplog.at_level(logging.WARNING, logger="tiered_cache.wire.shm"):
            t = threading.Thread(target=pool._run_prefault)
            t.start()
            t.join(10)
        assert pool.prefault_error is not None and "OSError" in pool.prefault_error
        assert any("prefaulting a shared pool stopped" in r.getMessage() for r in caplog.records)
        assert not shm._PREFAULT_UNSUPPORTED
    finally:
        pool._mmap = real
        pool.close()
