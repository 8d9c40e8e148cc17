"""The disk tier's data plane (DiskPool) on real files: round trips across reopen, corruption of
every kind is a miss (skipped or CorruptRecord) and counted, never wrong data; locking, space,
resize, threads. Crashes with real subprocesses: test_disk_crash.py."""

from __future__ import annotations

import errno
import logging
import os
import shutil
import struct
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiered_cache import records
from tiered_cache.data import disk_layout
from tiered_cache.data.disk import (
    CorruptSlots,
    DiskFullError,
    DiskPool,
    FormatVersionError,
    LockHeldError,
)
from tiered_cache.errors import CapacityError, TierUnavailableError
from tiered_cache.records import CorruptRecord

NS = xxhash.xxh3_128_digest(b"test-model/float16/2x2x4/bs4")
OTHER_NS = xxhash.xxh3_128_digest(b"other-model/float16/2x2x4/bs4")
TOKENS = 4
PB = 6000                   # not a multiple of 4096: payload areas carry padding


# ----------------------------------------------------------------------------- helpers
def make_record(ident: str, *, ns: bytes = NS, pb: int = PB, num_tokens: int = TOKENS,
                hits: int = 0) -> tuple[bytes, np.ndarray]:
    """A deterministic record (header bytes, payload) named by `ident`: the same ident always
    gives the same key, tokens and KV bytes, in any process."""
    rng = np.random.default_rng(xxhash.xxh3_64_intdigest(ident.encode()))
    payload = np.frombuffer(rng.bytes(pb), dtype=np.uint8).copy()
    tokens = rng.integers(0, 2**31 - 1, num_tokens, dtype=np.int32)
    parent = xxhash.xxh3_128_digest(b"p:" + ident.encode())
    header = records.encode_header(ns, key_of(ident), parent, xxhash.xxh3_128_digest(b"r"),
                                   len(ident) % 7, records.tokens_bytes(tokens), hits, pb,
                                   records.payload_hash(payload))
    return header, payload


def key_of(ident: str) -> bytes:
    return xxhash.xxh3_128_digest(b"k:" + ident.encode())


def open_pool(path: Path, num_slots: int = 32, **kw) -> DiskPool:
    kw.setdefault("payload_bytes", PB)
    kw.setdefault("num_tokens", TOKENS)
    kw.setdefault("namespace", NS)
    return DiskPool(path, num_slots=num_slots, **kw)


def write_idents(pool: DiskPool, slots: list[int], idents: list[str], **kw) -> None:
    recs = [make_record(i, pb=pool.layout.payload_bytes, **kw) for i in idents]
    pool.write(slots, [h for h, _ in recs], [p for _, p in recs])


def contents(pool: DiskPool, idents_by_key: dict[bytes, str] | None = None) -> dict[int, str]:
    """slot -> ident of every record scan() lists, each read back and checked byte for byte.
    Records that fail to read are left out (a miss); one that reads must be exact."""
    found = pool.scan()
    out = {}
    pb = pool.layout.payload_bytes
    for slot, header in found:
        buf = np.empty(pb, dtype=np.uint8)
        try:
            pool.read(slot, header, buf)
        except CorruptRecord:
            continue
        ident = (idents_by_key or {}).get(header.key)
        assert ident is not None or idents_by_key is None, f"slot {slot}: unknown key"
        if ident is not None:
            want_h, want_p = make_record(ident, pb=pb)
            assert np.array_equal(buf, want_p), f"slot {slot}: wrong KV for {ident}"
            assert header.tokens == records.decode_header(want_h).tokens
        out[slot] = ident
    return out


def keys(idents) -> dict[bytes, str]:
    return {key_of(i): i for i in idents}


def pool_dir(path: Path, ns: bytes = NS) -> Path:
    return path / ns.hex()


def flip(path: Path, offset: int, xor: int = 0xFF) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ xor]))


