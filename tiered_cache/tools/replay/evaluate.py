"""Policies evaluated across many cells: worst ratio to LRU and geometric mean, out of sample.

A *cell* is one request stream at one capacity: a generated family (`chat`, `rag`, `agent`,
`code`) with one seed, or a trace file. Every policy replays every cell through the real
control plane (`replay`), and each cell's hit rate is divided by LRU's in the same cell.

Why worst and geometric mean, over many cells, on seeds nobody tuned on: a policy is chosen
once and then meets workloads and capacities nobody measured. The worst cell bounds what it can
cost where it does not fit; the geometric mean of ratios weighs a 10% gain on a small hit rate
like a 10% gain on a large one, and does not let one big win hide many small losses (the
arithmetic mean of ratios would). Tuning seeds and reporting seeds are disjoint
(`TUNING_SEEDS`, `REPORTING_SEEDS`): a policy's shape and constants are chosen on the former and
reported on the latter, and on the shared trace, which no one tunes on either.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tiered_cache.tools.replay.driver import BASELINE_POLICY, replay
from tiered_cache.tools.replay.trace import load_trace

TUNING_SEEDS: tuple[int, ...] = (0, 1)
"""Seeds the adaptive policy's experts and constants were chosen on (and the earlier policies
checked on: docs/replay.md)."""

REPORTING_SEEDS: tuple[int, ...] = (2, 3, 4, 5, 6)
"""Seeds the evaluation reports on; nothing was tuned on them."""

CAPACITIES: tuple[int, ...] = (500, 1500, 5000)
"""Tight to loose: at 2,000 requests of 512-token blocks the generated families hold 9K-41K
distinct blocks (5000 holds most of chat's, agent's and code's reuse; rag's Zipf tail keeps
growing)."""

REQUESTS = 2000
"""Requests per generated stream."""


@dataclass(frozen=True)
class Cell:
    """One request stream at one capacity (device blocks; `host` blocks below it)."""

    source: str                     # a workload family, or a trace's name
    seed: int | None                # None for a trace
    capacity: int
    host: int = 0
    requests: int = REQUESTS
    path: str | None = field(default=None, compare=False)   # the trace file, for a trace

    @property
    def name(self) -> str:
        where = self.source if self.seed is None else f"{self.source}/s{self.seed}"
        tiers = f"{self.capacity}" if not self.host else f"{self.capacity}+{self.host}"
        return f"{where}@{tiers}"


def generated_cells(families: Iterable[str], seeds: Iterable[int], capacities: Iterable[int],
                    requests: int = REQUESTS) -> list[Cell]:
    return [Cell(f, s, c, requests=requests) for f in families for s in seeds
            for c in capacities]


def trace_cells(path: str | Path, capacities: Iterable[int],
                requests: int | None = None) -> list[Cell]:
    p = Path(path)
    return [Cell(p.stem, None, c, requests=requests or 0, path=str(p)) for c in capacities]


def cell_requests(cell: Cell) -> list[dict[str, Any]]:
    """The request stream of a cell (generated, or read from its trace)."""
    if cell.path is not None:
        return load_trace(cell.path, limit=cell.requests or None)
    from tiered_cache.tools import workloads

    return workloads.generate(cell.source, cell.requests, seed=cell.seed or 0)


def run_cell(cell: Cell, policies: Sequence[str], *, block_size: int = 512,
             requests: Sequence[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Replay one cell with every policy: `{"cell", "rates", "speed"}` (token hit rate and
    block ops/s per policy)."""
    reqs = cell_requests(cell) if requests is None else requests
    rates, speed = {}, {}
    for p in policies:
        r = replay(reqs, gpu_blocks=cell.capacity, host_blocks=cell.host,
                   block_size=block_size, policy=p)
        rates[p] = r["token_hit_rate"]
        speed[p] = r["block_ops_per_s"]
    return {"cell": cell.name, "source": cell.source, "seed": cell.seed,
            "capacity": cell.capacity, "host": cell.host, "rates": rates, "speed": speed}


def geomean(values: Iterable[float]) -> float:
    """Geometric mean of positive numbers (nan for none)."""
    vals = list(values)
    if not vals:
        return math.nan
    return math.exp(math.fsum(math.log(v) for v in vals) / len(vals))


def ratios(rows: Iterable[dict[str, Any]], baseline: str = BASELINE_POLICY
           ) -> dict[str, list[tuple[str, float]]]:
    """Per policy, (cell, hit rate / baseline's) for every cell where the baseline hit
    something (a ratio to zero means nothing; those cells are left out for every policy)."""
    out: dict[str, list[tuple[str, float]]] = {}
    for row in rows:
        rates = row["rates"]
        base = rates.get(baseline)
        if not base:
            continue
        for p, v in rates.items():
            out.setdefault(p, []).append((row["cell"], v / base))
    return out


def summarize(rows: Sequence[dict[str, Any]], baseline: str = BASELINE_POLICY
              ) -> dict[str, dict[str, Any]]:
    """Per policy: `worst` ratio and its `worst_cell`, `geomean` over all cells, `best`, and
    `by_source` (geomean per family or trace), from `run_cell` rows."""
    source_of = {row["cell"]: row["source"] for row in rows}
    out = {}
    for p, pairs in ratios(rows, baseline).items():
        worst_cell, worst = min(pairs, key=lambda x: x[1])
        by: dict[str, list[float]] = {}
        for cell, r in pairs:
            by.setdefault(source_of[cell], []).append(r)
        out[p] = {"cells": len(pairs), "worst": worst, "worst_cell": worst_cell,
                  "geomean": geomean(r for _, r in pairs), "best": max(r for _, r in pairs),
                  "by_source": {s: geomean(v) for s, v in by.items()}}
    return out


def speed_ratios(rows: Sequence[dict[str, Any]], baseline: str = BASELINE_POLICY
                 ) -> dict[str, float]:
    """Per policy, the geometric mean over cells of its replay speed / the baseline's in the
    same cell."""
    acc: dict[str, list[float]] = {}
    for row in rows:
        base = row["speed"].get(baseline)
        if not base:
            continue
        for p, v in row["speed"].items():
            acc.setdefault(p, []).append(v / base)
    return {p: geomean(v) for p, v in acc.items()}
