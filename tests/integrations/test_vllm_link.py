"""The connector's link to the node service (integrations/vllm/link.py): the two transports,
the namespace check, reattaching after the daemon restarts, in-process clients reaped like
socket ones; and the scheduler side waiting (vLLM's None) for blocks coming up from disk."""

from __future__ import annotations

import numpy as np
import pytest

from tests.oracles import wait_for
from tests.vllm_harness import (
    FakeRequest,
    MiniEngine,
    geometry,
    local_link,
    node_config,
    socket_link,
    tokens,
)
from tiered_cache.config import CacheConfig
from tiered_cache.daemon.service import NodeService
from tiered_cache.integrations.vllm.scheduler import SchedulerSide
from tiered_cache.integrations.vllm.settings import ConnectorSettings


def service(tmp_path, g=None, **extra) -> NodeService:
    return NodeService(CacheConfig.from_dict(node_config(tmp_path, g or geometry(),
                                                         **extra))).start()


def test_a_daemon_of_another_geometry_is_refused_with_the_sections_it_needs(tmp_path):
    svc = service(tmp_path, geometry(block_size=32))
    try:
        link = socket_link(svc.config.daemon.socket, geometry(block_size=16), attach=True,
                           timeout_s=2.0, wait_s=0)
        assert not link.attached
        assert "block_size: 16" in link.last_error and "num_kv_heads" in link.last_error
        assert link.counters["attach_failures"] >= 1
        link.close()
    finally:
        svc.stop(drain=False)


def test_both_transports_reach_the_same_pool(tmp_path):
    g = geometry()
    svc = service(tmp_path)
    try:
        local = local_link(svc, g, attach=True)
        remote = socket_link(svc.config.daemon.socket, g, attach=True)
        assert local.attached and remote.attached and local.tenant == remote.tenant
        # One engine writes through the socket, another reads in process: the same blocks.
        writer = MiniEngine(g, remote, remote)
        t = tokens(200, seed=1)
        writer.serve(FakeRequest("a", t))
        reader = MiniEngine(g, local, local_link(svc, g, attach=True))
        served = reader.serve(FakeRequest("b", t))
        assert served.matched == 192 and served.loaded_ok
        writer.close()
        reader.close()
    finally:
        svc.stop(drain=False)


def test_an_in_process_client_closed_is_reaped_like_a_socket(tmp_path):
    g = geometry()
    svc = service(tmp_path)
    try:
        eng = MiniEngine(g, local_link(svc, g, False), local_link(svc, g, True))
        t = tokens(200, seed=2)
        eng.serve(FakeRequest("a", t))
        matched, _ = eng.sched.lookup(FakeRequest("b", t), 0)
        assert matched == 192 and svc.stats(partitions=False)["handles"] == 1
        eng.sched.link.close()                       # the scheduler side goes away holding it
        wait_for(lambda: svc.stats(partitions=False)["handles"] == 0, "reaped")
        assert svc.stats(partitions=False)["reaped_handles"] == 1
        eng.worker.close()
    finally:
        svc.stop(drain=False)


def test_the_link_reattaches_after_a_daemon_restart(tmp_path):
    g = geometry()
    svc = service(tmp_path)
    path = svc.config.daemon.socket
    link = socket_link(path, g, attach=False, timeout_s=2.0)
    sched = SchedulerSide(g, ConnectorSettings(lookup_deadline_ms=200), link)
    try:
        t = tokens(200, seed=3)
        eng = MiniEngine(g, socket_link(path, g, False), socket_link(path, g, True))
        eng.serve(FakeRequest("a", t))
        assert sched.lookup(FakeRequest("b", t), 0)[0] == 192
        gen = link.generation
        svc.stop(drain=False)
        eng.close()
        assert sched.lookup(FakeRequest("c", t), 0) == (0, False)   # away: a miss
        svc = service(tmp_path)
        wait_for(lambda: link.attached and link.generation > gen, "reattached", timeout=30)
        sched.finished(FakeRequest("b", t))          # a hold of the old connection: not sent
        assert sched.counters["lost_holds"] == 1
        assert sched.lookup(FakeRequest("d", t), 0) == (0, False)   # a new, empty daemon
    finally:
        sched.close()
        link.close()
        svc.stop(drain=False)


class StubLink:
    """A link whose fetch finds nothing pinned but whose lookup counts blocks (they are on
    disk, coming up)."""

    attached = True
    generation = 1
    staging_slots = 0

    def __init__(self, peek: int) -> None:
        self.peek = peek
        self.calls: list[str] = []

    def root(self, salt, adapter, timeout_s=None):
        return b"r" * 16, 1

    def call(self, op, timeout_s=None, **fields):
        self.calls.append(op)
        if op == "fetch":
            return {"handle": 0, "slots": []}, 1
        if op == "lookup":
            return {"blocks": self.peek}, 1
        return {}, 1

    def stats(self):
        return {}


@pytest.mark.parametrize("peek", [0, 6])
def test_blocks_coming_up_from_disk_are_asked_again_until_the_wait_runs_out(peek):
    now = [0.0]
    sched = SchedulerSide(geometry(), ConnectorSettings(promote_wait_ms=100), StubLink(peek),
                          clock=lambda: now[0])
    req = FakeRequest("a", tokens(200))
    if peek:
        assert sched.lookup(req, 0) == (None, False)
        now[0] = 0.05
        assert sched.lookup(req, 0) == (None, False)
        now[0] = 0.2                                  # past promote_wait_ms: served as is
    assert sched.lookup(req, 0) == (0, False)
    assert sched.counters["promotion_waits"] == (2 if peek else 0)
    assert np.all([c in ("fetch", "lookup") for c in sched.link.calls])
