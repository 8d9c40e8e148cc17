"""`tiered-cache replay`: replay a request trace through the real control plane.

Every request of a Mooncake/Alibaba-shaped JSONL trace (`timestamp`, `input_length`,
`output_length`, `hash_ids`) is served by a `TieredKVCache` built with `storage: none` (metadata
only, no tensors): `open` matches its longest cached prefix in any tier (promoting host blocks),
`mark_computed` publishes its blocks, `close` leaves them cached. Nothing is simulated on the
side: hits, evictions, promotions and demotions are the cache's own.

- Tokens. Trace ids are already prefix-chained, so block j of a request is made of
  `block_size` tokens that all equal `hash_ids[j]`: equal ids give equal tokens and hence equal
  chained keys. A request is `len(hash_ids) * block_size` tokens: the trace counts whole blocks
  (the last one is usually partial in the real prompt) and so do the reference simulators;
  output tokens are not added. Token hit rate = hit blocks / requested blocks.
- Requests larger than the device tier cannot be served by this cache in one piece (every block
  of an open sequence lives in the device tier); they are counted as requested, missed and
  `oversized`, and change nothing.
- Belady (`--policy belady`) gets a `NextUseOracle` over the whole trace, advanced before each
  request.

Cost model (`CostModel`, every constant printed with the results):

- Recomputing the prefix of n tokens costs `2 P n + 2 L h n^2` FLOPs: `2P` per token in the
  linear layers and `4 L h t` for the attention of the token at position t (QK^T and PV, each
  `2 h t` per layer, h = query heads * head_dim); summed over t < n. At `peak_tflops * mfu`.
- A host hit instead moves its KV over PCIe at `pcie_gbps` (`bytes_per_token` per token).
- Seconds saved per request = compute time of its hit prefix - transfer time of its host hits.
  Default: a 70B model (P = 70.6e9, 80 layers, 64 query heads and 8 KV heads of 128, bf16 KV:
  327,680 bytes per token), an H100/H200 at 989 bf16 TFLOP/s dense and 50% MFU, PCIe 5.0 x16 at
  50 GB/s sustained.

Speed: block operations = requested blocks (each is looked up or hashed and published) + blocks
published; reported per second of replay wall time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tiered_cache.errors import CapacityError, ConfigError, TieredCacheError

MAX_ID = 2**31 - 1

MODEL_70B: dict[str, Any] = {
    "name": "llama-3-70b", "num_layers": 80, "num_kv_heads": 8, "head_dim": 128,
    "num_q_heads": 64, "dtype": "bfloat16", "num_params": 70.6e9,
}
"""Default geometry: Llama-3-70B, bf16 KV (327,680 bytes per token)."""

DEFAULT_POLICY = "class_credit"
"""The policy `replay` uses unless told otherwise (tiered_cache.policies.class_credit)."""

DEFAULT_CAPACITIES = (500, 1000, 2000, 3000, 5000, 10000, 20000)
DEFAULT_SWEEP_POLICIES = ("lru", "lfu", "arc", "s3fifo", "cost_aware", DEFAULT_POLICY,
                          "hit_density", "belady")


class TraceError(TieredCacheError, ValueError):
    """A trace line is not a request of the expected shape."""


# ---------------------------------------------------------------------------------------------
# traces


def load_trace(path: str | os.PathLike, limit: int | None = None) -> list[dict[str, Any]]:
    """Read a JSONL trace. Each line needs `hash_ids` (a list of ints in [0, 2**31)); the other
    fields are optional here (`timestamp`, `input_length`, `output_length`). Blank lines are
    skipped. Raises TraceError naming the line."""
    p = Path(path)
    try:
        f = p.open(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"{p}: cannot read trace: {exc.strerror or exc}") from None
    out: list[dict[str, Any]] = []
    with f:
        for n, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{p}:{n}: not JSON: {exc.msg}") from None
            out.append(check_request(rec, f"{p}:{n}"))
    return out


def check_request(rec: Any, where: str) -> dict[str, Any]:
    if not isinstance(rec, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(rec).__name__}")
    ids = rec.get("hash_ids")
    if not isinstance(ids, list):
        raise TraceError(f"{where}: 'hash_ids' must be a list of ints, got {ids!r:.60}")
    for x in ids:
        if not isinstance(x, int) or isinstance(x, bool) or not 0 <= x <= MAX_ID:
            raise TraceError(f"{where}: hash_ids: expected ints in [0, 2**31), got {x!r}")
    return rec


# ---------------------------------------------------------------------------------------------
# cost model


@dataclass(frozen=True)
class CostModel:
    """Prefill time a hit saves: recompute FLOPs at an MFU versus PCIe bytes for host hits."""

    num_params: float = 70.6e9
    num_layers: int = 80
    hidden: int = 8192                  # query heads * head_dim
    bytes_per_token: int = 327_680      # K and V, every layer
    peak_tflops: float = 989.0          # H100/H200 SXM bf16 dense
    mfu: float = 0.5
    pcie_gbps: float = 50.0             # PCIe 5.0 x16, sustained host -> device

    @classmethod
    def for_model(cls, model: dict[str, Any], **kw: Any) -> CostModel:
        from tiered_cache.config import KV_DTYPES

        q_heads = model.get("num_q_heads") or model["num_kv_heads"]
        bpt = 2 * model["num_layers"] * model["num_kv_heads"] * model["head_dim"] * KV_DTYPES[
            model["dtype"]]
        params = model.get("num_params") or 12 * model["num_layers"] * (
            q_heads * model["head_dim"]) ** 2       # the usual 12 L h^2 estimate
        return cls(num_params=float(params), num_layers=model["num_layers"],
                   hidden=q_heads * model["head_dim"], bytes_per_token=bpt, **kw)

    def prefix_flops(self, n: float) -> float:
        """FLOPs to compute the KV of a prefix of n tokens."""
        return 2.0 * self.num_params * n + 2.0 * self.num_layers * self.hidden * n * n

    def compute_seconds(self, n: float) -> float:
        return self.prefix_flops(n) / (self.peak_tflops * 1e12 * self.mfu)

    def transfer_seconds(self, tokens: float) -> float:
        return tokens * self.bytes_per_token / (self.pcie_gbps * 1e9)


# ---------------------------------------------------------------------------------------------
# replay


def build_cache(*, block_size: int, gpu_blocks: int, host_blocks: int, policy: str,
                model: dict[str, Any] | None = None, write_policy: str = "write_back"):
    """A storage-free TieredKVCache for replay."""
    from tiered_cache.cache import TieredKVCache
    from tiered_cache.config import CacheConfig

    cfg = CacheConfig.from_dict({
        "storage": "none", "block_size": block_size, "policy": policy,
        "write_policy": write_policy, "model": dict(model or MODEL_70B),
        "tiers": {"gpu": {"num_blocks": gpu_blocks, "device": "cpu"},
                  "host": {"num_blocks": host_blocks}},
        "migrator": {"enabled": False}, "compactor": {"enabled": False},
    })
    return TieredKVCache(cfg)


def attach_oracle(cache, requests: Sequence[dict[str, Any]]):
    """Give every tier policy that wants the future (`set_oracle`) a NextUseOracle."""
    wants = [t.policy for t in cache.tiers if hasattr(t.policy, "set_oracle")]
    if not wants:
        return None
    from tiered_cache.policies.belady import NextUseOracle

    oracle = NextUseOracle(r["hash_ids"] for r in requests)
    for p in wants:
        p.set_oracle(oracle)
    return oracle


def replay(requests: Sequence[dict[str, Any]], *, gpu_blocks: int, host_blocks: int = 0,
           block_size: int = 512, policy: str = DEFAULT_POLICY,
           model: dict[str, Any] | None = None, write_policy: str = "write_back",
           cost: CostModel | None = None, progress: bool = False) -> dict[str, Any]:
    """Replay `requests` (dicts with `hash_ids`) through a storage-free cache; return the
    report (see `tiered-cache replay --help` and docs/replay.md for the keys)."""
    if not isinstance(block_size, int) or block_size < 1:
        raise ConfigError("block_size", f"expected a positive int, got {block_size!r}")
    model = dict(model or MODEL_70B)
    cost = cost or CostModel.for_model(model)
    cache = build_cache(block_size=block_size, gpu_blocks=gpu_blocks, host_blocks=host_blocks,
                        policy=policy, model=model, write_policy=write_policy)
    oracle = attach_oracle(cache, requests)
    tier_names = [t.name for t in cache.tiers]
    bs = block_size
    requested = hit = oversized = oversized_blocks = 0
    hit_by_tier = dict.fromkeys(tier_names, 0)
    saved_s = compute_saved_s = transfer_s = 0.0
    bar = _progress(len(requests), progress, f"replay {policy}")
    t0 = time.perf_counter()
    for i, rec in enumerate(requests):
        if oracle is not None:
            oracle.advance(i)
        ids = rec["hash_ids"]
        n = len(ids)
        requested += n
        if n == 0:
            continue
        if n > gpu_blocks:
            oversized += 1
            oversized_blocks += n
            continue
        tokens = np.repeat(np.asarray(ids, dtype=np.int32), bs)
        try:
            seq = cache.open(tokens)
        except CapacityError:          # cannot happen with one sequence open; count, go on
            oversized += 1
            oversized_blocks += n
            continue
        k = seq.num_cached_tokens // bs
        if k:
            hit += k
            by = seq.cached_tokens_by_tier
            host_tokens = 0
            for name, tok in by.items():
                hit_by_tier[name] += tok // bs
                if name != "gpu":
                    host_tokens += tok
            c = cost.compute_seconds(k * bs)
            x = cost.transfer_seconds(host_tokens)
            compute_saved_s += c
            transfer_s += x
            saved_s += c - x
        cache.mark_computed(seq)
        cache.close(seq)
        if bar is not None and (i & 63) == 63:
            bar.update(64)
    elapsed = time.perf_counter() - t0
    if bar is not None:
        bar.update(len(requests) - bar.n)
        bar.close()
    stats = cache.stats()
    published = requested - hit - oversized_blocks
    ops = requested + published
    block_bytes = cache.block_bytes
    tiers = {}
    for t in cache.tiers:
        s = t.stats()
        tiers[t.name] = {"capacity_blocks": s["capacity_blocks"], "used_blocks": s["used_blocks"],
                         "evictions": s["evictions"], "hit_blocks": hit_by_tier[t.name]}
    demotions, promotions = stats["demotions"], stats["promotions"]
    report = {
        "policy": policy,
        "block_size": bs,
        "gpu_blocks": gpu_blocks,
        "host_blocks": host_blocks if "host" in tier_names else 0,
        "write_policy": write_policy,
        "requests": len(requests),
        "requested_blocks": requested,
        "hit_blocks": hit,
        "token_hit_rate": hit / requested if requested else 0.0,
        "hit_rate_by_tier": {name: (hit_by_tier[name] / requested if requested else 0.0)
                             for name in tier_names},
        "hit_tokens_by_tier": {name: hit_by_tier[name] * bs for name in tier_names},
        "oversized_requests": oversized,
        "tiers": tiers,
        "evictions": {name: tiers[name]["evictions"] for name in tier_names},
        "dropped_blocks": stats["dropped_blocks"],
        "promotions": {"blocks": promotions, "bytes": promotions * block_bytes},
        "demotions": {"blocks": demotions, "bytes": demotions * block_bytes},
        "write_through": {"blocks": stats["write_through_blocks"],
                          "bytes": stats["write_through_blocks"] * block_bytes},
        "bytes_moved": (promotions + demotions + stats["write_through_blocks"]) * block_bytes,
        "block_bytes": block_bytes,
        "prefill_seconds_saved": saved_s,
        "prefill_compute_seconds_saved": compute_saved_s,
        "host_transfer_seconds": transfer_s,
        "cost_model": asdict(cost),
        "model": model,
        "replay_seconds": elapsed,
        "block_ops": ops,
        "block_ops_per_s": ops / elapsed if elapsed > 0 else float("inf"),
        "requests_per_s": len(requests) / elapsed if elapsed > 0 else float("inf"),
    }
    return report


# ---------------------------------------------------------------------------------------------
# sweep


@dataclass
class SweepSpec:
    capacities: Sequence[int] = DEFAULT_CAPACITIES
    policies: Sequence[str] = DEFAULT_SWEEP_POLICIES
    gpu_fraction: float = 0.25
    tiers: Sequence[str] = ("single", "two")
    extra: dict[str, Any] = field(default_factory=dict)


def split_capacity(total: int, gpu_fraction: float, largest_request: int) -> tuple[int, int]:
    """(gpu, host) for a two-tier run of `total` blocks: `gpu_fraction` of it on the device,
    but never less than the largest request (the device tier must hold a whole sequence)."""
    gpu = max(1, math.ceil(total * gpu_fraction), largest_request)
    gpu = min(gpu, total)
    return gpu, total - gpu


def sweep(requests: Sequence[dict[str, Any]], spec: SweepSpec, *, block_size: int = 512,
          model: dict[str, Any] | None = None, progress: bool = True,
          **replay_kw: Any) -> dict[str, Any]:
    """Replay every (tiers, capacity, policy) combination; rows keep the headline numbers."""
    largest = max((len(r["hash_ids"]) for r in requests), default=0)
    runs = [(mode, cap, pol) for mode in spec.tiers for cap in spec.capacities
            for pol in spec.policies]
    bar = _progress(len(runs), progress, "sweep")
    rows: list[dict[str, Any]] = []
    for mode, cap, pol in runs:
        if bar is not None:
            bar.set_postfix_str(f"{mode} {cap} {pol}")
        gpu, host = (cap, 0) if mode == "single" else split_capacity(
            cap, spec.gpu_fraction, largest)
        r = replay(requests, gpu_blocks=gpu, host_blocks=host, block_size=block_size,
                   policy=pol, model=model, **replay_kw)
        rows.append({
            "tiers": mode, "capacity": cap, "policy": pol, "gpu_blocks": gpu,
            "host_blocks": host, "token_hit_rate": r["token_hit_rate"],
            "hit_rate_by_tier": r["hit_rate_by_tier"], "evictions": r["evictions"],
            "promotions": r["promotions"]["blocks"], "demotions": r["demotions"]["blocks"],
            "bytes_moved": r["bytes_moved"], "prefill_seconds_saved": r["prefill_seconds_saved"],
            "oversized_requests": r["oversized_requests"],
            "block_ops_per_s": r["block_ops_per_s"],
        })
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    base = {(r["tiers"], r["capacity"]): r["token_hit_rate"] for r in rows
            if r["policy"] == "lru"}
    for r in rows:
        b = base.get((r["tiers"], r["capacity"]))
        r["vs_lru"] = r["token_hit_rate"] / b if b else None
    return {"block_size": block_size, "gpu_fraction": spec.gpu_fraction,
            "largest_request_blocks": largest, "capacities": list(spec.capacities),
            "policies": list(spec.policies), "tiers": list(spec.tiers), "rows": rows}


def sweep_table(result: dict[str, Any]) -> str:
    """Text table: one line per (tiers, capacity), hit rate per policy (and x LRU)."""
    pols = result["policies"]
    lines = []
    head = f"{'tiers':6} {'capacity':>8} {'gpu+host':>13}  " + "  ".join(
        f"{p:>15}" for p in pols)
    lines.append(head)
    lines.append("-" * len(head))
    idx = {(r["tiers"], r["capacity"], r["policy"]): r for r in result["rows"]}
    for mode in result["tiers"]:
        for cap in result["capacities"]:
            any_row = next((idx[(mode, cap, p)] for p in pols if (mode, cap, p) in idx), None)
            if any_row is None:
                continue
            split = f"{any_row['gpu_blocks']}+{any_row['host_blocks']}"
            cells = []
            for p in pols:
                r = idx.get((mode, cap, p))
                if r is None:
                    cells.append(f"{'':>15}")
                    continue
                v = r["vs_lru"]
                cells.append(f"{r['token_hit_rate']:.3f} ({v:.2f}x)".rjust(15) if v else
                             f"{r['token_hit_rate']:.3f}".rjust(15))
            lines.append(f"{mode:6} {cap:>8} {split:>13}  " + "  ".join(cells))
    return "\n".join(lines)


def plot_sweep(result: dict[str, Any], path: str | os.PathLike, title: str = "") -> Path:
    """PNG of token hit rate against total capacity, one line per policy, one panel per tier
    layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = result["tiers"]
    fig, axes = plt.subplots(1, len(modes), figsize=(6.5 * len(modes), 4.6), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        for pol in result["policies"]:
            pts = sorted((r["capacity"], r["token_hit_rate"]) for r in result["rows"]
                         if r["tiers"] == mode and r["policy"] == pol)
            if not pts:
                continue
            style = {"linestyle": "--", "color": "black"} if pol == "belady" else {}
            if pol == DEFAULT_POLICY:
                style = {"linewidth": 2.5}
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", markersize=3,
                    label=pol, **style)
        ax.set_xscale("log")
        ax.set_xlabel(f"capacity (blocks of {result['block_size']} tokens)")
        ax.set_ylabel("token hit rate")
        sub = ("device tier only" if mode == "single" else
               f"device {result['gpu_fraction']:.0%} + host (device >= largest request)")
        ax.set_title(f"{title} - {sub}" if title else sub, fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


# ---------------------------------------------------------------------------------------------
# command line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Replay a Mooncake-shaped JSONL trace (timestamp, input_length, output_length, hash_ids) "
        "through a storage-free TieredKVCache; print hit rates by tier, what moved, and the "
        "prefill time saved. See docs/replay.md.")
    parser.add_argument("trace", nargs="?", help="JSONL trace file")
    src = parser.add_argument_group("generated workload instead of a file")
    src.add_argument("--workload", choices=("chat", "rag", "agent"),
                     help="replay a seeded synthetic workload (tiered_cache.workloads)")
    src.add_argument("--requests", type=int, default=None,
                     help="requests to generate (default 4000) or to read from TRACE (all)")
    src.add_argument("--seed", type=int, default=0, help="workload seed (default 0)")
    parser.add_argument("--block-size", type=int, default=512,
                        help="tokens per trace hash id (default 512: Mooncake traces)")
    parser.add_argument("--gpu-blocks", type=int, help="device tier blocks (required "
                        "without --sweep)")
    parser.add_argument("--host-blocks", type=int, default=0,
                        help="host tier blocks (default 0: a device-only cache)")
    parser.add_argument("--policy", default=DEFAULT_POLICY,
                        help=f"eviction policy, both tiers (default {DEFAULT_POLICY}; "
                             "belady is the offline reference)")
    parser.add_argument("--write-policy", default="write_back",
                        choices=("write_back", "write_through"))
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    geo = parser.add_argument_group("model geometry and cost model (default: 70B, bf16 KV)")
    geo.add_argument("--layers", type=int, default=MODEL_70B["num_layers"])
    geo.add_argument("--kv-heads", type=int, default=MODEL_70B["num_kv_heads"])
    geo.add_argument("--q-heads", type=int, default=MODEL_70B["num_q_heads"])
    geo.add_argument("--head-dim", type=int, default=MODEL_70B["head_dim"])
    geo.add_argument("--dtype", default=MODEL_70B["dtype"],
                     choices=("bfloat16", "float16", "float32", "fp8_e4m3"))
    geo.add_argument("--params", type=float, default=MODEL_70B["num_params"],
                     help="parameter count (default 70.6e9)")
    geo.add_argument("--peak-tflops", type=float, default=CostModel.peak_tflops,
                     help="device peak TFLOP/s (default 989: H100/H200 bf16 dense)")
    geo.add_argument("--mfu", type=float, default=CostModel.mfu,
                     help="model FLOP utilisation of prefill (default 0.5)")
    geo.add_argument("--pcie-gbps", type=float, default=CostModel.pcie_gbps,
                     help="host->device GB/s for host hits (default 50: PCIe 5.0 x16)")
    sw = parser.add_argument_group("sweep")
    sw.add_argument("--sweep", action="store_true",
                    help="replay every capacity x policy, single-tier and two-tier; print a "
                         "table, write JSON and a PNG")
    sw.add_argument("--capacities", default=",".join(map(str, DEFAULT_CAPACITIES)),
                    help="total blocks, comma separated")
    sw.add_argument("--policies", default=",".join(DEFAULT_SWEEP_POLICIES))
    sw.add_argument("--gpu-fraction", type=float, default=0.25,
                    help="device share of the total in two-tier runs (default 0.25; raised to "
                         "the largest request)")
    sw.add_argument("--tiers", default="single,two",
                    help="layouts to sweep: single (device only), two (device + host)")
    sw.add_argument("--out", default=None, metavar="DIR",
                    help="where the sweep writes JSON and PNG (default results/replay-NAME)")
    sw.add_argument("--no-plot", action="store_true", help="skip the PNG")
    sw.add_argument("--no-progress", action="store_true", help="no progress bar")