# ----------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("o_direct", [False, True])
@pytest.mark.parametrize("pb", [PB, 8192])
def test_round_trip_across_reopen(tmp_path, o_direct, pb):
    slots = [0, 1, 2, 3, 7, 9, 10, 31]          # runs and singles
    idents = [f"a{s}" for s in slots]
    with open_pool(tmp_path, o_direct=o_direct, payload_bytes=pb) as pool:
        assert pool.scan() == []
        write_idents(pool, slots, idents)
    with open_pool(tmp_path, o_direct=o_direct, payload_bytes=pb) as pool:
        found = pool.scan()
        assert [s for s, _ in found] == sorted(slots)
        outs = [np.zeros(pb, np.uint8) for _ in found]
        pool.read_many([s for s, _ in found], [h for _, h in found], outs)
        for (slot, header), out in zip(found, outs):
            ident = f"a{slot}"
            assert header.key == key_of(ident)
            assert np.array_equal(out, make_record(ident, pb=pb)[1])
        st_ = pool.stats()
        assert st_["records_read"] == len(slots) and st_["corrupt"] == 0
        assert st_["occupied_slots"] == len(slots)


def test_payload_kinds_tensor_numpy_memoryview_and_unaligned(tmp_path):
    """Host slots come as torch tensors (bfloat16 included), numpy views or memoryviews; with
    O_DIRECT an unaligned one goes through a bounce buffer, an aligned one straight."""
    import torch  # here: the crash workers import this module

    pb = 4096 * 4
    with open_pool(tmp_path, payload_bytes=pb, o_direct=True) as pool:
        assert pool.o_direct
        host = torch.zeros((4, pb // 2), dtype=torch.bfloat16)   # four "host slots"
        blobs = [make_record(f"t{i}", pb=pb) for i in range(4)]
        for i, (_, p) in enumerate(blobs):
            host[i].view(torch.uint8).copy_(torch.from_numpy(p))
        unaligned = np.zeros(pb + 1, np.uint8)[1:]
        unaligned[:] = blobs[3][1]
        pay = [host[0], host[1].view(torch.uint8).numpy(), memoryview(blobs[2][1]), unaligned]
        pool.write([4, 5, 6, 8], [h for h, _ in blobs], pay)
        found = dict(pool.scan())
        out = torch.empty((4, pb // 2), dtype=torch.bfloat16)
        pool.read_many([4, 5, 6, 8], [found[s] for s in (4, 5, 6, 8)],
                       [out[0], out[1], out[2].view(torch.uint8).numpy(), out[3]])
        assert torch.equal(out.view(torch.uint8), host.view(torch.uint8))


def test_reuse_erase_and_hits_persist(tmp_path):
    with open_pool(tmp_path) as pool:
        write_idents(pool, [1, 2, 3], ["old1", "old2", "old3"])
        write_idents(pool, [2, 3, 4], ["new2", "new3", "new4"])   # 2, 3 reused
        pool.erase([1, 4])
        pool.erase([1, 4, 5])                                       # idempotent
        pool.update_hits([2], [41])
        assert pool.stats()["records_erased"] == 2
    with open_pool(tmp_path) as pool:
        got = contents(pool, keys(["old1", "old2", "old3", "new2", "new3", "new4"]))
        assert got == {2: "new2", 3: "new3"}
        assert dict(pool.scan())[2].hits == 41
        with pytest.raises(CorruptSlots) as info:
            pool.update_hits([1], [3])                              # erased: nothing to update
        assert info.value.slots == [1]


def test_write_validates_before_touching_disk(tmp_path):
    with open_pool(tmp_path) as pool:
        write_idents(pool, [0], ["keep"])
        h, p = make_record("x")
        foreign, _ = make_record("x", ns=OTHER_NS)
        cases = [([1], [h], [p[:-1]], ValueError, "6000"),
                 ([1], [foreign], [p], ValueError, "another namespace"),
                 ([1, 1], [h, h], [p, p], ValueError, "twice"),
                 ([32], [h], [p], IndexError, "outside"),
                 ([1], [h[:-3]], [p], ValueError, "headers"),
                 ([1, 2], [h], [p], ValueError, "slots")]
        for slots, heads, pays, exc, match in cases:
            with pytest.raises(exc, match=match):
                pool.write(slots, heads, pays)
        with pytest.raises(ValueError, match="read-only"):
            pool.read(0, dict(pool.scan())[0], bytes(PB))
        assert contents(pool, keys(["keep"])) == {0: "keep"}


@pytest.mark.parametrize("o_direct", [False, True])
@pytest.mark.parametrize("cpus", [1, 2])
def test_batch_read_verifies_every_chunk(tmp_path, o_direct, cpus):
    """A batch larger than one read chunk (2 MiB buffered, 8 MiB O_DIRECT; verified inline with
    one CPU, on the verifier thread with more) still names exactly the damaged and the cut-off
    slots, and fills the rest."""
    pb, n = 1 << 20, 20
    with open_pool(tmp_path, payload_bytes=pb, o_direct=o_direct) as pool:
        pool._cpus = cpus
        slots = list(range(n))
        recs = [make_record(f"b{s}", pb=pb) for s in slots]
        found = pool.write(slots, [h for h, _ in recs], [p for _, p in recs])
        payloads = pool_dir(tmp_path) / "payloads"
        for s in (3, 9, 15):
            flip(payloads, s * pb + 12345)
        os.truncate(payloads, 17 * pb + pb // 2)            # 17 is cut short, 18, 19 are gone
        outs = [np.empty(pb, np.uint8) for _ in slots]
        with pytest.raises(CorruptSlots) as info:
            pool.read_many(slots, found, outs)
        reasons = info.value.reasons
        assert sorted(reasons) == [3, 9, 15, 17, 18, 19]
        assert "hash" in reasons[9] and "short read" in reasons[18]
        for s in set(slots) - set(reasons):
            assert np.array_equal(outs[s], recs[s][1])
        assert pool.corrupt == 6


# ----------------------------------------------------------------------------- namespaces
def test_namespaces_share_a_path_and_never_read_each_other(tmp_path):
    a = open_pool(tmp_path, namespace=NS)
    b = open_pool(tmp_path, namespace=OTHER_NS)     # both open at once: separate directories
    write_idents(a, [0, 1], ["a0", "a1"])
    write_idents(b, [0], ["b0"], ns=OTHER_NS)
    a.close()
    b.close()
    with open_pool(tmp_path, namespace=NS) as a:
        assert contents(a, keys(["a0", "a1"])) == {0: "a0", 1: "a1"}
    with open_pool(tmp_path, namespace=OTHER_NS) as b:
        assert [s for s, h in b.scan()] == [0] and b.scan()[0][1].key == key_of("b0")


def test_record_of_another_namespace_in_a_slot_is_skipped_and_counted(tmp_path):
    with open_pool(tmp_path, namespace=OTHER_NS) as b:
        write_idents(b, [5], ["b5"], ns=OTHER_NS)
    with open_pool(tmp_path) as a:
        write_idents(a, [4], ["a4"])
    # copy b's whole record (header and payload) into slot 5 of a
    stride_h, stride_p = disk_layout.ALIGN, disk_layout.round_up(PB, 4096)
    src, dst = pool_dir(tmp_path, OTHER_NS), pool_dir(tmp_path)
    for name, stride in (("headers", stride_h), ("payloads", stride_p)):
        data = (src / name).read_bytes()[5 * stride:6 * stride]
        with open(dst / name, "r+b") as f:
            f.seek(5 * stride)
            f.write(data)
    with open_pool(tmp_path) as a:
        assert contents(a, keys(["a4"])) == {4: "a4"}
        assert a.corrupt == 1 and a.last_scan == {"slots": 32, "records": 1, "corrupt": 1}
        # a header of the other namespace handed to read() is a miss too
        foreign = records.decode_header(make_record("b5", ns=OTHER_NS)[0])
        with pytest.raises(CorruptRecord, match="another namespace"):
            a.read(5, foreign, np.empty(PB, np.uint8))


def test_superblock_of_another_namespace_or_geometry_starts_empty(tmp_path, caplog):
    with open_pool(tmp_path) as a:
        write_idents(a, [0, 1], ["a0", "a1"])
    # the directory of NS moved under OTHER_NS's name: its superblock names another namespace
    shutil.copytree(pool_dir(tmp_path), pool_dir(tmp_path, OTHER_NS))
    with caplog.at_level(logging.WARNING), open_pool(tmp_path, namespace=OTHER_NS) as b:
        assert b.scan() == [] and "namespace" in b.stats()["reset"]
    assert "discarding" in caplog.text
    with open_pool(tmp_path, payload_bytes=PB * 2) as a:            # another geometry
        assert a.scan() == [] and "payload_bytes" in a.reset_reason
    with open_pool(tmp_path, num_tokens=8) as a:
        assert a.scan() == [] and "num_tokens" in a.reset_reason
    with open_pool(tmp_path, num_tokens=8) as a:                    # now it is this pool's
        assert a.reset_reason is None


def test_superblock_of_another_format_version_is_a_clear_error(tmp_path):
    with open_pool(tmp_path) as a:
        write_idents(a, [0], ["a0"])
    sb = pool_dir(tmp_path) / "superblock"
    data = bytearray(sb.read_bytes())
    struct.pack_into("<I", data, 8, 2)
    data[-16:] = xxhash.xxh3_128_digest(bytes(data[:-16]))          # valid, from version 2
    sb.write_bytes(bytes(data))
    with pytest.raises(FormatVersionError, match="disk format version 2.*reads version 1"):
        open_pool(tmp_path)
    assert sb.read_bytes() == bytes(data)                           # left alone
    data[8:12] = struct.pack("<I", 1)
    data[-16:] = xxhash.xxh3_128_digest(bytes(data[:-16]))
    sb.write_bytes(bytes(data))
    with open_pool(tmp_path) as a:                                  # and it opens again
        assert contents(a, keys(["a0"])) == {0: "a0"}


@settings(max_examples=40, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.data())
def test_flipped_superblock_bytes_start_empty(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("sb")
    with open_pool(path, num_slots=4) as a:
        write_idents(a, [0], ["a0"])
    sb = pool_dir(path) / "superblock"
    pos = data.draw(st.integers(0, sb.stat().st_size - 1))
    flip(sb, pos, data.draw(st.integers(1, 255)))
    with open_pool(path, num_slots=4) as a:
        assert a.reset_reason and a.scan() == []


# ----------------------------------------------------------------------------- corruption
@pytest.fixture(scope="module")
def populated(tmp_path_factory):
    """A closed pool of 24 records in 32 slots; tests copy it before damaging it."""
    path = tmp_path_factory.mktemp("populated")
    slots = list(range(0, 12)) + list(range(16, 28))
    with open_pool(path) as pool:
        write_idents(pool, slots, [f"r{s}" for s in slots])
    return path, {s: f"r{s}" for s in slots}


def _copy(populated, tmp_path_factory) -> tuple[Path, dict[int, str]]:
    src, want = populated
    dst = tmp_path_factory.mktemp("damaged")
    shutil.copytree(src, dst, dirs_exist_ok=True)
    return dst, want


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 32 * 4096 - 1), st.integers(1, 255)), min_size=1,
                max_size=6))
def test_flipped_header_bytes_are_misses(populated, tmp_path_factory, flips):
    path, want = _copy(populated, tmp_path_factory)
    headers = pool_dir(path) / "headers"
    hbytes = records.header_len(TOKENS)
    damaged = set()
    for pos, xor in flips:
        flip(headers, pos, xor)
        slot, off = divmod(pos, 4096)
        if slot in want and off < hbytes:
            damaged.add(slot)
    damaged = {s for s in damaged if _header_changed(populated[0], path, s)}
    with open_pool(path) as pool:
        got = contents(pool, keys(want.values()))
        assert got == {s: i for s, i in want.items() if s not in damaged}
        assert pool.corrupt >= len(damaged)


def _header_changed(src: Path, dst: Path, slot: int) -> bool:
    """Flips can cancel out (the same byte twice): compare with the original."""
    a = (pool_dir(src) / "headers").read_bytes()[slot * 4096:(slot + 1) * 4096]
    b = (pool_dir(dst) / "headers").read_bytes()[slot * 4096:(slot + 1) * 4096]
    return a[:records.header_len(TOKENS)] != b[:records.header_len(TOKENS)]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 32 * 8192 - 1), st.integers(1, 255)), min_size=1,
                max_size=6))
