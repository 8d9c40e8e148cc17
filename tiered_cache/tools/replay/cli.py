"""`tiered-cache replay`: the command line over the replay driver.

Every flag value is checked when it is parsed or, where it goes into the cache config, named
by its flag when the config rejects it (`--q-heads: ...`, never `model.num_q_heads: ...`).
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tiered_cache.errors import ConfigError, TieredCacheError
from tiered_cache.tools import command, extras
from tiered_cache.tools.replay.costs import MODEL_70B, CostModel
from tiered_cache.tools.replay.driver import (
    DEFAULT_CAPACITIES,
    DEFAULT_POLICY,
    DEFAULT_SWEEP_POLICIES,
    SweepSpec,
    replay,
    sweep,
)
from tiered_cache.tools.replay.report import format_report, plot_sweep, sweep_table
from tiered_cache.tools.replay.trace import load_trace
from tiered_cache.tools.workloads import WORKLOADS

DESCRIPTION = """\
Replay a Mooncake-shaped JSONL trace (timestamp, input_length, output_length, hash_ids), or a
generated workload, through a storage-free TieredKVCache; print hit rates by tier, what moved,
and the prefill time saved. With --sweep: every capacity x policy, single- and two-tier, as a
table, JSON and a PNG (hit rates, and their ratio to LRU's). See docs/replay.md.

examples:
  tiered-cache replay trace.jsonl --gpu-blocks 1000 --host-blocks 3000
  tiered-cache replay --workload chat --requests 2000 --gpu-blocks 500 --json
  tiered-cache replay trace.jsonl --sweep --policies lru,class_credit,adaptive,belady"""

FLAGS = {
    "block_size": "--block-size", "tiers.gpu.num_blocks": "--gpu-blocks",
    "tiers.host.num_blocks": "--host-blocks", "tiers.disk.num_blocks": "--disk-blocks",
    "policy": "--policy",
    "write_policy": "--write-policy", "model.num_layers": "--layers",
    "model.num_kv_heads": "--kv-heads", "model.num_q_heads": "--q-heads",
    "model.head_dim": "--head-dim", "model.dtype": "--dtype", "model.num_params": "--params",
    "num_params": "--params", "peak_tflops": "--peak-tflops", "mfu": "--mfu",
    "pcie_gbps": "--pcie-gbps", "capacities": "--capacities", "policies": "--policies",
    "tiers": "--tiers", "gpu_fraction": "--gpu-fraction",
}
"""Config and cost-model keys -> the flag that sets them, for error messages."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("trace", nargs="?", help="JSONL trace file (or use --workload)")
    src = parser.add_argument_group("generated workload instead of a file")
    src.add_argument("--workload", choices=tuple(WORKLOADS),
                     help="replay a seeded synthetic workload (tiered_cache.tools.workloads)")
    src.add_argument("--requests", type=command.non_negative_int, default=None,
                     help="requests to generate (default: 4000) or to read from TRACE "
                          "(default: all)")
    src.add_argument("--seed", type=int, default=0, help="workload seed")
    parser.add_argument("--block-size", type=command.positive_int, default=512,
                        help="tokens per trace hash id (Mooncake traces: 512)")
    parser.add_argument("--gpu-blocks", type=command.positive_int,
                        help="device tier blocks (required without --sweep)")
    parser.add_argument("--host-blocks", type=command.non_negative_int, default=0,
                        help="host tier blocks (0: a device-only cache)")
    parser.add_argument("--disk-blocks", type=command.non_negative_int, default=0,
                        help="disk tier blocks beneath host (0: none; needs --host-blocks); "
                             "blocks reused at least once are admitted")
    parser.add_argument("--policy", default=DEFAULT_POLICY,
                        help="eviction policy, both tiers (belady is the offline reference)")
    parser.add_argument("--write-policy", default="write_back",
                        choices=("write_back", "write_through"), help="when blocks reach host")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    geo = parser.add_argument_group("model geometry and cost model (default: 70B, bf16 KV)")
    geo.add_argument("--layers", type=command.positive_int, default=MODEL_70B["num_layers"],
                     help="model layers")
    geo.add_argument("--kv-heads", type=command.positive_int,
                     default=MODEL_70B["num_kv_heads"], help="KV heads per layer")
    geo.add_argument("--q-heads", type=command.positive_int, default=MODEL_70B["num_q_heads"],
                     help="query heads per layer (a multiple of --kv-heads)")
    geo.add_argument("--head-dim", type=command.positive_int, default=MODEL_70B["head_dim"],
                     help="dimensions per head")
    geo.add_argument("--dtype", default=MODEL_70B["dtype"],
                     choices=("bfloat16", "float16", "float32", "fp8_e4m3"), help="KV dtype")
    geo.add_argument("--params", type=command.positive_float, default=MODEL_70B["num_params"],
                     help="parameter count (default: %(default).3g)")
    geo.add_argument("--peak-tflops", type=command.positive_float,
                     default=CostModel.peak_tflops,
                     help="device peak TFLOP/s (989: H100/H200 bf16 dense)")
    geo.add_argument("--mfu", type=command.fraction, default=CostModel.mfu,
                     help="model FLOP utilisation of prefill")
    geo.add_argument("--pcie-gbps", type=command.positive_float, default=CostModel.pcie_gbps,
                     help="host->device GB/s for host hits (50: PCIe 5.0 x16)")
    sw = parser.add_argument_group("sweep")
    sw.add_argument("--sweep", action="store_true",
                    help="replay every capacity x policy, single-tier and two-tier; print a "
                         "table, write JSON and a PNG")
    sw.add_argument("--capacities", type=command.positive_int_list,
                    default=",".join(map(str, DEFAULT_CAPACITIES)),
                    help="total blocks, comma separated")
    sw.add_argument("--policies", type=command.name_list,
                    default=",".join(DEFAULT_SWEEP_POLICIES), help="policies, comma separated")
    sw.add_argument("--gpu-fraction", type=command.fraction, default=0.25,
                    help="device share of the total in two-tier runs (raised to the largest "
                         "request)")
    sw.add_argument("--tiers", type=command.name_list, default="single,two",
                    help="layouts to sweep: single (device only), two (device + host)")
    sw.add_argument("--out", default=None, metavar="DIR",
                    help="where the sweep writes JSON and PNG (default: results/replay-NAME)")
    sw.add_argument("--no-plot", action="store_true", help="skip the PNG")
    sw.add_argument("--no-progress", action="store_true", help="no progress bar")


def _requests(args: argparse.Namespace) -> tuple[list[dict[str, Any]], str]:
    if args.workload is not None:
        from tiered_cache.tools import workloads

        n = args.requests if args.requests is not None else 4000
        with command.config_errors(flags={"requests": "--requests",
                                          "block_size": "--block-size"}):
            requests = workloads.generate(args.workload, n, seed=args.seed,
                                          block_size=args.block_size)
        return requests, f"{args.workload}-s{args.seed}"
    return load_trace(args.trace, limit=args.requests), Path(args.trace).stem


def _check_policy(name: str, flag: str) -> None:
    """Resolve a policy name now, so a typo fails before the replay, naming the flag."""
    from tiered_cache.policies import resolve

    try:
        resolve(name, flag)
    except TieredCacheError:
        raise
    except (ValueError, TypeError, ImportError) as exc:   # should be ConfigErrors already
        raise ConfigError(flag, f"cannot load policy {name!r}: {exc}") from None


def main(args: argparse.Namespace) -> int:
    if (args.trace is None) == (args.workload is None):
        raise command.UsageError("give a TRACE file or --workload (one of them)")
    if not args.sweep and args.gpu_blocks is None:
        raise command.UsageError("--gpu-blocks is required (or use --sweep)")
    if args.q_heads % args.kv_heads:
        raise command.UsageError(f"--q-heads: must be a multiple of --kv-heads "
                                 f"({args.kv_heads}), got {args.q_heads}")
    for p in (args.policies if args.sweep else [args.policy]):
        _check_policy(p, "--policies" if args.sweep else "--policy")
    if args.sweep:
        extras.check(plot=not args.no_plot, progress=not args.no_progress)
    model = {"name": "replay-model", "num_layers": args.layers, "num_kv_heads": args.kv_heads,
             "num_q_heads": args.q_heads, "head_dim": args.head_dim, "dtype": args.dtype,
             "num_params": args.params}
    if model == {**MODEL_70B, "name": "replay-model"}:
        model = dict(MODEL_70B)
    with command.config_errors(flags=FLAGS):
        cost = CostModel.for_model(model, peak_tflops=args.peak_tflops, mfu=args.mfu,
                                   pcie_gbps=args.pcie_gbps)
    requests, name = _requests(args)
    if args.sweep:
        return _main_sweep(args, requests, name, model, cost)
    progress = not args.json and sys.stderr.isatty() and extras.available("tqdm")
    with command.config_errors(flags=FLAGS):
        report = replay(requests, gpu_blocks=args.gpu_blocks, host_blocks=args.host_blocks,
                        block_size=args.block_size, policy=args.policy, model=model,
                        write_policy=args.write_policy, cost=cost, progress=progress,
                        disk_blocks=args.disk_blocks)
    report["trace"] = name
    print(json.dumps(report) if args.json else format_report(report))
    return 0


def _main_sweep(args: argparse.Namespace, requests: list[dict[str, Any]], name: str,
                model: dict[str, Any], cost: CostModel) -> int:
    with command.config_errors(flags=FLAGS):
        spec = SweepSpec(capacities=args.capacities, policies=args.policies,
                         gpu_fraction=args.gpu_fraction, tiers=args.tiers)
        result = sweep(requests, spec, block_size=args.block_size, model=model, cost=cost,
                       write_policy=args.write_policy, progress=not args.no_progress)
    result["trace"] = name
    result["requests"] = len(requests)
    result["cost_model"] = asdict(cost)
    out = Path(args.out) if args.out else Path("results") / f"replay-{name}"
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / "sweep.json"
    json_path.write_text(json.dumps(result, indent=1) + "\n")
    png = None if args.no_plot else plot_sweep(result, out / "sweep.png", title=name)
    result["files"] = {"json": str(json_path), "png": str(png) if png else None}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{name}: {len(requests)} requests, block size {args.block_size}, "
              "token hit rate (x LRU)")
        print(sweep_table(result))
        print(f"wrote {json_path}" + (f" and {png}" if png else ""))
    return 0
