"""Control plane per block against the peers' own code: vLLM's `BlockPool`, SGLang's `RadixCache`.

Same prompts, same run, same process: each peer is measured in a child interpreter where that
peer is importable (vLLM and SGLang pin different torch builds, so they get one child each), and
the child times our cache and the peer interleaved, best of `--repeats`. Ratios are ours / peer.

The workload is `control_plane.py`'s: a cache of exactly N cached blocks (64-block prompts of
distinct token ids, block / page size 16, nothing shared between prompts), then

- hit:  re-serve cached prompts drawn at random (the whole prompt is a prefix hit);
- miss: serve prompts never seen (the cache is full: 64 blocks published, 64 evicted).

What each side does per request (all of it inside the timed loop; token ids are prepared before,
each side in its own native form):

- ours (`TieredKVCache`, `storage: none`, one device tier of N blocks, `--policy`): `open`
  (64 chained xxh3-128 keys over the int32 token bytes, prefix-dict match, token verification
  of the matched blocks, pin; on a miss 64 new blocks, whose allocation evicts 64 by the policy),
  `mark_computed` (publishes the new blocks), `close` (unpins; leaves become candidates).
- vLLM (`vllm.v1.core`): a `Request` with the engine's block hasher (64 chained hashes with
  `xxhash`, the fastest algorithm it ships, over a pickle of (parent, tokens, extra keys)),
  `FullAttentionManager.find_longest_cache_hit` (`BlockPool.get_cached_block` per block),
  `BlockPool.touch` (pins: hit blocks leave the free queue), `get_new_blocks(64)` on a miss
  (pops the free queue's head, evicting each popped block's cached hash: its LRU),
  `cache_full_blocks` (registers the new hashes), `free_blocks` in reverse order (unpins: the
  blocks join the free queue's tail, as `KVCacheManager.free` does). A pool of N + 1 blocks
  (its null block takes one). Not included: the scheduler and `KVCacheManager`'s own
  bookkeeping (both would only add to vLLM's side).
- SGLang (`sglang.srt.mem_cache`): `RadixKey` over an `array('q')` of the tokens, `match_prefix`,
  `inc_lock_ref` of the matched node, `path_device_indices` (the prefix's KV indices, which the
  scheduler reads into the request's row), on a miss `PagedTokenToKVPoolAllocator.alloc` of
  1,024 tokens after `evict` of as many when the allocator is short (its LRU over the tree's
  evictable leaves), `insert` of the whole prompt with its KV indices, `dec_lock_ref`. A radix
  tree keeps one node per distinct prompt here (nothing is shared), so its per-block work is a
  64th of a node's. Not included: the scheduler's second match and row writes at
  `cache_finished_req` (both would only add to SGLang's side).

A full hit is taken whole on every side (an engine recomputes the last token, so vLLM and
SGLang cap the match one token short; here all three match all 64 blocks, the same work).

`--memory`: resident bytes per cached block instead. Each (side, N) runs in a fresh process:
RSS after imports and a warm-up, then the side is built and filled with N cached blocks, and
(RSS after - RSS before) / N is reported (the prompts' token arrays are made and dropped one at a
time; vLLM's `Request` objects are dropped after each request, as the engine does).

    python benchmarks/control_plane_peers.py [--quick] [--policy adaptive]
        [--vllm-python /work/venvs/vllm/bin/python] [--sglang-python PY] [--repo OTHER_CHECKOUT]
    python benchmarks/control_plane_peers.py --memory --sizes 100000 1000000

A peer whose package does not import with the interpreter given (default: this one) is skipped
and the table says so; nothing else in the project needs either package. `--repo` measures our
side from another checkout (e.g. a git worktree of an older commit) in children of its own,
interleaved with this checkout's, so before and after come from the same sitting.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
BLOCK = 16
PROMPT_BLOCKS = 64
PROMPT_TOKENS = BLOCK * PROMPT_BLOCKS

CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def clock() -> float:
    """The timed loops' clock (`--clock`): wall time, or this process's CPU time (all its
    threads: a side that used helper threads would be charged for them)."""
    return _clock()


PEERS = {
    "vllm": ("vllm.v1.core.block_pool", "vLLM BlockPool"),
    "sglang": ("sglang.srt.mem_cache.radix_cache", "SGLang RadixCache"),
}


# ---------------------------------------------------------------------------- the sides


def token_ids(i: int):
    """Prompt i's 1,024 distinct token ids (int64 range, as numpy)."""
    import numpy as np

    start = i * PROMPT_TOKENS
    return np.arange(start, start + PROMPT_TOKENS, dtype=np.int64)


