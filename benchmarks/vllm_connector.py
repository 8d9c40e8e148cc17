"""The vLLM connector on vLLM's CPU engine: TTFT of a reused prefix, overhead without reuse,
and the scheduler-side lookup latency.

1. `ttft`: time to first token of a prompt whose first 1,500 tokens were seen before, three
   ways: recomputed (vLLM without the connector, its prefix cache reset), vLLM's own prefix
   cache hit, and the connector (vLLM's cache reset: the prefix comes from the connector's
   shared-memory pool). Interleaved round by round.
2. `overhead`: a workload with no reuse at all (distinct prompts), vLLM with and without the
   connector (every block it computes is saved; every lookup misses): the connector's cost per
   request, target at most 3% of the time of a request's steps. Two measures: the time the
   connector's calls take on the scheduler's and the forward's threads (waits included) over
   the request time (`overhead_in_path`, what the target is checked on), and the ratio of
   request times with and without, pairs interleaved (noisy on a shared machine).
3. `lookup`: `get_num_new_matched_tokens` (SchedulerSide.lookup) latency at 100 cached blocks,
   p50/p99: against the embedded service in the same process (direct calls) and through a
   `tiered-cache serve` daemon's socket; targets under 1 ms and under 2 ms. Interleaved; needs
   no vLLM.

Engines run one per process (the engine core in that process); the machine may be loaded by
other work, so every comparison is measured in the same run, interleaved.

    .venv-vllm/bin/python benchmarks/vllm_connector.py             # a few minutes
    .venv-vllm/bin/python benchmarks/vllm_connector.py --quick     # smoke run
    .venv/bin/python benchmarks/vllm_connector.py --parts lookup   # without vLLM
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import default_out, environment, print_table, quantile, write_json  # noqa: E402

VOCAB = 1000
PARTS = ("ttft", "overhead", "lookup")


# ------------------------------------------------------------------------------- engines

def engine_main(spec: dict[str, Any]) -> int:
    """One engine process: JSON commands a line in, one JSON answer a line out."""
    from tiered_cache.integrations.vllm import engine

    engine.set_cpu_env(in_process=True)
    kw = dict(max_model_len=4096, disable_log_stats=False)
    if spec["connector"]:
        llm = engine.make_llm(spec["model"], connector={
            "tiers": {"host": {"num_blocks": spec["host_blocks"]}},
            "vllm": {"socket_dir": spec["socket_dir"]}}, **kw)
    else:
        llm = engine.make_llm(spec["model"], connector=False, **kw)
    sched, _ = engine.connectors(llm)
    engine.generate(llm, [[1] * 64], 2)
    llm.reset_prefix_cache()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "reset":
            llm.reset_prefix_cache()
            print("{}", flush=True)
            continue
        if cmd["op"] == "stats":
            s = sched.scheduler.stats() if sched is not None else {}
            s.pop("link", None)
            _, worker = engine.connectors(llm)
            s["seconds"] = {**(sched.seconds if sched is not None else {}),
                            **(worker.seconds if worker is not None else {})}
            if worker is not None:
                s["worker_seconds"] = dict(worker.worker.seconds)
            print(json.dumps(s), flush=True)
            continue
        out = engine.generate(llm, [cmd["prompt"]], cmd["new_tokens"])[0]
        print(json.dumps({"ttft_s": out.ttft_s, "latency_s": out.seconds,
                          "cached": out.cached_tokens, "tokens": out.tokens}), flush=True)
    if sched is not None:
        sched.shutdown()
    return 0


class Engine:
    def __init__(self, spec: dict[str, Any]) -> None:
        self.proc = subprocess.Popen([sys.executable, __file__, "--engine", json.dumps(spec)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        for line in self.proc.stdout:
            if line.startswith('{"ready"'):
                return
        raise RuntimeError(f"engine did not start (exit {self.proc.wait()})")

    def ask(self, **cmd: Any) -> dict[str, Any]:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:            # anything else vLLM prints is skipped
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"engine stopped (exit {self.proc.wait()})")

    def gen(self, prompt: np.ndarray, new_tokens: int) -> dict[str, Any]:
        return self.ask(op="gen", prompt=[int(x) for x in prompt], new_tokens=new_tokens)

    def close(self) -> None:
        self.proc.stdin.close()
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def ttft_part(plain: Engine, conn: Engine, rounds: int, prefix: int, suffix: int,
              rng: np.random.Generator) -> dict[str, Any]:
    """Round r: a fresh prefix; each way warms it with one suffix, then is timed with another
    (the order of the three ways rotates)."""
    times: dict[str, list[float]] = {"recompute": [], "vllm_prefix_hit": [], "connector": []}
    cached: dict[str, list[int]] = {k: [] for k in times}
    same = True
    for r in range(rounds):
        pre = rng.integers(1, VOCAB, prefix)
        a = np.concatenate([pre, rng.integers(1, VOCAB, suffix)])
        b = np.concatenate([pre, rng.integers(1, VOCAB, suffix)])
        ways = list(times)
        ways = ways[r % 3:] + ways[:r % 3]
        toks = {}
        for way in ways:
            if way == "recompute":
                plain.ask(op="reset")
                out = plain.gen(b, 1)
            elif way == "vllm_prefix_hit":
                plain.ask(op="reset")
                plain.gen(a, 1)
                out = plain.gen(b, 1)
            else:
                conn.ask(op="reset")
                conn.gen(a, 1)
                conn.ask(op="reset")          # vLLM forgets it; the connector does not
                out = conn.gen(b, 1)
            times[way].append(out["ttft_s"])
            cached[way].append(out["cached"])
            toks[way] = out["tokens"]
        same = same and len({tuple(t) for t in toks.values()}) == 1
    rows = []
    base = statistics.median(times["recompute"])
    for way, xs in times.items():
        rows.append({"way": way, "ttft_p50_ms": statistics.median(xs) * 1e3,
                     "ttft_min_ms": min(xs) * 1e3,
                     "vs_recompute": base / statistics.median(xs),
                     "cached_tokens": int(statistics.median(cached[way]))})
    return {"rows": rows, "rounds": rounds, "prefix_tokens": prefix, "suffix_tokens": suffix,
            "first_tokens_identical": same}


def overhead_part(plain: Engine, conn: Engine, requests: int, prompt: int, new: int,
                  rng: np.random.Generator) -> dict[str, Any]:
    lat: dict[str, list[float]] = {"without": [], "with": []}
    first = conn.ask(op="stats")
    before, before_w = first["seconds"], first.get("worker_seconds", {})
    for i in range(requests):
        p = rng.integers(1, VOCAB, prompt)
        order = [("without", plain), ("with", conn)]
        if i % 2:
            order.reverse()
        for name, e in order:
            out = e.gen(p, new)
            assert out["cached"] == 0, "the no-reuse workload hit a cache"
            lat[name].append(out["latency_s"])
    w, c = statistics.median(lat["without"]), statistics.median(lat["with"])
    # Pairwise: the same prompt back to back with and without (noise cancels in the ratio).
    ratios = [b / a for a, b in zip(lat["without"], lat["with"])]
    stats = conn.ask(op="stats")
    spent = {k: v - before.get(k, 0.0) for k, v in stats["seconds"].items()}
    inside = {f"wait_for_save.{k}": v - before_w.get(k, 0.0)
              for k, v in stats.get("worker_seconds", {}).items()}
    in_path = sum(spent.values())
    return {"requests": requests, "prompt_tokens": prompt, "new_tokens": new,
            "steps_per_request": 1 + new, "without_p50_ms": w * 1e3, "with_p50_ms": c * 1e3,
            "overhead_pairs": statistics.median(ratios) - 1, "overhead_of_medians": c / w - 1,
            "connector_in_path_ms": in_path / requests * 1e3,
            "overhead_in_path": in_path / sum(lat["with"]),
            "target": 0.03, "meets_target": in_path / sum(lat["with"]) <= 0.03,
            "seconds_by_call": {**spent, **inside},
            "connector": {k: stats.get(k) for k in ("lookups", "planned_saves",
                                                    "saved_blocks", "lookup_p50_ms")}}


# ------------------------------------------------------------------------------- lookups

def lookup_part(iters: int, blocks: int, tmp: str) -> dict[str, Any]:
    """SchedulerSide.lookup at `blocks` cached blocks: in process vs through a socket."""
    import yaml

    from tiered_cache.config import CacheConfig
    from tiered_cache.daemon.process import NodeProcess
    from tiered_cache.daemon.service import NodeService
    from tiered_cache.integrations.vllm.identity import Geometry
    from tiered_cache.integrations.vllm.link import DaemonLink, LocalTransport, SocketTransport
    from tiered_cache.integrations.vllm.scheduler import SchedulerSide
    from tiered_cache.integrations.vllm.settings import ConnectorSettings

    bs = 32
    g = Geometry("bench-llama", "float32", 4, 4, 32, bs, bs, 1)
    cfg = {"model": g.model_section(), "block_size": bs,
           "tiers": {"host": {"num_blocks": 4 * blocks}},
           "daemon": {"socket": os.path.join(tmp, "local", "d.sock"), "lease_s": 30.0}}
    svc = NodeService(CacheConfig.from_dict(cfg)).start()
    sock = os.path.join(tmp, "remote", "d.sock")
    cfg2 = {**cfg, "daemon": {"socket": sock, "lease_s": 30.0}}
    Path(tmp, "daemon.yaml").write_text(yaml.safe_dump(cfg2))
    node = NodeProcess(Path(tmp, "daemon.yaml"), sock, log_path=Path(tmp, "daemon.log")).start()
    settings = ConnectorSettings(lookup_deadline_ms=50)
    sides = {
        "in_process": SchedulerSide(g, settings, DaemonLink(
            lambda: LocalTransport(svc), g, attach=False, timeout_s=5, name="bench").start()),
        "daemon_socket": SchedulerSide(g, settings, DaemonLink(
            lambda: SocketTransport(sock, 5.0), g, attach=False, timeout_s=5,
            name="bench").start(wait_s=10)),
    }
    try:
        tokens = [int(x) for x in np.random.default_rng(0).integers(1, VOCAB, blocks * bs + 1)]
        _store(g, svc, sock, tokens)

        class Req:
            def __init__(self, rid: str) -> None:
                self.request_id, self.all_token_ids, self.cache_salt = rid, tokens, None
                self.num_tokens = len(tokens)

        times: dict[str, list[float]] = {k: [] for k in sides}
        cpu: dict[str, list[float]] = {k: [] for k in sides}
        hits: dict[str, int] = {}
        load = os.getloadavg()
        for i in range(iters + 50):
            for name in (list(sides) if i % 2 else list(sides)[::-1]):
                side = sides[name]
                req = Req(f"r{i}")
                c0, t0 = time.thread_time(), time.perf_counter()
                hit, _ = side.lookup(req, 0)
                dt, dc = time.perf_counter() - t0, time.thread_time() - c0
                side.finished(req)
                hits[name] = hit
                if i >= 50:
                    times[name].append(dt)
                    cpu[name].append(dc)
        rows = []
        for name, xs in times.items():
            target = 1.0 if name == "in_process" else 2.0
            p99 = quantile(xs, 0.99) * 1e3
            rows.append({"path": name, "blocks": blocks, "hit_tokens": hits[name],
                         "p50_ms": quantile(xs, 0.5) * 1e3, "p99_ms": p99,
                         "p90_ms": quantile(xs, 0.9) * 1e3,
                         "cpu_p99_ms": quantile(cpu[name], 0.99) * 1e3,
                         "target_ms": target, "p99_meets_target": p99 < target})
        return {"rows": rows, "iters": iters, "load_average": load,
                "note": "cpu_p99 is this thread's CPU time (the lookup's own work, without "
                        "waits for a core); the socket path's daemon time is in wall only"}
    finally:
        for side in sides.values():
            side.close()
            side.link.close()
        node.stop()
        svc.stop(drain=False)


def _store(g, svc, sock: str, tokens: list[int]) -> None:
    """Publish the blocks of `tokens` in both services, through the worker side."""
    import torch

    from tiered_cache.integrations.vllm.link import DaemonLink, LocalTransport, SocketTransport
    from tiered_cache.integrations.vllm.plans import SaveOp, StepPlan, TokenUpdate
    from tiered_cache.integrations.vllm.worker import WorkerSide

    n = (len(tokens) - 1) // g.block_size
    for connect in (lambda: LocalTransport(svc), lambda: SocketTransport(sock, 10.0)):
        link = DaemonLink(connect, g, attach=True, timeout_s=10, name="store").start(wait_s=10)
        w = WorkerSide(g, rank=0, resolve_link=lambda link=link: link, attach_timeout_s=10,
                       load_timeout_s=10)
        kv = {f"layer.{i}": torch.randn(n + 1, g.num_kv_heads, g.block_size, 2 * g.head_dim)
              for i in range(g.num_layers)}
        w.register(kv, "CPU_ATTN", num_blocks=n + 1, dtype=torch.float32)
        step = max(1, link.staging_slots)
        for first in range(0, n, step):
            count = min(step, n - first)
            toks = np.asarray(tokens[:(first + count) * g.block_size], np.int32)
            plan = StepPlan(tokens=[TokenUpdate("s", first * g.block_size,
                                                toks[first * g.block_size:])],
                            saves=[SaveOp("s", None, None, first, count, first,
                                          list(range(first, first + count)))])
            w.bind(plan)
            for name in w.layers:
                w.save_layer(name)
            w.end_step()
        w.close()


# ------------------------------------------------------------------------------- main

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a smoke run")
    p.add_argument("--parts", default=",".join(PARTS),
                   help=f"comma-separated subset of {','.join(PARTS)}")
    p.add_argument("--out", "--json", dest="out", default=default_out("vllm_connector"))
    p.add_argument("--rounds", type=int, default=None, help="TTFT rounds (8; quick 2)")
    p.add_argument("--requests", type=int, default=None,
                   help="no-reuse requests per engine (24; quick 3)")
    p.add_argument("--iters", type=int, default=None, help="timed lookups per path (2000)")
    p.add_argument("--engine", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.engine:
        sys.exit(engine_main(json.loads(args.engine)))
    parts = [x for x in args.parts.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        p.error(f"--parts: unknown {bad}")
    q = args.quick
    rng = np.random.default_rng(0)
    out: dict[str, Any] = {"benchmark": "vllm_connector", "quick": q,
                           "environment": environment(),
                           "note": "2-core machine shared with other jobs: ratios of runs "
                                   "interleaved in the same process tree, not absolute times"}
    tmp = tempfile.mkdtemp(prefix="tc-vb-")
    try:
        if "lookup" in parts:
            res = lookup_part(args.iters or (200 if q else 2000), 100, tmp)
            out["lookup"] = res
            print_table(res["rows"], title="get_num_new_matched_tokens at 100 cached blocks")
        engine_parts = [x for x in parts if x != "lookup"]
        if engine_parts:
            import importlib.util

            if importlib.util.find_spec("vllm") is None:
                out["skipped"] = {x: "vLLM is not installed here (run from .venv-vllm)"
                                  for x in engine_parts}
                print(f"skipped {engine_parts}: vLLM is not installed (run from .venv-vllm)")
            else:
                from tiered_cache.integrations.vllm.engine import write_tiny_llama

                model = write_tiny_llama(Path(tmp) / "model", vocab=VOCAB)
                spec = {"model": model, "connector": False, "host_blocks": 2048,
                        "socket_dir": tmp}
                plain = Engine(spec)
                conn = Engine({**spec, "connector": True})
                try:
                    if "ttft" in engine_parts:
                        res = ttft_part(plain, conn, args.rounds or (2 if q else 8), 1500, 32,
                                        rng)
                        out["ttft"] = res
                        print_table(res["rows"], title=f"TTFT of a prompt reusing a "
                                    f"{res['prefix_tokens']}-token prefix (+{res['suffix_tokens']} "
                                    f"new), {res['rounds']} interleaved rounds")
                    if "overhead" in engine_parts:
                        res = overhead_part(plain, conn, args.requests or (3 if q else 24),
                                            1024, 32, rng)
                        out["overhead"] = res
                        print_table([{k: v for k, v in res.items()
                                      if k not in ("connector", "seconds_by_call")}],
                                    title="no reuse: a request's time with the connector vs "
                                          "without (pairs interleaved)")
                finally:
                    plain.close()
                    conn.close()
        write_json(args.out, out)
    finally:
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