def main(args: argparse.Namespace) -> int:
    if (args.trace is None) == (args.workload is None):
        print("tiered-cache replay: give a TRACE file or --workload (one of them)",
              file=sys.stderr)
        return 2
    if args.block_size < 1:
        raise ConfigError("--block-size", f"expected a positive int, got {args.block_size}")
    if args.workload is not None:
        from tiered_cache import workloads

        requests = workloads.generate(args.workload, args.requests if args.requests is not None
                                      else 4000, seed=args.seed, block_size=args.block_size)
        name = f"{args.workload}-s{args.seed}"
    else:
        requests = load_trace(args.trace, limit=args.requests)
        name = Path(args.trace).stem
    model = {"name": "replay-model", "num_layers": args.layers, "num_kv_heads": args.kv_heads,
             "num_q_heads": args.q_heads, "head_dim": args.head_dim, "dtype": args.dtype,
             "num_params": args.params}
    if model == {**MODEL_70B, "name": "replay-model"}:
        model = dict(MODEL_70B)
    cost = CostModel.for_model(model, peak_tflops=args.peak_tflops, mfu=args.mfu,
                               pcie_gbps=args.pcie_gbps)
    if args.sweep:
        return _main_sweep(args, requests, name, model, cost)
    if args.gpu_blocks is None:
        print("tiered-cache replay: --gpu-blocks is required (or use --sweep)", file=sys.stderr)
        return 2
    report = replay(requests, gpu_blocks=args.gpu_blocks, host_blocks=args.host_blocks,
                    block_size=args.block_size, policy=args.policy, model=model,
                    write_policy=args.write_policy, cost=cost,
                    progress=not args.json and sys.stderr.isatty())
    report["trace"] = name
    if args.json:
        print(json.dumps(report))
    else:
        print(format_report(report))
    return 0