class Ours:
    label = "ours"

    def __init__(self, n_blocks: int, policy: str) -> None:
        from tiered_cache import CacheConfig, TieredKVCache

        cfg = CacheConfig.from_dict({
            "model": {"name": "bench", "num_layers": 80, "num_kv_heads": 8, "head_dim": 128,
                      "dtype": "bfloat16"},
            "block_size": BLOCK,
            "storage": "none",
            "policy": policy,
            "tiers": {"gpu": {"device": "cpu", "num_blocks": n_blocks},
                      "host": {"num_blocks": 0}},
            "migrator": {"enabled": False},
            "compactor": {"enabled": False},
        })
        self.cache = TieredKVCache(cfg)

    @staticmethod
    def prepare(i: int):
        return token_ids(i).astype("int32")

    def serve_all(self, prompts) -> float:
        open_, mark, close = self.cache.open, self.cache.mark_computed, self.cache.close
        t0 = clock()
        for p in prompts:
            s = open_(p)
            mark(s)
            close(s)
        return clock() - t0

    def hit_blocks(self, p) -> int:
        s = self.cache.open(p)
        n = s.num_cached_tokens // BLOCK
        self.cache.close(s)
        return n

    def cached_blocks(self) -> int:
        return self.cache.stats()["cached_blocks"]


class Vllm:
    label = "vllm"

    def __init__(self, n_blocks: int, policy: str) -> None:
        import torch
        from vllm.sampling_params import SamplingParams
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
        from vllm.v1.core.single_type_kv_cache_manager import FullAttentionManager
        from vllm.v1.kv_cache_interface import FullAttentionSpec
        from vllm.v1.request import Request

        hash_fn = get_hash_fn_by_name("xxhash")
        init_none_hash(hash_fn)
        self.pool = BlockPool(n_blocks + 1, enable_caching=True, hash_block_size=BLOCK)
        self.spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=8, head_size=128,
                                      dtype=torch.bfloat16)
        self.hasher = get_request_block_hasher(BLOCK, hash_fn)
        self.params = SamplingParams(max_tokens=1)
        self.Request = Request
        self.find = FullAttentionManager.find_longest_cache_hit
        self._n = 0

    @staticmethod
    def prepare(i: int):
        return token_ids(i).tolist()

    def _serve(self, toks, Request, params, hasher, find, pool, spec) -> int:
        self._n += 1
        req = Request(str(self._n), toks, params, None, block_hasher=hasher)
        (hit,), _ = find(req.block_hashes, len(toks), [0], pool, spec, False, BLOCK)
        pool.touch(hit)
        full = len(toks) // BLOCK
        blocks = hit + pool.get_new_blocks(full - len(hit)) if len(hit) < full else hit
        pool.cache_full_blocks(req, blocks, len(hit), full, BLOCK, 0)
        pool.free_blocks(reversed(blocks))
        return len(hit)

    def serve_all(self, prompts) -> float:
        serve = self._serve
        args = (self.Request, self.params, self.hasher, self.find, self.pool, self.spec)
        t0 = clock()
        for p in prompts:
            serve(p, *args)
        return clock() - t0

    def hit_blocks(self, p) -> int:
        return self._serve(p, self.Request, self.params, self.hasher, self.find, self.pool,
                           self.spec)

    def cached_blocks(self) -> int:
        return len(self.pool.cached_block_hash_to_block)


