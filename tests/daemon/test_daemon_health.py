"""The daemon's health: a partition whose index is torn (it refuses every request, so it serves
no wrong KV but no KV at all) makes `/health` fail and `up` read 0, naming the tenant, so that
a supervisor restarts the daemon instead of keeping a daemon that only answers errors."""

from __future__ import annotations

import os

import pytest

from tiered_cache.config import CacheConfig
from tiered_cache.core import atomic
from tiered_cache.daemon.observe import DaemonCollector
from tiered_cache.daemon.service import NodeService
from tiered_cache.errors import CacheBrokenError


@pytest.fixture
def service(tmp_path):
    cfg = {"model": {"name": "health", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
                     "dtype": "float32"},
           "block_size": 4, "tiers": {"host": {"num_blocks": 16}},
           "daemon": {"socket": os.path.join(tmp_path, "d.sock")}}
    svc = NodeService(CacheConfig.from_dict(cfg)).start()
    yield svc
    svc.stop(drain=False)


def _up(svc) -> float:
    fam = next(f for f in DaemonCollector(svc).collect() if f.name.endswith("daemon_up"))
    return fam.samples[0].value


@pytest.mark.parametrize("exc", [KeyboardInterrupt, MemoryError])
def test_a_torn_partition_makes_the_daemon_unhealthy(service, exc):
    assert service.healthy() == (True, "ok") and _up(service) == 1.0
    part = next(iter(service.partitions.values()))
    with pytest.raises(exc):
        with atomic.atomic():
            raise exc()                 # as if it landed mid-mutation
    ok, why = service.healthy()
    assert not ok and part.tenant in why and exc.__name__ in why and "restart" in why
    assert _up(service) == 0.0
    with pytest.raises(CacheBrokenError):
        part.index.open([1, 2, 3, 4])   # and it refuses: a miss for every engine
