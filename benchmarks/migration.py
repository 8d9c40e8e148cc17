"""Migration bandwidth: batched demotion (device -> host) and promotion (host -> device) of
70B-geometry KV blocks, next to one contiguous ``copy_`` of the same number of bytes.

Geometry: Llama-70B KV (8 KV heads, head_dim 128, bfloat16, 16-token blocks: 64 KiB per layer
per block). The layer count is 80 on a GPU (5 MiB blocks); on a CPU-only machine it is scaled
down (``--layers``, default 8: 512 KiB blocks) so that enough blocks fit in memory. The per-layer
block geometry, and therefore the size of each contiguous chunk the copies move, is unchanged.

Two levels are measured, each next to a plain contiguous copy of the same bytes, timed
interleaved (baseline, ours, baseline, ours, ...) so that the machine's drift hits both:

(a) kernels: ``tiered_cache.kernels.copy_blocks_to_host`` / ``copy_blocks_to_gpu`` on the
    layer-major device pool and the block-major host pool, with contiguous slot runs and with
    scattered slots (random slots on both sides), all layers at once and (promotion) one layer
    per call as the migrator issues it. Backend ``auto`` (Triton or copy engines on a GPU, the
    numba one-pass copier on a CPU) and ``torch`` (the torch twin) are both timed.
(b) end to end: a ``TieredKVCache`` (tensor storage, write_back) whose device tier is filled
    with published blocks; one more ``open()`` pushes it past the migrator's high watermark and
    the clock runs until the demotions counter (read without the lock) reaches the expected
    count (demotion down to the low watermark; polled every 2 ms). Then the prompts are
    reopened and the clock runs until ``cache.wait(seq, L - 1)`` has returned for every one of
    them (layer-wise promotion; on a GPU ``wait`` only orders the caller's stream, so the
    clock stops after a device synchronize). Two prompt lengths are run: short prompts give
    many block chains, long ones few (the migrator demotes leaves of chains, so the chain
    count shapes its batches).

Baseline: on a GPU, ``copy_`` between a device buffer and a pinned host buffer (one
``cudaMemcpyAsync``) in the same direction; on a CPU, ``copy_`` between two host buffers (the
"device" pool is in CPU memory there too). Targets: >= 0.9 of the baseline. Each row gives the
median ratio and its range over the pairs (``n``); absolute GB/s are only meaningful on a quiet
machine.

    python benchmarks/migration.py [--quick] [--out results/migration.json]
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import default_out, environment, gbps, print_table, write_json  # noqa: E402

from tiered_cache import TieredKVCache  # noqa: E402
from tiered_cache.config import CacheConfig  # noqa: E402
from tiered_cache.kernels import copy_blocks_to_gpu, copy_blocks_to_host  # noqa: E402

HEADS, HEAD_DIM, BLOCK, DTYPE = 8, 128, 16, torch.bfloat16
FULL_LAYERS = 80
TARGET = 0.9


# ----------------------------------------------------------------------------- timing
class Clock:
    """Wall time of a callable; with CUDA, synchronized before and after."""

    def __init__(self, cuda: bool) -> None:
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)

    def __call__(self, fn) -> float:
        self.sync()
        t0 = time.perf_counter()
        fn()
        self.sync()
        return time.perf_counter() - t0


def paired(clock: Clock, ours, base, repeats: int, budget_s: float = 4.0) -> dict:
    """Interleaved timing of ours and the baseline (base, ours, base, ours, ...): medians, and
    the median and spread of the paired ratios base/ours. The first pair is a warm-up unless it
    alone takes a good part of `budget_s` (a slow path is then timed fewer times)."""
    tb, to = clock(base), clock(ours)
    per = tb + to
    n = max(1, min(repeats, int(budget_s / per)))
    pairs = [(tb, to)] if per > budget_s / 4 else []
    while len(pairs) < n:
        tb = clock(base)
        to = clock(ours)
        pairs.append((tb, to))
    ratios = [b / o for b, o in pairs]
    return {"ours_s": statistics.median(o for _, o in pairs),
            "base_s": statistics.median(b for b, _ in pairs),
            "ratio": statistics.median(ratios), "ratio_min": min(ratios),
            "ratio_max": max(ratios), "pairs": len(pairs)}


def row(name: str, direction: str, nbytes: int, nblocks: int, t: dict, **extra) -> dict:
    r = {"case": name, "direction": direction, "blocks": nblocks, "MiB": nbytes / 2**20,
         "ours_GBps": gbps(nbytes, t["ours_s"]), "copy__GBps": gbps(nbytes, t["base_s"]),
         "ratio": t["ratio"], "ratio_range": f"{t['ratio_min']:.2f}-{t['ratio_max']:.2f}",
         "n": t["pairs"], "ours_ms": t["ours_s"] * 1e3, "meets_0.9": t["ratio"] >= TARGET}
    r.update(extra)
    return r


class Baseline:
    """One contiguous copy_ of `nbytes` in each direction, between the benchmark's two memories."""

    def __init__(self, nbytes: int, device: torch.device, pinned: bool) -> None:
        self.dev = torch.ones(nbytes, dtype=torch.uint8, device=device)
        self.host = torch.ones(nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.nb = device.type == "cuda"

    def to_host(self, nbytes: int):
        src, dst = self.dev[:nbytes], self.host[:nbytes]
        return lambda: dst.copy_(src, non_blocking=self.nb)

    def to_device(self, nbytes: int):
        src, dst = self.host[:nbytes], self.dev[:nbytes]
        return lambda: dst.copy_(src, non_blocking=self.nb)


# ----------------------------------------------------------------------------- (a) kernels
def bench_kernels(args, device: torch.device, cuda: bool, base: Baseline) -> list[dict]:
    L, n = args.layers, args.blocks
    slots = 2 * n                       # room to scatter
    clock = Clock(cuda)
    gpu_kv = torch.empty((L, 2, slots, BLOCK, HEADS, HEAD_DIM), dtype=DTYPE, device=device)
    gpu_kv.view(torch.int16).random_(-2**15, 2**15 - 1)
    host_kv = torch.zeros((slots, L, 2, BLOCK, HEADS, HEAD_DIM), dtype=DTYPE, pin_memory=cuda)
    block_bytes = gpu_kv[:, :, 0].numel() * gpu_kv.element_size()
    nbytes = n * block_bytes
    g = torch.Generator().manual_seed(0)
    contiguous = (list(range(n // 2, n // 2 + n)), list(range(n // 3, n // 3 + n)))
    # Scattered: a sorted random subset on the source side (as transfer.group sorts plans by
    # source slot) and a random permutation on the destination side: no two neighbours form a run.
    src_s = torch.randperm(slots, generator=g)[:n].sort().values.tolist()
    dst_s = torch.randperm(slots, generator=g)[:n].tolist()
    nb = cuda
    # auto: Triton / copy engines on a GPU, the numba one-pass copier on a CPU; torch: the
    # torch twin (the CPU path before the numba copier), for comparison in the same run.
    backends = ["auto", "torch"]
    rows = []
    for backend in backends:
        for kind, (gs, hs) in (("contiguous", contiguous), ("scattered", (src_s, dst_s))):
            if backend == "torch" and kind == "scattered" and cuda:
                # NOTE: the torch twin gathers scattered host blocks with index_select on the
                # CPU side (well under 1 GB/s), seconds per call at this size; the copy-engine
                # comparison needs only the contiguous runs.
                continue
            def demote(gs=gs, hs=hs, backend=backend):
                copy_blocks_to_host(gpu_kv, gs, host_kv, hs, backend=backend, non_blocking=nb)

            def promote(gs=gs, hs=hs, backend=backend):
                copy_blocks_to_gpu(host_kv, hs, gpu_kv, gs, backend=backend, non_blocking=nb)

            def promote_layers(gs=gs, hs=hs, backend=backend):
                for layer in range(L):
                    copy_blocks_to_gpu(host_kv, hs, gpu_kv, gs, layers=(layer,),
                                       backend=backend, non_blocking=nb)

            cases = (("demote", "to_host", demote, base.to_host(nbytes)),
                     ("promote", "to_device", promote, base.to_device(nbytes)),
                     ("promote, layer by layer", "to_device", promote_layers,
                      base.to_device(nbytes)))
            for name, direction, ours, ref in cases:
                t = paired(clock, ours, ref, args.repeats)
                rows.append(row(f"kernel {name} ({kind})", direction, nbytes, n, t,
                                backend=backend, level="kernel", slots=kind))
            # Spot check (a wrong copy is not bandwidth): after these cases each pair holds the
            # same bits on both sides.
            for i in (0, len(gs) // 2, len(gs) - 1):
                assert torch.equal(host_kv[hs[i]].view(torch.int16),
                                   gpu_kv[:, :, gs[i]].cpu().view(torch.int16)), (
                    f"kernel copy is wrong ({backend}, {kind}, pair {i})")
    return rows


# ----------------------------------------------------------------------------- (b) end to end
def make_cache(args, device: torch.device) -> TieredKVCache:
    return TieredKVCache(CacheConfig.from_dict({
        "model": {"name": "llama-70b-kv-geometry", "num_layers": args.layers,
                  "num_kv_heads": HEADS, "head_dim": HEAD_DIM, "num_q_heads": 64,
                  "dtype": "bfloat16"},
        "block_size": BLOCK,
        "tiers": {"gpu": {"device": "cuda" if device.type == "cuda" else "cpu",
                          "num_blocks": args.gpu_blocks},
                  "host": {"num_blocks": args.gpu_blocks, "memory": "pinned"}},
        "write_policy": "write_back",
        "storage": "tensors",
        "migrator": {"enabled": True, "high_watermark": args.high, "low_watermark": args.low,
                     "num_workers": args.workers, "batch_blocks": args.batch_blocks,
                     "wait_timeout_s": 120.0},
        "compactor": {"enabled": False},
    }))


def reset_holds(cache: TieredKVCache) -> None:
    """Clear the control-plane lock's HoldStats (a hold taken outside a commit section, as
    this one, is not filed; `reset` excludes concurrent observations)."""
    with cache.index.lock:
        cache.index.lock.holds.reset()


def prompt_tokens(i: int, nblocks: int) -> np.ndarray:
    # Distinct first tokens per prompt (i < 2**15): no two prompts share a prefix.
    return (np.arange(nblocks * BLOCK, dtype=np.int64) + i * 65_536 + 1).astype(np.int32)


def wait_for(pred, timeout: float, poll: float = 0.002) -> bool:
    deadline = time.perf_counter() + timeout
    while not pred():
        if time.perf_counter() > deadline:
            return False
        time.sleep(poll)
    return True


def bench_end_to_end(args, device: torch.device, cuda: bool, base: Baseline,
                     prompt_blocks: int) -> dict:
    clock = Clock(cuda)
    cache = make_cache(args, device)
    # The baseline copies of the bytes this run will move (known from the geometry), timed
    # just before and just after the run: the median of the four is compared with the run.
    L, P, G = args.layers, prompt_blocks, args.gpu_blocks
    fill = int(args.high * G) // P * P
    k = max(args.trigger_blocks, int(args.high * G) + 1 - fill)   # past the watermark
    # Down to the low watermark, but only unpinned blocks can go (the trigger stays open).
    expect = min(fill, fill + k - int(args.low * G))
    nbytes = expect * cache.block_bytes
    base_before = ([clock(base.to_host(nbytes)) for _ in range(2)],
                   [clock(base.to_device(nbytes)) for _ in range(2)])
    try:
        num_prompts = fill // P                         # at the watermark, not past it
        kv = torch.ones((P * BLOCK, HEADS, HEAD_DIM), dtype=DTYPE, device=device)
        prompts = [prompt_tokens(i, P) for i in range(num_prompts)]
        t0 = time.perf_counter()
        for toks in prompts:
            seq = cache.open(toks)
            for layer in range(L):
                cache.write(seq, layer, kv, kv)
            cache.close(seq)
        clock.sync()
        setup_s = time.perf_counter() - t0
        st = cache.stats()
        assert st["demotions"] == 0 and st["tiers"]["gpu"]["used_blocks"] == fill, st
        # ---- demotion: one more open() passes the high watermark
        trigger = prompt_tokens(2**15 - 1, k)
        reset_holds(cache)
        t0 = time.perf_counter()
        tseq = cache.open(trigger)
        # NOTE: the counter is read without the lock: `stats()` every 2 ms took the lock the
        # demoter plans and commits under, and built every tier's statistics, on a core the
        # copies need (2 cores here): the probe must not slow what it measures.
        counters = cache.index.counters
        ok = wait_for(lambda: counters.demotions >= expect, args.timeout)
        demote_s = time.perf_counter() - t0
        assert ok, f"demotion stalled at {cache.stats()['demotions']} of {expect}"
        demote_bytes = expect * cache.block_bytes
        time.sleep(0.02)
        st = cache.stats()
        assert st["demotions"] == expect, (st["demotions"], expect)
        lock_demote = st["lock_hold"]
        cache.close(tseq)
        cache.invalidate(trigger)
        cache.migrator.drain()
        # ---- promotion: reopen every prompt; done when the last layer of each has landed
        before = cache.stats()["promotions"]
        reset_holds(cache)
        t0 = time.perf_counter()
        seqs = [cache.open(toks) for toks in prompts]
        for seq in seqs:
            cache.wait(seq, L - 1)
        clock.sync()
        promote_s = time.perf_counter() - t0
        # NOTE: a reader is woken when its last layer lands, just before the copy's commit
        # counts the promotion: wait for the count (untimed) before reading it.
        wait_for(lambda: counters.promotions - before >= expect, args.timeout)
        st = cache.stats()
        promoted = st["promotions"] - before
        lock_promote = st["lock_hold"]
        promote_bytes = promoted * cache.block_bytes
        assert promoted == expect, (promoted, expect)
        assert all(s.num_cached_tokens == P * BLOCK for s in seqs)
        for seq in seqs:
            cache.close(seq)
    finally:
        cache.shutdown()
    b_dem = statistics.median(base_before[0] + [clock(base.to_host(nbytes)) for _ in range(2)])
    b_pro = statistics.median(base_before[1] + [clock(base.to_device(nbytes))
                                                for _ in range(2)])
    return {"prompt_blocks": P, "setup_s": setup_s, "prompts": num_prompts, "demoted": expect,
            "demote_s": demote_s, "demote_base_s": b_dem, "demote_bytes": demote_bytes,
            "promoted": promoted, "promote_s": promote_s, "promote_base_s": b_pro,
            "promote_bytes": promote_bytes, "lock_hold_demotion": lock_demote,
            "lock_hold_promotion": lock_promote}


def end_to_end_rows(runs: list[dict], args) -> list[dict]:
    rows = []
    for P in sorted({r["prompt_blocks"] for r in runs}):
        mine = [r for r in runs if r["prompt_blocks"] == P]
        for name, direction, key in (
                ("e2e demotion (watermark)", "to_host", "demote"),
                ("e2e promotion (reopen, layer-wise)", "to_device", "promote")):
            ratios = [r[f"{key}_base_s"] / r[f"{key}_s"] for r in mine]
            t = {"ours_s": statistics.median(r[f"{key}_s"] for r in mine),
                 "base_s": statistics.median(r[f"{key}_base_s"] for r in mine),
                 "ratio": statistics.median(ratios), "ratio_min": min(ratios),
                 "ratio_max": max(ratios), "pairs": len(mine)}
            nblocks = mine[0]["demoted" if key == "demote" else "promoted"]
            rows.append(row(f"{name}, {P}-block prompts", direction, mine[0][f"{key}_bytes"],
                            nblocks, t, level="e2e", backend="auto", slots="allocator",
                            prompt_blocks=P))
    return rows


# ----------------------------------------------------------------------------- main
def parse(argv=None):
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small fast run (< 10 s)")
    p.add_argument("--out", default=default_out("migration"))
    p.add_argument("--layers", type=int, default=None,
                   help=f"layers per block (default {FULL_LAYERS} on a GPU, 8 on CPU)")
    p.add_argument("--blocks", type=int, default=None, help="blocks per kernel-level copy")
    p.add_argument("--gpu-blocks", type=int, default=None, help="device tier slots (e2e)")
    p.add_argument("--prompt-blocks", type=int, nargs="+", default=None,
                   help="blocks per prompt, one e2e scenario each (default: short and long)")
    p.add_argument("--trigger-blocks", type=int, default=None)
    p.add_argument("--high", type=float, default=0.9, help="migrator.high_watermark")
    p.add_argument("--low", type=float, default=0.1, help="migrator.low_watermark")
    p.add_argument("--batch-blocks", type=int, default=64, help="migrator.batch_blocks")
    p.add_argument("--workers", type=int, default=2, help="migrator.num_workers")
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--e2e-repeats", type=int, default=None)
    p.add_argument("--timeout", type=float, default=60.0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads (default: torch's choice)")
    args = p.parse_args(argv)
    quick = args.quick
    defaults = {
        "layers": (2 if quick else (FULL_LAYERS if cuda else 8)),
        # GPU: 80 layers (5 MiB blocks): 1.25 GiB per kernel-level copy, 2.5 GiB tiers.
        "blocks": (32 if quick else (256 if cuda else 1024)),
        "gpu_blocks": (128 if quick else (512 if cuda else 2048)),
        "prompt_blocks": ([4, 32] if quick else [16, 256 if not cuda else 128]),
        "trigger_blocks": (4 if quick else 16),
        "repeats": (2 if quick else 7),
        "e2e_repeats": (1 if quick else (2 if cuda else 3)),
    }
    for k, v in defaults.items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    block_bytes = args.layers * 2 * BLOCK * HEADS * HEAD_DIM * 2
    scaled = args.layers != FULL_LAYERS
    note = (f"{args.layers} layers x (2 x {BLOCK} tokens x {HEADS} heads x {HEAD_DIM} x bf16) = "
            f"{block_bytes / 2**10:.0f} KiB per block"
            + (f" (layer count scaled down from {FULL_LAYERS} to fit memory; per-layer block "
               "geometry unchanged: 32 KiB contiguous chunks per (layer, K/V))" if scaled else ""))
    where = ("device pool on CUDA, host pool pinned; baseline = copy_ device<->pinned "
             "(cudaMemcpyAsync)" if cuda else
             "no CUDA: the device pool is in CPU memory; baseline = copy_ between two host "
             "buffers")
    print(f"geometry: {note}\n{where}", flush=True)
    big = max(args.blocks, args.gpu_blocks) * block_bytes
    base = Baseline(big, device, pinned=cuda)
    t_start = time.perf_counter()
    rows = bench_kernels(args, device, cuda, base)
    gc.collect()
    runs = []
    for P in args.prompt_blocks:
        for _ in range(args.e2e_repeats):
            runs.append(bench_end_to_end(args, device, cuda, base, P))
            gc.collect()                # free the last cache's pools before the next one
    rows += end_to_end_rows(runs, args)
    cols = ["case", "backend", "blocks", "MiB", "ours_GBps", "copy__GBps", "ratio",
            "ratio_range", "n", "ours_ms", "meets_0.9"]
    print_table(rows, cols, title=f"\nmigration bandwidth vs one contiguous copy_ "
                f"(target ratio >= {TARGET})")
    e2e_table = [{"run": i, "blocks/prompt": r["prompt_blocks"], "prompts": r["prompts"],
                  "setup_s": r["setup_s"], "demoted": r["demoted"],
                  "demote_ms": r["demote_s"] * 1e3,
                  "demote_x": r["demote_base_s"] / r["demote_s"],
                  "lock_max_ms(dem)": r["lock_hold_demotion"]["max_s"] * 1e3,
                  "promoted": r["promoted"], "promote_ms": r["promote_s"] * 1e3,
                  "promote_x": r["promote_base_s"] / r["promote_s"],
                  "lock_max_ms(pro)": r["lock_hold_promotion"]["max_s"] * 1e3}
                 for i, r in enumerate(runs)]
    print_table(e2e_table, title="\nend-to-end runs")
    elapsed = time.perf_counter() - t_start
    payload = {
        "benchmark": "migration", "quick": args.quick, "target_ratio": TARGET,
        "geometry": {"num_layers": args.layers, "full_num_layers": FULL_LAYERS,
                     "layers_scaled_down": scaled, "num_kv_heads": HEADS, "head_dim": HEAD_DIM,
                     "block_size": BLOCK, "dtype": "bfloat16", "block_bytes": block_bytes,
                     "note": note},
        "device": str(device), "baseline": where,
        "config": {k: getattr(args, k) for k in (
            "blocks", "gpu_blocks", "prompt_blocks", "trigger_blocks", "high", "low",
            "batch_blocks", "workers", "repeats", "e2e_repeats")},
        "rows": rows, "e2e_runs": runs,
        "all_meet_target": all(r["meets_0.9"] for r in rows),
        "elapsed_s": elapsed, "environment": environment(),
    }
    write_json(args.out, payload)
    return 0


if __name__ == "__main__":
    sys.exit(main())