class Sglang:
    label = "sglang"

    def __init__(self, n_blocks: int, policy: str) -> None:
        import torch
        from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
        from sglang.srt.mem_cache.base_prefix_cache import (
            EvictParams,
            InsertParams,
            MatchPrefixParams,
        )
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey

        self.alloc = PagedTokenToKVPoolAllocator(
            size=n_blocks * BLOCK, page_size=BLOCK, dtype=torch.bfloat16, device="cpu",
            kvcache=None, need_sort=False)
        self.tree = RadixCache(CacheInitParams(
            disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=self.alloc,
            page_size=BLOCK))
        self.RadixKey, self.Match, self.Insert, self.Evict = (
            RadixKey, MatchPrefixParams, InsertParams, EvictParams)
        self.cat = torch.cat

    @staticmethod
    def prepare(i: int):
        from array import array

        return array("q", token_ids(i).tolist())

    def _serve(self, toks) -> int:
        tree, alloc = self.tree, self.alloc
        key = self.RadixKey(toks)
        m = tree.match_prefix(self.Match(key=key))
        node = m.last_device_node
        tree.inc_lock_ref(node)
        have = m.device_prefix_len
        prefix = tree.path_device_indices(node)
        need = len(toks) - have
        if need:
            idx = alloc.alloc(need)
            if idx is None:
                tree.evict(self.Evict(num_tokens=need))
                idx = alloc.alloc(need)
                if idx is None:
                    raise RuntimeError("SGLang side: no room after evict")
            value = self.cat([prefix, idx]) if have else idx
        else:
            value = prefix
        tree.insert(self.Insert(key=key, value=value))
        tree.dec_lock_ref(node)
        return have // BLOCK

    def serve_all(self, prompts) -> float:
        serve = self._serve
        t0 = clock()
        for p in prompts:
            serve(p)
        return clock() - t0

    def hit_blocks(self, p) -> int:
        return self._serve(p)

    def cached_blocks(self) -> int:
        return self.tree.evictable_size() // BLOCK + self.tree.protected_size() // BLOCK


SIDES = {"ours": Ours, "vllm": Vllm, "sglang": Sglang}


# ---------------------------------------------------------------------------- one child


def fill(side, n_blocks: int) -> None:
    n_prompts, rest = divmod(n_blocks, PROMPT_BLOCKS)
    assert rest == 0, "sizes are whole prompts"
    batch = 256
    for lo in range(0, n_prompts, batch):
        side.serve_all([side.prepare(i) for i in range(lo, min(n_prompts, lo + batch))])


def measure(peer: str, n_blocks: int, sample: int, repeats: int, seed: int,
            policy: str) -> list[dict]:
    """Ours and `peer`, each filled with the same `n_blocks` cached blocks, then the hit loop
    and the miss loop over the same prompts, interleaved, best of `repeats`."""
    sides = [Ours(n_blocks, policy), SIDES[peer](n_blocks, policy)]
    t0 = time.perf_counter()
    for s in sides:
        fill(s, n_blocks)
    fill_s = time.perf_counter() - t0
    for s in sides:
        assert s.cached_blocks() == n_blocks, (s.label, s.cached_blocks(), n_blocks)
    gc.collect()
    gc.freeze()
    gc.disable()
    try:
        n_prompts = n_blocks // PROMPT_BLOCKS
        rng = random.Random(seed)
        k = min(sample, n_prompts)
        picks = [rng.randrange(n_prompts) for _ in range(k)]
        hits = {s.label: [s.prepare(i) for i in picks] for s in sides}
        times: dict[tuple[str, str], list[float]] = {}
        for s in sides:                             # warm up, and check it is a full hit
            s.serve_all(hits[s.label][:8])
            assert s.hit_blocks(hits[s.label][-1]) == PROMPT_BLOCKS, s.label
        for _ in range(repeats):
            for s in sides:
                times.setdefault((s.label, "hit"), []).append(s.serve_all(hits[s.label]))
        nxt = n_prompts + 2
        for s in sides:                             # warm up the miss path
            s.serve_all([s.prepare(nxt + j) for j in range(4)])
        nxt += 4
        for _ in range(repeats):
            fresh = list(range(nxt, nxt + k))
            nxt += k
            for s in sides:
                new = [s.prepare(i) for i in fresh]
                times.setdefault((s.label, "miss"), []).append(s.serve_all(new))
        for s in sides:
            assert s.cached_blocks() == n_blocks, (s.label, s.cached_blocks())
            assert s.hit_blocks(s.prepare(nxt - 1)) == PROMPT_BLOCKS, s.label
    finally:
        gc.unfreeze()
        gc.enable()
    blocks = k * PROMPT_BLOCKS
    rows = []
    for workload in ("hit", "miss"):
        ours = min(times[("ours", workload)]) / blocks * 1e9
        theirs = min(times[(peer, workload)]) / blocks * 1e9
        rows.append({"peer": peer, "cached_blocks": n_blocks, "workload": workload,
                     "policy": policy, "ours_ns_per_block": round(ours, 1),
                     "peer_ns_per_block": round(theirs, 1),
                     "ratio": round(ours / theirs, 3), "timed_blocks": blocks,
                     "repeats": repeats, "fill_s": round(fill_s, 2)})
    return rows


