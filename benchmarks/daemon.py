"""The node daemon end to end: lookups through its socket, copies out of and into its shared
memory, publishes, and aggregate lookups/s of several client processes.

A real node daemon (`python -m tiered_cache serve`, via `tiered_cache.daemon.process.NodeProcess`)
runs in a subprocess with one partition: 8 layers, 8 KV heads, head_dim 128, 16-token blocks,
float16 (512 KiB blocks: the 70B geometry with 8 layers instead of 80). An engine
(`TieredKVCache` with `tiers.daemon`, CPU "GPU" tier) computes a prefix of 128 blocks (the
largest of `--sizes`) and publishes it; the benchmark then talks to the daemon with the raw
protocol the engine's `DaemonTier` speaks (hello, attach: two fds, root, fetch / release,
publish, lookup). Each measurement sits next to a baseline taken in the same run:

- latency: p50/p99 of `lookup` (root, parent = root, the tokens of N cached blocks; nothing
  pinned) next to `BlockIndex.peek` of the same blocks in an in-process `TieredKVCache`
  (`storage: none`, the same index code without the socket); and of the `fetch` + `release`
  pair (what an engine's open() sends: pin, then unpin after the copy) next to the in-process
  `open` + `close` of the same tokens. A no-op `heartbeat` gives the bare round trip.
- copies: GB/s of a client's copy out of the pool (its read-only mapping) into a tensor laid out
  like an engine's device pool, `kernels.copy_blocks_to_gpu` as `DaemonTier.load` does, and of
  the copy into its staging area, `kernels.copy_blocks_to_host` as `DaemonTier.put` does, each
  next to a plain `dst.copy_(src)` of the same bytes between two private contiguous tensors.
  Target: >= 0.9x. GB/s are medians (and bests) of the repeats; the ratio is the median of
  back-to-back pairs (ours, then the baseline), so load drifting over the run hits both alike.
- publish (end to end put): blocks/s and GB/s of the client copy into staging + the `publish`
  request (the daemon checks every key and copies staging -> pool), fresh chained keys each
  round, next to the same plain copy_. A put moves the bytes twice, so ~0.5x is its bound.
  NOTE: that copy_ runs between the same two buffers every round, so part of them stays in
  the cache (32 MiB moved; a 32 MiB L3 here), while the publish reads a staging area the client
  has just written and writes pool slots that are not cached. The publish request is
  therefore also put next to a copy_ with its own memory pattern (out of the staging area
  just written, into one of 8 private regions in turn): what the daemon's own work costs,
  apart from the memory system's.
  Each round's blocks are invalidated after it (the pool never fills), and warm-up rounds
  first write every pool slot once (the first write of a slot page-faults it into the
  daemon's mapping: reported apart, as `publish_first_touch`).
- throughput: aggregate `lookup`s/s of 1, 2 and 4 client processes (one connection each, tight
  loop for `--seconds`), next to linear scaling of the 1-client rate (and, for 1 client, the
  in-process peek rate). The daemon's own CPU time per run is recorded (cores busy, and CPU
  us per lookup): on a 2-core machine the daemon and 4 clients share 2 cores, so 4 clients
  cannot scale linearly; and the daemon is one Python process (a thread per connection, one
  GIL), so its share is at most about one core whatever the clients.

Absolute numbers depend on the machine (client and daemon share its cores); the ratios within
the run are the result.

    python benchmarks/daemon.py                 # ~40 s (more on a loaded machine)
    python benchmarks/daemon.py --quick         # a smoke run, ~15-20 s
    python benchmarks/daemon.py --out /tmp/daemon.json   (--json is the same option)
"""

from __future__ import annotations

import argparse
import os
import select
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO))
from common import default_out, environment, gbps, print_table, quantile, write_json  # noqa: E402

from tiered_cache import kernels  # noqa: E402
from tiered_cache.daemon.process import NodeProcess  # noqa: E402
from tiered_cache.hashing import xxh3_128  # noqa: E402
from tiered_cache.wire.client import Client, Heartbeat  # noqa: E402
from tiered_cache.wire.ops import make_protocol  # noqa: E402
from tiered_cache.wire.shm import PoolGeometry, SharedPool  # noqa: E402

