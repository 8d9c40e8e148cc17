"""The vLLM connector's scheduler and worker sides against a real node service (no vLLM):
hits with the loaded KV checked byte for byte, every way a request ends releasing its holds,
failed loads reported to vLLM (and their step's saves dropped), the lookup deadline, requests
whose KV is not a function of their token ids, sub-blocks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import numpy as np
import pytest
import yaml

from tests.oracles import wait_for
from tests.vllm_harness import (
    FakeLora,
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
from tiered_cache.integrations.vllm.scheduler import Scheduled, SchedulerSide
from tiered_cache.integrations.vllm.settings import ConnectorSettings


@pytest.fixture
def service(tmp_path):
    svc = NodeService(CacheConfig.from_dict(node_config(tmp_path, geometry()))).start()
    yield svc
    svc.stop(drain=False)


@pytest.fixture
def engine(service):
    g = geometry()
    eng = MiniEngine(g, local_link(service, g, attach=False), local_link(service, g, True))
    yield eng
    eng.close()


def handles(service) -> int:
    return service.stats(partitions=False)["handles"]


def test_a_prompt_computed_once_is_served_with_its_exact_kv(engine, service):
    req = FakeRequest("a", tokens(200))
    first = engine.serve(req)
    assert first.matched == 0
    again = FakeRequest("b", list(req.all_token_ids))
    second = engine.serve(again)
    assert second.matched == 192                     # 6 vLLM blocks; the last token computed
    assert second.loaded_ok and not second.errors
    assert handles(service) == 0
    s = engine.sched.stats()
    assert s["loaded_tokens"] == 192 and s["holds_now"] == 0


def test_past_vllms_own_hit_only_the_rest_is_loaded(engine):
    req = FakeRequest("a", tokens(200, seed=1))
    engine.serve(req)
    served = engine.serve(FakeRequest("b", list(req.all_token_ids)), local_hit=64)
    assert served.matched == 128 and served.loaded_ok


def test_blocks_vllm_had_but_the_daemon_lacks_are_saved_again(engine, service):
    """vLLM's own prefix hit covers blocks the daemon has not got (another engine computed
    them, or the daemon restarted): they are published with the new ones."""
    req = FakeRequest("a", tokens(200, seed=2))
    served = engine.serve(req, local_hit=96)
    assert served.matched == 0
    again = engine.serve(FakeRequest("b", list(req.all_token_ids)))
    assert again.matched == 192 and again.loaded_ok


def test_salts_adapters_and_multimodal_requests_do_not_share(engine):
    t = tokens(200, seed=3)
    engine.serve(FakeRequest("a", t, cache_salt="red"))
    assert engine.serve(FakeRequest("b", t, cache_salt="blue")).matched == 0
    assert engine.serve(FakeRequest("c", t)).matched == 0
    assert engine.serve(FakeRequest("d", t, cache_salt="red")).matched == 192
    engine.serve(FakeRequest("e", t, lora_request=FakeLora("sql")))
    assert engine.serve(FakeRequest("f", t, lora_request=FakeLora("sql"))).matched == 192
    assert engine.serve(FakeRequest("g", t, lora_request=FakeLora("chat"))).matched == 0
    mm = FakeRequest("h", t, mm_features=["image"])
    assert engine.serve(mm).matched == 0
    assert engine.sched.counters["not_reusable"] == 1


# ------------------------------------------------------------------------------- holds

def looked_up(engine, service, seed: int) -> FakeRequest:
    t = tokens(200, seed=seed)
    engine.serve(FakeRequest(f"w{seed}", t))
    req = FakeRequest(f"r{seed}", list(t))
    matched, _ = engine.sched.lookup(req, 0)
    assert matched == 192 and handles(service) == 1
    return req


def test_holds_released_when_the_request_is_aborted_before_it_was_scheduled(engine, service):
    req = looked_up(engine, service, 10)
    engine.sched.finished(req)                       # request_finished, never allocated
    assert handles(service) == 0 and engine.sched.held() == 0


def test_holds_released_when_vllm_allocates_no_load(engine, service):
    req = looked_up(engine, service, 11)
    engine.sched.after_alloc(req, [1, 2, 3, 4, 5, 6, 7], 0)
    assert handles(service) == 0


def test_holds_released_when_the_lookup_is_asked_again(engine, service):
    """A request that could not be scheduled is looked up again next step (or after a
    preemption): the old hold goes, one new one is taken."""
    req = looked_up(engine, service, 12)
    engine.sched.lookup(req, 0)
    assert handles(service) == 1
    engine.sched.finished(req)
    assert handles(service) == 0


def test_holds_released_when_the_request_is_preempted(engine, service):
    req = looked_up(engine, service, 13)
    ids = engine.kv.allocate(7)
    engine.blocks[req.request_id] = ids
    engine.sched.after_alloc(req, ids, 192)
    engine.step([])                                  # loads planned (the request waits)
    engine.sched.reqs[req.request_id].fresh = False
    engine.step([], preempted={req.request_id})
    assert handles(service) == 0 and req.request_id not in engine.sched.reqs
    assert req.request_id not in engine.worker.reqs  # the workers forgot it too


def test_holds_released_when_the_load_completes(engine, service):
    req = looked_up(engine, service, 14)
    ids = engine.kv.allocate(7)
    engine.blocks[req.request_id] = ids
    engine.sched.after_alloc(req, ids, 192)
    engine.step([Scheduled(req.request_id, 192, 8)])
    assert handles(service) == 0
    assert engine.kv.check(ids, req.all_token_ids, 0, 192)
    engine.finish(req)


def test_holds_released_when_the_load_fails_and_vllm_recomputes(engine, service):
    req = looked_up(engine, service, 15)
    ids = engine.kv.allocate(7)
    engine.blocks[req.request_id] = ids
    engine.sched.after_alloc(req, ids, 192)

    # The worker's own fetch finds nothing: the daemon dropped the prefix meanwhile.
    part = next(iter(service.partitions.values()))
    root = next(iter(part._roots))
    part.invalidate(root, np.asarray(req.all_token_ids[:192], "int32"))
    engine.step([Scheduled(req.request_id, 192, 8)])
    assert engine.last_errors == set(ids[:6])        # every loaded vLLM block: recompute
    assert handles(service) == 0
    assert engine.sched.reqs[req.request_id].saved == 0
    engine.finish(req)


def test_no_handle_outlives_a_mixed_workload(engine, service):
    for i in range(6):
        t = tokens(100 + 40 * i, seed=20 + i % 3)
        engine.serve(FakeRequest(f"m{i}", t))
    assert handles(service) == 0 and engine.sched.held() == 0


# ------------------------------------------------------------------------------- failures

def test_a_void_copy_is_a_load_error_and_its_steps_saves_are_dropped(engine, service):
    """The worker's handle found not held at release (its lease was reaped under the copy):
    the copied KV cannot be trusted. vLLM gets the blocks as load errors, and what the step
    computed after them is not published."""
    t = tokens(300, seed=30)
    engine.serve(FakeRequest("w", t[:200]))
    req = FakeRequest("r", t)

    def reap(worker):
        link = worker.link
        transport = link._transport
        service.leases.close(transport.peer.client)      # the daemon reaps this client
        wait_for(lambda: not service.stats(partitions=False)["handles"] > 1, "reaped")

    served = engine.serve(req, hook=reap)
    assert served.matched == 192
    assert served.errors == set(served.blocks[:6])
    assert engine.worker.counters["void_copies"] == 1
    assert engine.worker.counters["dropped_saves"] >= 1
    # Nothing of r's step was published: its blocks past the first 200 tokens are absent.
    fresh = FakeRequest("x", t)
    assert engine.sched.lookup(fresh, 0)[0] == 192
    engine.sched.finished(fresh)


def test_a_daemon_lost_under_a_save_copy_unmaps_the_staging_area_after_it(engine, monkeypatch):
    """The link drops its staging area (daemon lost) on its own thread while a layer's save
    copy writes into it: the mapping lasts until the copy ends (an unmap under it was a
    SIGSEGV of the copy thread), and nothing of the step is published."""
    worker = engine.worker
    copy = worker._copy_out_retained
    entered, resume = threading.Event(), threading.Event()
    seen: list[bool] = []
    staged = []

    def held_copy(saves, layer):
        entered.set()
        assert resume.wait(10)
        staged.append(worker._staging)
        seen.append(worker._staging._mmap is not None)     # closed, still mapped
        copy(saves, layer)

    def lose(w):
        def drop():
            entered.wait(10)
            link = w.link
            link._lost(link._transport, ConnectionError("test: the daemon went away"))
            resume.set()

        threading.Thread(target=drop, daemon=True).start()

    monkeypatch.setattr(worker, "_copy_out_retained", held_copy)
    t = tokens(200, seed=31)
    engine.serve(FakeRequest("a", t), hook=lose)
    assert seen and all(seen)
    assert staged[0]._mmap is None                     # unmapped once the copies ended
    wait_for(lambda: engine.sched.link.attached and worker.link.attached, "links back")
    fresh = FakeRequest("b", t)
    assert engine.sched.lookup(fresh, 0)[0] == 0
    engine.sched.finished(fresh)


def test_a_daemon_gone_is_a_miss_at_once(tmp_path):
    """An external daemon that is not running: lookups miss without waiting."""
    g = geometry()
    link = socket_link(str(tmp_path / "nobody.sock"), g, attach=False, timeout_s=0.2, wait_s=0)
    sched = SchedulerSide(g, ConnectorSettings(lookup_deadline_ms=5), link)
    assert sched.lookup(FakeRequest("a", tokens(200)), 0) == (0, False)
    assert sched.counters["daemon_away"] == 1
    link.close()


@pytest.mark.slow
def test_a_stalled_daemon_costs_the_lookup_its_deadline_then_a_miss(tmp_path):
    """A daemon that stops answering (SIGSTOP) mid-run: the lookup gives up at its deadline
    (the connection is then dropped and re-made in the background) and the request is a miss;
    once the daemon is back, lookups hit again."""
    g = geometry()
    cfg = node_config(tmp_path, g)
    path = tmp_path / "daemon.yaml"
    path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.Popen([sys.executable, "-m", "tiered_cache", "serve", "--config",
                             str(path)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True)
    eng = None
    try:
        assert proc.stdout.readline().startswith("READY")
        sock = cfg["daemon"]["socket"]
        eng = MiniEngine(g, socket_link(sock, g, attach=False),
                         socket_link(sock, g, attach=True),
                         settings=ConnectorSettings(lookup_deadline_ms=50))
        t = tokens(200, seed=40)
        eng.serve(FakeRequest("a", t))
        assert eng.serve(FakeRequest("b", t)).matched == 192
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            # NOTE: the signal lands when the kernel next schedules the daemon; until its state
            # says stopped it may still answer.
            wait_for(lambda: stopped(proc.pid), "the daemon stopped")
            assert eng.sched.lookup(FakeRequest("c", t), 0) == (0, False)
            assert eng.sched.counters["daemon_away"] + eng.sched.counters[
                "deadline_misses"] >= 1
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        wait_for(lambda: eng.sched.link.attached, "scheduler link back", timeout=30)
        wait_for(lambda: eng.sched.lookup(FakeRequest("d", t), 0)[0] == 192, "hits again",
                 timeout=30)
        eng.sched.finished(FakeRequest("d", t))
    finally:
        if eng is not None:
            eng.close()
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        proc.stdout.close()


def stopped(pid: int) -> bool:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


# ------------------------------------------------------------------------------- geometry

def test_sub_blocks_vllm_block_of_four(service, tmp_path):
    """tiered-cache blocks of 8 tokens under vLLM blocks of 32."""
    g = geometry(block_size=8, vllm_block_size=32)
    svc = NodeService(CacheConfig.from_dict(node_config(tmp_path / "n8", g, 256))).start()
    try:
        eng = MiniEngine(g, local_link(svc, g, False), local_link(svc, g, True))
        t = tokens(150, seed=50)
        eng.serve(FakeRequest("a", t))
        served = eng.serve(FakeRequest("b", t))
        assert served.matched == 128 and served.loaded_ok
        eng.close()
    finally:
        svc.stop(drain=False)


def test_saves_spread_over_steps_when_the_staging_area_is_small(tmp_path):
    g = geometry()
    cfg = node_config(tmp_path, g)
    cfg["daemon"]["staging_blocks"] = 4
    svc = NodeService(CacheConfig.from_dict(cfg)).start()
    try:
        eng = MiniEngine(g, local_link(svc, g, False), local_link(svc, g, True))
        t = tokens(330, seed=60)
        req = FakeRequest("a", t)
        eng.serve(req, finish=False)                 # 20 blocks to save, 4 per step
        st = eng.sched.reqs["a"]
        assert st.saved == 4
        while st.saved < 20:
            eng.step([Scheduled("a", 330, 0)])
        eng.finish(req)
        assert eng.serve(FakeRequest("b", t)).matched == 320
        eng.close()
    finally:
        svc.stop(drain=False)


def test_lookup_never_offers_the_last_token(engine):
    t = tokens(192, seed=70)                         # exactly 6 vLLM blocks
    engine.serve(FakeRequest("a", t))
    assert engine.serve(FakeRequest("b", t)).matched == 160


def test_a_bug_in_the_service_during_a_load_is_a_load_error_not_a_crash(engine, service,
                                                                          monkeypatch):
    t = tokens(200, seed=80)
    engine.serve(FakeRequest("a", t))
    real = service.handle
    worker_peer = engine.worker._link(False)._transport.peer

    def broken(peer, req):
        if peer == worker_peer and req.op == "fetch":
            raise KeyError("a handler bug")
        return real(peer, req)

    monkeypatch.setattr(service, "handle", broken)
    served = engine.serve(FakeRequest("b", t))
    assert served.matched == 192 and served.errors == set(served.blocks[:6])
    assert engine.worker.link.counters["errors"] == 1
    assert handles(service) == 0