def rss() -> int:
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss


def memory_child(side_name: str, n_blocks: int, policy: str) -> dict:
    """Fresh process: resident bytes per cached block of one side filled with n_blocks
    (the heap trimmed before the first reading: `common.trim_heap`)."""
    from common import trim_heap

    cls = SIDES[side_name]
    warm = cls(PROMPT_BLOCKS * 4, policy)           # imports and one-time set-up
    fill(warm, PROMPT_BLOCKS * 4)
    del warm
    gc.collect()
    trim_heap()
    before = rss()
    side = cls(n_blocks, policy)
    fill(side, n_blocks)
    gc.collect()
    after = rss()
    assert side.cached_blocks() == n_blocks
    return {"side": side_name, "cached_blocks": n_blocks, "policy": policy,
            "rss_bytes_per_block": round((after - before) / n_blocks, 1)}


# ---------------------------------------------------------------------------- orchestration


STUBS = ROOT / "tests" / "sglang_hicache" / "stubs"


def child_env(python: str) -> dict:
    """A child's environment: no PYTHONPATH of ours, but SGLang's torchvision stand-in
    (tests/sglang_hicache/stubs) where the interpreter has sglang but no torchvision, as in
    `.venv-sglang` (`make test-sglang`: the sglang wheel over the CPU torch)."""
    env = dict(os.environ, PYTHONHASHSEED="0")      # vLLM's non-crypto NONE_HASH seed
    env.pop("PYTHONPATH", None)
    probe = subprocess.run([python, "-c", "import importlib.util as u; print(u.find_spec("
                            "'sglang') is not None and u.find_spec('torchvision') is None)"],
                           capture_output=True, text=True, env=env, timeout=600)
    if probe.stdout.strip() == "True":
        env["PYTHONPATH"] = str(STUBS)
    return env


def importable(python: str, module: str) -> tuple[bool, str]:
    proc = subprocess.run([python, "-c", f"import {module}"], capture_output=True, text=True,
                          timeout=600, env=child_env(python))
    if proc.returncode == 0:
        return True, ""
    tail = (proc.stderr.strip().splitlines() or ["?"])[-1]
    return False, tail


def child(python: str, root: str, args: list[str]) -> list[dict]:
    env = child_env(python)
    # NOTE: the peers' interpreters may carry another numba, which would recompile (and
    # overwrite) the policies' on-disk kernel cache each time the interpreters alternate; so
    # would two checkouts whose kernels differ. One cache per (interpreter, checkout).
    import hashlib

    tag = hashlib.sha1(f"{python}\0{Path(root).resolve()}".encode()).hexdigest()[:12]
    env.setdefault("NUMBA_CACHE_DIR", str(ROOT / "results" / ".numba" / tag))
    from common import checkout_child

    return checkout_child(Path(__file__).resolve(), ["--child-root", root, *args],
                          python=python, env=env, timeout=7200)


