"""Policy evaluation that cannot overfit: every policy, many cells, seeds nobody tuned on.

Cells: the generated families (`tiered_cache.tools.workloads`: chat, rag, agent, code; 2,000
requests of 512-token blocks) x seeds x capacities 500 / 1,500 / 5,000 blocks (tight to loose),
plus the shared Mooncake trace (`../shared/traces/mooncake_synthetic_trace.jsonl`, all 3,993
requests) at the same capacities. Single tier (device only); `--two-tier` adds each cell split
25% device / 75% host.

Two splits, in the same run and against LRU in the same run, reported separately: the
*tuning* seeds (0, 1: the adaptive policy's experts and constants were chosen on them) and the
*held-out* seeds (2-6, nothing was tuned on them) plus the shared trace. For every registered
online policy (Belady, the offline optimum, with `--belady`): the worst ratio of its token hit
rate to LRU's in the same cell, which cell that was, and the geometric mean of the ratios over
all cells of the split (and per family). Then the replay speed of the adaptive policy against
LRU on the shared trace, best of `--speed-repeats` runs each, interleaved, at every capacity;
and, for every policy, the geometric mean over the cells of its speed / LRU's in the same cell
(those runs share the machine with each other: a rough figure).

Targets (issue 16), for `adaptive`, on the held-out split: worst cell >= 0.99x LRU; geometric
mean >= 1.10x LRU and at least the best single registered policy's; replay speed >= 0.9x LRU's
at every capacity (issue 25; it was 0.7x). Whether each is met is printed and stored, as
measured. Speed is block operations per second of the replay loop (wall time), and per CPU
second of the whole replay call (`process_time`: on a machine other jobs load, waiting for a
core does not count); `--speed-clock` says which one the target is judged on.

    python benchmarks/policy_eval.py                 # both splits: ~12 minutes on 2 cores
    python benchmarks/policy_eval.py --seeds report  # the held-out split only
    python benchmarks/policy_eval.py --experts       # also adaptive pinned to each expert
    python benchmarks/policy_eval.py --quick         # seconds: a smoke test
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from multiprocessing import get_context
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common import default_out, environment, print_table, write_json  # noqa: E402

from tiered_cache.policies import POLICIES  # noqa: E402
from tiered_cache.policies.adaptive import AdaptivePolicy  # noqa: E402
from tiered_cache.policies.shadow import EXPERTS  # noqa: E402
from tiered_cache.tools import workloads  # noqa: E402
from tiered_cache.tools.replay import load_trace, replay, split_capacity  # noqa: E402
from tiered_cache.tools.replay.evaluate import (  # noqa: E402
    CAPACITIES,
    REPORTING_SEEDS,
    REQUESTS,
    TUNING_SEEDS,
    Cell,
    cell_requests,
    generated_cells,
    run_cell,
    speed_ratios,
    summarize,
    trace_cells,
)

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "traces" / \
    "mooncake_synthetic_trace.jsonl"
ADAPTIVE = "adaptive"
OFFLINE = ("belady",)
TARGET_WORST, TARGET_GEOMEAN, TARGET_SPEED = 0.99, 1.10, 0.9


PINNED = {}
"""`adaptive` whose live tier always follows one expert (the duel still runs, so the cost is
the same): what each expert alone gives, next to what the choice gives."""
for _e in EXPERTS:
    _cls = type(f"Pinned_{_e.name}", (AdaptivePolicy,), {"name": f"adaptive={_e.name}",
                                                         "pinned": _e.name})
    globals()[_cls.__name__] = _cls
    PINNED[f"policy_eval:{_cls.__name__}"] = _cls.name


def _splits(text: str) -> dict[str, tuple[int, ...]]:
    """Seeds per split: `split` (both, the default), `tune`, `report`, or a comma list (a
    seed goes to the split it belongs to)."""
    if text == "split":
        return {"tuning": TUNING_SEEDS, "held_out": REPORTING_SEEDS}
    if text == "tune":
        return {"tuning": TUNING_SEEDS}
    if text == "report":
        return {"held_out": REPORTING_SEEDS}
    seeds = tuple(int(x) for x in text.split(","))
    out = {"tuning": tuple(x for x in seeds if x in TUNING_SEEDS),
           "held_out": tuple(x for x in seeds if x not in TUNING_SEEDS)}
    return {k: v for k, v in out.items() if v}


def _run(job: tuple[Cell, tuple[str, ...]]) -> dict:
    cell, policies = job
    return run_cell(cell, policies)


def _two_tier(cells: list[Cell]) -> list[Cell]:
    out = []
    for c in cells:
        largest = max(len(r["hash_ids"]) for r in cell_requests(c))
        gpu, host = split_capacity(c.capacity, 0.25, largest)
        out.append(Cell(c.source, c.seed, gpu, host, c.requests, c.path))
    return out


def _speed(trace: list, capacities: tuple[int, ...], policies: tuple[str, ...],
           repeats: int, clock: str = "wall") -> list[dict]:
    rows = []
    for cap in capacities:
        best = dict.fromkeys(policies, 0.0)
        best_cpu = dict.fromkeys(policies, 0.0)
        for _ in range(max(1, repeats)):
            for p in policies:              # interleaved: drift hits every policy alike
                t0 = time.process_time()
                r = replay(trace, gpu_blocks=cap, policy=p)
                cpu = time.process_time() - t0
                best[p] = max(best[p], r["block_ops_per_s"])
                best_cpu[p] = max(best_cpu[p], r["block_ops"] / cpu if cpu > 0 else 0.0)
        for p in policies:
            rows.append({"capacity": cap, "policy": p, "block_ops_per_s": best[p],
                         "x_lru_wall": best[p] / best["lru"],
                         "block_ops_per_cpu_s": best_cpu[p],
                         "x_lru_cpu": best_cpu[p] / best_cpu["lru"]})
            rows[-1]["x_lru"] = rows[-1][f"x_lru_{clock}"]
    return rows


def _table(policies, label, rows, title) -> dict:
    summary = summarize(rows)
    cell_speed = speed_ratios(rows)
    sources = list(dict.fromkeys(r["source"] for r in rows))
    table = []
    for p in policies:
        x = summary[p]
        table.append({"policy": label[p], "worst": x["worst"], "worst cell": x["worst_cell"],
                      "geomean": x["geomean"], **{src: x["by_source"].get(src)
                                                  for src in sources},
                      "speed x lru (cells)": cell_speed.get(p)})
    print_table(table, title=title)
    return {"summary": {label[p]: summary[p] for p in policies},
            "speed_x_lru_cells": {label[p]: cell_speed.get(p) for p in policies}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a smoke test: 200 requests, one held-out seed, two capacities, and "
                         "one tuning seed at one capacity")
    ap.add_argument("--seeds", default="split",
                    help="split (tuning 0-1 and held-out 2-6, default), tune, report, or a "
                         "comma list")
    ap.add_argument("--families", default=",".join(workloads.WORKLOADS))
    ap.add_argument("--capacities", default=",".join(map(str, CAPACITIES)))
    ap.add_argument("--requests", type=int, default=None,
                    help=f"requests per generated stream (default {REQUESTS}; quick 200)")
    ap.add_argument("--trace", default=str(SHARED), help="the shared trace (JSONL)")
    ap.add_argument("--no-trace", action="store_true", help="generated families only")
    ap.add_argument("--belady", action="store_true", help="also the offline optimum")
    ap.add_argument("--experts", action="store_true",
                    help="also adaptive pinned to each of its experts")
    ap.add_argument("--two-tier", action="store_true", help="also 25%% device + 75%% host")
    ap.add_argument("--policies", default=None,
                    help="a comma list of the policies to evaluate (lru is always one; the "
                         "'best single' target is then judged among these)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1))
    ap.add_argument("--speed-repeats", type=int, default=3)
    ap.add_argument("--speed-clock", choices=("wall", "cpu"), default="wall",
                    help="the clock the speed target is judged on (both are reported)")
    ap.add_argument("--out", default=default_out("policy_eval"), help="JSON output path")
    args = ap.parse_args()

    splits = _splits(args.seeds)
    caps = tuple(int(c) for c in args.capacities.split(","))
    n_req = args.requests or (200 if args.quick else REQUESTS)
    split_caps = dict.fromkeys(splits, caps)
    if args.quick:
        splits = {k: v[:1] for k, v in splits.items()}
        split_caps = {k: (300,) if k == "tuning" else (300, 1000) for k in splits}
        caps = (300, 1000)
    families = [f for f in args.families.split(",") if f]
    policies = tuple(p for p in POLICIES if p not in OFFLINE or args.belady)
    if args.policies:
        wanted = {p.strip() for p in args.policies.split(",") if p.strip()}
        unknown = wanted.difference(POLICIES)
        if unknown:
            raise SystemExit(f"--policies: unknown {sorted(unknown)}; known {sorted(POLICIES)}")
        policies = tuple(p for p in policies if p in wanted or p == "lru")
    policies = ("lru", *[p for p in policies if p != "lru"])
    if args.experts:
        policies += tuple(PINNED)
    have_trace = not args.no_trace and Path(args.trace).exists()
    if not have_trace and not args.no_trace:
        print(f"note: {args.trace} not found; generated families only", flush=True)
    cells: dict[str, list[Cell]] = {}
    for split, seeds in splits.items():
        cells[split] = generated_cells(families, seeds, split_caps[split], n_req)
        if split == "held_out" and have_trace:
            cells[split] += trace_cells(args.trace, caps, n_req if args.quick else None)
        if args.two_tier:
            cells[split] += _two_tier(cells[split])
    everything = [c for cs in cells.values() for c in cs]
    print(f"{len(everything)} cells x {len(policies)} policies; "
          + "; ".join(f"{k} seeds {list(v)}" for k, v in splits.items())
          + f"; {args.jobs} jobs", flush=True)

    t0 = time.perf_counter()
    jobs = [(c, policies) for c in everything]
    rows: list[dict] = []
    if args.jobs > 1:
        with get_context("fork").Pool(args.jobs) as pool:
            for i, row in enumerate(pool.imap_unordered(_run, jobs), 1):
                rows.append(row)
                print(f"  [{i}/{len(jobs)}] {row['cell']}", flush=True)
    else:
        for i, job in enumerate(jobs, 1):
            rows.append(_run(job))
            print(f"  [{i}/{len(jobs)}] {rows[-1]['cell']}", flush=True)
    eval_s = time.perf_counter() - t0
    order = {c.name: i for i, c in enumerate(everything)}
    rows.sort(key=lambda r: order[r["cell"]])
    split_of = {c.name: k for k, cs in cells.items() for c in cs}
    for r in rows:
        r["split"] = split_of[r["cell"]]

    label = {p: PINNED.get(p, p) for p in policies}
    results = {}
    for split, seeds in splits.items():
        mine = [r for r in rows if r["split"] == split]
        what = ("tuning seeds" if split == "tuning" else "held-out seeds") + f" {list(seeds)}"
        if split == "held_out" and have_trace:
            what += " + the shared trace"
        results[split] = {"seeds": list(seeds), **_table(
            policies, label, mine,
            f"\nratio of token hit rate to LRU's over {len(mine)} cells ({what})")}

    speed_trace = load_trace(args.trace, limit=n_req if args.quick else None) if have_trace \
        else workloads.generate(families[0], n_req, seed=next(iter(splits.values()))[0])
    speed_pols = ("lru", ADAPTIVE)
    repeats = 1 if args.quick else args.speed_repeats
    speed = _speed(speed_trace, caps, speed_pols, repeats, args.speed_clock)
    where = "the shared trace" if have_trace else families[0]
    print_table(speed, title=f"\nreplay speed on {where} (best of {repeats}, interleaved; "
                             f"x_lru: {args.speed_clock} time)")

    judged = "held_out" if "held_out" in results else "tuning"
    summary = results[judged]["summary"]
    a = summary[ADAPTIVE]
    rivals = {p: summary[p]["geomean"] for p in POLICIES
              if p not in OFFLINE and p != ADAPTIVE and p in summary}
    best_rival = max(rivals, key=rivals.get) if rivals else "lru"
    min_speed = min(r["x_lru"] for r in speed if r["policy"] == ADAPTIVE)
    meets = {
        "worst": a["worst"] >= TARGET_WORST,
        "geomean": a["geomean"] >= TARGET_GEOMEAN,
        "vs_best_single": a["geomean"] >= rivals[best_rival],
        "speed": min_speed >= TARGET_SPEED,
    }
    print(f"\ntargets, on the {judged.replace('_', '-')} split:")
    print(f"adaptive worst {a['worst']:.3f} ({a['worst_cell']}) >= {TARGET_WORST}: "
          f"{'met' if meets['worst'] else 'NOT met'}")
    print(f"adaptive geomean {a['geomean']:.3f} >= {TARGET_GEOMEAN}: "
          f"{'met' if meets['geomean'] else 'NOT met'}")
    print(f"adaptive geomean {a['geomean']:.3f} >= best single registered ({best_rival} "
          f"{rivals[best_rival]:.3f}): {'met' if meets['vs_best_single'] else 'NOT met'}")
    print(f"adaptive replay speed ({args.speed_clock} time) >= {TARGET_SPEED}x LRU at every "
          f"capacity: min {min_speed:.2f}x -> {'met' if meets['speed'] else 'NOT met'}")
    print(f"evaluation {eval_s:.0f} s")
    write_json(args.out, {
        "benchmark": "policy_eval", "quick": args.quick, "environment": environment(),
        "seeds": results[judged]["seeds"], "tuning_seeds": list(TUNING_SEEDS),
        "reporting_seeds": list(REPORTING_SEEDS), "capacities": list(caps),
        "requests": n_req, "families": families, "trace": args.trace if have_trace else None,
        "policies": [label[p] for p in policies], "judged_on": judged,
        "summary": summary, "speed_x_lru_cells": results[judged]["speed_x_lru_cells"],
        "splits": results, "speed": speed, "best_single": best_rival, "meets": meets,
        "cells": rows, "eval_seconds": eval_s,
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
