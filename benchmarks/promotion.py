"""The control plane of a promotion, per block: what reopening a prompt held only in host memory
costs the cache's bookkeeping, with no copy.

A `storage: none` cache (gpu + host, both with room for every prompt, migrator off, policy
`--policy`, by default the cache's default) publishes `--prompts` prompts of `--blocks` blocks
each. A timed loop reopens and closes every prompt after their device copies were evicted
(untimed; each keeps its host copy): each open matches the chain, plans its promotion (device
slots, the plan as data, the readiness its readers wait on), commits it (there is nothing to
copy) and hears of the reuse in every policy; each close unpins the chain. The figure is the
best of `--repeats` loops, in microseconds per promoted block, with the garbage collector
off while timing.

This is the part of `migration.py`'s end-to-end promotion that is not the copy: on a 2-core
machine it runs beside the copy threads, so every microsecond here slows the copy too.

The baseline is the same loop on another checkout, measured in the same sitting (`--repo`: a
git worktree of an older commit, run in a child process of its own, interleaved with this
checkout's).

    python benchmarks/promotion.py [--quick] [--repo /work/wt/base] [--out results/promotion.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BLOCK = 16


def measure(n_blocks: int, n_prompts: int, repeats: int, policy: str) -> dict:
    """Best-of-`repeats` microseconds per promoted block, in this interpreter's tiered_cache."""
    import numpy as np

    from tiered_cache import CacheConfig, TieredKVCache

    room = n_blocks * n_prompts + 64
    cache = TieredKVCache(CacheConfig.from_dict({
        "model": {"name": "bench", "num_layers": 80, "num_kv_heads": 8, "head_dim": 128,
                  "dtype": "bfloat16"},
        "block_size": BLOCK, "storage": "none", "policy": policy,
        "tiers": {"gpu": {"device": "cpu", "num_blocks": room},
                  "host": {"num_blocks": room}},
        "migrator": {"enabled": False}, "compactor": {"enabled": False}}))
    try:
        per = n_blocks * BLOCK
        prompts = [np.arange(i * per, (i + 1) * per, dtype=np.int32) for i in range(n_prompts)]
        for p in prompts:
            s = cache.open(p)
            cache.mark_computed(s)
            cache.close(s)
        ix = cache.index
        open_, close = cache.open, cache.close
        expected = n_blocks * n_prompts
        best = float("inf")
        for r in range(repeats + 1):            # the first loop warms up, untimed
            with ix.lock:
                ix.space.evict(0, expected)     # device copies go; host copies stay
            before = ix.counters.promotions
            gc.disable()
            try:
                t0 = time.perf_counter()
                for p in prompts:
                    close(open_(p))
                dt = time.perf_counter() - t0
            finally:
                gc.enable()
            got = ix.counters.promotions - before
            if got != expected:
                raise SystemExit(f"promoted {got} of {expected} blocks: not a clean run")
            if r:
                best = min(best, dt)
        return {"blocks_per_prompt": n_blocks, "prompts": n_prompts,
                "us_per_block": round(best / expected * 1e6, 3)}
    finally:
        cache.shutdown()


def main(argv: list[str] | None = None) -> int:
    sys.path.insert(0, str(HERE))
    from common import (
        best_by_checkout,
        default_out,
        environment,
        import_checkout,
        print_table,
        write_json,
    )

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smoke run (seconds)")
    ap.add_argument("--blocks", type=int, nargs="+", default=[16, 64, 256],
                    help="blocks per prompt")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per timed loop (64)")
    ap.add_argument("--repeats", type=int, default=None, help="timed loops (15)")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved child runs per checkout")
    ap.add_argument("--policy", default="adaptive")
    ap.add_argument("--repo", default=None, help="also measure this checkout (the baseline)")
    ap.add_argument("--out", default=default_out("promotion"))
    ap.add_argument("--child-root", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    prompts = args.prompts or (4 if args.quick else 64)
    repeats = args.repeats or (2 if args.quick else 15)
    blocks = [16] if args.quick else args.blocks
    if args.child_root:
        import_checkout(args.child_root)
        print(json.dumps([measure(n, prompts, repeats, args.policy) for n in blocks]))
        return 0

    checkouts = [("this", str(ROOT))]
    if args.repo:
        checkouts.append(("baseline", str(Path(args.repo).resolve())))
    common = ["--blocks", *map(str, blocks), "--prompts", str(prompts), "--repeats",
              str(repeats), "--policy", args.policy]
    best = best_by_checkout(Path(__file__).resolve(), checkouts, common,
                            1 if args.quick else args.rounds, "blocks_per_prompt", "us_per_block")
    rows = []
    for n in blocks:
        row = {"blocks_per_prompt": n, "this_us_per_block": best[("this", n)]}
        if args.repo:
            row["baseline_us_per_block"] = best[("baseline", n)]
            row["x_baseline"] = round(best[("this", n)] / best[("baseline", n)], 3)
        rows.append(row)
    print_table(rows, title=f"promotion control plane, us per promoted block (best of "
                            f"{repeats} loops of {prompts} prompts; policy {args.policy})")
    write_json(args.out, {"benchmark": "promotion", "quick": args.quick,
                          "environment": environment(), "baseline": args.repo, "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
