"""tiered-cache as a vLLM secondary tier (tiered_cache.integrations.vllm_secondary) beneath
vLLM's CPU offloading pool: first the tier's six-method interface on its own (vLLM's own job and
request types, a real memoryview, a real disk and redis-server), then the real vLLM engine (the
CPU build, tests/vllm/secondary_run.py with the test-only CPU spec of cpu_tiering_spec.py): what
vLLM's CPU pool no longer holds comes back from our tier with identical greedy tokens, a
corrupted record is recomputed, noise under valid records changes the tokens (so the
comparisons can fail), and a second engine process is served, through Redis and through the
node daemon, what the first one stored."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import LookupResult, ReqContext  # noqa: E402
from vllm.v1.kv_offload.tiering.base import TransferJob  # noqa: E402

from tests import redis_servers as rs  # noqa: E402
from tiered_cache.errors import ConfigError  # noqa: E402
from tiered_cache.integrations.vllm_secondary import TieredCacheTier  # noqa: E402

HERE = Path(__file__).parent
RUN = str(HERE / "secondary_run.py")
REPO = HERE.parent.parent
CHUNK = 8192
N = 16


def spec() -> SimpleNamespace:
    """What the tier reads of vLLM's OffloadingSpec (its `config` and `replicated_layout`)."""
    group = SimpleNamespace(group_id=0, tokens_per_block=16, layer_names=("l0", "l1"))
    config = SimpleNamespace(
        groups=(group,), worker_kv_bytes_per_block=CHUNK, kv_cache_layout="NHD",
        canonical_layout=False, model=SimpleNamespace(name="tiny", dtype="float32"),
        cache=SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, world_size=1))
    return SimpleNamespace(config=config, replicated_layout=False)


def primary() -> tuple[np.ndarray, memoryview]:
    rows = np.zeros((N, CHUNK), dtype=np.uint8)
    return rows, memoryview(rows)


def job(job_id: int, keys: list[bytes], chunks: list[int], promotion: bool) -> TransferJob:
    return TransferJob(job_id=job_id, keys=keys, chunk_ids=np.array(chunks, np.int32),
                       is_promotion=promotion, req_context=ReqContext(req_id="r"))


def finish(tier: TieredCacheTier, n: int) -> list:
    out: list = []
    deadline = time.monotonic() + 30
    while len(out) < n and time.monotonic() < deadline:
        tier.drain_jobs()
        out.extend(tier.get_finished_jobs())
    return out


def test_store_lookup_load_through_the_tiers_interface(tmp_path):
    rows, view = primary()
    tier = TieredCacheTier(spec(), view, "TieredCacheTier",
                           config={"tiers": {"disk": {"path": str(tmp_path), "num_blocks": 8}}})
    ctx = ReqContext(req_id="r")
    rows[:4] = np.random.default_rng(0).integers(0, 255, (4, CHUNK), dtype=np.uint8)
    want = rows[:4].copy()
    keys = [b"h%d" % i + b"\0\0\0\0" for i in range(4)]
    assert tier.lookup(keys[0], ctx) is LookupResult.MISS
    tier.submit_store(job(1, keys, [0, 1, 2, 3], False))
    [done] = finish(tier, 1)
    assert done.job_id == 1 and done.success
    assert all(tier.lookup(k, ctx) is LookupResult.HIT for k in keys)
    rows[:] = 0
    tier.submit_load(job(2, keys[1:3], [9, 10], True))
    [done] = finish(tier, 1)
    assert done.success and np.array_equal(rows[9:11], want[1:3])
    # a load past what the tier holds: only the leading run is reported loaded
    tier.submit_load(job(3, [keys[3], b"missing\0\0\0\0", keys[0]], [12, 13, 14], True))
    [done] = finish(tier, 1)
    assert not done.success and list(done.successful_keys) == [keys[3]]
    tier.shutdown()


def test_config_is_required_and_checked():
    rows, view = primary()
    with pytest.raises(ConfigError, match="required"):
        TieredCacheTier(spec(), view, "TieredCacheTier")
    with pytest.raises(ConfigError) as info:
        TieredCacheTier(spec(), view, "TieredCacheTier", config={"tiers": {"gpu": {}}})
    assert info.value.path == "tiers.gpu"