TARGET = 0.9
MODEL = {"name": "bench", "num_layers": 8, "num_kv_heads": 8, "head_dim": 128,
         "num_q_heads": 64, "dtype": "float16"}
BS = 16
L, H, D = MODEL["num_layers"], MODEL["num_kv_heads"], MODEL["head_dim"]
BLOCK_BYTES = L * 2 * BS * H * D * 2            # 512 KiB
CLOCK = time.perf_counter


# ---------------------------------------------------------------------------------- setup

def write_config(tmp: Path, host_blocks: int, staging: int, lease_s: float) -> tuple[Path, str]:
    sock = str(tmp / "s" / "daemon.sock")       # "s" does not exist: the daemon makes it 0700
    if len(sock.encode()) >= 90:
        raise SystemExit(f"socket path too long ({len(sock)} bytes): {sock}")
    m = MODEL
    cfg = tmp / "daemon.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        model: {{name: {m['name']}, num_layers: {L}, num_kv_heads: {H}, head_dim: {D},
                num_q_heads: {m['num_q_heads']}, dtype: {m['dtype']}}}
        block_size: {BS}
        tiers:
          gpu: {{num_blocks: 8, device: cpu}}
          host: {{num_blocks: {host_blocks}}}
        daemon: {{socket: {sock}, lease_s: {lease_s}, staging_blocks: {staging}}}
        """))
    return cfg, sock


def engine_config(sock: str | None, gpu_blocks: int) -> dict:
    tiers: dict = {"gpu": {"num_blocks": gpu_blocks, "device": "cpu"}}
    if sock is None:
        tiers["host"] = {"num_blocks": 0}
        return {"model": MODEL, "block_size": BS, "tiers": tiers, "storage": "none",
                "verify_tokens": True}
    tiers["daemon"] = {"socket": sock, "timeout_s": 30.0}
    return {"model": MODEL, "block_size": BS, "tiers": tiers}


def populate(sock: str, tokens: np.ndarray, seed: int) -> tuple[list[torch.Tensor], float]:
    """An engine computes `tokens` (every layer written) and publishes them to the daemon (in
    the background, as it would while serving); returns the keys it wrote per layer (for the
    copy check) and the seconds until the daemon had taken every block."""
    from tiered_cache import TieredKVCache
    from tiered_cache.config import CacheConfig

    nblocks = len(tokens) // BS
    gen = torch.Generator().manual_seed(seed)
    kv = [torch.randn((len(tokens), H, D), generator=gen).to(torch.float16) for _ in range(L)]
    cache = TieredKVCache(CacheConfig.from_dict(engine_config(sock, nblocks + 8)))
    try:
        t0 = CLOCK()
        seq = cache.open(tokens)
        for layer in range(L):
            cache.write(seq, layer, kv[layer], -kv[layer])      # V = -K: checkable
        cache.close(seq)
        deadline = time.monotonic() + 60
        while True:
            store = cache.stats()["tiers"]["daemon"]["store"]
            if store["taken_blocks"] >= nblocks:
                break
            if time.monotonic() > deadline:
                raise RuntimeError(f"the daemon took {store['taken_blocks']} of {nblocks} "
                                   f"blocks in 60 s: {store}")
            time.sleep(0.01)
        took = CLOCK() - t0
    finally:
        cache.shutdown()
    return kv, took


class RawClient:
    """The protocol as DaemonTier speaks it: hello, attach (pool read-only, staging
    read-write), root; a heartbeat thread keeps the lease."""

    def __init__(self, sock: str) -> None:
        self.client = Client(sock, make_protocol(), timeout_s=30.0).connect()
        hello = self.client.call("hello")
        reply = self.client.request("attach")
        fields = dict(reply.fields)
        n_staging = fields.pop("staging_slots")
        g = PoolGeometry.from_fields(fields)
        self.pool = SharedPool.attach(reply.fds[0], g, writable=False)
        self.staging = SharedPool.attach(reply.fds[1], PoolGeometry(
            n_staging, g.num_layers, g.block_size, g.num_kv_heads, g.head_dim, g.dtype))
        self.root = self.client.call("root", salt=b"")["root"]
        self.lease_s = hello["lease_s"]
        self.beat = Heartbeat(self.client, self.lease_s).start()

    def call(self, op: str, **fields):
        return self.client.call(op, **fields)

    def close(self) -> None:
        self.beat.stop(5)
        self.pool.close()
        self.staging.close()
        self.client.close()


# ---------------------------------------------------------------------------------- latency

def interleaved(cases: dict, iters: int, rounds: int = 10) -> dict[str, list[float]]:
    """Time each case `iters` times, in rounds that alternate the cases (noise from other
    processes then hits every case alike). Warm-up first."""
    for fn in cases.values():
        for _ in range(max(20, iters // 20)):
            fn()
    times: dict[str, list[float]] = {k: [] for k in cases}
    per = max(1, iters // rounds)
    for _ in range(rounds):
        for name, fn in cases.items():
            ts = times[name]
            for _ in range(per):
                t0 = CLOCK()
                fn()
                ts.append(CLOCK() - t0)
    return times


def latency(raw: RawClient, local, tokens: np.ndarray, sizes: list[int],
            iters: int) -> tuple[list[dict], dict]:
    root_key, root_id = local.index.register_root(None, None)
    rows: list[dict] = []
    rates: dict = {}
    hb = interleaved({"heartbeat": lambda: raw.call("heartbeat")}, iters)["heartbeat"]
    rows.append(_lat_row("heartbeat round trip (no-op)", None, hb, None, ""))
    for n in sizes:
        toks = tokens[:n * BS]
        got = raw.call("lookup", root=raw.root, parent=raw.root, tokens=toks)["blocks"]
        if got != n:
            raise RuntimeError(f"daemon lookup of {n} cached blocks found {got}")
        if local.index.peek(root_id, root_key, toks) != n:
            raise RuntimeError(f"in-process peek of {n} blocks did not find them all")

        def d_lookup(toks=toks) -> None:
            raw.call("lookup", root=raw.root, parent=raw.root, tokens=toks)

        def l_peek(toks=toks) -> None:
            local.index.peek(root_id, root_key, toks)

        def d_fetch(toks=toks, n=n) -> None:
            r = raw.call("fetch", root=raw.root, parent=raw.root, tokens=toks, wait_ms=2000)
            assert len(r["slots"]) == n, r
            assert raw.call("release", handle=r["handle"])["held"]

        def l_open(toks=toks, n=n) -> None:
            seq = local.open(toks)
            local.close(seq)

        k = iters if n <= 16 else max(200, iters // 4)
        t = interleaved({"lookup": d_lookup, "peek": l_peek, "fetch": d_fetch, "open": l_open},
                        k)
        rows.append(_lat_row(f"lookup, {n} blocks", n, t["lookup"], t["peek"],
                             "in-process BlockIndex.peek"))
        rows.append(_lat_row(f"fetch+release, {n} blocks", n, t["fetch"], t["open"],
                             "in-process open+close"))
        rates[n] = {"peek_per_s": 1 / quantile(t["peek"], 0.5),
                    "lookup_per_s_1_client_inline": 1 / quantile(t["lookup"], 0.5)}
    return rows, rates


def _lat_row(name: str, n, ts: list[float], base: list[float] | None, what: str) -> dict:
    p50, p99 = quantile(ts, 0.5) * 1e6, quantile(ts, 0.99) * 1e6
    row = {"measurement": name, "blocks": n, "samples": len(ts), "daemon_p50_us": p50,
           "daemon_p99_us": p99}
    if base is not None:
        b50, b99 = quantile(base, 0.5) * 1e6, quantile(base, 0.99) * 1e6
        row.update(baseline=what, baseline_p50_us=b50, baseline_p99_us=b99,
                   x_baseline_p50=p50 / b50, x_baseline_p99=p99 / b99)
    return row


# ---------------------------------------------------------------------------------- copies

def _best_median(ts: list[float]) -> tuple[float, float]:
    return min(ts), sorted(ts)[len(ts) // 2]


def copies(raw: RawClient, tokens: np.ndarray, kv: list[torch.Tensor], n: int,
           repeats: int) -> list[dict]:
    """Out of the pool (read-only mapping) into a device-layout tensor, and from it into the
    staging area, vs a plain contiguous copy_ of the same bytes."""
    r = raw.call("fetch", root=raw.root, parent=raw.root, tokens=tokens[:n * BS], wait_ms=2000)
    slots = list(r["slots"])
    if len(slots) != n:
        raise RuntimeError(f"fetch of {n} blocks pinned {len(slots)}")
    try:
        pool, staging = raw.pool.kv, raw.staging.kv
        dev = torch.empty((L, 2, n, BS, H, D), dtype=torch.float16)   # an engine's pool
        dst_slots = list(range(n))
        nbytes = n * BLOCK_BYTES
        a = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
        b = torch.empty_like(a)

        def out_of_pool() -> None:
            kernels.copy_blocks_to_gpu(pool, slots, dev, dst_slots)

        def into_staging() -> None:
            kernels.copy_blocks_to_host(dev, dst_slots, staging, dst_slots)

        def plain() -> None:
            b.copy_(a)

        cases = {"out": out_of_pool, "in": into_staging, "plain": plain}
        for fn in cases.values():       # fault every page in, compile, before timing
            fn()
            fn()
        # Correctness: what the engine wrote is what came out, and what went into staging.
        for blk in (0, n // 2, n - 1):
            for layer in (0, L - 1):
                want = kv[layer][blk * BS:(blk + 1) * BS]
                if not (torch.equal(dev[layer, 0, blk], want)
                        and torch.equal(dev[layer, 1, blk], -want)):
                    raise RuntimeError(f"block {blk} layer {layer} read out of the pool differs "
                                       "from what the engine wrote")
        if not torch.equal(staging[:n].view(torch.uint8), pool[slots].view(torch.uint8)):
            raise RuntimeError("staging differs from the pool after the round trip")
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(repeats):
            for name, fn in cases.items():
                t0 = CLOCK()
                fn()
                times[name].append(CLOCK() - t0)
    finally:
        raw.call("release", handle=r["handle"])
    rows = []
    for name, what in (("out", "pool -> device layout (copy_blocks_to_gpu, read-only mapping)"),
                       ("in", "device layout -> staging (copy_blocks_to_host)")):
        row = _bw_row(f"copy {what}", n, times[name], times["plain"], "plain contiguous copy_")
        row[f"meets_{TARGET}"] = row["ratio"] >= TARGET
        rows.append(row)
    return rows


def _bw_row(name: str, n: int, ts: list[float], base: list[float], what: str) -> dict:
    """GB/s (median and best) of `ts` and of its baseline; `ratio` is the median over the
    repeats of baseline time / our time, each pair measured back to back (robust to the load
    of other processes drifting during the run), `ratio_best` best against best."""
    nbytes = n * BLOCK_BYTES
    best, med = _best_median(ts)
    b_best, b_med = _best_median(base)
    paired = sorted(b / t for t, b in zip(ts, base))
    return {"measurement": name, "blocks": n, "MiB": nbytes / 2**20, "repeats": len(ts),
            "daemon_GBps": gbps(nbytes, med), "daemon_GBps_best": gbps(nbytes, best),
            "blocks_per_s": n / med, "baseline": what, "baseline_GBps": gbps(nbytes, b_med),
            "baseline_GBps_best": gbps(nbytes, b_best), "ratio": paired[len(paired) // 2],
            "ratio_best": b_best / best}


# ---------------------------------------------------------------------------------- publish

def chain(root: bytes, tokens: np.ndarray) -> list[dict]:
    """Publish entries for `tokens` from the root: chained keys, parents, depths."""
    entries, parent = [], root
    for i in range(len(tokens) // BS):
        tb = tokens[i * BS:(i + 1) * BS].astype("<i4").tobytes()
        key = xxh3_128(parent + tb)
        entries.append({"slot": i, "key": key, "parent": parent, "depth": i, "tokens": tb,
                        "hits": 0})
        parent = key
    return entries


ROTATE = 8


def publishes(raw: RawClient, n: int, repeats: int, warmup: int,
              seed: int) -> tuple[list[dict], dict]:
    """Rounds of: stage n fresh blocks (client copy) + publish them (daemon copy + index).
    After each round its blocks are invalidated (untimed), so the pool never fills. `warmup`
    untimed rounds first, enough for the daemon to have written every pool slot once: a
    slot's first write page-faults its (huge) pages into the daemon's mapping, which a
    long-running daemon has long paid (round 0 is reported apart)."""
    rng = np.random.default_rng(seed)
    src = torch.randn((L, 2, n, BS, H, D)).to(torch.float16)
    staging = raw.staging.kv
    nbytes = n * BLOCK_BYTES
    a = torch.randint(0, 256, (nbytes,), dtype=torch.uint8)
    b = torch.empty_like(a)
    # The same-pattern baseline: a copy_ out of the staging area just written (as the
    # publish reads it) into one of ROTATE private regions in turn, touched once beforehand
    # (as the publish writes pool slots that are not in the cache).
    flat = staging.view(-1).view(torch.uint8)[:nbytes]
    rot = torch.zeros((ROTATE, nbytes), dtype=torch.uint8)
    t_copy, t_pub, t_all, t_plain, t_same = [], [], [], [], []
    first: dict = {}
    for r in range(warmup + repeats):
        toks = rng.integers(1 << 20, 1 << 30, n * BS, dtype=np.int32)
        entries = chain(raw.root, toks)
        t0 = CLOCK()
        kernels.copy_blocks_to_host(src, list(range(n)), staging, list(range(n)))
        t1 = CLOCK()
        taken = raw.call("publish", root=raw.root, entries=entries)["taken"]
        t2 = CLOCK()
        if sum(taken) != n:
            raise RuntimeError(f"publish took {sum(taken)} of {n} fresh blocks")
        t3 = CLOCK()
        b.copy_(a)
        t4 = CLOCK()
        dropped = raw.call("invalidate", root=raw.root, tokens=toks)["blocks"]
        if dropped != n:
            raise RuntimeError(f"invalidate dropped {dropped} of {n} blocks")
        if r == 0:
            first = {"client_copy_GBps": gbps(nbytes, t1 - t0),
                     "publish_GBps": gbps(nbytes, t2 - t1),
                     "plain_copy_GBps": gbps(nbytes, t4 - t3),
                     "note": "round 0: pool slots never written before (the daemon's page "
                             "faults)"}
        kernels.copy_blocks_to_host(src, list(range(n)), staging, list(range(n)))
        t5 = CLOCK()
        rot[r % ROTATE].copy_(flat)
        t6 = CLOCK()
        if r >= warmup:
            t_copy.append(t1 - t0)
            t_pub.append(t2 - t1)
            t_all.append(t2 - t0)
            t_plain.append(t4 - t3)
            t_same.append(t6 - t5)
    what = "plain contiguous copy_ (one copy)"
    rows = [_bw_row("put end to end: stage + publish", n, t_all, t_plain, what),
            _bw_row("  client copy into staging", n, t_copy, t_plain, what),
            _bw_row("  publish request (daemon: keys checked, staging -> pool)", n, t_pub,
                    t_plain, what),
            _bw_row("  publish request, against the same-pattern copy_", n, t_pub, t_same,
                    "copy_ from the staging area just written into a region not in the "
                    f"cache ({ROTATE} in turn)")]
    return rows, first


# ---------------------------------------------------------------------------------- throughput

WORKER = """
    import sys, time
    import numpy as np
    from tiered_cache.wire.client import Client
    from tiered_cache.wire.ops import make_protocol
    path, want, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    tokens = np.frombuffer(bytes.fromhex(sys.argv[4]), dtype="<i4")
    c = Client(path, make_protocol(), timeout_s=30.0).connect()
    c.call("hello")
    root = c.call("root", salt=b"")["root"]
    for _ in range(200):
        got = c.call("lookup", root=root, parent=root, tokens=tokens)["blocks"]
    assert got == want, (got, want)
    print("ready", flush=True)
    for _ in sys.stdin:                 # one line: one run of `seconds`
        c.call("heartbeat")
        n = 0
        t0 = time.monotonic()
        end = t0 + seconds
        while True:
            for _ in range(20):
                c.call("lookup", root=root, parent=root, tokens=tokens)
            n += 20
            t1 = time.monotonic()
            if t1 >= end:
                break
        print(t0, t1, n, flush=True)
