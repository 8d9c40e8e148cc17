"""Tensor parallelism through the connector's own API, two rank processes (tests/vllm_rank.py)
and the scheduler side here: each rank stores and loads its own heads; a block is a hit only
when every rank's part is there (a rank killed mid-store leaves no partial hit); a load that
fails on one rank drops the step's saves on every rank."""

from __future__ import annotations

import signal
import subprocess
import sys
from multiprocessing.connection import Listener
from pathlib import Path

import numpy as np
import pytest

from tests.vllm_harness import FakeRequest, geometry, local_link, node_config, tokens
from tests.vllm_rank import AUTHKEY
from tiered_cache.config import CacheConfig
from tiered_cache.daemon.service import NodeService
from tiered_cache.hashing import tenant_salt
from tiered_cache.integrations.vllm.identity import rank_salt
from tiered_cache.integrations.vllm.plans import WorkerReport
from tiered_cache.integrations.vllm.scheduler import Scheduled, SchedulerSide, StepInput
from tiered_cache.integrations.vllm.settings import ConnectorSettings

pytestmark = pytest.mark.slow     # a process per rank (tests/vllm_rank.py)

TP = 2
RANK = str(Path(__file__).resolve().parents[1] / "vllm_rank.py")


class Ranks:
    def __init__(self, sock: str, store: str, tmp: Path) -> None:
        address = str(tmp / "ranks.sock")
        listener = Listener(address, authkey=AUTHKEY)
        self.procs = [subprocess.Popen([sys.executable, RANK, address, str(r), str(TP), sock,
                                        store]) for r in range(TP)]
        self.conns = [None] * TP
        try:
            accepted = [listener.accept() for _ in range(TP)]
        finally:
            listener.close()
        for conn in accepted:
            assert conn.poll(120), "a rank did not start"
            hello = conn.recv()
            self.conns[hello[1]] = conn

    def step(self, plan, compute=None, check=None, die=None):
        for r, c in enumerate(self.conns):
            c.send((plan, compute, check, die.get(r) if die else None))
        out = []
        for r, c in enumerate(self.conns):
            if die and r in die:
                assert self.procs[r].wait(30) == -signal.SIGKILL
                continue
            assert c.poll(120), f"rank {r} did not answer"
            out.append(c.recv())
        return out

    def close(self):
        for c, p in zip(self.conns, self.procs):
            if p.poll() is None:
                c.send(None)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()


@pytest.fixture
def node(tmp_path):
    g = geometry(tp=TP)
    svc = NodeService(CacheConfig.from_dict(node_config(tmp_path, g))).start()
    sched = SchedulerSide(g, ConnectorSettings(), local_link(svc, g, attach=False))
    ranks = Ranks(str(tmp_path / "s" / "d.sock"), str(tmp_path / "gloo"), tmp_path)
    yield svc, sched, ranks
    ranks.close()
    sched.close()
    svc.stop(drain=False)


def prefill(sched, ranks, req, ids, *, die=None, check=True):
    """One step computing the prompt after what the lookup found (and loading that)."""
    matched, _ = sched.lookup(req, 0)
    sched.after_alloc(req, ids, matched)
    plan = sched.build_plan(StepInput([Scheduled(req.request_id, matched,
                                                 req.num_tokens - matched)]),
                            lambda rid: ids)
    out = ranks.step(plan, compute=(ids, req.all_token_ids, matched, req.num_tokens),
                     check=(ids, req.all_token_ids, 0, matched) if check and matched else None,
                     die=die)
    report = WorkerReport()
    for rep, _, _ in out:
        report = report.merge(rep)
    sched.on_report(report)
    return matched, out


def rank_blocks(svc, req, rank: int) -> int:
    """Leading blocks of rank `rank`'s part of the request that the daemon holds."""
    part = next(iter(svc.partitions.values()))
    root = part.root(tenant_salt(part.tenant.encode(), rank_salt(None, rank, TP)), None)
    return part.lookup(root, root, np.asarray(req.all_token_ids, np.int32))


def test_each_rank_serves_its_own_heads(node):
    svc, sched, ranks = node
    t = tokens(200, seed=1)
    prefill(sched, ranks, FakeRequest("a", t), list(range(1, 8)))
    assert rank_blocks(svc, FakeRequest("x", t), 0) == rank_blocks(svc, FakeRequest("x", t), 1)
    matched, out = prefill(sched, ranks, FakeRequest("b", t), list(range(10, 17)))
    assert matched == 192
    assert [ok for _, _, ok in out] == [True, True]       # each rank's own heads, exactly
    assert all(not errors for _, errors, _ in out)
    assert sched.held() == 0 and svc.stats(partitions=False)["handles"] == 0


def test_a_rank_killed_mid_store_leaves_no_partial_hit(node):
    svc, sched, ranks = node
    t = tokens(200, seed=2)
    req = FakeRequest("a", t)
    prefill(sched, ranks, req, list(range(1, 8)), die={1: 0})    # rank 1 dies after layer 0
    sched.finished(req)
    assert rank_blocks(svc, req, 0) == 12 and rank_blocks(svc, req, 1) == 0
    assert sched.lookup(FakeRequest("b", t), 0) == (0, False)
    assert sched.held() == 0


def test_a_load_failing_on_one_rank_drops_the_steps_saves_on_every_rank(node):
    svc, sched, ranks = node
    t = tokens(300, seed=3)
    first = FakeRequest("a", t[:200])
    prefill(sched, ranks, first, list(range(1, 8)))
    sched.finished(first)
    req = FakeRequest("b", t)
    matched, _ = sched.lookup(req, 0)
    assert matched == 192
    # Rank 1's part vanishes before its worker fetches it (the scheduler's hold notwithstanding,
    # e.g. an operator's invalidate): rank 1's load fails, rank 0's succeeds.
    part = next(iter(svc.partitions.values()))
    root1 = part.root(tenant_salt(part.tenant.encode(), rank_salt(None, 1, TP)), None)
    part.invalidate(root1, np.asarray(t[:192], np.int32))
    ids = list(range(10, 20))
    sched.after_alloc(req, ids, matched)
    plan = sched.build_plan(StepInput([Scheduled("b", matched, 300 - matched)]),
                            lambda rid: ids)
    out = ranks.step(plan, compute=(ids, t, matched, 300))
    errors = set().union(*(e for _, e, _ in out))
    assert errors == set(ids[:6])                         # vLLM recomputes from block 0
    report = out[0][0].merge(out[1][0])
    assert report.failed == {"b": 0}
    sched.on_report(report)
    # Neither rank published what it computed on top of the failed load.
    assert rank_blocks(svc, req, 0) == 12
    assert sched.reqs["b"].saved == 0 and sched.held() == 0
