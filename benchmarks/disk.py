"""Disk tier bandwidth and restart time: DiskPool vs plain sequential file I/O of the same bytes.

Blocks have the 70B geometry (8 KV heads, head_dim 128, 16-token blocks, bfloat16) with 8 layers
instead of 80, so one block is 512 KiB (a 70B block is 5 MiB) and a run moves a few hundred MiB.
They sit in page-aligned host memory, as the host tier's slots do (tiered_cache.data.segments).

- write: `DiskPool.write` of every block, in batches (each durable on return: payloads, then
  headers, each fdatasync'd), vs the same bytes written with `os.pwrite` to one file in the same
  directory in the same batches, each fdatasync'd (the same durability: `plain_GBps`, `ratio`),
  and with one fdatasync at the very end (the plainest write: `plain_1sync_GBps`, `ratio_1sync`).
  Fresh slots (erased, untimed, before each repeat), and reused slots (the pool tombstones their
  old headers first: one more fdatasync per batch).
- read: `DiskPool.read_many` of every block into host memory, payload hash verified, vs
  `os.preadv` of the same bytes from the plain file.
- cache: "page cache" is buffered I/O, reads warm (just written); "cold" is buffered I/O with
  `posix_fadvise(DONTNEED)` on both files before each read repeat (the data is durable, so
  the kernel drops it); "O_DIRECT" bypasses the page cache for pool and baseline alike.
- scan: reopen a pool of 10^5 records (4 KiB payloads, so it fits) and `scan()` it, header table
  dropped from the page cache first: the index rebuild of a restart. Baseline: one sequential
  read of the same header table. Target < 5 s.

- cache reopen: a TieredKVCache started on a disk tier holding 10^5 blocks (chains of 64, tiny
  payloads): scan + index rebuild (every record's key, parent, root and tokens checked), next
  to the pool's scan alone. Target < 5 s.
- cache demotion: a cache serving prompts whose blocks the migrator demotes device -> host ->
  disk (70B geometry, 8 layers), bytes reaching the disk per second of serving, next to a plain
  write of the same bytes (one fdatasync per batch).

Target: ours >= 0.8x the plain file for every bandwidth row.

    python benchmarks/disk.py [--quick] [--dir DIR] [--out results/disk.json]
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import xxhash

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import default_out, environment, gbps, print_table, write_json  # noqa: E402

from tiered_cache import records  # noqa: E402
from tiered_cache.data.disk import DiskPool  # noqa: E402

FULL = {"num_layers": 80, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}
LAYERS = 8
BLOCK_BYTES = LAYERS * 2 * FULL["block_size"] * FULL["num_kv_heads"] * FULL["head_dim"] * 2
TARGET = 0.8
SCAN_TARGET_S = 5.0


def host_blocks(n: int) -> torch.Tensor:
    """n blocks of random KV in page-aligned memory, [n, BLOCK_BYTES] uint8."""
    buf = mmap.mmap(-1, n * BLOCK_BYTES)
    t = torch.frombuffer(buf, dtype=torch.uint8).view(n, BLOCK_BYTES)
    rng = np.random.default_rng(0)
    for i in range(n):
        t[i] = torch.from_numpy(np.frombuffer(bytearray(rng.bytes(BLOCK_BYTES)), np.uint8))
    return t


def headers_for(ns: bytes, blocks: torch.Tensor, tag: bytes) -> list[bytes]:
    tokens = records.tokens_bytes(np.arange(FULL["block_size"]))
    out = []
    for i in range(blocks.shape[0]):
        key = xxhash.xxh3_128_digest(tag + i.to_bytes(8, "little"))
        out.append(records.encode_header(ns, key, key, ns, i, tokens, 0, BLOCK_BYTES,
                                         records.payload_hash(blocks[i].numpy())))
    return out


def drop_cache(path: Path) -> None:
    """Evict a (durable) file's pages from the page cache."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class PlainFile:
    """The baseline: one file, the same bytes, sequential positional I/O in the same chunks."""

    def __init__(self, path: Path, nbytes: int, o_direct: bool) -> None:
        self.path = path
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if o_direct else 0)
        self.fd = os.open(path, flags, 0o644)
        self.nbytes = nbytes

    def write(self, host: torch.Tensor, batch: int, sync_each: bool = True) -> None:
        """`sync_each`: fdatasync after every batch, the durability DiskPool.write gives (each
        call durable on return); else once at the end."""
        view = memoryview(host.numpy()).cast("B")
        step = batch * BLOCK_BYTES
        for off in range(0, self.nbytes, step):
            os.pwrite(self.fd, view[off:off + step], off)
            if sync_each:
                os.fdatasync(self.fd)
        if not sync_each:
            os.fdatasync(self.fd)

    def read(self, host: torch.Tensor, batch: int) -> None:
        view = memoryview(host.numpy()).cast("B")
        step = batch * BLOCK_BYTES
        for off in range(0, self.nbytes, step):
            os.preadv(self.fd, [view[off:off + step]], off)

    def close(self) -> None:
        os.close(self.fd)


