"""The page store (tiered_cache.pages) on real files and a real redis-server: pages named by an
engine's own keys round-trip through the disk and remote tiers, a record that fails
verification is a miss and is dropped so the next put rewrites it, the disk index survives a
restart, bad input is a typed error that touches nothing, and a page one process puts is found
by another through Redis."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import xxhash

from tests import redis_servers as rs
from tiered_cache import records
from tiered_cache.errors import ConfigError
from tiered_cache.pages import identity
from tiered_cache.pages.config import PageStoreConfig
from tiered_cache.pages.disk import PageDisk
from tiered_cache.pages.identity import PageFormat, PageKeyError, PageSizeError
from tiered_cache.pages.store import PageStore, part_name

REPO = Path(__file__).resolve().parents[2]
PB = 6000                   # not a multiple of 4096: slots carry padding
FMT = PageFormat("test", "tiny", "float16", "page_first", 16, PB, "L2/H2/D64")
PART = part_name(0, 2, False)


def page(name: str, pb: int = PB) -> np.ndarray:
    """Deterministic bytes of the page called `name` (the same in every process)."""
    rng = np.random.default_rng(xxhash.xxh3_64_intdigest(name.encode()))
    return np.frombuffer(rng.bytes(pb), dtype=np.uint8).copy()


def pieces(buf: np.ndarray, cuts=(0, 1234, 5000)) -> list[np.ndarray]:
    """A page as pieces, the way an engine pool holds K and V apart."""
    bounds = [*cuts, len(buf)]
    return [buf[a:b] for a, b in zip(bounds, bounds[1:])]


def disk_store(path: Path, num_pages: int = 8, **kw) -> PageStore:
    cfg = PageStoreConfig.load({"tiers": {"disk": {"path": str(path), "num_blocks": num_pages}},
                                "pages": kw}, "test")
    return PageStore.from_config(cfg, FMT, disk_dir="tp0")


# ----------------------------------------------------------------------------- identity
def test_identity_separates_formats_tenants_parts_and_keys():
    d = FMT.digest()
    assert PageFormat("test", "tiny", "float16", "layer_first", 16, PB, "L2/H2/D64").digest() != d
    assert PageFormat("test", "tiny", "float16", "page_first", 16, PB, "L2/H2/D64",
                      shards=2).digest() != d
    roots = {identity.page_root(d, t, p) for t in (b"", b"a", b"b") for p in (b"tp0/2", b"tp1/2")}
    assert len(roots) == 6
    # length prefixes: ("ab", "c") and ("a", "bc") are different roots
    assert identity.page_root(d, b"ab", b"c") != identity.page_root(d, b"a", b"bc")
    r = identity.page_root(d, b"", PART)
    head = identity.encode_header(d, r, b"key-1", page("x"))
    h = records.decode_header(head, namespace=d, num_tokens=identity.IDENT_TOKENS)
    assert identity.matches(h, r, b"key-1")
    assert not identity.matches(h, r, b"key-2")
    assert not identity.matches(h, identity.page_root(d, b"", b"tp1/2"), b"key-1")
    assert identity.stored_key(h) == b"key-1"


@pytest.mark.parametrize("bad", ["", "x" * 125, 7, None, ["a"]])
def test_bad_keys_are_typed_errors(bad):
    with pytest.raises(PageKeyError):
        identity.check_keys([bad])


def test_repeated_key_in_a_batch_is_refused():
    with pytest.raises(PageKeyError, match=r"keys\[2\].*twice"):
        identity.check_keys(["a", "b", b"a"])


# ----------------------------------------------------------------------------- disk
def test_disk_round_trip_in_pieces_and_restart(tmp_path):
    names = [f"p{i}" for i in range(5)]
    st = disk_store(tmp_path)
    assert st.put(names, [pieces(page(n)) for n in names], PART) == [True] * 5
    outs = [np.zeros(PB, np.uint8) for _ in names]
    assert st.get(names, [pieces(o) for o in outs], PART) == [True] * 5
    assert all(np.array_equal(o, page(n)) for o, n in zip(outs, names))
    st.close()
    st = disk_store(tmp_path)                   # a new process would see the same
    assert st.disk.stats()["recovered"] == 5
    assert st.exists(names + ["absent"], PART) == 5
    out = np.zeros(PB, np.uint8)
    assert st.get(["p3"], [out], PART) == [True] and np.array_equal(out, page("p3"))
    st.close()


def test_disk_parts_and_tenants_do_not_see_each_other(tmp_path):
    st = disk_store(tmp_path)
    st.put(["k"], [page("k")], PART)
    assert st.exists(["k"], part_name(1, 2, False)) == 0
    st.close()
    other = disk_store(tmp_path, tenant_salt="someone-else")
    assert other.exists(["k"], PART) == 0
    assert other.get(["k"], [np.zeros(PB, np.uint8)], PART) == [False]
    other.close()


def test_disk_evicts_least_recently_used(tmp_path):
    st = disk_store(tmp_path, num_pages=3)
    st.put(["a", "b", "c"], [page(n) for n in "abc"], PART)
    st.get(["a"], [np.zeros(PB, np.uint8)], PART)          # a is now the most recent
    st.put(["d"], [page("d")], PART)                        # evicts b
    assert st.disk.contains(st.root(PART), [b"a", b"b", b"c", b"d"]) == [True, False, True, True]
    out = np.zeros(PB, np.uint8)
    assert st.get(["d"], [out], PART) == [True] and np.array_equal(out, page("d"))
    st.close()


def _payload_offset(disk: PageDisk, root: bytes, key: bytes) -> int:
    entry = disk._index[identity.page_key(root, key)]
    return entry.slot * disk.pool.layout.payload_stride


def test_corrupt_disk_record_is_a_miss_dropped_and_rewritten(tmp_path):
    st = disk_store(tmp_path)
    st.put(["good", "bad"], [page("good"), page("bad")], PART)
    off = _payload_offset(st.disk, st.root(PART), b"bad")
    path = st.disk.pool.dir / "payloads"
    with open(path, "r+b") as f:                            # a bit flips on the disk
        f.seek(off + 77)
        b = f.read(1)
        f.seek(off + 77)
        f.write(bytes([b[0] ^ 0x10]))
    outs = [np.zeros(PB, np.uint8), np.full(PB, 0xAB, np.uint8)]
    assert st.get(["good", "bad"], outs, PART) == [True, False]
    assert np.array_equal(outs[0], page("good"))
    assert st.disk.stats()["corrupt"] == 1
    assert st.exists(["bad"], PART) == 0                    # dropped: never served
    assert st.put(["bad"], [page("bad")], PART) == [True]   # ... so the next put rewrites it
    out = np.zeros(PB, np.uint8)
    assert st.get(["bad"], [out], PART) == [True] and np.array_equal(out, page("bad"))
    st.close()
    st = disk_store(tmp_path)                               # and a restart agrees
    assert st.exists(["good", "bad"], PART) == 2
    st.close()


def test_foreign_record_at_restart_is_erased(tmp_path):
    st = disk_store(tmp_path)
    st.put(["x"], [page("x")], PART)
    pool = st.disk.pool
    slot = st.disk._index[identity.page_key(st.root(PART), b"x")].slot
    # a record whose stored engine key does not produce its page key (written by a bug, or a
    # collision): it must never be restored as "x"
    root = st.root(PART)
    head = records.encode_header(st.digest, identity.page_key(root, b"x"), root, root, 0,
                                 identity.ident(b"y"), 0, PB, records.payload_hash(page("y")))
    pool.write([slot], [head], [page("y")])
    st.close()
    st = disk_store(tmp_path)
    assert st.disk.stats()["erased_at_open"] == 1 and st.exists(["x"], PART) == 0
    st.close()


def test_bad_input_raises_and_touches_nothing(tmp_path):
    st = disk_store(tmp_path)
    with pytest.raises(PageSizeError, match="6,000"):
        st.put(["a", "b"], [page("a"), page("b", PB - 1)], PART)
    with pytest.raises(PageKeyError):
        st.put(["a", "x" * 200], [page("a"), page("b")], PART)
    with pytest.raises(PageSizeError, match="2 keys and 1"):
        st.put(["a", "b"], [page("a")], PART)
    with pytest.raises(PageSizeError, match="read-only"):
        st.get(["a"], [memoryview(bytes(PB))], PART)
    assert len(st.disk) == 0 and st.disk.stats()["puts"] == 0
    st.close()


@pytest.mark.parametrize("raw, path, msg", [
    ({"model": {"name": "x"}}, "model", "set by the engine"),
    ({"tiers": {"host": {"num_blocks": 3}}}, "tiers.host", "engine's own tier"),
    ({"tiers": {"disk": {"path": "/x", "num_blocks": 1, "admit_min_hits": 2}}},
     "tiers.disk.admit_min_hits", "no meaning"),
    ({"tiers": {"disk": {"path": "/x", "num_blocks": 1},
                "daemon": {"socket": "/s"}}}, "tiers.daemon", "daemon's config"),
    ({"tiers": {}}, "tiers", "at least one"),
    ({"tiers": {"disk": {"num_blocks": 1}}}, "tiers.disk.path", "required"),
    ({"tiers": {"disk": {"path": "/x", "num_blocks": -1}}}, "tiers.disk.num_blocks", "num_blocks"),
    ({"tiers": {"disk": {"path": "/x", "num_blocks": 1}}, "pages": {"lookup_deadline_ms": 0}},
     "pages.lookup_deadline_ms", "milliseconds"),
    ({"tiers": {"disk": {"path": "/x", "num_blocks": 1}}, "pages": {"salt": "a"}},
     "pages.salt", "unknown key"),
])
def test_config_errors_name_the_key(raw, path, msg):
    with pytest.raises(ConfigError, match=msg) as info:
        PageStoreConfig.load(raw, "extra")
    assert info.value.path == path


def test_config_from_yaml_file(tmp_path):
    f = tmp_path / "tc.yaml"
    f.write_text(f"tiers:\n  disk:\n    path: {tmp_path}/d\n    capacity: 1MiB\n"
                 "pages:\n  lookup_deadline_ms: 2\n")
    cfg = PageStoreConfig.load(str(f), "extra.config")
    st = PageStore.from_config(cfg, FMT, disk_dir="tp0")
    assert st.disk.pool.num_slots == (1 << 20) // (4096 + 8192)
    assert st.lookup_deadline_s == 0.002
    st.close()
    with pytest.raises(ConfigError, match="cannot read"):
        PageStoreConfig.load(str(tmp_path / "missing.yaml"), "extra.config")


# ----------------------------------------------------------------------------- remote
def remote_store(url: str, disk: Path | None = None, **pages) -> PageStore:
    # NOTE: a generous deadline: a loaded test machine takes more than the 5 ms default to
    # connect the first time, and a lookup cut short is a (correct) miss the tests would not see
    pages.setdefault("lookup_deadline_ms", 2000)
    tiers: dict = {"remote": {"url": url}}
    if disk is not None:
        tiers["disk"] = {"path": str(disk), "num_blocks": 16}
    cfg = PageStoreConfig.load({"tiers": tiers, "pages": pages}, "test")
    return PageStore.from_config(cfg, FMT, disk_dir="tp0")


@pytest.mark.slow
def test_remote_round_trip_and_leading_exists(redis_server):
    st = remote_store(redis_server.url, tenant_salt=os.urandom(8).hex())
    names = ["r0", "r1", "r2"]
    assert st.put(names, [pieces(page(n)) for n in names], PART) == [True] * 3
    assert st.exists(["r0", "r1", "zz", "r2"], PART) == 2
    outs = [np.zeros(PB, np.uint8) for _ in names]
    assert st.get(names, [pieces(o) for o in outs], PART) == [True] * 3
    assert all(np.array_equal(o, page(n)) for o, n in zip(outs, names))
    st.close()


@pytest.mark.slow
def test_every_ranks_part_must_be_there(redis_server):
    salt = os.urandom(8).hex()
    st = remote_store(redis_server.url, tenant_salt=salt)
    p0, p1 = part_name(0, 2, False), part_name(1, 2, False)
    st.put(["a", "b", "c"], [page("a"), page("b"), page("c")], p0)
    st.put(["a", "b"], [page("a1"), page("b1")], p1)        # rank 1 died before its "c"
    assert st.exists(["a", "b", "c"], p0) == 3
    assert st.exists(["a", "b", "c"], p0, other_parts=[p1]) == 2
    st.close()


@pytest.mark.slow
def test_corrupt_remote_value_is_deleted_and_rewritten(redis_server):
    st = remote_store(redis_server.url, tenant_salt=os.urandom(8).hex())
    st.put(["v"], [page("v")], PART)
    skey = st.remote.store.server_key(st.root(PART), identity.page_key(st.root(PART), b"v"))
    raw = redis_server.raw()
    value = bytearray(raw.get(skey))
    value[-5] ^= 0xFF                                       # the server returns damaged bytes
    raw.set(skey, bytes(value))
    out = np.full(PB, 7, np.uint8)
    assert st.get(["v"], [out], PART) == [False]
    assert raw.exists(skey) == 0                            # dropped, so ...
    assert st.put(["v"], [page("v")], PART) == [True]       # ... the next put writes it again
    assert st.get(["v"], [out], PART) == [True] and np.array_equal(out, page("v"))
    raw.close()
    st.close()


@pytest.mark.slow
def test_value_of_another_engine_key_is_a_miss(redis_server):
    st = remote_store(redis_server.url, tenant_salt=os.urandom(8).hex())
    root = st.root(PART)
    # a verified record of engine key "w" stored under the page key of "v" (a collision)
    body = page("w").tobytes()
    head = identity.encode_header(st.digest, root, b"w", body)
    fake = records.encode_header(st.digest, identity.page_key(root, b"v"), root, root, 0,
                                 identity.ident(b"w"), 0, PB, records.payload_hash(body))
    assert records.decode_header(head).tokens == records.decode_header(fake).tokens
    st.remote.store.put(root, [(identity.page_key(root, b"v"), fake + body)])
    assert st.get(["v"], [np.zeros(PB, np.uint8)], PART) == [False]
    assert st.remote.mismatched == 1
    st.close()


@pytest.mark.slow
def test_remote_hits_fill_the_disk(redis_server, tmp_path):
    salt = os.urandom(8).hex()
    writer = remote_store(redis_server.url, tenant_salt=salt)
    writer.put(["f"], [page("f")], PART)
    reader = remote_store(redis_server.url, tmp_path / "disk", tenant_salt=salt)
    out = np.zeros(PB, np.uint8)
    assert reader.get(["f"], [out], PART) == [True]
    assert reader.disk.contains(reader.root(PART), [b"f"]) == [True]
    writer.close()
    reader.close()


def test_dead_server_is_a_miss_not_an_error(tmp_path):
    url = f"redis://:{rs.PASSWORD}@127.0.0.1:{rs.free_port()}/0"
    st = remote_store(url, tmp_path / "disk")
    assert st.put(["a"], [page("a")], PART) == [True]       # the disk took it
    assert st.exists(["a", "b"], PART) == 1
    assert st.get(["b"], [np.zeros(PB, np.uint8)], PART) == [False]
    st.close()


@pytest.mark.slow
def test_a_page_put_by_one_process_is_found_by_another(redis_server):
    salt = os.urandom(8).hex()
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO)!r})
        from tests.pages.test_pages import page, remote_store, PART
        st = remote_store({redis_server.url!r}, tenant_salt={salt!r})
        print(st.put(["x0", "x1"], [page("x0"), page("x1")], PART))
        st.close()
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[True, True]"
    st = remote_store(redis_server.url, tenant_salt=salt)
    outs = [np.zeros(PB, np.uint8), np.zeros(PB, np.uint8)]
    assert st.exists(["x0", "x1"], PART) == 2
    assert st.get(["x0", "x1"], outs, PART) == [True, True]
    assert np.array_equal(outs[0], page("x0")) and np.array_equal(outs[1], page("x1"))
    st.close()
