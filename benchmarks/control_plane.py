"""Control-plane cost per block: open + publish (mark_computed) + close, storage-free.

A `storage: none` cache (block_size 16, device tier of exactly N blocks, no host tier, eviction
policy `--policy`, by default the cache's default, `adaptive`) is filled with N distinct cached
blocks (prompts of 64 blocks), then two loops are timed:

- hit:  re-open cached prompts chosen at random (64 blocks matched and pinned), mark_computed
        (nothing left to publish), close.
- miss: open prompts never seen before (64 new blocks; the tier is full, so 64 blocks are
        evicted), mark_computed (64 blocks published), close.

Baselines, measured in the same run, over the same prompts and the same N keys:

- floor: compute the chained xxh3-128 keys of the prompt's blocks (from the same int32 token
         arrays) and look each one up in a plain dict holding the cache's N keys: the least work
         any prefix cache must do per block.
- dict.get: a bare `dict.get` loop over precomputed keys, for scale.
- LRU dict: the floor plus the bookkeeping of the simplest possible LRU cache of keys (an
         OrderedDict: `move_to_end` on a hit; insert and `popitem(last=False)` on a miss), for
         context on the miss loop, which must publish and evict.

Every time (wall time; `--clock cpu`: the process's CPU time) is the best of `--repeats` runs
(ours and the floor interleaved), with the garbage
collector frozen/disabled while timing (same for both). Targets (from the issue): a hit within 4x
of the floor, a miss (which must also publish and evict) within 10x, and flat (max/min within
1.2) from 10^4 to 10^6 cached blocks. Whether they are met is reported as measured.

    python benchmarks/control_plane.py            # 10^3 .. 10^6 cached blocks
    python benchmarks/control_plane.py --quick    # 10^3 .. 10^5
    python benchmarks/control_plane.py --memory [--repo OLD_CHECKOUT]
    python benchmarks/control_plane.py --policy lru     # another policy

`--memory`: memory per cached block instead (target: at most 300 bytes at 10^5 and 10^6
blocks). Each size runs in a fresh interpreter: tracemalloc is started before the cache is
built, the cache is filled as above, and (traced bytes after - before) / N is reported, next
to the same fill of a plain dict of the N keys (the least any prefix index holds), and, in
another fresh interpreter without tracemalloc, the resident set's growth over the same fill
((RSS after - RSS before) / N: what the machine gives, allocator overhead included).
`--repo` measures another checkout the same way (e.g. the commit before a change, in a git
worktree), so before and after come from the same run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import psutil
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    checkout_child,
    environment,
    import_checkout,
    print_table,
    trim_heap,
    write_json,
)

if TYPE_CHECKING:
    from tiered_cache import TieredKVCache

BLOCK = 16
PROMPT_BLOCKS = 64
PROMPT_TOKENS = BLOCK * PROMPT_BLOCKS
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def clock() -> float:
    """The timed loops' clock: wall time (`perf_counter`), or with `--clock cpu` this process's
    CPU time (`process_time`: on a machine other jobs load, time spent waiting for a core does
    not count)."""
    return _clock()


_clock = time.perf_counter


def make_cache(num_blocks: int, policy: str = "adaptive") -> TieredKVCache:
    from tiered_cache import CacheConfig, TieredKVCache

    cfg = CacheConfig.from_dict({
        "model": {"name": "bench", "num_layers": 80, "num_kv_heads": 8, "head_dim": 128,
                  "dtype": "bfloat16"},
        "block_size": BLOCK,
        "storage": "none",
        "policy": policy,
        "tiers": {"gpu": {"device": "cpu", "num_blocks": num_blocks},
                  "host": {"num_blocks": 0}},
        "migrator": {"enabled": False},
        "compactor": {"enabled": False},
    })
    return TieredKVCache(cfg)


def prompt(i: int) -> np.ndarray:
    """Prompt i: 1024 distinct token ids, so every block of every prompt is distinct."""
    start = i * PROMPT_TOKENS
    return np.arange(start, start + PROMPT_TOKENS, dtype=np.int32)


# ---------------------------------------------------------------------------- workloads


def run_ours(cache: TieredKVCache, prompts: list[np.ndarray], check: bool = True) -> float:
    open_, mark, close = cache.open, cache.mark_computed, cache.close
    t0 = clock()
    for p in prompts:
        s = open_(p)
        mark(s)
        close(s)
    dt = clock() - t0
    if check:                                     # sanity: the loop did what it claims
        s = cache.open(prompts[-1])
        assert s.num_cached_tokens == PROMPT_TOKENS, s.num_cached_tokens
        cache.close(s)
    return dt


def run_floor(index: dict, root: bytes, prompts: list[np.ndarray]) -> float:
    h = xxhash.xxh3_128_digest
    get = index.get
    step = BLOCK * 4
    t0 = clock()
    for p in prompts:
        data = p.tobytes()
        key = root
        for i in range(0, len(data), step):
            key = h(key + data[i:i + step])
            get(key)
    return clock() - t0


def run_lru_dict(lru: OrderedDict, root: bytes, prompts: list[np.ndarray]) -> float:
    h = xxhash.xxh3_128_digest
    get, touch, pop = lru.get, lru.move_to_end, lru.popitem
    step = BLOCK * 4
    t0 = clock()
    for p in prompts:
        data = p.tobytes()
        key = root
        for i in range(0, len(data), step):
            key = h(key + data[i:i + step])
            if get(key, False) is False:
                lru[key] = True
                pop(last=False)
            else:
                touch(key)
    return clock() - t0


def run_dict_get(index: dict, keys: list[bytes]) -> float:
    get = index.get
    t0 = clock()
    for k in keys:
        get(k)
    return clock() - t0


def chain_keys(root: bytes, p: np.ndarray) -> list[bytes]:
    data, step, key, out = p.tobytes(), BLOCK * 4, root, []
    for i in range(0, len(data), step):
        key = xxhash.xxh3_128_digest(key + data[i:i + step])
        out.append(key)
    return out


# ---------------------------------------------------------------------------- one size


def measure(n_blocks: int, sample: int, repeats: int, seed: int,
            policy: str = "adaptive") -> list[dict]:
    """Fill a device tier of exactly `n_blocks` slots with `n_blocks` cached blocks (64-block
    prompts, the last one shorter), then time the hit and miss loops."""
    n_prompts, rest = divmod(n_blocks, PROMPT_BLOCKS)
    cache = make_cache(n_blocks, policy)
    gc.disable()
    t0 = time.perf_counter()
    for i in range(n_prompts + (rest > 0)):
        p = prompt(i) if i < n_prompts else prompt(i)[:rest * BLOCK]
        s = cache.open(p)
        cache.mark_computed(s)
        cache.close(s)
    fill_s = time.perf_counter() - t0
    gc.collect()
    gc.freeze()                                   # the cache's objects never get rescanned
    cached = cache.stats()["cached_blocks"]
    assert cached == n_blocks == cache.stats()["tiers"]["gpu"]["used_blocks"], cached
    root = cache.hasher.root(None)[0]
    floor_index = dict(cache.index.prefix)        # the same N keys, in a plain dict
    lru = OrderedDict.fromkeys(cache.index.prefix, True)
    rng = random.Random(seed)
    k = min(sample, n_prompts)

    # hits: random cached prompts; the same ones for ours and the floor
    hit_prompts = [prompt(rng.randrange(n_prompts)) for _ in range(k)]
    hit_keys = [key for p in hit_prompts for key in chain_keys(root, p)]
    run_ours(cache, hit_prompts[:8], check=False)          # warm up
    ours_hit, floor_hit, get_hit, lru_hit = [], [], [], []
    for _ in range(repeats):
        ours_hit.append(run_ours(cache, hit_prompts))
        floor_hit.append(run_floor(floor_index, root, hit_prompts))
        get_hit.append(run_dict_get(floor_index, hit_keys))
        lru_hit.append(run_lru_dict(lru, root, hit_prompts))

    # misses: prompts never seen before; each evicts 64 blocks (the tier is full)
    next_new = n_prompts + 2
    run_ours(cache, [prompt(next_new + j) for j in range(4)], check=False)     # warm up
    next_new += 4
    ours_miss, floor_miss, get_miss, lru_miss = [], [], [], []
    for _ in range(repeats):
        new = [prompt(next_new + j) for j in range(k)]
        next_new += k
        new_keys = [key for p in new for key in chain_keys(root, p)]
        floor_miss.append(run_floor(floor_index, root, new))
        get_miss.append(run_dict_get(floor_index, new_keys))
        lru_miss.append(run_lru_dict(lru, root, new))
        ours_miss.append(run_ours(cache, new))
    s = cache.stats()
    assert s["tiers"]["gpu"]["evictions"] >= repeats * k * PROMPT_BLOCKS
    assert s["cached_blocks"] == cached
    rss = psutil.Process(os.getpid()).memory_info().rss
    gc.unfreeze()
    gc.enable()

    blocks = k * PROMPT_BLOCKS
    rows = []
    for workload, ours, floor, get, lru_t in (
            ("hit", ours_hit, floor_hit, get_hit, lru_hit),
            ("miss", ours_miss, floor_miss, get_miss, lru_miss)):
        ours_ns, floor_ns = min(ours) / blocks * 1e9, min(floor) / blocks * 1e9
        lru_ns = min(lru_t) / blocks * 1e9
        rows.append({
            "cached_blocks": cached, "workload": workload, "policy": policy,
            "ours_ns_per_block": round(ours_ns, 1),
            "floor_ns_per_block": round(floor_ns, 1),
            "dict_get_ns_per_block": round(min(get) / blocks * 1e9, 1),
            "lru_dict_ns_per_block": round(lru_ns, 1),
            "ratio": round(ours_ns / floor_ns, 2),
            "ratio_vs_lru_dict": round(ours_ns / lru_ns, 2),
            "ours_median_ns_per_block": round(sorted(ours)[len(ours) // 2] / blocks * 1e9, 1),
            "timed_blocks": blocks, "repeats": repeats,
            "fill_s": round(fill_s, 2), "rss_mib": round(rss / 2**20),
        })
    del cache, floor_index, lru
    gc.collect()
    return rows


# ---------------------------------------------------------------------------- memory


def warm(policy: str) -> bytes:
    """Imports and one-time set-up (the compiled passes a fill runs load at their first
    call), not per block: a 256-block cache filled with 4 prompts, as control_plane_peers.py
    warms up; a one-prompt warm-up left ~6 MB of it to the measured fill (60 B per block at
    10^5). Returns the hasher's root key."""
    cache = make_cache(PROMPT_BLOCKS * 4, policy)
    for i in range(4):
        s = cache.open(prompt(i))
        cache.mark_computed(s)
        cache.close(s)
    root = cache.hasher.root(None)[0]
    cache.shutdown()
    del cache, s
    gc.collect()
    return root


