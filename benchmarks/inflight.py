"""In-flight prefix sharing: K concurrent cold requests with the same new prefix.

K sequences are opened together (before any of them has computed anything) over a 128-block
shared prefix plus 4 blocks of their own, with `share_inflight` off (the baseline: every open
allocates and computes its own copy) and on (the first open computes the prefix, the others take
its blocks and wait for them). Reported per K: device blocks pinned once all are open, prefill
tokens the engine has to compute, whether the opens fit the device tier (20,000 blocks: the
baseline runs out at K = 152), and open() time per request. Control plane only
(`storage: none`, `mark_computed` as the computation): the counts are exact, not timed.

A second table prices the feature where nothing is shared: the same requests one after
another (each computed and closed before the next opens) with it off and on; registering a
writer's blocks moves the hashing of its prompt from publish to open, so the cost is the dict
entries.

    python benchmarks/inflight.py [--quick] [--out results/inflight.json]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import default_out, environment, print_table, write_json  # noqa: E402

from tiered_cache import TieredKVCache  # noqa: E402
from tiered_cache.config import CacheConfig  # noqa: E402
from tiered_cache.errors import CapacityError  # noqa: E402

BS, PREFIX_BLOCKS, OWN_BLOCKS, CAPACITY = 16, 128, 4, 20_000


def make(share: bool, capacity: int = CAPACITY) -> TieredKVCache:
    cfg = CacheConfig.from_dict({
        "model": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8},
        "block_size": BS, "storage": "none", "share_inflight": share,
        "tiers": {"gpu": {"num_blocks": capacity, "device": "cpu"}, "host": {"num_blocks": 0}},
        "migrator": {"enabled": False}, "compactor": {"enabled": False}})
    return TieredKVCache(cfg)


def prompts(k: int, base: int = 0) -> tuple[list[int], list[list[int]]]:
    prefix = [base + t for t in range(PREFIX_BLOCKS * BS)]
    return prefix, [prefix + [1_000_000 + base + i] * (OWN_BLOCKS * BS) for i in range(k)]


def concurrent(k: int, share: bool) -> dict:
    _, reqs = prompts(k)
    with make(share) as cache:
        seqs = []
        t0 = time.perf_counter()
        try:
            for p in reqs:
                seqs.append(cache.open(p))
        except CapacityError:
            pass
        open_s = time.perf_counter() - t0
        fits = len(seqs) == k
        pinned = cache.stats()["tiers"]["gpu"]["pinned_blocks"]
        computed = sum(s.num_tokens - s.num_cached_tokens for s in seqs)
        for s in seqs:
            cache.mark_computed(s)
        cached = cache.stats()["cached_blocks"]
        for s in seqs:
            cache.close(s)
    return {"fits": fits, "opened": len(seqs), "pinned_blocks": pinned,
            "prefill_tokens": computed, "cached_blocks_after": cached,
            "open_us": open_s / max(1, len(seqs)) * 1e6}


def sequential(n: int, share: bool, repeats: int) -> float:
    """Median seconds for n requests one after another, each a new prompt (nothing shared)."""
    times = []
    for r in range(repeats):
        with make(share, capacity=4 * (PREFIX_BLOCKS + OWN_BLOCKS)) as cache:
            _, reqs = prompts(n, base=10_000_000 * (r + 1))
            reqs = [[t + 7919 * i for t in p] for i, p in enumerate(reqs)]   # all distinct
            t0 = time.perf_counter()
            for p in reqs:
                s = cache.open(p)
                cache.mark_computed(s)
                cache.close(s)
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    ks = [1, 4, 16, 64] if args.quick else [1, 2, 4, 8, 16, 32, 64, 128, 151, 152, 256]
    rows = []
    for k in ks:
        base, share = concurrent(k, False), concurrent(k, True)
        rows.append({
            "K": k, "bound_128+4K": PREFIX_BLOCKS + OWN_BLOCKS * k,
            "pinned_off": base["pinned_blocks"], "pinned_on": share["pinned_blocks"],
            "prefill_tok_off": base["prefill_tokens"], "prefill_tok_on": share["prefill_tokens"],
            "fits_off": base["fits"], "fits_on": share["fits"],
            "open_us_off": base["open_us"], "open_us_on": share["open_us"],
            "within_bound": share["pinned_blocks"] <= PREFIX_BLOCKS + OWN_BLOCKS * k,
            "prefix_computed_once": share["prefill_tokens"]
            == (PREFIX_BLOCKS + OWN_BLOCKS * k) * BS,
        })
    print_table(rows, title=f"K concurrent cold requests, {PREFIX_BLOCKS}-block shared prefix + "
                f"{OWN_BLOCKS} own blocks each, {CAPACITY:,}-block device tier "
                "(share_inflight off | on)")
    n, reps = (20, 3) if args.quick else (100, 5)
    off, on = sequential(n, False, reps), sequential(n, True, reps)
    seq_rows = [{"requests": n, "blocks_each": PREFIX_BLOCKS + OWN_BLOCKS,
                 "off_ms_per_req": off / n * 1e3, "on_ms_per_req": on / n * 1e3,
                 "on/off": on / off}]
    print_table(seq_rows, title="nothing to share: requests one after another (cost of the "
                "registration)")
    ok = all(r["within_bound"] and r["prefix_computed_once"] and r["fits_on"] for r in rows)
    print(f"targets (K <= 256: pinned <= 128 + 4K, prefix computed once): "
          f"{'met' if ok else 'MISSED'}")
    write_json(args.out or default_out("inflight"), {
        "benchmark": "inflight", "quick": args.quick, "environment": environment(),
        "block_size": BS, "prefix_blocks": PREFIX_BLOCKS, "own_blocks": OWN_BLOCKS,
        "capacity_blocks": CAPACITY, "rows": rows, "sequential": seq_rows, "targets_met": ok})
    return 0


if __name__ == "__main__":
    sys.exit(main())
