"""tiered-cache as SGLang's HiCache storage backend, against SGLang 0.5.23's own code: the backend
is loaded by SGLang's `dynamic` storage factory, SGLang's host KV pool classes hold the KV on
CPU, and SGLang's cache controller methods drive it (prefetch: batch_exists -> batch_get_v1;
write-back: batch_set_v1). Real disk, a real redis-server, a real node daemon, and other
processes."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

from tests import redis_servers as rs
from tests.sglang_hicache import sgl
from tiered_cache.errors import ConfigError

MHA_LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def disk(tmp_path, pages: int = 64) -> dict:
    return {"tiers": {"disk": {"path": str(tmp_path / "disk"), "num_blocks": pages}}}


def tokens(n_pages: int, start: int = 1000) -> list[int]:
    return list(range(start, start + n_pages * sgl.PAGE))


def fresh(pool, n_pages: int, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    slots = pool.alloc(n_pages * pool.page_size)
    sgl.fill(pool, slots, seed)
    return slots, sgl.pages_of(pool, slots)


@pytest.mark.parametrize("layout", MHA_LAYOUTS)
def test_write_back_then_prefetch_round_trips_through_disk(tmp_path, layout):
    pool = sgl.mha_pool(layout)
    b = sgl.backend(disk(tmp_path), pool)
    assert type(b).__name__ == "TieredCacheStorage"
    assert b.pages.zero_copy and b.pages.pieces_per_page == (4 if layout == "layer_first" else 2)
    ctrl = sgl.controller(b, pool)
    toks = tokens(6)
    slots, want = fresh(pool, 6, seed=1)
    assert sgl.write_back(ctrl, pool, toks, slots) == len(toks)
    pool.free(slots)
    hit, got, new = sgl.prefetch(ctrl, pool, toks + [1, 2, 3, 4, 5])   # a page past the end
    assert hit == got == len(toks)
    assert all(torch.equal(a, w) for a, w in zip(sgl.pages_of(pool, new), want))
    b.close()


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_mla_pool_round_trip(tmp_path, layout):
    pool = sgl.mla_pool(layout)
    b = sgl.backend(disk(tmp_path), pool, mla=True)
    ctrl = sgl.controller(b, pool)
    toks = tokens(3)
    slots, want = fresh(pool, 3, seed=2)
    assert sgl.write_back(ctrl, pool, toks, slots) == len(toks)
    hit, got, new = sgl.prefetch(ctrl, pool, toks)
    assert got == len(toks)
    assert all(torch.equal(a, w) for a, w in zip(sgl.pages_of(pool, new), want))
    b.close()


def test_v1_and_generic_interfaces_read_each_others_pages(tmp_path):
    pool = sgl.mha_pool("layer_first")
    b = sgl.backend(disk(tmp_path), pool)
    v1, generic = sgl.controller(b, pool), sgl.controller(b, pool, v1=False)
    a_toks, b_toks = tokens(2, 10), tokens(2, 20)
    a_slots, a_want = fresh(pool, 2, seed=3)
    b_slots, b_want = fresh(pool, 2, seed=4)
    assert sgl.write_back(v1, pool, a_toks, a_slots) == len(a_toks)
    assert sgl.write_back(generic, pool, b_toks, b_slots) == len(b_toks)
    _, got, new = sgl.prefetch(generic, pool, a_toks)
    assert got == len(a_toks) and all(
        torch.equal(x, w) for x, w in zip(sgl.pages_of(pool, new), a_want))
    _, got, new = sgl.prefetch(v1, pool, b_toks)
    assert got == len(b_toks) and all(
        torch.equal(x, w) for x, w in zip(sgl.pages_of(pool, new), b_want))
    # the single-key calls too
    flat = pool.get_dummy_flat_data_page()
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    key = get_storage_hash_str(a_toks, None, page_size=sgl.PAGE)[1]
    assert b.exists(key) and torch.equal(b.get(key, flat), a_want[1])
    assert b.get("0" * 64, pool.get_dummy_flat_data_page()) is None
    b.close()


def test_corrupt_page_stops_the_prefetch_and_is_rewritten(tmp_path):
    pool = sgl.mha_pool("page_first")
    b = sgl.backend(disk(tmp_path), pool)
    ctrl = sgl.controller(b, pool)
    toks = tokens(4)
    slots, want = fresh(pool, 4, seed=5)
    sgl.write_back(ctrl, pool, toks, slots)
    d = b.store.disk
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    from tiered_cache.pages import identity
    hashes = get_storage_hash_str(toks, None, page_size=sgl.PAGE)
    entry = d._index[identity.page_key(b.store.root(b.part), hashes[2].encode())]
    with open(d.pool.dir / "payloads", "r+b") as f:
        f.seek(entry.slot * d.pool.layout.payload_stride + 3)
        f.write(b"\x99")
    hit, got, new = sgl.prefetch(ctrl, pool, toks)
    assert hit == len(toks)                             # the index still lists it ...
    assert got == 2 * sgl.PAGE                          # ... but its KV is never served
    assert all(torch.equal(a, w) for a, w in zip(sgl.pages_of(pool, new)[:2], want[:2]))
    assert b.batch_exists(hashes) == 2                  # dropped
    assert sgl.write_back(ctrl, pool, toks, slots) == len(toks)    # rewritten by write-back
    _, got, new = sgl.prefetch(ctrl, pool, toks)
    assert got == len(toks)
    assert all(torch.equal(a, w) for a, w in zip(sgl.pages_of(pool, new), want))
    b.close()


def test_pages_survive_a_restart_of_the_engine(tmp_path):
    pool = sgl.mha_pool("page_first")
    b = sgl.backend(disk(tmp_path), pool)
    toks = tokens(3)
    slots, want = fresh(pool, 3, seed=6)
    sgl.write_back(sgl.controller(b, pool), pool, toks, slots)
    b.close()
    pool2 = sgl.mha_pool("page_first")
    b2 = sgl.backend(disk(tmp_path), pool2)
    _, got, new = sgl.prefetch(sgl.controller(b2, pool2), pool2, toks)
    assert got == len(toks)
    assert all(torch.equal(a, w) for a, w in zip(sgl.pages_of(pool2, new), want))
    b2.close()


def test_another_layout_or_model_never_reads_these_pages(tmp_path):
    pool = sgl.mha_pool("page_first")
    b = sgl.backend(disk(tmp_path), pool)
    toks = tokens(2)
    slots, _ = fresh(pool, 2, seed=7)
    sgl.write_back(sgl.controller(b, pool), pool, toks, slots)
    b.close()
    other = sgl.mha_pool("layer_first")                 # same bytes per page, other order
    b2 = sgl.backend(disk(tmp_path), other)
    assert sgl.prefetch(sgl.controller(b2, other), other, toks)[0] == 0
    b2.close()


def test_config_errors_are_typed_and_name_the_key(tmp_path):
    pool = sgl.mha_pool("page_first")
    with pytest.raises(ConfigError, match="extra-config.config: required"):
        _no_config(pool)
    with pytest.raises(ConfigError) as info:
        sgl.backend({"tiers": {"disk": {"path": str(tmp_path), "num_blocks": 4}},
                     "model": {"name": "x"}}, pool)
    assert info.value.path == "model"
    with pytest.raises(ConfigError) as info:
        sgl.backend(disk(tmp_path), pool, mla=True, tp_size=2)  # no tier the ranks share
    assert info.value.path == "tiers.disk"
    with pytest.raises(ConfigError, match="cannot read"):
        sgl.backend(str(tmp_path / "missing.yaml"), pool)


def _no_config(pool):
    from sglang.srt.mem_cache.storage import StorageBackendFactory
    cfg = sgl.storage_config(None)
    del cfg.extra_config["config"]
    return StorageBackendFactory.create_backend("dynamic", cfg, pool)


def test_yaml_config_file_and_storage_metrics(tmp_path):
    f = tmp_path / "tc.yaml"
    f.write_text(f"tiers:\n  disk:\n    path: {tmp_path}/d\n    capacity: 4MiB\n")
    pool = sgl.mha_pool("page_first")
    b = sgl.backend(str(f), pool, metrics=True)
    ctrl = sgl.controller(b, pool)
    toks = tokens(3)
    slots, _ = fresh(pool, 3, seed=8)
    sgl.write_back(ctrl, pool, toks, slots)
    sgl.prefetch(ctrl, pool, toks)
    m = b.get_stats()
    assert m.backup_pgs == [3] and m.prefetch_pgs == [3] and m.prefetch_bandwidth[0] > 0
    assert b.get_stats().backup_pgs == []                # reset on read, as SGLang expects
    b.close()


# ----------------------------------------------------------------------------- ranks, shared tiers
@pytest.fixture(scope="module")
def redis_server():
    rs.require()
    with rs.RedisServer() as srv:
        yield srv


@pytest.fixture(scope="module")
def redis_url(redis_server):
    return redis_server.url


def remote(url: str, salt: str) -> dict:
    return {"tiers": {"remote": {"url": url}},
            "pages": {"tenant_salt": salt, "lookup_deadline_ms": 2000}}


def test_a_page_set_is_a_hit_only_when_every_ranks_part_is_there(redis_url, tmp_path):
    cfg = remote(redis_url, "ranks")
    pools = [sgl.mha_pool("page_first") for _ in range(2)]
    ranks = [sgl.backend(cfg, pools[r], tp_rank=r, tp_size=2) for r in range(2)]
    toks = tokens(4)
    for r in range(2):
        slots, _ = fresh(pools[r], 4, seed=10 + r)
        n = 4 if r == 0 else 2                      # rank 1 stored only its first two pages
        sgl.write_back(sgl.controller(ranks[r], pools[r]), pools[r], toks[:n * sgl.PAGE],
                       slots[:n * sgl.PAGE])
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    hashes = get_storage_hash_str(toks, None, page_size=sgl.PAGE)
    assert ranks[0].batch_exists(hashes) == 2
    assert ranks[1].batch_exists(hashes) == 2
    # each rank reads its own part: rank 0's pages are not rank 1's
    _, got, new = sgl.prefetch(sgl.controller(ranks[1], pools[1]), pools[1], toks[:8])
    assert got == 8
    for b in ranks:
        b.close()


def test_mla_one_writer_all_ranks_read(redis_url):
    cfg = remote(redis_url, "mla")
    pools = [sgl.mla_pool("page_first") for _ in range(2)]
    ranks = [sgl.backend(cfg, pools[r], tp_rank=r, tp_size=2, mla=True) for r in range(2)]
    assert ranks[0].writer and not ranks[1].writer
    toks = tokens(3)
    slots, want = fresh(pools[1], 3, seed=12)
    assert ranks[1].batch_set_v1(["k"], slots[:sgl.PAGE]) == [False]   # not the writer
    slots0, want = fresh(pools[0], 3, seed=12)
    assert sgl.write_back(sgl.controller(ranks[0], pools[0]), pools[0], toks, slots0) == 12
    _, got, new = sgl.prefetch(sgl.controller(ranks[1], pools[1]), pools[1], toks)
    assert got == len(toks)
    assert all(torch.equal(a, w) for a, w in zip(sgl.pages_of(pools[1], new), want))
    for b in ranks:
        b.close()


def test_batch_exists_answers_within_its_deadline_when_the_server_is_slow(redis_server):
    redis_url = redis_server.url
    with rs.LatencyProxy(redis_server.port, delay_s=0.5) as proxy:
        slow = {"tiers": {"remote": {"url": proxy.url()}},
                "pages": {"tenant_salt": "slow", "lookup_deadline_ms": 20}}
        pool = sgl.mha_pool("page_first")
        fast = sgl.backend(remote(redis_url, "slow"), pool)
        toks = tokens(2)
        slots, _ = fresh(pool, 2, seed=13)
        sgl.write_back(sgl.controller(fast, pool), pool, toks, slots)
        from sglang.srt.mem_cache.utils import get_storage_hash_str
        hashes = get_storage_hash_str(toks, None, page_size=sgl.PAGE)
        assert fast.batch_exists(hashes) == 2
        b = sgl.backend(slow, sgl.mha_pool("page_first"))
        assert b.batch_exists(hashes) == 0          # a miss, not a wait: the deadline held
        b.close()
        fast.close()


CHILD = textwrap.dedent("""
    import json, sys
    sys.path[:0] = sys.argv[1].split(":")
    from tests.sglang_hicache import sgl
    from tests.sglang_hicache.test_hicache_backend import fresh, tokens
    cfg = json.loads(sys.argv[2])
    pool = sgl.mha_pool("page_first")
    b = sgl.backend(cfg, pool)
    slots, want = fresh(pool, 5, seed=21)
    n = sgl.write_back(sgl.controller(b, pool), pool, tokens(5), slots)
    b.close()
    print(json.dumps({"written": n, "pages": [w.tolist() for w in want]}))