def test_a_shared_tier_is_looked_up_asynchronously(tmp_path):
    rs.require()
    with rs.RedisServer() as srv:
        cfg = {"tiers": {"remote": {"url": srv.url}}, "pages": {"lookup_deadline_ms": 2000}}
        rows, view = primary()
        writer = TieredCacheTier(spec(), view, "TieredCacheTier", config=cfg)
        rows[5] = 7
        writer.submit_store(job(1, [b"k\0\0\0\0"], [5], False))
        assert finish(writer, 1)[0].success
        writer.shutdown()
        rows2, view2 = primary()
        reader = TieredCacheTier(spec(), view2, "TieredCacheTier", config=cfg)
        ctx = ReqContext(req_id="r2")
        assert reader.lookup(b"k\0\0\0\0", ctx) is LookupResult.RETRY    # asked in background
        reader.on_schedule_end(None)
        deadline = time.monotonic() + 30
        result = LookupResult.RETRY
        while result is LookupResult.RETRY and time.monotonic() < deadline:
            time.sleep(0.05)
            result = reader.lookup(b"k\0\0\0\0", ctx)
        assert result is LookupResult.HIT
        reader.submit_load(job(2, [b"k\0\0\0\0"], [0], True))
        assert finish(reader, 1)[0].success and (rows2[0] == 7).all()
        reader.on_request_finished(ctx)
        reader.shutdown()


# ----------------------------------------------------------------------------- the engine
def engine(work: Path, config: dict, mode: str) -> dict:
    proc = subprocess.run([sys.executable, RUN, str(work), json.dumps(config), mode],
                          capture_output=True, text=True, timeout=600, cwd=REPO)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-3000:], proc.stderr[-6000:])
    return json.loads(lines[-1][len("RESULT "):])


@pytest.fixture(scope="module")
def work():
    with tempfile.TemporaryDirectory(prefix="tcv2-") as d:     # short: a socket lives here
        yield Path(d)


def test_vllm_engine_evicted_chunks_come_back_from_our_tier(work):
    r = engine(work, {"tiers": {"disk": {"path": str(work / "disk"), "num_blocks": 256}}},
               "sequence")
    assert r["stored"]["stored_chunks"] >= 8                    # cascaded from the CPU pool
    # 1. after vLLM's own caches were emptied, from our tier, the same tokens
    assert r["after_served"]["loaded_chunks"] >= 8
    assert r["served"] == r["first"]
    # 2. corrupt records: never served, recomputed, the same tokens, stored again
    assert r["corrupted"] >= 8 and r["disk_after_corrupt"]["corrupt"] >= 8
    assert r["after_corrupt"]["failed_loads"] >= 1
    assert r["after_corrupt"]["loaded_chunks"] == r["after_served"]["loaded_chunks"]
    assert r["recomputed"] == r["first"]
    assert r["after_corrupt"]["stored_chunks"] > r["stored"]["stored_chunks"]
    # 3. control: what our tier serves is what the engine attends to
    assert r["after_noise"]["loaded_chunks"] > r["after_corrupt"]["loaded_chunks"]
    assert r["noise"] != r["first"]


def test_a_second_engine_process_is_served_through_redis(work):
    rs.require()
    with rs.RedisServer() as srv:
        cfg = {"tiers": {"remote": {"url": srv.url}}, "pages": {"lookup_deadline_ms": 2000}}
        wrote = engine(work, cfg, "write")
        read = engine(work, cfg, "read")
    assert wrote["counts"]["stored_chunks"] >= 8
    assert read["counts"]["loaded_chunks"] >= 8 and read["tokens"] == wrote["tokens"]


def test_a_second_engine_process_is_served_through_the_daemon(work):
    from tiered_cache.daemon.process import NodeProcess

    sock = str(work / "d.sock")
    cfg_path = work / "daemon.yaml"
    cfg_path.write_text(textwrap.dedent(f"""\
        model: {{name: daemon-own, num_layers: 2, num_kv_heads: 2, head_dim: 8,
                num_q_heads: 4, dtype: float32}}
        block_size: 4
        tiers:
          gpu: {{num_blocks: 8, device: cpu}}
          host: {{num_blocks: 16}}
        daemon: {{socket: {sock}, page_pool_mib: 8}}
        """))
    node = NodeProcess(cfg_path, sock, log_path=work / "daemon.log").start()
    try:
        cfg = {"tiers": {"daemon": {"socket": sock}}, "pages": {"lookup_deadline_ms": 2000}}
        wrote = engine(work, cfg, "write")
        read = engine(work, cfg, "read")
    finally:
        node.kill()
    assert wrote["counts"]["stored_chunks"] >= 8
    assert read["counts"]["loaded_chunks"] >= 8 and read["tokens"] == wrote["tokens"]
