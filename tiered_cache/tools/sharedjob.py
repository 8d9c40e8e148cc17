"""`tiered-cache run-shared`: two engine processes serving one chat workload, on their own and
through one node daemon, to show reuse across processes.

    tiered-cache run-shared --config configs/default.yaml           # ~1 min on 2 CPU cores
    tiered-cache run-shared --config configs/default.yaml --quick   # seconds (tests)

The workload is the main job's (tiered_cache.tools.mainjob): users share a system prompt and
talk for several turns; a turn's prompt is the whole conversation so far. Here a load balancer
sends each turn of a user to the other engine than the last (turn + user, modulo the number of
engines), as a round-robin balancer does. Every engine is a process with its own
random-weight Llama (same seed: the same model) and its own device tier, sized for one request.

Modes:
- `separate`: each engine has only its own device tier: a conversation's history, computed by
  the other engine last turn, is computed again; the system prompt once per engine.
- `shared`: the same engines attached to one `tiered-cache serve` daemon (started here, its
  host tier from the config): what one engine computed, the other loads from the daemon's
  shared memory.

Prints prefill tokens computed, tokens reused by tier (`daemon` is what came across
processes), TTFT p50 and service time per mode, and whether every greedy output was the same in
both modes; writes `<out-dir>/sharedjob.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from tiered_cache.tools import command, extras
from tiered_cache.tools.mainjob import Workload, _percentile

DESCRIPTION = """\
Serve a multi-turn chat workload with two engine processes whose turns alternate (a
round-robin load balancer), first each on its own, then both attached to one node daemon
(started here): the daemon's share of the reused tokens is the reuse across processes.
Writes OUT_DIR/sharedjob.json.