def bandwidth_rows(work: Path, n: int, batch: int, repeats: int) -> list[dict]:
    src = host_blocks(n)
    dst = host_blocks(n)
    rows = []
    for o_direct in (False, True):
        rows += mode_rows(work, src, dst, batch, repeats, o_direct)
    nbytes = n * BLOCK_BYTES
    t0 = time.perf_counter()
    for i in range(n):
        records.payload_hash(src[i].numpy())
    rows.append({"direction": "hash", "slots": "xxh3-128 of each payload (caller, info)",
                 "cache": "", "blocks": n, "MiB": nbytes / 2**20,
                 "ours_GBps": gbps(nbytes, time.perf_counter() - t0)})
    return rows


def paired(ours: Callable[[], None], base: Callable[[], None],
           ours_setup: Callable[[], None] | None, base_setup: Callable[[], None] | None,
           repeats: int) -> tuple[list[float], list[float]]:
    """Seconds of `ours` and `base`, alternated (one untimed round first), each after its setup
    (untimed). NOTE: alternated, because this machine's disk swings between speeds from one
    second to the next; measured apart, a swing lands on one side only."""
    t_ours: list[float] = []
    t_base: list[float] = []
    for r in range(repeats + 1):
        for fn, setup, out in ((ours, ours_setup, t_ours), (base, base_setup, t_base)):
            if setup is not None:
                setup()
            t0 = time.perf_counter()
            fn()
            if r:
                out.append(time.perf_counter() - t0)
    return t_ours, t_base


