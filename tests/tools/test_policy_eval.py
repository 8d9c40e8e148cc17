"""The evaluation across cells (tiered_cache.tools.replay.evaluate): ratios to LRU, worst cell,
geometric mean, and the tuning / reporting split."""

from __future__ import annotations

import math

import pytest

from tiered_cache.tools.replay.evaluate import (
    REPORTING_SEEDS,
    TUNING_SEEDS,
    Cell,
    generated_cells,
    geomean,
    ratios,
    run_cell,
    speed_ratios,
    summarize,
    trace_cells,
)


def row(cell, source, rates, speed=None):
    return {"cell": cell, "source": source, "rates": rates,
            "speed": speed or dict.fromkeys(rates, 1.0)}


def test_tuning_and_reporting_seeds_are_disjoint():
    assert not set(TUNING_SEEDS) & set(REPORTING_SEEDS)
    assert len(REPORTING_SEEDS) >= 5


def test_geomean():
    assert geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert geomean([1.1]) == pytest.approx(1.1)
    assert math.isnan(geomean([]))


def test_summary_worst_cell_and_geomean():
    rows = [row("chat/s2@500", "chat", {"lru": 0.2, "x": 0.3, "y": 0.19}),
            row("chat/s2@5000", "chat", {"lru": 0.5, "x": 0.45, "y": 0.55}),
            row("rag/s2@500", "rag", {"lru": 0.1, "x": 0.2, "y": 0.1}),
            row("empty@500", "empty", {"lru": 0.0, "x": 0.1, "y": 0.0})]   # LRU hit nothing
    s = summarize(rows)
    assert s["lru"]["worst"] == 1.0 and s["lru"]["geomean"] == pytest.approx(1.0)
    x = s["x"]
    assert x["cells"] == 3                       # the cell where LRU hit nothing is left out
    assert x["worst"] == pytest.approx(0.9) and x["worst_cell"] == "chat/s2@5000"
    assert x["geomean"] == pytest.approx((1.5 * 0.9 * 2.0) ** (1 / 3))
    assert x["by_source"]["rag"] == pytest.approx(2.0)
    assert x["by_source"]["chat"] == pytest.approx(math.sqrt(1.5 * 0.9))
    assert s["y"]["worst_cell"] == "chat/s2@500"
    assert [c for c, _ in ratios(rows)["y"]] == ["chat/s2@500", "chat/s2@5000", "rag/s2@500"]


def test_speed_ratios_are_per_cell():
    rows = [row("a", "a", {"lru": 0.1, "x": 0.1}, {"lru": 100.0, "x": 50.0}),
            row("b", "b", {"lru": 0.1, "x": 0.1}, {"lru": 10.0, "x": 20.0})]
    assert speed_ratios(rows)["x"] == pytest.approx(1.0)


def test_cells_and_names(tmp_path):
    cells = generated_cells(["chat", "code"], [2, 3], [500, 5000], requests=100)
    assert len(cells) == 8 and cells[0].name == "chat/s2@500"
    path = tmp_path / "t.jsonl"
    path.write_text('{"hash_ids": [1, 2]}\n{"hash_ids": [1, 3]}\n')
    (c,) = trace_cells(path, [4])
    assert c.name == "t@4" and c.seed is None
    assert Cell("agent", 4, 100, host=300).name == "agent/s4@100+300"


def test_run_cell_replays_every_policy(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_text("".join(f'{{"hash_ids": [1, 2, {10 + i % 3}]}}\n' for i in range(30)))
    (c,) = trace_cells(path, [4])
    out = run_cell(c, ["lru", "adaptive"], block_size=2)
    assert set(out["rates"]) == {"lru", "adaptive"}
    assert out["rates"]["lru"] > 0 and out["speed"]["adaptive"] > 0
    assert out["cell"] == "t@4" and out["capacity"] == 4