examples:
  tiered-cache run-shared --config configs/default.yaml
  tiered-cache run-shared --config configs/default.yaml --quick"""

MODES = ("separate", "shared")
FULL = Workload(users=4, turns=4, system_tokens=512, user_tokens=128, new_tokens=4)
QUICK = Workload(users=2, turns=2, system_tokens=64, user_tokens=24, new_tokens=2)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pos = command.positive_int
    parser.add_argument("--config", metavar="FILE", default=None,
                        help="cache config (YAML); default: the embedded default config")
    parser.add_argument("--quick", action="store_true", help="a tiny workload (seconds)")
    parser.add_argument("--engines", type=pos, default=2, help="engine processes")
    parser.add_argument("--prefill-chunk-size", type=pos, default=512,
                        help="prompt tokens per prefill forward pass")
    parser.add_argument("--seed", type=int, default=0, help="seed of the workload and model")
    parser.add_argument("--out-dir", default="results", metavar="DIR",
                        help="where sharedjob.json goes")
    parser.add_argument("--engine", nargs=2, metavar=("CONFIG_JSON", "SEED"),
                        help=argparse.SUPPRESS)       # internal: run as one engine process


# ------------------------------------------------------------------------------- an engine

def engine_main(config_json: str, seed: int, chunk: int) -> int:
    """One engine process: read a prompt a line (JSON token ids), serve it, write the result
    a line. Ends at EOF."""
    import torch

    from tiered_cache import CacheConfig, TieredKVCache
    from tiered_cache.integrations.transformers import _cache_kwarg
    from tiered_cache.tools.mainjob import build_model, serve_prompt

    torch.set_grad_enabled(False)
    torch.set_num_threads(1)
    config = CacheConfig.from_dict(json.loads(config_json))
    model = build_model(config, "cpu", seed)
    kwarg = _cache_kwarg(model)
    with TieredKVCache(config) as cache:
        daemon = config.tiers.daemon is not None
        if daemon:
            deadline = time.monotonic() + 30
            while not cache.stores[0].available and time.monotonic() < deadline:
                time.sleep(0.05)
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            req = json.loads(line)
            served = serve_prompt(model, cache, kwarg, np.asarray(req["prompt"], np.int64),
                                  req["new_tokens"], chunk)
            if daemon:          # let the background publish land before the other engine asks
                _settle(cache)
            print(json.dumps({"out": served.out, "ttft_s": served.ttft_s,
                              "latency_s": served.latency_s, "cached": served.cached,
                              "by_tier": served.by_tier}), flush=True)
    return 0


def _settle(cache, timeout_s: float = 10.0) -> None:
    """Wait until the migrator has no work queued (the publishes of this request are done)."""
    if cache.migrator is not None:
        cache.migrator.settle(timeout_s)


# ------------------------------------------------------------------------------- the job

def _engine_config(config, gpu_blocks: int, socket: str | None) -> dict[str, Any]:
    data = config.to_dict()
    data["tiers"]["gpu"].update(capacity=None, num_blocks=gpu_blocks, device="cpu")
    data["tiers"]["host"].update(capacity=None, num_blocks=0)
    data["tiers"]["disk"] = data["tiers"]["remote"] = None
    if socket is not None:
        data["tiers"]["daemon"] = {"socket": socket}
    data["metrics"] = {"http_port": None}
    return data


def _daemon_config(config, host_blocks: int, socket: str, path: Path) -> Path:
    import yaml

    data = config.to_dict()
    data["tiers"]["gpu"].update(capacity=None, num_blocks=1, device="cpu")
    data["tiers"]["host"].update(capacity=None, num_blocks=host_blocks, memory="pageable")
    data["tiers"]["disk"] = data["tiers"]["remote"] = data["tiers"]["daemon"] = None
    data["metrics"] = {"http_port": None}
    data["daemon"] = {"socket": socket, "lease_s": 30.0}
    path.write_text(yaml.safe_dump(data))
    return path


def _start_engines(n: int, config: dict, args) -> list[subprocess.Popen]:
    procs = [subprocess.Popen(
        [sys.executable, "-m", "tiered_cache", "run-shared", "--engine", json.dumps(config),
         str(args.seed), "--prefill-chunk-size", str(args.prefill_chunk_size)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(n)]
    for p in procs:
        line = p.stdout.readline()
        if not line.startswith('{"ready"'):
            raise RuntimeError(f"an engine process did not start (exit {p.poll()})")
    return procs


def _serve(procs: list[subprocess.Popen], workload: Workload, progress) -> dict[str, Any]:
    system, messages = workload.token_streams()
    history = [system.astype(np.int64) for _ in range(workload.users)]
    res: dict[str, Any] = {"ttft_s": [], "service_s": 0.0, "prompt_tokens": 0,
                           "prefill_tokens": 0, "hit_tokens": {}, "outputs": [],
                           "by_engine": [0] * len(procs)}
    for turn in range(workload.turns):
        for user in range(workload.users):
            e = (turn + user) % len(procs)
            prompt = np.concatenate([history[user], messages[user][turn]])
            p = procs[e]
            p.stdin.write(json.dumps({"prompt": prompt.tolist(),
                                      "new_tokens": workload.new_tokens}) + "\n")
            p.stdin.flush()
            r = json.loads(p.stdout.readline())
            res["ttft_s"].append(r["ttft_s"])
            res["service_s"] += r["latency_s"]
            res["prompt_tokens"] += len(prompt)
            res["prefill_tokens"] += len(prompt) - r["cached"]
            for tier, n in r["by_tier"].items():
                res["hit_tokens"][tier] = res["hit_tokens"].get(tier, 0) + n
            res["outputs"].append(r["out"])
            res["by_engine"][e] += 1
            history[user] = np.concatenate([prompt, np.asarray(r["out"], dtype=np.int64)])
            progress.update(1)
    return res


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.stdin:
            p.stdin.close()
    for p in procs:
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tiered_cache.daemon.process import NodeProcess
    from tiered_cache.sizing import tier_num_blocks

    t_start = time.perf_counter()
    source = args.config or "<default config>"
    config = command.load_config(args.config)
    if config.storage != "tensors":
        raise command.UsageError(f"{source}: storage: the job needs `storage: tensors`")
    if config.model.dtype not in ("float32", "float16", "bfloat16"):
        raise command.UsageError(f"{source}: model.dtype {config.model.dtype!r}: the daemon "
                                 "moves float32/float16/bfloat16 KV")
    extras.check(plot=False, progress=True, model=True)
    workload = QUICK if args.quick else Workload(**{**vars(FULL), "seed": args.seed})
    bs = config.block_size
    seq_blocks = -(-(workload.prompt_length(workload.turns - 1) + workload.new_tokens) // bs)
    gpu_blocks = seq_blocks + 4
    with command.config_errors(source=source):
        host_blocks = max(tier_num_blocks(config, "host"),
                          2 * -(-workload.working_set_tokens() // bs))
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="tc-shared-") as tmp, \
            extras.progress_bar(len(MODES) * workload.num_requests, "tiered-cache run-shared",
                                unit="req", enabled=True, leave=True) as progress:
        socket = os.path.join(tmp, "s", "daemon.sock")
        daemon = None
        for mode in MODES:
            if mode == "shared":
                cfg = _daemon_config(config, host_blocks, socket, Path(tmp) / "daemon.yaml")
                daemon = NodeProcess(cfg, socket, log_path=Path(tmp) / "daemon.log").start()
            engine_cfg = _engine_config(config, gpu_blocks,
                                        socket if mode == "shared" else None)
            procs = _start_engines(args.engines, engine_cfg, args)
            try:
                results[mode] = _serve(procs, workload, progress)
            finally:
                _stop(procs)
        if daemon is not None:
            daemon.stop()
    summaries = {}
    for mode, r in results.items():
        hits = r["hit_tokens"]
        summaries[mode] = {
            "requests": len(r["ttft_s"]), "service_s": r["service_s"],
            "ttft_p50_ms": _percentile(r["ttft_s"], 50) * 1e3,
            "prompt_tokens": r["prompt_tokens"], "prefill_tokens": r["prefill_tokens"],
            "reused_tokens": {t: n for t, n in hits.items()},
            "hit_rate": sum(hits.values()) / r["prompt_tokens"] if r["prompt_tokens"] else 0,
            "requests_by_engine": r["by_engine"],
        }
    outs = [r["outputs"] for r in results.values()]
    report = {
        "config": str(args.config) if args.config else "<default>", "quick": bool(args.quick),
        "engines": args.engines, "gpu_blocks_per_engine": gpu_blocks,
        "daemon_host_blocks": host_blocks,
        "workload": vars(workload), "modes": summaries,
        "outputs_identical_across_modes": all(o == outs[0] for o in outs),
        "elapsed_s": time.perf_counter() - t_start,
    }
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "sharedjob.json"
    report["json"] = str(path)
    path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def format_table(report: dict[str, Any]) -> str:
    lines = [f"{report['engines']} engine processes, turns alternating between them; "
             f"{report['gpu_blocks_per_engine']} device blocks each",
             f"{'mode':<10} {'prefill tok':>12} {'reused: gpu':>12} {'daemon':>8} "
             f"{'hit rate':>9} {'TTFT p50 ms':>12} {'service s':>10}"]
    for mode, s in report["modes"].items():
        r = s["reused_tokens"]
        lines.append(f"{mode:<10} {s['prefill_tokens']:>12,} {r.get('gpu', 0):>12,} "
                     f"{r.get('daemon', 0):>8,} {s['hit_rate']:>9.1%} "
                     f"{s['ttft_p50_ms']:>12.1f} {s['service_s']:>10.2f}")
    sep, sh = report["modes"].get("separate"), report["modes"].get("shared")
    if sep and sh and sh["prefill_tokens"]:
        lines.append(f"prefill computed with the daemon: {sh['prefill_tokens']:,} of "
                     f"{sep['prefill_tokens']:,} tokens "
                     f"({sep['prefill_tokens'] / sh['prefill_tokens']:.2f}x fewer); "
                     f"{sh['reused_tokens'].get('daemon', 0):,} tokens came from the other "
                     "engine through the daemon")
    lines.append(f"greedy outputs identical across modes: "
                 f"{report['outputs_identical_across_modes']}")
    lines.append(f"wrote {report['json']}")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    if args.engine:
        return engine_main(args.engine[0], int(args.engine[1]), args.prefill_chunk_size)
    report = run(args)
    print(format_table(report))
    return 0 if report["outputs_identical_across_modes"] else 1