def _main_sweep(args, requests, name, model, cost) -> int:
    def ints(s: str) -> list[int]:
        try:
            vals = [int(x) for x in s.split(",") if x.strip()]
        except ValueError:
            raise ConfigError("--capacities", f"expected comma-separated ints, got {s!r}") from None
        if not vals or min(vals) < 1:
            raise ConfigError("--capacities", f"expected positive ints, got {s!r}")
        return vals

    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    from tiered_cache.policies import resolve

    for p in policies:
        resolve(p, "--policies")
    tiers = [t.strip() for t in args.tiers.split(",") if t.strip()]
    if not tiers or set(tiers) - {"single", "two"}:
        raise ConfigError("--tiers", f"expected 'single', 'two' or both, got {args.tiers!r}")
    if not 0 < args.gpu_fraction <= 1:
        raise ConfigError("--gpu-fraction", f"expected a number in (0, 1], got "
                                            f"{args.gpu_fraction}")
    spec = SweepSpec(capacities=ints(args.capacities), policies=policies,
                     gpu_fraction=args.gpu_fraction, tiers=tiers)
    result = sweep(requests, spec, block_size=args.block_size, model=model, cost=cost,
                   write_policy=args.write_policy, progress=not args.no_progress)
    result["trace"] = name
    result["requests"] = len(requests)
    result["cost_model"] = asdict(cost)
    out = Path(args.out) if args.out else Path("results") / f"replay-{name}"
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "sweep.json"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    png = None
    if not args.no_plot:
        png = plot_sweep(result, out / "sweep.png", title=name)
    result["files"] = {"json": str(json_path), "png": str(png) if png else None}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{name}: {len(requests)} requests, block size {args.block_size}, "
              "token hit rate (x LRU)")
        print(sweep_table(result))
        print(f"wrote {json_path}" + (f" and {png}" if png else ""))
    return 0