def main(argv: list[str] | None = None) -> dict:
    sys.path.insert(0, str(HERE))
    from common import environment, print_table, write_json

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="10^3 and 10^4 cached blocks only")
    ap.add_argument("--sizes", type=int, nargs="*", help="cached block counts (multiples of 64)")
    ap.add_argument("--policy", default="adaptive", help="our policy (default: the default)")
    ap.add_argument("--sample", type=int, default=100, help="prompts per timed loop")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--rounds", type=int, default=1,
                    help="children per (checkout, peer, size), alternating checkouts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS))
    ap.add_argument("--vllm-python", default=os.environ.get("TC_VLLM_PYTHON", sys.executable))
    ap.add_argument("--sglang-python",
                    default=os.environ.get("TC_SGLANG_PYTHON", sys.executable))
    ap.add_argument("--repo", default=None, help="also measure our side from this checkout")
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall time (default) or the process's CPU time (on a loaded machine)")
    ap.add_argument("--memory", action="store_true", help="RSS bytes per cached block instead")
    ap.add_argument("--out", default=None)
    ap.add_argument("--child-root", help=argparse.SUPPRESS)
    ap.add_argument("--child-peer", help=argparse.SUPPRESS)
    ap.add_argument("--child-side", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    global _clock
    _clock = CLOCKS[args.clock]
    if args.child_root:                             # in a child: measure, print JSON
        from common import import_checkout

        import_checkout(args.child_root)
        if args.child_side:
            rows = [memory_child(args.child_side, n, args.policy) for n in args.sizes]
        else:
            rows = [r for n in args.sizes for r in measure(
                args.child_peer, n, args.sample, args.repeats, args.seed, args.policy)]
        print(json.dumps(rows))
        return {}

    sizes = args.sizes or ([10**5, 10**6] if args.memory else
                           [1024, 10240] if args.quick else [1024, 10240, 102400, 1024000])
    sizes = [s - s % PROMPT_BLOCKS for s in sizes]
    pythons = {"vllm": args.vllm_python, "sglang": args.sglang_python}
    available, skipped = {}, {}
    for peer in args.peers:
        ok, why = importable(pythons[peer], PEERS[peer][0])
        if ok:
            available[peer] = pythons[peer]
        else:
            skipped[peer] = f"{PEERS[peer][0]} does not import with {pythons[peer]}: {why}"
            print(f"{PEERS[peer][1]}: skipped ({skipped[peer]})", flush=True)
    checkouts = [("this", str(ROOT))]
    if args.repo:
        checkouts.append(("other", str(Path(args.repo).resolve())))
    common_args = ["--policy", args.policy, "--seed", str(args.seed), "--clock", args.clock]
    rows: list[dict] = []
    t0 = time.perf_counter()
    if args.memory:
        sides = [("ours", sys.executable)] + [(p, py) for p, py in available.items()]
        for _, root in checkouts:
            # NOTE: a fill measured in a process that compiled the kernels reads ~15% low at
            # 10^5 blocks (the compiler's freed memory is reused: `common.trim_heap`), so each
            # checkout's kernel cache is filled first, by a run that is not recorded.
            child(sys.executable, root, ["--child-side", "ours", "--sizes", str(4 * 64),
                                         *common_args])
        for n in sizes:
            for side, py in sides:
                for label, root in (checkouts if side == "ours" else checkouts[:1]):
                    for r in child(py, root, ["--child-side", side, "--sizes", str(n),
                                              *common_args]):
                        rows.append({"checkout": label if side == "ours" else "", **r})
        print_table(rows, ["side", "checkout", "cached_blocks", "policy",
                           "rss_bytes_per_block"],
                    title="control plane: resident bytes per cached block (fresh process per"
                          " row)")
    else:
        for peer, py in available.items():
            for n in sizes:
                for _ in range(args.rounds):
                    for label, root in checkouts:
                        for r in child(py, root, ["--child-peer", peer, "--sizes", str(n),
                                                  "--sample", str(args.sample), "--repeats",
                                                  str(args.repeats), *common_args]):
                            rows.append({"checkout": label, **r})
        if args.rounds > 1:                         # best of the rounds, per cell
            best: dict[tuple, dict] = {}
            for r in rows:
                cell = (r["checkout"], r["peer"], r["cached_blocks"], r["workload"])
                if cell not in best or r["ratio"] < best[cell]["ratio"]:
                    best[cell] = r
            rows = list(best.values())
        print_table(rows, ["peer", "checkout", "cached_blocks", "workload", "ours_ns_per_block",
                           "peer_ns_per_block", "ratio"],
                    title=f"control plane vs peers: ns per block ({args.clock} time), best of "
                          f"{args.repeats}, ratio = ours ({args.policy}) / peer, same process")
    if not available:
        print("no peer importable: nothing measured (pass --vllm-python / --sglang-python)")
    print(f"total {time.perf_counter() - t0:.1f} s")
    payload = {"benchmark": "control_plane_peers_memory" if args.memory else
               "control_plane_peers", "rows": rows, "skipped": skipped,
               "interpreters": available, "args": vars(args), "environment": environment()}
    write_json(args.out or ("results/control_plane_peers_memory.json" if args.memory
                            else "results/control_plane_peers.json"), payload)
    return payload


if __name__ == "__main__":
    main()