def test_flipped_payload_bytes_are_corrupt_records(populated, tmp_path_factory, flips):
    path, want = _copy(populated, tmp_path_factory)
    payloads = pool_dir(path) / "payloads"
    for pos, xor in flips:
        flip(payloads, pos, xor)
    src = (pool_dir(populated[0]) / "payloads").read_bytes()
    now = payloads.read_bytes()
    damaged = {s for s in want if src[s * 8192:s * 8192 + PB] != now[s * 8192:s * 8192 + PB]}
    with open_pool(path) as pool:
        found = pool.scan()
        assert [s for s, _ in found] == sorted(want)       # headers are intact
        outs = [np.empty(PB, np.uint8) for _ in found]
        if damaged:
            with pytest.raises(CorruptSlots) as info:
                pool.read_many([s for s, _ in found], [h for _, h in found], outs)
            assert set(info.value.slots) == damaged
        else:
            pool.read_many([s for s, _ in found], [h for _, h in found], outs)
        for (slot, _), out in zip(found, outs):
            if slot not in damaged:
                assert np.array_equal(out, make_record(want[slot])[1])
        assert pool.corrupt == len(damaged)


@settings(max_examples=30, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.sampled_from(["headers", "payloads"]), st.integers(0, 32 * 8192))
def test_truncated_files_are_misses(populated, tmp_path_factory, name, size):
    path, want = _copy(populated, tmp_path_factory)
    f = pool_dir(path) / name
    size = min(size, f.stat().st_size)
    os.truncate(f, size)
    stride = 4096 if name == "headers" else 8192
    hbytes = records.header_len(TOKENS)
    if name == "headers":
        whole = {s for s in want if s * stride + hbytes <= size}
    else:
        whole = {s for s in want if (s + 1) * stride <= size}
    with open_pool(path) as pool:
        got = contents(pool, keys(want.values()))
        assert got == {s: i for s, i in want.items() if s in whole}
        if name == "payloads":
            # a header whose payload area was cut is counted at scan, not listed
            assert [s for s, _ in pool.scan()] == sorted(whole)
            assert pool.last_scan["corrupt"] == len(want) - len(whole)


