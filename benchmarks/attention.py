"""Paged decode attention benchmark.

CPU (always): the torch twin of ``paged_decode_attention`` against a naive baseline that
gathers each sequence's blocks into contiguous K/V with ``torch.cat``, repeats K/V per query
head (GQA) and runs plain softmax attention, in the same run, on the same pools.

CUDA (when available): the Triton kernel on the 70B geometry (Hq=64, Hkv=8, D=128, bf16,
block 16) at 8K/32K/128K tokens with 0/10/50% of the blocks in the pinned host pool, as
bytes/s against the bytes it must read; the device bandwidth (a large ``copy_``) and the PCIe
time of the host bytes alone (a pinned host-to-device copy) are measured in the same run.

Prints tables and writes JSON (``--out``, default ``results/attention.json``).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable

import torch
from common import default_out, environment, print_table, time_it, write_json

from tiered_cache.kernels import paged_decode_attention
from tiered_cache.kernels.testing import PagedCase, relative_error

# ---------------------------------------------------------------------------------------------
# pools
# ---------------------------------------------------------------------------------------------


def make_pools(
    batch: int, tokens: int, *, hkv: int, d: int, block: int, dtype: torch.dtype,
    host_fraction: float, device: torch.device, seed: int = 0,
) -> PagedCase:
    """One layer of a two-tier cache holding ``batch`` sequences of ``tokens`` tokens, blocks
    scattered over random slots, ``host_fraction`` of them in the (pinned, on CUDA) host pool.
    Only one layer is allocated (``num_layers = 1``) to keep memory at the benchmarked size."""
    gen = torch.Generator().manual_seed(seed)
    nb = math.ceil(tokens / block)
    total = batch * nb
    on_host = torch.rand(batch, nb, generator=gen) < host_fraction
    n_host = int(on_host.sum())
    n_gpu = total - n_host
    tiers = on_host.to(torch.int8)
    tables = torch.empty(batch, nb, dtype=torch.int32)
    tables[~on_host] = torch.randperm(max(n_gpu, 1), generator=gen)[:n_gpu].to(torch.int32)
    tables[on_host] = torch.randperm(max(n_host, 1), generator=gen)[:n_host].to(torch.int32)
    shape = (block, hkv, d)
    gpu_kv = torch.empty(1, 2, max(n_gpu, 1), *shape, dtype=dtype, device=device)
    gpu_kv.normal_()
    host_shape = (max(n_host, 1), 1, 2, *shape)
    if device.type == "cuda":  # fill on the device: CPU randn of GBs is slow
        host_kv = torch.empty(host_shape, dtype=dtype, pin_memory=True)
        host_kv.copy_(torch.randn(host_shape, dtype=dtype, device=device))
    else:
        host_kv = torch.randn(host_shape, dtype=dtype)
    lens = torch.full((batch,), tokens, dtype=torch.int32)
    return PagedCase(gpu_kv, host_kv, None, None, tables.to(device), tiers.to(device),
                     lens.to(device), [], [])


def naive_decode(case: PagedCase, q: torch.Tensor, scale: float) -> torch.Tensor:
    """Baseline: per sequence, torch.cat its blocks into contiguous K/V, repeat K/V for GQA,
    softmax attention."""
    gk, gv = case.gpu_kv[0, 0], case.gpu_kv[0, 1]
    hk, hv = case.host_kv[:, 0, 0], case.host_kv[:, 0, 1]
    block = gk.shape[1]
    group = q.shape[1] // gk.shape[2]
    tables, tiers = case.block_tables.tolist(), case.block_tiers.tolist()
    outs = []
    for b, n in enumerate(case.seq_lens.tolist()):
        nb = math.ceil(n / block)
        ks = [(hk if tiers[b][j] else gk)[tables[b][j]] for j in range(nb)]
        vs = [(hv if tiers[b][j] else gv)[tables[b][j]] for j in range(nb)]
        k = torch.cat(ks)[:n].to(q.device).float().repeat_interleave(group, dim=1)
        v = torch.cat(vs)[:n].to(q.device).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].float(), k) * scale
        outs.append(torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v))
    return torch.stack(outs).to(q.dtype)


def ours(case: PagedCase, q: torch.Tensor, backend: str, num_splits: int | None = None):
    return paged_decode_attention(
        q, case.pools(0, 0), case.pools(1, 0), case.block_tables, case.block_tiers,
        case.seq_lens, backend=backend, num_splits=num_splits,
    )


def cpu_time(fn: Callable[[], object], reps: int) -> float:
    """Median wall time in ms over ``reps`` runs after one warm-up."""
    return time_it(fn, warmup=1, repeats=reps)["median_s"] * 1e3


# ---------------------------------------------------------------------------------------------
# CPU: twin vs naive gather
# ---------------------------------------------------------------------------------------------


def run_cpu(contexts: list[int], batch: int, hq: int, hkv: int, d: int, reps: int) -> list[dict]:
    rows = []
    for tokens in contexts:
        case = make_pools(batch, tokens, hkv=hkv, d=d, block=16, dtype=torch.float32,
                          host_fraction=0.1, device=torch.device("cpu"))
        q = torch.randn(batch, hq, d)
        scale = d**-0.5
        err = relative_error(ours(case, q, "torch"), naive_decode(case, q, scale).double())
        t_ours = cpu_time(lambda case=case, q=q: ours(case, q, "torch"), reps)
        t_base = cpu_time(lambda case=case, q=q, s=scale: naive_decode(case, q, s), reps)
        rows.append({"tokens": tokens, "ours_ms": t_ours, "baseline_ms": t_base,
                     "speedup": t_base / t_ours, "rel_err": err})
        del case
    print_table(rows, title=f"\nCPU paged decode (torch twin) vs naive gather, float32, B={batch},"
                f" Hq={hq}, Hkv={hkv}, D={d}, block 16, 10% host blocks, "
                f"{torch.get_num_threads()} threads")
    return rows


# ---------------------------------------------------------------------------------------------
# CUDA: bytes/s of the Triton kernel vs device bandwidth and PCIe
# ---------------------------------------------------------------------------------------------


def cuda_time(fn: Callable[[], object], reps: int) -> float:
    """Median ms over ``reps`` runs (CUDA events) after two warm-ups. Includes the host-side
    launch cost whenever the GPU work is shorter than it."""
    fn()
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def kernel_time(fn: Callable[[], object], reps: int) -> tuple[float, str]:
    """GPU time of ``fn`` alone: replay it from a CUDA graph (no Python launch cost in the
    measurement); plain event timing if capture fails. Returns (ms, method)."""
    try:
        fn()  # compile outside the capture
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            fn()  # warm the caching allocator on the capture stream
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn()
        return cuda_time(graph.replay, reps), "cuda_graph"
    except Exception as e:  # capture is an optimization of the measurement, never required
        print(f"(graph capture failed: {type(e).__name__}: {e}; timing direct calls)")
        torch.cuda.synchronize()
        return cuda_time(fn, reps), "events"


def device_bandwidth(nbytes: int = 4 << 30) -> float:
    """Device memory bandwidth in bytes/s from a large device-to-device copy_ (read + write)."""
    a = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    ms = cuda_time(lambda: b.copy_(a), 10)
    return 2 * nbytes / (ms * 1e-3)


def pcie_ms(nbytes: int) -> float:
    """Time of a pinned host-to-device copy of ``nbytes`` (the host blocks' bytes alone)."""
    if nbytes == 0:
        return 0.0
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    return cuda_time(lambda: dst.copy_(src, non_blocking=True), 5)


def run_cuda(contexts: list[int], fractions: list[float], batch: int, reps: int) -> dict:
    hq, hkv, d, block, dtype = 64, 8, 128, 16, torch.bfloat16
    dev = torch.device("cuda")
    bw = device_bandwidth()
    rows = []
    for tokens in contexts:
        for frac in fractions:
            case = make_pools(batch, tokens, hkv=hkv, d=d, block=block, dtype=dtype,
                              host_fraction=frac, device=dev)
            q = torch.randn(batch, hq, d, device=dev, dtype=dtype)
            n_host = int(case.block_tiers.sum())
            n_all = case.block_tiers.numel()
            block_bytes = 2 * block * hkv * d * dtype.itemsize  # K and V of one block
            total_bytes = n_all * block_bytes
            host_bytes = n_host * block_bytes
            ms, method = kernel_time(lambda case=case, q=q: ours(case, q, "triton"), reps)
            launch_ms = cuda_time(lambda case=case, q=q: ours(case, q, "triton"), reps)
            # bw counts read + write bytes of the copy; the kernel only reads.
            hbm_ms = (total_bytes - host_bytes) / bw * 1e3
            link_ms = pcie_ms(host_bytes)
            bound = max(hbm_ms, link_ms)
            twin = ours(case, q, "torch", num_splits=None)
            err = relative_error(ours(case, q, "triton").float().cpu(), twin.double().cpu())
            rows.append({
                "tokens": tokens, "host_pct": round(frac * 100), "kernel_ms": ms,
                "call_ms": launch_ms, "GBps": total_bytes / (ms * 1e-3) / 1e9,
                "hbm_ms": hbm_ms, "pcie_ms": link_ms, "bound_ms": bound,
                "of_bound": bound / ms, "rel_err": err, "bytes": total_bytes,
                "host_bytes": host_bytes, "timing": method,
            })
            del case, q, twin
            torch.cuda.empty_cache()
    print_table(rows, columns=["tokens", "host_pct", "kernel_ms", "call_ms", "GBps", "hbm_ms",
                               "pcie_ms", "bound_ms", "of_bound", "rel_err"],
                title=f"\nCUDA paged decode ({torch.cuda.get_device_name()}), 70B geometry: "
                f"B={batch}, Hq={hq}, Hkv={hkv}, D={d}, bf16, block {block}; device copy_ "
                f"{bw / 1e9:.0f} GB/s (read+write); bound = max(GPU-pool bytes at copy_ "
                "bandwidth, pinned H2D copy of the host bytes)")
    return {"device": torch.cuda.get_device_name(), "device_copy_GBps": bw / 1e9, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=default_out("attention"))
    p.add_argument("--contexts", default="1024,4096,16384", help="CPU context lengths (tokens)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--hq", type=int, default=32)
    p.add_argument("--hkv", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cuda-contexts", default="8192,32768,131072")
    p.add_argument("--cuda-host-fractions", default="0,0.1,0.5")
    p.add_argument("--no-cuda", action="store_true", help="skip the CUDA part")
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (default 1: on a shared box, multi-threaded CPU timings are "
                   "dominated by OpenMP threads waiting for each other)")
    args = p.parse_args(argv)
    if args.threads > 0:
        torch.set_num_threads(args.threads)

    t0 = time.perf_counter()
    result: dict = {
        "benchmark": "paged_decode_attention",
        "environment": environment(),
        "cpu": {
            "config": {"batch": args.batch, "hq": args.hq, "hkv": args.hkv,
                       "head_dim": args.head_dim, "dtype": "float32", "block_size": 16,
                       "host_fraction": 0.1,
                       "baseline": "per-sequence torch.cat gather + repeat_interleave GQA + "
                                   "softmax attention"},
            "rows": run_cpu([int(x) for x in args.contexts.split(",")], args.batch, args.hq,
                            args.hkv, args.head_dim, args.reps),
        },
        "cuda": None,
    }
    if torch.cuda.is_available() and not args.no_cuda:
        result["cuda"] = run_cuda([int(x) for x in args.cuda_contexts.split(",")],
                                  [float(x) for x in args.cuda_host_fractions.split(",")],
                                  args.batch, reps=20)
    result["wall_s"] = time.perf_counter() - t0
    write_json(args.out, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
