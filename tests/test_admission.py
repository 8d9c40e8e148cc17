"""Memory admission (tiered_cache/admission.py): every tier is checked against what the machine
can give before anything is allocated; a config that asks for more is refused with a typed
ConfigError naming the key and the numbers, unless `overcommit` lists the tier.

The machine's free memory and disk space are replaced by small fakes (psutil, the filesystem's
free bytes), so the refusals are exercised with pools of a few MiB: nothing here allocates what
this machine cannot give, even on code without the check.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from tiered_cache import CacheConfig, TieredKVCache, sizing
from tiered_cache.errors import ConfigError
from tiered_cache.sizing import MiB
from tiered_cache.tiers.disk import pool_dir

ROOT = Path(__file__).resolve().parent.parent

# 2 layers x K,V x 16 tokens x 2 heads x 16 x float32 = 8 KiB per block
MODEL = {"name": "adm", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "num_q_heads": 4,
         "dtype": "float32"}
BLOCK = 8 * 1024


def config(_top: dict | None = None, **tiers) -> CacheConfig:
    base = {"gpu": {"device": "cpu", "num_blocks": 16}, "host": {"num_blocks": 0}, **tiers}
    return CacheConfig.from_dict({"model": MODEL, "block_size": 16, "tiers": base,
                                  "migrator": {"enabled": False},
                                  "compactor": {"enabled": False}, **(_top or {})})


@pytest.fixture
def ram(monkeypatch):
    """Fake available RAM: set `ram.available` (psutil's other fields stay real)."""
    state = SimpleNamespace(available=1 << 40)
    real = psutil.virtual_memory

    def fake():
        return real()._replace(available=state.available)

    monkeypatch.setattr(psutil, "virtual_memory", fake)
    return state


@pytest.fixture
def no_pools(monkeypatch):
    """Fail the test if any pool is allocated."""
    from tiered_cache.data import pools

    def refuse(*a, **k):
        raise AssertionError("a pool was allocated before the admission check refused")

    monkeypatch.setattr(pools, "make_pool", refuse)


def refused(exc_info) -> ConfigError:
    exc = exc_info.value
    assert type(exc).__name__ == "InsufficientMemoryError", type(exc)
    assert isinstance(exc, ConfigError)
    return exc


# ---------------------------------------------------------------------------- engine tiers

def test_device_tier_in_cpu_memory_beyond_ram_is_refused(ram, no_pools):
    ram.available = 4 * MiB
    cfg = config(gpu={"device": "cpu", "num_blocks": 1024})        # 8 MiB
    with pytest.raises(ConfigError) as info:
        TieredKVCache(cfg)
    exc = refused(info)
    assert exc.path == "tiers.gpu.num_blocks"
    msg = str(exc)
    assert "8.00 MiB" in msg and "4.00 MiB" in msg and "host memory" in msg
    assert "CPU memory" in msg and "overcommit" in msg


def test_forty_gib_device_tier_without_cuda_is_refused_before_allocating(no_pools):
    """The issue's case, with the real free memory: `capacity: 40GiB` on a machine without
    CUDA (the device tier then lives in CPU memory)."""
    import torch

    if torch.cuda.is_available() or psutil.virtual_memory().available > 48 * 1024**3:
        pytest.skip("this machine can give 40 GiB to the device tier")
    cfg = CacheConfig.from_dict({"model": MODEL, "tiers": {"gpu": {"capacity": "40GiB"},
                                                           "host": {"num_blocks": 0}}})
    with pytest.raises(ConfigError) as info:
        TieredKVCache(cfg)
    exc = refused(info)
    assert exc.path == "tiers.gpu.capacity" and "40.00 GiB" in str(exc)


@pytest.mark.parametrize("memory", ["pageable", "pinned"])
def test_host_tier_beyond_ram_is_refused(ram, no_pools, memory):
    ram.available = 6 * MiB
    cfg = config(host={"capacity": "16MiB", "memory": memory})
    with pytest.raises(ConfigError) as info:
        TieredKVCache(cfg)
    exc = refused(info)
    # the device tier (CPU memory here) draws on the same RAM: both keys are named
    assert exc.path == "tiers.gpu.num_blocks, tiers.host.capacity"
    assert "16.00 MiB" in str(exc) and "6.00 MiB" in str(exc) and memory in str(exc)


def test_device_and_host_tiers_in_ram_add_up(ram, no_pools):
    """Each fits alone; together they do not (both live in RAM without CUDA)."""
    ram.available = 12 * MiB
    cfg = config(gpu={"device": "cpu", "num_blocks": 1024}, host={"num_blocks": 1024})
    with pytest.raises(ConfigError) as info:
        TieredKVCache(cfg)
    exc = refused(info)
    assert exc.path == "tiers.gpu.num_blocks, tiers.host.num_blocks"
    assert "16.00 MiB" in str(exc) and "12.00 MiB" in str(exc)


def test_percent_capacities_that_add_past_the_free_memory_are_refused(ram, no_pools):
    ram.available = 8 * MiB
    cfg = config(gpu={"device": "cpu", "capacity": "70%"}, host={"capacity": "70%"})
    with pytest.raises(ConfigError) as info:
        TieredKVCache(cfg)
    assert refused(info).path == "tiers.gpu.capacity, tiers.host.capacity"


def test_overcommit_lets_the_listed_tiers_through(ram, caplog):
    ram.available = 1 * MiB
    cfg = config(gpu={"device": "cpu", "num_blocks": 256}, host={"num_blocks": 256},
                 _top={"overcommit": ["gpu", "host"]})
    with caplog.at_level(logging.WARNING, logger="tiered_cache.admission"):
        cache = TieredKVCache(cfg)
    cache.shutdown()
    assert "overcommit" in caplog.text and "tiers.gpu.num_blocks" in caplog.text
    # Overcommitting one tier does not excuse the other.
    cfg = config(gpu={"device": "cpu", "num_blocks": 256}, host={"num_blocks": 256},
                 _top={"overcommit": ["host"]})
    with pytest.raises(ConfigError) as info:
        TieredKVCache(cfg)
    assert refused(info).path == "tiers.gpu.num_blocks"


@pytest.mark.parametrize("bad", ["gpu", ["gpu", "gpu"], ["ram"], [1], None, True])
def test_overcommit_is_a_list_of_tier_names(bad):
    with pytest.raises(ConfigError) as info:
        config(_top={"overcommit": bad})
    assert info.value.path == "overcommit"


def test_what_fits_still_starts(ram):
    ram.available = 64 * MiB
    cache = TieredKVCache(config(gpu={"device": "cpu", "num_blocks": 1024},
                                 host={"num_blocks": 1024}))
    assert cache.stats()["tiers"]["gpu"]["capacity_blocks"] == 1024
    cache.shutdown()


def test_storage_none_allocates_nothing_and_is_not_checked(ram):
    ram.available = 0
    cfg = CacheConfig.from_dict({"model": MODEL, "storage": "none",
                                 "tiers": {"gpu": {"device": "cpu", "num_blocks": 1 << 20},
                                           "host": {"num_blocks": 1 << 20}}})
    TieredKVCache(cfg).shutdown()


# ---------------------------------------------------------------------------- disk tier

@pytest.fixture
def small_disk(monkeypatch):
    """A filesystem of `small_disk.size` bytes under a temp dir: its free space is that minus
    what the files under it take (the real filesystem's own check sees the same)."""
    root = Path(tempfile.mkdtemp(prefix="tc-adm-"))
    state = SimpleNamespace(size=8 * MiB, root=root)

    def used() -> int:
        return sum(p.stat().st_blocks * 512 for p in root.rglob("*") if p.is_file())

    def free() -> int:
        return max(0, state.size - used())

    real_usage = shutil.disk_usage

    def disk_usage(path):
        if str(path).startswith(str(root)):
            return SimpleNamespace(total=state.size, used=used(), free=free())
        return real_usage(path)

    from tiered_cache.data import disk as disk_mod

    real_free = disk_mod.free_bytes
    monkeypatch.setattr(shutil, "disk_usage", disk_usage)
    monkeypatch.setattr(disk_mod, "free_bytes",
                        lambda p: free() if str(p).startswith(str(root)) else real_free(p))
    yield state
    shutil.rmtree(root, ignore_errors=True)


def disk_config(path: Path, capacity: str, **top) -> CacheConfig:
    return CacheConfig.from_dict({
        "model": MODEL, "block_size": 16,
        "tiers": {"gpu": {"device": "cpu", "num_blocks": 8}, "host": {"num_blocks": 16},
                  "disk": {"path": str(path), "capacity": capacity}},
        "migrator": {"enabled": True}, "compactor": {"enabled": False}, **top})


def test_disk_capacity_percent_is_sized_by_the_slot_footprint(small_disk):
    """`capacity: "80%"`: the tier takes 80% of the free space, counted in on-disk slots
    (4 KiB header area + the payload rounded to 4 KiB: 12 KiB for an 8 KiB block), so it
    starts. Sized by KV bytes it asked for 120% of the free space and refused to start."""
    cfg = disk_config(small_disk.root / "d", "80%")
    footprint = sizing.tier_slot_bytes(cfg, "disk")
    assert footprint == 4096 + BLOCK
    cache = TieredKVCache(cfg)
    try:
        n = cache.stats()["tiers"]["disk"]["capacity_blocks"]
        assert n == int(0.8 * small_disk.size) // footprint
    finally:
        cache.shutdown()
    # A restart finds the room its own files take: same size, nothing cut off.
    cache = TieredKVCache(cfg)
    try:
        assert cache.stats()["tiers"]["disk"]["capacity_blocks"] == n
    finally:
        cache.shutdown()


def test_disk_byte_capacity_is_sized_by_the_slot_footprint(small_disk):
    cfg = disk_config(small_disk.root / "d", "6MiB")
    cache = TieredKVCache(cfg)
    try:
        n = cache.stats()["tiers"]["disk"]["capacity_blocks"]
        assert n == 6 * MiB // (4096 + BLOCK)
        held = sizing.held_bytes(pool_dir(cfg))
        # the slots, plus the superblock and the lock file
        assert n * (4096 + BLOCK) <= held <= n * (4096 + BLOCK) + 64 * 1024
    finally:
        cache.shutdown()


def test_disk_tier_beyond_free_space_is_refused(small_disk, no_pools):
    cfg = disk_config(small_disk.root / "d", "16MiB")
    with pytest.raises(ConfigError) as info:
        TieredKVCache(cfg)
    exc = refused(info)
    assert exc.path == "tiers.disk.capacity"
    assert "disk space" in str(exc) and "8.00 MiB" in str(exc)
    assert not (small_disk.root / "d").exists()


def test_planner_counts_disk_slots_by_their_footprint():
    from tiered_cache.tools import planner

    with tempfile.TemporaryDirectory() as tmp:
        cfg = disk_config(Path(tmp), "12MiB")
        plan = planner.make_plan(cfg)
    disk = plan.tiers[-1]
    assert disk.name == "disk" and disk.num_blocks == 12 * MiB // (4096 + BLOCK)
    assert disk.bytes == disk.num_blocks * (4096 + BLOCK) <= 12 * MiB


# ---------------------------------------------------------------------------- the daemon

def daemon_config(tmp: Path, host_blocks: int, tenants: dict | None = None,
                  disk: dict | None = None, **top) -> CacheConfig:
    tiers = {"gpu": {"device": "cpu", "num_blocks": 8}, "host": {"num_blocks": host_blocks}}
    if disk:
        tiers["disk"] = disk
    return CacheConfig.from_dict({
        "model": MODEL, "block_size": 16, "tiers": tiers,
        "daemon": {"socket": str(tmp / "d.sock"), "tenants": tenants or {}}, **top})


@pytest.fixture
def short_tmp():
    d = Path(tempfile.mkdtemp(prefix="tc-adm-"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_daemon_refuses_at_start_what_its_tenant_pools_add_up_to(ram, short_tmp, monkeypatch):
    """Two configured tenants of 8 MiB pools each (plus the daemon's own uid): 24 MiB asked,
    20 MiB available; refused before the first pool is created."""
    from tiered_cache.daemon.service import NodeService
    from tiered_cache.wire import shm

    created = []
    real_create = shm.SharedPool.create
    monkeypatch.setattr(shm.SharedPool, "create", classmethod(
        lambda cls, *a, **k: created.append(1) or real_create.__func__(cls, *a, **k)))
    ram.available = 20 * MiB
    cfg = daemon_config(short_tmp, 1024, {"uid:4000001": "a", "uid:4000002": "b"})
    with pytest.raises(ConfigError) as info:
        NodeService(cfg)
    exc = refused(info)
    assert exc.path == "tiers.host.num_blocks"
    assert "24.00 MiB" in str(exc) and "20.00 MiB" in str(exc)
    assert "3 tenant partitions" in str(exc)
    assert created == []


def test_shipped_daemon_config_is_refused_on_a_small_machine(short_tmp):
    """configs/daemon.yaml asks 480 GiB per tenant: on this machine the daemon says so."""
    if psutil.virtual_memory().available > 500 * 1024**3:
        pytest.skip("this machine has the memory")
    from tiered_cache.daemon.service import NodeService

    cfg = CacheConfig.from_yaml(ROOT / "configs" / "daemon.yaml")
    cfg.daemon.socket = str(short_tmp / "d.sock")
    with pytest.raises(ConfigError) as info:
        NodeService(cfg)
    exc = refused(info)
    assert exc.path == "tiers.host.capacity" and "480.00 GiB" in str(exc)


def test_a_new_partition_is_checked_counting_those_that_exist(ram, short_tmp):
    from tiered_cache.daemon.service import NodeService

    ram.available = 64 * MiB
    service = NodeService(daemon_config(short_tmp, 1024))       # 8 MiB, the own uid's
    try:
        assert len(service.partitions) == 1
        ram.available = 4 * MiB                                 # what is left after it
        with pytest.raises(ConfigError) as info:
            service.partition("late")
        exc = refused(info)
        assert "1 partition already hold 8.00 MiB" in str(exc)
        assert "late" in str(exc) and "late" not in service.partitions
    finally:
        service.stop(drain=False)


def test_daemon_disk_per_tenant_is_checked_against_the_filesystem(small_disk, ram):
    from tiered_cache.daemon.service import NodeService

    ram.available = 1 << 34
    disk = {"path": str(small_disk.root / "disk"), "capacity": "5MiB"}
    cfg = daemon_config(small_disk.root, 64, {"uid:4000001": "a"}, disk=disk)
    with pytest.raises(ConfigError) as info:               # 2 tenants x 5 MiB > 8 MiB
        NodeService(cfg)
    exc = refused(info)
    assert exc.path == "tiers.disk.capacity" and "disk space" in str(exc)
    ok = daemon_config(small_disk.root, 64, {"uid:4000001": "a"}, disk=disk,
                       overcommit=["disk"])
    assert sizing.tier_num_blocks(ok, "disk") == 5 * MiB // (4096 + BLOCK)
    assert os.path.exists(small_disk.root)


def test_daemon_partition_disk_percent_keeps_its_size_across_restarts(small_disk, ram):
    """A partition's `"80%"` disk tier counts its own directory's files as room on restart
    (they live under <path>/<tenant>/), so it neither shrinks nor cuts records off."""
    from tiered_cache.daemon.partition import Partition

    ram.available = 1 << 34
    disk = {"path": str(small_disk.root / "disk"), "capacity": "80%"}
    cfg = daemon_config(small_disk.root, 64, disk=disk)
    sizes = []
    for _ in range(2):
        part = Partition("t", cfg)
        try:
            sizes.append(part.stats()["tiers"]["disk"]["capacity_blocks"])
        finally:
            part.close(drain=False)
    assert sizes[0] == sizes[1] == int(0.8 * small_disk.size) // (4096 + BLOCK)