""")


def run_writer(cfg: dict) -> tuple[int, list[torch.Tensor]]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(sgl.REPO), json.dumps(cfg)],
                         capture_output=True, text=True, timeout=300, env=sgl.env(),
                         cwd=sgl.REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return got["written"], [torch.tensor(p) for p in got["pages"]]


def read_all(cfg: dict, want: list[torch.Tensor]) -> None:
    pool = sgl.mha_pool("page_first")
    b = sgl.backend(cfg, pool)
    _, got, new = sgl.prefetch(sgl.controller(b, pool), pool, tokens(5))
    assert got == 5 * sgl.PAGE
    assert all(torch.equal(a, w) for a, w in zip(sgl.pages_of(pool, new), want))
    b.close()


def test_another_process_finds_the_pages_through_redis(redis_url):
    cfg = remote(redis_url, "xproc")
    written, want = run_writer(cfg)
    assert written == 5 * sgl.PAGE
    read_all(cfg, want)


def test_another_process_finds_the_pages_through_the_daemon(tmp_path):
    from tiered_cache.daemon.process import NodeProcess
    sock = str(tmp_path / "s" / "d.sock")
    daemon_cfg = tmp_path / "daemon.yaml"
    daemon_cfg.write_text(textwrap.dedent(f"""\
        model: {{name: daemon-own, num_layers: 2, num_kv_heads: 2, head_dim: 8,
                num_q_heads: 4, dtype: float32}}
        block_size: 4
        tiers:
          gpu: {{num_blocks: 8, device: cpu}}
          host: {{num_blocks: 16}}
          disk: {{num_blocks: 16, path: {tmp_path / 'disk'}}}
        daemon: {{socket: {sock}, page_pool_mib: 1, page_disk_mib: 2}}
        """))
    node = NodeProcess(daemon_cfg, sock, log_path=tmp_path / "daemon.log").start()
    try:
        cfg = {"tiers": {"daemon": {"socket": sock}}, "pages": {"lookup_deadline_ms": 1000}}
        written, want = run_writer(cfg)
        assert written == 5 * sgl.PAGE
        read_all(cfg, want)
    finally:
        node.kill()


def test_sidecar_host_pools_are_refused_at_attach(tmp_path):
    pool = sgl.mha_pool("page_first")
    b = sgl.backend(disk(tmp_path), pool)
    b.register_mem_host_pool_v2(pool, "kv")
    b.on_host_pools_registered()                        # the KV pool alone is fine
    b.register_mem_host_pool_v2(sgl.mha_pool("page_first"), "mamba")
    with pytest.raises(ConfigError, match="mamba"):
        b.on_host_pools_registered()
    b.close()