def rss_child(n_blocks: int, policy: str) -> dict:
    """In a fresh interpreter, without tracemalloc (its own tables would count): resident
    bytes per cached block of a filled cache."""
    warm(policy)
    trim_heap()
    rss0 = psutil.Process(os.getpid()).memory_info().rss
    cache = make_cache(n_blocks, policy)
    n_prompts, rest = divmod(n_blocks, PROMPT_BLOCKS)
    for i in range(n_prompts + (rest > 0)):
        p = prompt(i) if i < n_prompts else prompt(i)[:rest * BLOCK]
        s = cache.open(p)
        cache.mark_computed(s)
        cache.close(s)
    gc.collect()
    rss = psutil.Process(os.getpid()).memory_info().rss - rss0
    assert cache.stats()["cached_blocks"] == n_blocks
    return {"rss_bytes_per_block": round(rss / n_blocks, 1)}


def memory_child(n_blocks: int, policy: str) -> dict:
    """In a fresh interpreter: traced Python bytes per cached block of a filled cache, and of
    a plain dict holding the same keys."""
    import tracemalloc

    root = warm(policy)
    gc.disable()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    cache = make_cache(n_blocks, policy)
    n_prompts, rest = divmod(n_blocks, PROMPT_BLOCKS)
    for i in range(n_prompts + (rest > 0)):
        p = prompt(i) if i < n_prompts else prompt(i)[:rest * BLOCK]
        s = cache.open(p)
        cache.mark_computed(s)
        cache.close(s)
    gc.collect()
    ours = tracemalloc.get_traced_memory()[0] - base
    assert cache.stats()["cached_blocks"] == n_blocks
    cache.shutdown()
    del cache
    gc.collect()
    base2 = tracemalloc.get_traced_memory()[0]
    plain = {key: 0 for i in range(n_prompts) for key in chain_keys(root, prompt(i))}
    plain_bytes = tracemalloc.get_traced_memory()[0] - base2
    return {"cached_blocks": n_blocks, "policy": policy,
            "bytes_per_block": round(ours / n_blocks, 1),
            "dict_of_keys_bytes_per_block": round(plain_bytes / max(1, len(plain)), 1)}