def mode_rows(work: Path, src: torch.Tensor, dst: torch.Tensor, batch: int, repeats: int,
              o_direct: bool) -> list[dict]:
    """The write and read rows of one I/O mode (buffered or O_DIRECT)."""
    n = src.shape[0]
    nbytes = n * BLOCK_BYTES
    slots = list(range(n))
    batches = [slots[i:i + batch] for i in range(0, n, batch)]
    ns = xxhash.xxh3_128_digest(b"bench-disk-%d" % o_direct)
    heads = headers_for(ns, src, b"k")
    pool = DiskPool(work, num_slots=n, payload_bytes=BLOCK_BYTES,
                    num_tokens=FULL["block_size"], namespace=ns, o_direct=o_direct)
    plain = PlainFile(work / f"plain-{int(o_direct)}.bin", nbytes, o_direct)
    found: dict[int, records.RecordHeader] = {}

    src_np, dst_np = src.numpy(), dst.numpy()      # numpy views of the host slots

    def pool_write() -> None:
        for b in batches:
            for s, h in zip(b, pool.write(b, [heads[s] for s in b], [src_np[s] for s in b])):
                found[s] = h

    def pool_read() -> None:
        for b in batches:
            pool.read_many(b, [found[s] for s in b], [dst_np[s] for s in b])

    def plain_write() -> None:
        plain.write(src, batch)

    def plain_write_1sync() -> None:
        plain.write(src, batch, sync_each=False)

    def plain_read() -> None:
        plain.read(dst, batch)

    def erase() -> None:
        pool.erase(slots)

    def cold() -> None:
        drop_cache(pool.dir / "payloads")
        drop_cache(plain.path)

    cache = "O_DIRECT" if o_direct else "page cache"
    cases = [("write", "fresh slots", cache, pool_write, plain_write, erase, None),
             ("write", "reused slots", cache, pool_write, plain_write, None, None),
             ("read", "", cache, pool_read, plain_read, None, None)]
    if not o_direct:
        cases.append(("read", "", "cold (fadvise DONTNEED)", pool_read, plain_read, cold, cold))
    rows = []
    try:
        for direction, kind, cache_kind, ours, base, setup, base_setup in cases:
            t_ours, t_base = paired(ours, base, setup, base_setup, repeats)
            if direction == "read":
                assert torch.equal(dst, src), "read returned other bytes"
            ratio = statistics.median(t_base) / statistics.median(t_ours)
            row = {"direction": direction, "slots": kind, "cache": cache_kind,
                   "o_direct": pool.o_direct, "blocks": n, "batch": batch, "MiB": nbytes / 2**20,
                   "ours_GBps": gbps(nbytes, statistics.median(t_ours)),
                   "plain_GBps": gbps(nbytes, statistics.median(t_base)), "ratio": ratio,
                   f"meets_{TARGET}": ratio >= TARGET, "ours_s": t_ours, "plain_s": t_base}
            if direction == "write":
                # the plainest baseline too: the same bytes, one fdatasync at the very end
                _, t_one = paired(ours, plain_write_1sync, setup, None, max(1, repeats // 2))
                row["plain_1sync_GBps"] = gbps(nbytes, statistics.median(t_one))
                row["ratio_1sync"] = statistics.median(t_one) / statistics.median(t_ours)
            rows.append(row)
    finally:
        pool.close()
        plain.close()
        shutil.rmtree(pool.dir)
        plain.path.unlink()
    return rows


def scan_row(work: Path, count: int) -> dict:
    ns = xxhash.xxh3_128_digest(b"bench-disk-scan")
    pb = 4096
    kw = dict(num_slots=count, payload_bytes=pb, num_tokens=FULL["block_size"], namespace=ns)
    payload = np.frombuffer(np.random.default_rng(1).bytes(pb), dtype=np.uint8)
    digest = records.payload_hash(payload)
    tokens = records.tokens_bytes(np.arange(FULL["block_size"]))
    t0 = time.perf_counter()
    with DiskPool(work, **kw) as pool:
        step = 4096
        for start in range(0, count, step):
            sl = list(range(start, min(count, start + step)))
            heads = [records.encode_header(ns, xxhash.xxh3_128_digest(s.to_bytes(8, "little")),
                                           ns, ns, s, tokens, 0, pb, digest) for s in sl]
            pool.write(sl, heads, [payload] * len(sl))
    fill_s = time.perf_counter() - t0
    headers = work / ns.hex() / "headers"
    drop_cache(headers)
    t0 = time.perf_counter()
    with DiskPool(work, **kw) as pool:
        found = pool.scan()
    reopen_s = time.perf_counter() - t0
    assert len(found) == count, f"scan found {len(found)} of {count} records"
    with DiskPool(work, **kw) as pool:
        t0 = time.perf_counter()
        pool.scan()
        warm_s = time.perf_counter() - t0
    drop_cache(headers)
    t0 = time.perf_counter()
    with open(headers, "rb", buffering=0) as f:
        while f.read(8 << 20):
            pass
    plain_s = time.perf_counter() - t0
    table_mib = headers.stat().st_size / 2**20
    shutil.rmtree(work / ns.hex())
    return {"records": count, "header_table_MiB": table_mib,
            "fill_s": fill_s, "reopen_and_scan_cold_s": reopen_s, "scan_warm_s": warm_s,
            "plain_read_of_header_table_cold_s": plain_s,
            f"meets_{SCAN_TARGET_S}s": reopen_s < SCAN_TARGET_S}


def _disk_config(path: Path, *, layers: int, heads: int, dim: int, gpu: int, host: int,
                 disk: int) -> dict:
    return {"model": {"name": "bench-disk", "num_layers": layers, "num_kv_heads": heads,
                      "head_dim": dim, "dtype": "bfloat16"},
            "block_size": FULL["block_size"],
            "tiers": {"gpu": {"device": "cpu", "num_blocks": gpu},
                      "host": {"num_blocks": host, "memory": "pageable"},
                      "disk": {"path": str(path), "num_blocks": disk, "admit_min_hits": 0}},
            "compactor": {"enabled": False}}


def cache_reopen_row(work: Path, count: int) -> dict:
    """Reopen a cache whose disk holds `count` blocks: scan + rebuild of the index."""
    from tiered_cache import CacheConfig, TieredKVCache

    cfg = CacheConfig.from_dict(_disk_config(work, layers=1, heads=1, dim=8, gpu=64, host=64,
                                             disk=count))
    bs = FULL["block_size"]
    cache = TieredKVCache(cfg)
    hasher, ns = cache.hasher, cache.hasher.namespace_digest()
    pool = cache.pools[2]
    cache.shutdown()
    pb = pool.kv_bytes
    payload = np.zeros(pb, dtype=np.uint8)
    digest = records.payload_hash(payload)
    root, _ = hasher.root(None, None)
    t0 = time.perf_counter()
    with DiskPool(work, num_slots=count, payload_bytes=pb, num_tokens=bs, namespace=ns) as raw:
        slots, heads, chain = [], [], 64
        key = root
        for s in range(count):
            depth = s % chain
            if depth == 0:
                key = root
            tokens = np.arange(s * bs, (s + 1) * bs, dtype="<i4").tobytes()
            parent, key = key, hasher.key(key, tokens)
            heads.append(records.encode_header(ns, key, parent, root, depth, tokens, 1, pb,
                                               digest))
            slots.append(s)
            if len(slots) == 4096 or s == count - 1:
                raw.write(slots, heads, [payload] * len(slots))
                slots, heads = [], []
    fill_s = time.perf_counter() - t0
    drop_cache(next(work.glob("*/headers")))
    t0 = time.perf_counter()
    cache = TieredKVCache(cfg)
    reopen_s = time.perf_counter() - t0
    recovered = cache.stats()["recovered_blocks"]
    cache.shutdown()
    with DiskPool(work, num_slots=count, payload_bytes=pb, num_tokens=bs, namespace=ns) as raw:
        t0 = time.perf_counter()
        raw.scan()
        scan_s = time.perf_counter() - t0
    assert recovered == count, f"recovered {recovered} of {count}"
    shutil.rmtree(work / ns.hex())
    return {"blocks": count, "fill_s": fill_s, "cache_reopen_s": reopen_s,
            "pool_scan_warm_s": scan_s, "index_rebuild_s": max(0.0, reopen_s - scan_s),
            f"meets_{SCAN_TARGET_S}s": reopen_s < SCAN_TARGET_S}


def cache_demotion_row(work: Path, n: int, batch: int) -> dict:
    """Serve n/4 distinct 4-block prompts through a cache whose device tier holds 32 blocks and
    host tier 128: the migrator demotes the rest to disk, batch by batch. GB/s of those
    host -> disk demotion copies (time on the copy thread: the handler, the record hashes, the
    three fdatasyncs of each batch) vs a plain write of the same bytes in batches of the same
    mean size, each fdatasync'd."""
    from tiered_cache import CacheConfig, TieredKVCache

    cfg = CacheConfig.from_dict(_disk_config(work, layers=LAYERS, heads=FULL["num_kv_heads"],
                                             dim=FULL["head_dim"], gpu=32, host=128,
                                             disk=n + 64))
    cache = TieredKVCache(cfg)
    bs = FULL["block_size"]
    k = torch.zeros((4 * bs, FULL["num_kv_heads"], FULL["head_dim"]), dtype=torch.bfloat16)
    for i in range(n // 4):
        seq = cache.open(list(range(i * 4 * bs, (i + 1) * 4 * bs)))
        for layer in range(LAYERS):
            cache.write(seq, layer, k, k)
        cache.close(seq)
    cache.migrator.settle(120)
    copies = cache.stats()["copies"].get("host->disk", {"blocks": 0, "seconds": 0.0})
    cache.shutdown()
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True, exist_ok=True)
    blocks = copies["blocks"]
    per = max(1, round(blocks / max(1, _demotion_batches(blocks, 128))))
    src = host_blocks(max(1, min(blocks, 256)))
    plain = work / "plain"
    fd = os.open(plain, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        t1 = time.perf_counter()
        for start in range(0, blocks, per):
            for j in range(start, min(blocks, start + per)):
                os.pwrite(fd, memoryview(src[j % len(src)].numpy()).cast("B"), j * BLOCK_BYTES)
            os.fdatasync(fd)
        plain_s = time.perf_counter() - t1
    finally:
        os.close(fd)
        plain.unlink()
    ours = gbps(blocks * BLOCK_BYTES, copies["seconds"])
    base = gbps(blocks * BLOCK_BYTES, plain_s)
    return {"prompts": n // 4, "blocks_demoted_to_disk": blocks, "batch_blocks": per,
            "ours_GBps": ours, "plain_GBps": base, "ratio": ours / base if base else 0.0}


def _demotion_batches(blocks: int, host: int) -> int:
    """Batches the host demoter makes: it lowers the host tier from the high watermark (0.9)
    to the low one (0.8) each round, so about 0.1 * host blocks a batch."""
    return -(-blocks // max(1, int(0.1 * host)))


def filesystem(path: Path) -> str:
    try:
        return subprocess.run(["findmnt", "-n", "-o", "FSTYPE,SOURCE", "-T", str(path)],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    ap.add_argument("--dir", default=None, help="where to put the files (default: a temp dir)")
    ap.add_argument("--blocks", type=int, default=None, help="blocks per bandwidth run")
    ap.add_argument("--batch", type=int, default=64, help="blocks per write/read call")
    ap.add_argument("--scan-records", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--out", default=default_out("disk"))
    args = ap.parse_args()
    n = args.blocks or (64 if args.quick else 512)
    scan_n = args.scan_records or (10**4 if args.quick else 10**5)
    repeats = args.repeats or (2 if args.quick else 7)
    work = Path(tempfile.mkdtemp(prefix="tc-bench-disk-", dir=args.dir))
    need = 2 * n * (BLOCK_BYTES + 4096) + scan_n * 2 * 4096
    free = shutil.disk_usage(work).free
    if need * 1.2 > free:
        sys.exit(f"{work}: needs about {need / 2**30:.1f} GiB free, has {free / 2**30:.1f}")
    print(f"files in {work} ({filesystem(work)}), {need / 2**20:,.0f} MiB at most, "
          f"{free / 2**30:,.1f} GiB free", flush=True)
    load_before = os.getloadavg()
    try:
        rows = bandwidth_rows(work, n, args.batch, repeats)
        scan = scan_row(work, scan_n)
        reopen = cache_reopen_row(work / "reopen", scan_n)
        demotion = cache_demotion_row(work / "demotion", n, args.batch)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    load = {"before": load_before, "after": os.getloadavg(), "cpus": os.cpu_count()}
    print_table(rows, ["direction", "slots", "cache", "blocks", "batch", "MiB", "ours_GBps",
                       "plain_GBps", "ratio", f"meets_{TARGET}", "plain_1sync_GBps",
                       "ratio_1sync"],
                title=f"disk tier: DiskPool vs a plain sequential file, {BLOCK_BYTES // 1024} "
                      f"KiB blocks ({LAYERS} of {FULL['num_layers']} layers of a 70B model)")
    print()
    print_table([scan], title="restart: reopen + scan (index rebuild), header table cold")
    print()
    print_table([reopen], title="restart of a cache: TieredKVCache() on a disk tier of "
                                f"{scan_n:,} blocks (scan + index rebuild)")
    print()
    print_table([demotion], title="serving with demotion device -> host -> disk (migrator)")
    print(f"load average (1 min) {load['before'][0]:.1f} before, {load['after'][0]:.1f} after, "
          f"on {load['cpus']} CPUs: other work on this machine shares the disk and the CPUs")
    bw = [r for r in rows if "ratio" in r]
    write_json(args.out, {
        "benchmark": "disk", "quick": args.quick, "filesystem": filesystem(work.parent),
        "geometry": {**FULL, "num_layers": LAYERS, "full_num_layers": FULL["num_layers"],
                     "layers_scaled_down": True, "dtype": "bfloat16",
                     "block_bytes": BLOCK_BYTES},
        "target_ratio": TARGET, "repeats": repeats, "load_average": load, "rows": rows,
        "scan": scan, "cache_reopen": reopen, "cache_demotion": demotion,
        "all_meet_target": all(r[f"meets_{TARGET}"] for r in bw)
        and scan[f"meets_{SCAN_TARGET_S}s"] and reopen[f"meets_{SCAN_TARGET_S}s"],
        "environment": environment()})


if __name__ == "__main__":
    main()