"""


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def throughput(sock: str, daemon_pid: int, tokens: np.ndarray, counts: list[int],
               seconds: float, rounds: int, peek_per_s: float) -> list[dict]:
    """Aggregate lookups/s of k client processes at once (best of `rounds`, the rounds
    interleaved across the k's; one pool of processes, reused)."""
    n = len(tokens) // BS
    hexed = tokens.astype("<i4").tobytes().hex()
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(WORKER), sock, str(n),
                               str(seconds), hexed],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(max(counts))]
    runs: dict[int, list[tuple[float, float]]] = {k: [] for k in counts}
    try:
        for p in procs:
            if _line(p) != "ready":
                raise RuntimeError("a lookup client failed to start")
        for _ in range(rounds):
            for k in counts:
                c0, w0 = _cpu_s(daemon_pid), time.monotonic()
                for p in procs[:k]:     # CLOCK_MONOTONIC is the same in every process
                    p.stdin.write("go\n")
                    p.stdin.flush()
                spans = [_line(p).split() for p in procs[:k]]
                c1, w1 = _cpu_s(daemon_pid), time.monotonic()
                total = sum(int(s[2]) for s in spans)
                wall = max(float(s[1]) for s in spans) - min(float(s[0]) for s in spans)
                runs[k].append((total / wall, (c1 - c0) / (w1 - w0)))
    finally:
        for p in procs:
            p.stdin.close()
        for p in procs:
            p.wait(60)
    rows = []
    one = max(runs[counts[0]])[0] / counts[0]
    for k in counts:
        best = max(runs[k])
        med = sorted(r[0] for r in runs[k])[len(runs[k]) // 2]
        if k == 1:
            base, what = peek_per_s, "in-process peek/s (1 thread)"
        else:
            base, what = k * one, f"linear scaling: {k} x the 1-client rate"
        rows.append({"measurement": f"aggregate lookups/s, {k} client process"
                                    f"{'es' if k > 1 else ''} ({n} blocks)",
                     "clients": k, "blocks": n, "rounds": rounds, "seconds": seconds,
                     "daemon_per_s": best[0], "daemon_per_s_median": med,
                     "daemon_cpu_cores": best[1],
                     "daemon_cpu_us_per_lookup": best[1] / best[0] * 1e6,
                     "baseline": what, "baseline_per_s": base,
                     "ratio": best[0] / base, "x_one_client": best[0] / one})
    return rows


def _line(p: subprocess.Popen, timeout: float = 120.0) -> str:
    ready, _, _ = select.select([p.stdout], [], [], timeout)
    if not ready:
        raise RuntimeError("a lookup client said nothing")
    return p.stdout.readline().strip()


# ---------------------------------------------------------------------------------- report

def summary(lat: list[dict], cps: list[dict], pubs: list[dict], tps: list[dict]) -> list[dict]:
    """The rows of the one table: measurement, daemon, baseline, ratio (daemon / baseline)."""
    out = []
    for r in lat:
        for q in ("p50", "p99"):
            row = {"measurement": f"{r['measurement']} {q}", "unit": "us",
                   "daemon": r[f"daemon_{q}_us"]}
            if "baseline" in r:
                row.update(baseline=r[f"baseline_{q}_us"], ratio=r[f"x_baseline_{q}"],
                           baseline_is=r["baseline"])
            out.append(row)
    for r in cps + pubs:
        out.append({"measurement": f"{r['measurement']} ({r['blocks']} blocks)", "unit": "GB/s",
                    "daemon": r["daemon_GBps"], "baseline": r["baseline_GBps"],
                    "ratio": r["ratio"], "baseline_is": r["baseline"]})
    put = pubs[0]
    out.append({"measurement": f"put end to end ({put['blocks']} blocks)", "unit": "blocks/s",
                "daemon": put["blocks_per_s"],
                "baseline": put["baseline_GBps"] * 1e9 / BLOCK_BYTES, "ratio": put["ratio"],
                "baseline_is": "plain copy_ of the same bytes"})
    for r in tps:
        out.append({"measurement": r["measurement"], "unit": "lookups/s",
                    "daemon": r["daemon_per_s"], "baseline": r["baseline_per_s"],
                    "ratio": r["ratio"], "baseline_is": r["baseline"]})
    return out


def daemon_errors(log_path: Path) -> list[str]:
    if not log_path.exists():
        return []
    return [ln for ln in log_path.read_text(errors="replace").splitlines()
            if " ERROR " in ln or " CRITICAL " in ln or "Traceback" in ln][:20]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run (~15 s)")
    p.add_argument("--out", "--json", dest="out", default=default_out("daemon"),
                   help="where the JSON goes (default results/daemon.json)")
    p.add_argument("--sizes", type=int, nargs="+", default=[8, 128],
                   help="cached blocks per lookup / fetch")
    p.add_argument("--iters", type=int, default=None,
                   help="timed requests per latency case (4000; a quarter past 16 blocks)")
    p.add_argument("--staging-blocks", type=int, default=64,
                   help="the daemon's staging area per client: blocks per copy and publish")
    p.add_argument("--host-blocks", type=int, default=None, help="the daemon's pool, 512 KiB "
                   "blocks (512; 256 with --quick)")
    p.add_argument("--repeats", type=int, default=None, help="timed runs per copy (41) and "
                   "publish (15) case")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--seconds", type=float, default=None, help="seconds per lookup run (2)")
    p.add_argument("--rounds", type=int, default=None, help="runs per client count (2)")
    p.add_argument("--throughput-blocks", type=int, default=8,
                   help="cached blocks per lookup in the throughput runs")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    q = args.quick
    iters = args.iters or (300 if q else 4000)
    repeats = args.repeats or (5 if q else 41)
    pub_repeats = args.repeats or (3 if q else 15)
    seconds = args.seconds or (0.3 if q else 2.0)
    rounds = args.rounds or (1 if q else 2)
    staging = args.staging_blocks
    args.host_blocks = args.host_blocks or (256 if q else 512)
    prefix = max(max(args.sizes), staging, args.throughput_blocks)
    if prefix + staging > args.host_blocks:
        raise SystemExit(f"--host-blocks {args.host_blocks} cannot hold the prefix ({prefix}) "
                         f"and a publish round ({staging})")

    t_start = CLOCK()
    load_before = os.getloadavg()
    tokens = np.random.default_rng(args.seed).integers(0, 1 << 17, prefix * BS,
                                                        dtype=np.int32)
    tmp = Path(tempfile.mkdtemp(prefix="tcd-", dir="/tmp"))     # 0700, ours; short path
    cfg, sock = write_config(tmp, args.host_blocks, staging, 30.0)
    log_path = tmp / "daemon.log"
    out: dict = {"benchmark": "daemon", "quick": q, "target_ratio": TARGET,
                 "geometry": {**MODEL, "block_size": BS, "block_bytes": BLOCK_BYTES},
                 "config": {"prefix_blocks": prefix, "sizes": args.sizes,
                            "latency_iters": iters, "copy_repeats": repeats,
                            "publish_repeats": pub_repeats, "staging_blocks": staging,
                            "host_blocks": args.host_blocks, "clients": args.clients,
                            "seconds": seconds, "rounds": rounds,
                            "throughput_blocks": args.throughput_blocks,
                            "torch_threads": torch.get_num_threads()}}
    raw = local = None
    phases: dict[str, float] = {}
    daemon = NodeProcess(cfg, sock, log_path=log_path)
    try:
        t0 = CLOCK()
        daemon.start()
        out["daemon_start_s"] = CLOCK() - t0
        phases["daemon_start"] = CLOCK() - t0
        kv, took = populate(sock, tokens, args.seed)
        phases["populate"] = CLOCK() - t0 - phases["daemon_start"]
        out["populate"] = {"blocks": prefix, "seconds_to_taken": took}
        print(f"daemon up in {out['daemon_start_s']:.1f} s; an engine computed and published "
              f"{prefix} blocks ({prefix * BLOCK_BYTES / 2**20:.0f} MiB) in {took:.2f} s",
              flush=True)

        from tiered_cache import TieredKVCache
        from tiered_cache.config import CacheConfig

        local = TieredKVCache(CacheConfig.from_dict(engine_config(None, prefix + 8)))
        seq = local.open(tokens)
        local.mark_computed(seq)
        local.close(seq)
        raw = RawClient(sock)

        mark = CLOCK()
        lat_rows, rates = latency(raw, local, tokens, args.sizes, iters)
        phases["latency"], mark = CLOCK() - mark, CLOCK()
        print_table(lat_rows, ["measurement", "samples", "daemon_p50_us", "daemon_p99_us",
                               "baseline_p50_us", "baseline_p99_us", "x_baseline_p50",
                               "baseline"], title="latency through the daemon's socket (us)")
        print()
        copy_rows = copies(raw, tokens, kv, staging, repeats)
        phases["copies"], mark = CLOCK() - mark, CLOCK()
        pub_rows, first = publishes(raw, staging, pub_repeats,
                                    -(-args.host_blocks // staging) + 1, args.seed + 1)
        phases["publish"], mark = CLOCK() - mark, CLOCK()
        print_table(copy_rows + pub_rows, ["measurement", "blocks", "MiB", "daemon_GBps",
                                           "daemon_GBps_best", "baseline_GBps",
                                           "baseline_GBps_best", "ratio", "ratio_best"],
                    title=f"copies and puts vs a plain copy_ of the same bytes (GB/s, median "
                          f"and best of {repeats} / {pub_repeats}; ratio: median of back-to-"
                          f"back pairs; target >= {TARGET}x for the copies)")
        print(f"first publish into never-written pool slots: {first['publish_GBps']:.2f} GB/s "
              f"(client copy {first['client_copy_GBps']:.2f}, plain copy_ "
              f"{first['plain_copy_GBps']:.2f})")
        print()
        tn = args.throughput_blocks
        peek_rate = rates.get(tn, {}).get("peek_per_s")
        if peek_rate is None:           # a throughput size that the latency runs skipped
            root_key, root_id = local.index.register_root(None, None)
            ts = interleaved({"peek": lambda: local.index.peek(root_id, root_key,
                                                               tokens[:tn * BS])}, iters)
            peek_rate = 1 / quantile(ts["peek"], 0.5)
        raw.close()
        raw = None
        tp_rows = throughput(sock, daemon.pid, tokens[:tn * BS], args.clients, seconds, rounds,
                             peek_rate)
        phases["throughput"] = CLOCK() - mark
        print_table(tp_rows, ["measurement", "daemon_per_s", "daemon_per_s_median",
                              "daemon_cpu_cores", "daemon_cpu_us_per_lookup", "x_one_client",
                              "baseline_per_s", "ratio"],
                    title=f"aggregate lookups/s (best of {rounds}); {os.cpu_count()} CPU cores "
                          "shared by the daemon and its clients")
        if os.cpu_count() and os.cpu_count() < 1 + max(args.clients):
            print(f"NOTE: {os.cpu_count()} cores for the daemon and up to {max(args.clients)} "
                  "clients: more clients than free cores cannot scale linearly")
        print()
    finally:
        if raw is not None:
            raw.close()
        if local is not None:
            local.shutdown()
        rc = daemon.stop() if daemon.proc is not None else None
        errors = daemon_errors(log_path)
        shutil.rmtree(tmp, ignore_errors=True)
    rows = summary(lat_rows, copy_rows, pub_rows, tp_rows)
    print_table(rows, ["measurement", "unit", "daemon", "baseline", "ratio", "baseline_is"],
                title="node daemon vs its baselines, same run (ratio = daemon / baseline)")
    copies_ok = all(r[f"meets_{TARGET}"] for r in copy_rows)
    print(f"\ncopies >= {TARGET}x a plain copy_: {'MET' if copies_ok else 'NOT MET'}; "
          f"daemon exit status {rc}, {len(errors)} error lines in its log")
    load = os.getloadavg()
    print(f"load average (1 min) {load_before[0]:.1f} before, {load[0]:.1f} after, on "
          f"{os.cpu_count()} CPUs: other work on this machine shares the cores; "
          f"{CLOCK() - t_start:.0f} s in all")
    out.update(summary=rows, latency=lat_rows, copy=copy_rows, publish=pub_rows,
               publish_first_touch=first, throughput=tp_rows, copies_meet_target=copies_ok,
               daemon_exit_status=rc, daemon_log_errors=errors,
               load_average={"before": load_before, "after": os.getloadavg(),
                             "cpus": os.cpu_count()},
               elapsed_s=CLOCK() - t_start, phases_s=phases,
               environment=environment(),
               note="client and daemon share the machine's cores: ratios within the run are "
                    "the result")
    write_json(args.out, out)


if __name__ == "__main__":
    main()