def test_swapped_payloads_are_corrupt(tmp_path):
    with open_pool(tmp_path) as pool:
        write_idents(pool, [0, 1], ["s0", "s1"])
    f = pool_dir(tmp_path) / "payloads"
    data = bytearray(f.read_bytes())
    data[0:8192], data[8192:16384] = data[8192:16384], data[0:8192]
    f.write_bytes(bytes(data))
    with open_pool(tmp_path) as pool:
        assert contents(pool, keys(["s0", "s1"])) == {}
        assert pool.corrupt == 2


def test_scan_across_chunks_counts_and_logs_once(tmp_path, caplog):
    n = 2100 + 7                                    # more than one 8 MiB read of headers
    with open_pool(tmp_path, num_slots=n, payload_bytes=64) as pool:
        slots = list(range(0, n, 3))
        write_idents(pool, slots, [f"c{s}" for s in slots])
    headers = pool_dir(tmp_path) / "headers"
    for s in (0, 2049, n - 1 - (n - 1) % 3):
        flip(headers, s * 4096 + 20)
    with caplog.at_level(logging.WARNING), open_pool(tmp_path, num_slots=n,
                                                     payload_bytes=64) as pool:
        found = pool.scan()
        assert len(found) == len(slots) - 3 and pool.corrupt == 3
    warnings = [r for r in caplog.records if "corrupt" in r.getMessage()]
    assert len(warnings) == 1 and "3 corrupt record(s)" in warnings[0].getMessage()


