"""Two node daemons sharing through one Redis server: what a fetch costs when the blocks come
from the store (the other node computed them) instead of the daemon's own pool.

Setup: a real `redis-server` on loopback (tests/redis_servers.py), daemons A and B (`tiered-cache
serve`, each with `tiers.remote` on that server), 512 KiB blocks (8 layers of a 70B-class
block). An engine attached to A computes P prefixes of N blocks each; A puts them to the store.
Then a client of B fetches each prefix twice (fetch + release, what an engine's open() sends):

- cold: B's pool does not have it: B asks the store which blocks it holds, loads them straight
  into new pool slots (each record verified) and answers;
- warm: the same prefix again, now from B's pool.

Baseline in the same run: a plain redis-py pipeline `GET` of N of the stored records (the least
any client must do to move those bytes out of the store), timed right after each cold fetch. The
first cold fetch's blocks are compared with what A's engine wrote (every byte).

    python benchmarks/daemon_remote.py            # ~40 s
    python benchmarks/daemon_remote.py --quick
"""

from __future__ import annotations

import argparse
import json
import shutil
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
from daemon import BLOCK_BYTES, BS, MODEL, RawClient, populate  # noqa: E402

from tests import redis_servers as rs  # noqa: E402
from tiered_cache.daemon.process import NodeProcess  # noqa: E402

CLOCK = time.perf_counter


def write_config(tmp: Path, name: str, url: str, host_blocks: int) -> tuple[Path, str]:
    sock = str(tmp / name / "daemon.sock")
    m = MODEL
    cfg = tmp / f"{name}.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        model: {{name: {m['name']}, num_layers: {m['num_layers']},
                num_kv_heads: {m['num_kv_heads']}, head_dim: {m['head_dim']},
                num_q_heads: {m['num_q_heads']}, dtype: {m['dtype']}}}
        block_size: {BS}
        tiers:
          gpu: {{num_blocks: 8, device: cpu}}
          host: {{num_blocks: {host_blocks}}}
          remote: {{url: "{url}", lookup_deadline_ms: 2000, put_queue_mib: 1024}}
        daemon: {{socket: {sock}, lease_s: 30}}
        """))
    return cfg, sock


def remote_stats(raw: RawClient) -> dict:
    return json.loads(raw.call("stats")["json"])["partition"]["tiers"]["remote"]


def fetch(raw: RawClient, tokens: np.ndarray, n: int) -> tuple[float, list[int], int]:
    t0 = CLOCK()
    r = raw.call("fetch", root=raw.root, parent=raw.root, tokens=tokens, wait_ms=10_000)
    dt = CLOCK() - t0
    return dt, list(r["slots"]), r["handle"]


def main() -> int:
    why = rs.missing()
    if why:
        raise SystemExit(f"needs a real redis-server: {why}")
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--prefixes", type=int, default=None, help="prefixes (8; quick 3)")
    p.add_argument("--blocks", type=int, default=32, help="blocks per prefix")
    p.add_argument("--out", "--json", dest="out", default=default_out("daemon_remote"))
    args = p.parse_args()
    n_prefix = args.prefixes or (3 if args.quick else 8)
    n = args.blocks
    tmp = Path(tempfile.mkdtemp(prefix="tc-dr-"))
    host_blocks = n * n_prefix + 16
    cold, warm, base, records = [], [], [], 0
    checked = False
    t_start = CLOCK()
    with rs.RedisServer(extra=("--maxmemory", "4gb")) as srv:
        cfg_a, sock_a = write_config(tmp, "a", srv.url, host_blocks)
        cfg_b, sock_b = write_config(tmp, "b", srv.url, host_blocks)
        a = NodeProcess(cfg_a, sock_a, log_path=tmp / "a.log").start()
        b = NodeProcess(cfg_b, sock_b, log_path=tmp / "b.log").start()
        try:
            prompts = [np.arange(i * 1_000_000, i * 1_000_000 + n * BS, dtype=np.int32)
                       for i in range(n_prefix)]
            kvs = [populate(sock_a, t, seed=i)[0] for i, t in enumerate(prompts)]
            ra, rb = RawClient(sock_a), RawClient(sock_b)
            try:
                deadline = time.monotonic() + 120
                while remote_stats(ra)["put_blocks"] < n * n_prefix:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"A put {remote_stats(ra)} of {n * n_prefix} blocks")
                    time.sleep(0.05)
                redis = srv.raw()
                while redis.dbsize() < n * n_prefix and time.monotonic() < deadline:
                    time.sleep(0.05)            # the store's writer is asynchronous
                keys = sorted(redis.keys("tc:*"))
                records = len(keys)
                for i, toks in enumerate(prompts):
                    dt, slots, handle = fetch(rb, toks, n)
                    if len(slots) != n:
                        raise SystemExit(f"B's cold fetch of prefix {i} found {len(slots)} "
                                         f"of {n} blocks: {remote_stats(rb)}")
                    if not checked:             # every byte of what A's engine wrote
                        kv = kvs[i]
                        for j, s in enumerate(slots):
                            blk = rb.pool.kv[s]
                            for layer in range(len(kv)):
                                want = kv[layer][j * BS:(j + 1) * BS]
                                if not (torch.equal(blk[layer, 0], want)
                                        and torch.equal(blk[layer, 1], -want)):
                                    raise SystemExit(f"wrong KV in block {j} layer {layer}")
                        checked = True
                    rb.call("release", handle=handle)
                    cold.append(dt)
                    group = keys[(i * n) % len(keys):][:n]
                    t0 = CLOCK()
                    pipe = redis.pipeline(transaction=False)
                    for k in group:
                        pipe.get(k)
                    got = pipe.execute()
                    base.append(CLOCK() - t0)
                    assert all(v is not None for v in got)
                    dt, slots, handle = fetch(rb, toks, n)
                    rb.call("release", handle=handle)
                    warm.append(dt)
                stats_b = remote_stats(rb)
            finally:
                ra.close()
                rb.close()
        finally:
            a.stop()
            b.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    nbytes = n * BLOCK_BYTES
    c50, w50, b50 = (quantile(x, 0.5) for x in (cold, warm, base))
    rows = [
        {"measurement": f"B fetch + release, cold (from the store), {n} blocks", "p50_ms":
         c50 * 1e3, "max_ms": max(cold) * 1e3, "GBps": gbps(nbytes, c50),
         "x_baseline": c50 / b50},
        {"measurement": f"B fetch + release, warm (from B's pool), {n} blocks", "p50_ms":
         w50 * 1e3, "max_ms": max(warm) * 1e3, "GBps": gbps(nbytes, w50),
         "x_baseline": w50 / b50},
        {"measurement": f"baseline: redis-py pipeline GET of {n} stored records", "p50_ms":
         b50 * 1e3, "max_ms": max(base) * 1e3, "GBps": gbps(nbytes, b50), "x_baseline": 1.0},
    ]
    print_table(rows, ["measurement", "p50_ms", "max_ms", "GBps", "x_baseline"],
                title=f"two daemons through one redis-server: {n_prefix} prefixes of {n} blocks "
                      f"of {BLOCK_BYTES >> 10} KiB (KV checked: {checked})")
    print(f"B's remote tier: loaded {stats_b['loaded_blocks']}, failures "
          f"{stats_b['load_failures']}; {records} records in the store; "
          f"{CLOCK() - t_start:.0f} s in all")
    write_json(args.out, {"benchmark": "daemon_remote", "rows": rows, "remote_b": stats_b,
                          "kv_checked": checked, "args": vars(args),
                          "environment": environment()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