def memory(sizes: list[int], repo: str | None, out: str, policy: str = "adaptive",
           root: str | None = None) -> dict:
    rows = []
    checkouts = [("this", str(Path(root or Path(__file__).resolve().parent.parent)))]
    if repo:
        checkouts.append(("other", str(Path(repo).resolve())))
    for label, root in checkouts:
        for n in sizes:
            row = {}
            for mode in ("--memory-child", "--rss-child"):
                row.update(checkout_child(__file__, [mode, str(n), "--policy", policy,
                                                     "--root", root], cwd=root))
            rows.append({"checkout": label, "path": root, **row,
                         "meets_300": row["bytes_per_block"] <= 300,
                         "rss_meets_300": row["rss_bytes_per_block"] <= 300})
    print_table(rows, ["checkout", "policy", "cached_blocks", "bytes_per_block",
                       "rss_bytes_per_block", "dict_of_keys_bytes_per_block", "meets_300",
                       "rss_meets_300"],
                title="control plane: bytes per cached block (tracemalloc, and RSS without it; "
                      "fresh processes, storage: none)")
    payload = {"benchmark": "control_plane_memory", "rows": rows,
               "target_bytes_per_block": 300, "environment": environment()}
    write_json(out, payload)
    return payload


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10^3 .. 10^5 cached blocks only")
    ap.add_argument("--sizes", type=int, nargs="*", help="cached block counts (override)")
    ap.add_argument("--sample", type=int, default=100, help="prompts per timed loop")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default="adaptive", help="eviction policy (default: adaptive, "
                    "the cache's default)")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="time the loops by wall time (default) or by this process's CPU time")
    ap.add_argument("--out", default=None)
    ap.add_argument("--memory", action="store_true",
                    help="bytes per cached block instead (fresh process per size)")
    ap.add_argument("--repo", default=None,
                    help="with --memory: also measure this checkout (e.g. an older commit)")
    ap.add_argument("--root", default=str(Path(__file__).resolve().parent.parent),
                    help="the checkout whose tiered_cache to measure (default: this one; e.g. "
                         "a git worktree of an older commit)")
    ap.add_argument("--memory-child", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--rss-child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    global _clock
    _clock = CLOCKS[args.clock]
    import_checkout(args.root)
    import tiered_cache

    checkout = str(Path(tiered_cache.__file__).resolve().parent.parent)
    if args.memory_child:
        print(json.dumps(memory_child(args.memory_child, args.policy)))
        return {}
    if args.rss_child:
        print(json.dumps(rss_child(args.rss_child, args.policy)))
        return {}
    if args.memory:
        return memory(args.sizes or ([10**4, 10**5] if args.quick else [10**5, 10**6]),
                      args.repo, args.out or "results/control_plane_memory.json", args.policy,
                      args.root)
    args.out = args.out or "results/control_plane.json"
    sizes = args.sizes or ([10**3, 10**4, 10**5] if args.quick
                           else [10**3, 10**4, 10**5, 10**6])

    rows: list[dict] = []
    t0 = time.perf_counter()
    print(f"tiered_cache from {checkout}", flush=True)
    for n in sizes:
        rows.extend(measure(n, args.sample, args.repeats, args.seed, args.policy))
    columns = ["cached_blocks", "workload", "ours_ns_per_block", "floor_ns_per_block", "ratio",
               "dict_get_ns_per_block", "lru_dict_ns_per_block", "ratio_vs_lru_dict", "rss_mib"]
    print_table(rows, columns, title=f"control plane ({args.policy}, {args.clock} time): ns per "
                f"block, best of {args.repeats} (open + mark_computed + close vs chained "
                "xxh3-128 + dict.get)")

    # Targets, as measured.
    limits = {"hit": 4.0, "miss": 10.0}
    worst = {w: max(r["ratio"] for r in rows if r["workload"] == w) for w in limits}
    flat, floor_flat = {}, {}
    for workload in ("hit", "miss"):
        big = [r for r in rows if r["workload"] == workload and r["cached_blocks"] >= 10**4]
        ours = [r["ours_ns_per_block"] for r in big]
        floor = [r["floor_ns_per_block"] for r in big]
        flat[workload] = round(max(ours) / min(ours), 3) if len(big) >= 2 else None
        floor_flat[workload] = round(max(floor) / min(floor), 3) if len(big) >= 2 else None
    flat_ok = all(v is not None and v <= 1.2 for v in flat.values())
    has_range = any(r["cached_blocks"] >= 10**6 for r in rows) and any(
        r["cached_blocks"] <= 10**4 for r in rows)
    print()
    for w, limit in limits.items():
        print(f"{w} within {limit:g}x of the floor: "
              f"{'MET' if worst[w] <= limit else 'NOT MET'} (worst ratio {worst[w]:.2f})")
    span = "10^4..10^6" if has_range else "10^4..max measured (run without --quick for 10^6)"
    print(f"flat within 20% over {span}: {'MET' if flat_ok else 'NOT MET'} "
          f"(max/min ours: hit {flat['hit']}, miss {flat['miss']}; the floor itself: "
          f"hit {floor_flat['hit']}, miss {floor_flat['miss']})")
    print(f"total {time.perf_counter() - t0:.1f} s")

    payload = {
        "benchmark": "control_plane",
        "description": "ns per block of open + mark_computed + close (storage: none, block_size"
                       f" 16, 64-block prompts, policy {args.policy}, device tier of exactly N "
                       "blocks) vs a floor of chained xxh3-128 + dict.get over the same keys",
        "rows": rows,
        "targets": {
            **{f"{w}_within_{limit:g}x_of_floor": {"met": worst[w] <= limit,
                                                   "worst_ratio": worst[w]}
               for w, limit in limits.items()},
            "flat_within_20pct_1e4_to_1e6": {"met": flat_ok if has_range else None,
                                              "max_over_min": flat,
                                              "floor_max_over_min": floor_flat,
                                              "sizes_measured": sizes},
        },
        "args": vars(args),
        "checkout": checkout,
        "environment": environment(),
    }
    write_json(args.out, payload)
    return payload


if __name__ == "__main__":
    main()