# ----------------------------------------------------------------------------- lock, lifecycle
def test_second_opener_in_this_process_is_refused_until_close(tmp_path):
    a = open_pool(tmp_path)
    with pytest.raises(LockHeldError, match=f"this process \\(pid {os.getpid()}\\)") as info:
        open_pool(tmp_path)
    assert isinstance(info.value, TierUnavailableError) and info.value.pid == os.getpid()
    assert str(pool_dir(tmp_path)) in str(info.value)
    a.close()
    a.close()                                       # idempotent
    open_pool(tmp_path).close()


HOLDER = r"""
import sys
from tiered_cache.data.disk import DiskPool
pool = DiskPool(sys.argv[1], num_slots=4, payload_bytes=6000, num_tokens=4,
                namespace=bytes.fromhex(sys.argv[2]))
print("ready", flush=True)
sys.stdin.readline()
pool.close()
print("closed", flush=True)
sys.stdin.readline()
"""


def _holder(path: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), NS.hex()],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


@pytest.mark.slow
def test_another_process_holds_the_lock_until_it_closes(tmp_path):
    proc = _holder(tmp_path)
    try:
        with pytest.raises(LockHeldError, match=f"in use by process {proc.pid} ") as info:
            open_pool(tmp_path)
        assert info.value.pid == proc.pid
        proc.stdin.write("close\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "closed"
        open_pool(tmp_path).close()
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.slow
def test_a_sigkilled_holder_leaves_no_stale_lock(tmp_path):
    proc = _holder(tmp_path)
    with pytest.raises(LockHeldError):
        open_pool(tmp_path)
    proc.kill()                                     # SIGKILL
    proc.wait()
    open_pool(tmp_path).close()


@pytest.mark.slow
def test_this_process_holding_refuses_another(tmp_path):
    with open_pool(tmp_path):
        code = ("import sys\nfrom tiered_cache.data.disk import DiskPool\n"
                "try:\n    DiskPool(sys.argv[1], num_slots=4, payload_bytes=6000, num_tokens=4,"
                " namespace=bytes.fromhex(sys.argv[2]))\n"
                "except Exception as e:\n    print(type(e).__name__, e)\n")
        out = subprocess.run([sys.executable, "-c", code, str(tmp_path), NS.hex()],
                             capture_output=True, text=True, check=True).stdout
        assert out.startswith("LockHeldError") and f"in use by process {os.getpid()} " in out


def test_closed_pool_refuses_io(tmp_path):
    pool = open_pool(tmp_path)
    pool.close()
    h, p = make_record("x")
    for call in (lambda: pool.write([0], [h], [p]), pool.scan, lambda: pool.erase([0]),
                 lambda: pool.resize(8)):
        with pytest.raises(TierUnavailableError, match="closed"):
            call()
    assert pool.stats()["closed"] is True


# ----------------------------------------------------------------------------- space, resize
def test_disk_too_small_is_a_clear_error(tmp_path):
    with pytest.raises(DiskFullError, match=r"need [\d,]+ more bytes .* only [\d,]+ are free"):
        open_pool(tmp_path, num_slots=10**6, payload_bytes=1 << 30)
    with open_pool(tmp_path, num_slots=4) as pool:   # a failed open leaves a usable directory
        with pytest.raises(DiskFullError, match="only"):
            pool.resize(10**9)
        assert pool.num_slots == 4


def test_space_accounting_matches_the_disk(tmp_path):
    with open_pool(tmp_path, num_slots=64) as pool:
        st_ = pool.stats()
        assert st_["bytes_reserved"] == 64 * (4096 + 8192)
        assert st_["bytes_on_disk"] >= st_["bytes_reserved"]    # preallocated, not sparse
        pool.resize(16)
        assert pool.stats()["bytes_on_disk"] < st_["bytes_on_disk"]


def test_resize_keeps_records_in_remaining_slots(tmp_path):
    with open_pool(tmp_path, num_slots=16, max_slots=64) as pool:
        write_idents(pool, [1, 5, 12], ["z1", "z5", "z12"])
        pool.resize(64)
        write_idents(pool, [40], ["z40"])
        pool.resize(8)                                # 12 and 40 cut off
        with pytest.raises(IndexError):
            write_idents(pool, [12], ["z12"])
        pool.resize(48)                               # grown back: empty, not resurrected
        assert contents(pool, keys(["z1", "z5", "z12", "z40"])) == {1: "z1", 5: "z5"}
        with pytest.raises(CapacityError, match="max_slots"):
            pool.resize(65)
    with open_pool(tmp_path, num_slots=6) as pool:    # reopen smaller: 5 kept, cut at 6
        assert contents(pool, keys(["z1", "z5"])) == {1: "z1", 5: "z5"}


# ----------------------------------------------------------------------------- threads
def test_concurrent_writers_and_readers_on_different_slots(tmp_path):
    n_threads, per = 4, 24
    errors = []
    with open_pool(tmp_path, num_slots=n_threads * per) as pool:
        def worker(t: int) -> None:
            try:
                base = t * per
                for r in range(3):
                    slots = list(range(base, base + per, 2)) if r % 2 else list(
                        range(base, base + per))
                    write_idents(pool, slots, [f"w{t}.{r}.{s}" for s in slots])
                    found = {s: h for s, h in zip(slots, [records.decode_header(
                        make_record(f"w{t}.{r}.{s}")[0]) for s in slots])}
                    outs = [np.empty(PB, np.uint8) for _ in slots]
                    pool.read_many(slots, [found[s] for s in slots], outs)
                    for s, o in zip(slots, outs):
                        assert np.array_equal(o, make_record(f"w{t}.{r}.{s}")[1])
            except BaseException as exc:         # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors, errors
    with open_pool(tmp_path, num_slots=n_threads * per) as pool:
        want = {}
        for t in range(n_threads):
            for s in range(t * per, (t + 1) * per):
                want[s] = f"w{t}.2.{s}"
        idents = {f"w{t}.{r}.{s}" for t in range(n_threads) for r in range(3)
                  for s in range(t * per, (t + 1) * per)}
        assert contents(pool, keys(idents)) == want


def test_close_waits_for_io_and_later_calls_fail_cleanly(tmp_path):
    """A close racing writers: every write either completes or raises TierUnavailableError
    ("closed"), never an OSError on a closed (or reused) file descriptor."""
    pool = open_pool(tmp_path, num_slots=64)
    outcomes: list[object] = []
    start = threading.Barrier(3)

    def writer(t: int) -> None:
        start.wait()
        for r in range(200):
            try:
                write_idents(pool, [t * 32 + r % 32], [f"c{t}.{r}"])
            except TierUnavailableError as exc:
                outcomes.append(exc)
                return
            except BaseException as exc:         # noqa: BLE001
                outcomes.append(exc)
                return
        outcomes.append("done")

    threads = [threading.Thread(target=writer, args=(t,)) for t in range(2)]
    for th in threads:
        th.start()
    start.wait()
    pool.close()
    for th in threads:
        th.join()
    for o in outcomes:
        assert o == "done" or (isinstance(o, TierUnavailableError) and "closed" in str(o)), o


# ----------------------------------------------------------------------------- O_DIRECT
def test_o_direct_refused_falls_back_with_a_warning(caplog):
    """tmpfs refused O_DIRECT before Linux 6.6; where no filesystem here refuses it, skip."""
    probe = Path("/dev/shm") / f"tc-odirect-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_DIRECT)
        os.close(fd)
        pytest.skip("/dev/shm accepts O_DIRECT on this kernel: no refusing filesystem here")
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
    finally:
        probe.unlink(missing_ok=True)
    path = Path("/dev/shm") / f"tc-disk-{os.getpid()}"
    try:
        with caplog.at_level(logging.WARNING), open_pool(path, o_direct=True) as pool:
            assert not pool.o_direct and pool.o_direct_refused
            write_idents(pool, [0], ["d0"])
            assert contents(pool, keys(["d0"])) == {0: "d0"}
        assert "refuses O_DIRECT" in caplog.text
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------- pieces
@pytest.mark.parametrize("o_direct", [False, True])
def test_payload_in_pieces_round_trip(tmp_path, o_direct):
    """A payload given as a list of buffers (a page lying in several places of an engine's
    pool) is written and read back to back, verified like one buffer, and reads into pieces."""
    header, payload = make_record("pieces")
    cuts = [0, 1000, 1001, 4500, PB]
    pieces = [payload[a:b] for a, b in zip(cuts, cuts[1:])]
    with open_pool(tmp_path, o_direct=o_direct) as pool:
        [rec] = pool.write([3], [header], [pieces])
        outs = [np.zeros(b - a, dtype=np.uint8) for a, b in zip(cuts, cuts[1:])]
        pool.read(3, rec, outs)
        assert np.array_equal(np.concatenate(outs), payload)
        whole = np.zeros(PB, dtype=np.uint8)
        pool.read(3, rec, whole)
        assert np.array_equal(whole, payload)
        with pytest.raises(ValueError, match="a slot holds"):
            pool.write([4], [header], [pieces[:-1]])
        # a header whose payload hash does not match the pieces is a miss, never data
        bad = [p.copy() for p in pieces]
        bad[2][0] ^= 1
        pool.write([5], [header], [bad])
        with pytest.raises(CorruptRecord):
            pool.read(5, rec, [np.zeros(b - a, dtype=np.uint8) for a, b in zip(cuts, cuts[1:])])