def format_report(r: dict[str, Any]) -> str:
    gib = 1024**3
    tiers = list(r["hit_rate_by_tier"])
    lines = [
        f"trace {r.get('trace', '?')}: {r['requests']} requests, {r['requested_blocks']} blocks "
        f"of {r['block_size']} tokens; policy {r['policy']}; gpu {r['gpu_blocks']} + host "
        f"{r['host_blocks']} blocks ({r['block_bytes'] / 2**20:.0f} MiB each)",
        f"token hit rate      {r['token_hit_rate']:.4f}  (" + ", ".join(
            f"{t} {r['hit_rate_by_tier'][t]:.4f}" for t in tiers) + ")",
        "evictions           " + ", ".join(f"{t} {r['evictions'][t]}" for t in tiers)
        + f"  (dropped {r['dropped_blocks']})",
        f"promotions          {r['promotions']['blocks']} blocks, "
        f"{r['promotions']['bytes'] / gib:.1f} GiB",
        f"demotions           {r['demotions']['blocks']} blocks, "
        f"{r['demotions']['bytes'] / gib:.1f} GiB",
        f"bytes moved         {r['bytes_moved'] / gib:.1f} GiB (incl. write-through "
        f"{r['write_through']['bytes'] / gib:.1f} GiB)",
        f"prefill saved       {r['prefill_seconds_saved']:.1f} s "
        f"(compute {r['prefill_compute_seconds_saved']:.1f} s - host transfers "
        f"{r['host_transfer_seconds']:.1f} s; {r['cost_model']['peak_tflops']:g} TFLOP/s x MFU "
        f"{r['cost_model']['mfu']:g}, PCIe {r['cost_model']['pcie_gbps']:g} GB/s)",
    ]
    if r["oversized_requests"]:
        lines.append(f"oversized           {r['oversized_requests']} requests larger than the "
                     "device tier (counted as misses)")
    lines.append(f"replay speed        {r['block_ops_per_s']:,.0f} block ops/s "
                 f"({r['block_ops']} ops in {r['replay_seconds']:.2f} s)")
    return "\n".join(lines)


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:         # pragma: no cover - tqdm is a dependency
        return None
    return tqdm(total=total, desc=desc, unit="run" if desc == "sweep" else "req",
                file=sys.stderr, leave=False, dynamic_ncols=True)


def requests_from(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Validate in-memory records (e.g. from tiered_cache.workloads) like trace lines."""
    return [check_request(r, f"request {i}") for i, r in enumerate(records)]
