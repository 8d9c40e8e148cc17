"""Smoke tests of the benchmarks: each runs with `--quick` in a subprocess, exits 0, prints its
table and writes JSON with the keys that reports read. Numbers are not checked (CI machines are
noisy); only that every measurement is there and sane."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "benchmarks"


def run_bench(name: str, tmp_path: Path, *extra: str, timeout: float = 90.0):
    out = tmp_path / "results" / f"{name}.json"
    proc = subprocess.run(
        [sys.executable, str(BENCH / f"{name}.py"), "--quick", "--out", str(out), *extra],
        cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (f"{name} exited {proc.returncode}\n--- stdout\n"
                                  f"{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}")
    assert out.exists(), f"{name} did not write {out}"
    return json.loads(out.read_text()), proc.stdout


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x) and x > 0


@pytest.mark.slow
def test_migration_quick(tmp_path):
    data, stdout = run_bench("migration", tmp_path)
    assert "migration bandwidth vs one contiguous copy_" in stdout
    assert data["benchmark"] == "migration" and data["quick"] is True
    geo = data["geometry"]
    assert {"num_layers", "full_num_layers", "layers_scaled_down", "block_bytes",
            "note"} <= set(geo)
    assert geo["num_kv_heads"] == 8 and geo["head_dim"] == 128 and geo["block_size"] == 16
    assert isinstance(data["all_meet_target"], bool)
    rows = data["rows"]
    for r in rows:
        assert {"case", "direction", "level", "blocks", "MiB", "ours_GBps", "copy__GBps",
                "ratio", "meets_0.9"} <= set(r), r
        assert _positive(r["ours_GBps"]) and _positive(r["copy__GBps"]) and _positive(r["ratio"])
    kernel = {(r["direction"], r["slots"]) for r in rows if r["level"] == "kernel"}
    assert kernel >= {("to_host", "contiguous"), ("to_host", "scattered"),
                      ("to_device", "contiguous"), ("to_device", "scattered")}
    e2e = [r for r in rows if r["level"] == "e2e"]
    assert {r["direction"] for r in e2e} == {"to_host", "to_device"}
    for run in data["e2e_runs"]:
        assert run["demoted"] > 0 and run["promoted"] == run["demoted"]
        assert _positive(run["demote_s"]) and _positive(run["promote_s"])
        assert {"p50_s", "p99_s", "max_s"} <= set(run["lock_hold_demotion"])


@pytest.mark.slow
def test_compaction_quick(tmp_path):
    data, stdout = run_bench("compaction", tmp_path, "--check")
    assert "lock holds" in stdout
    assert data["benchmark"] == "compaction" and data["blocks"] == 10**5
    assert set(data["meets"]) == {"p99", "max"}
    on, base = data["online"], data["baseline"]
    setup = on["setup"]
    assert _positive(setup["fill_s"]) and setup["live_blocks"] > 0
    assert on["fragmentation_before"] > 0.5            # heavily fragmented to start with
    assert on["fragmentation_after"] < on["fragmentation_before"]
    assert on["blocks_moved"] > 0 and _positive(on["time_s"])
    for key in ("p50_ms", "p99_ms", "max_ms", "holds"):
        assert key in on["lock"] and key in base["lock"]
    assert on["lock"]["holds"] > 0 and on["lock"]["p50_ms"] <= on["lock"]["max_ms"]
    assert "tc-compactor" in on["lock"]["by_thread"]
    assert base["blocks_moved"] > 0 and _positive(base["pause_s"])
    assert base["fragmentation_after"] < base["fragmentation_before"]
    # The stop-the-world pause is one hold: it is the longest of its window.
    assert base["lock"]["max_ms"] >= base["pause_s"] * 1e3 * 0.99


def test_common_helpers(tmp_path, capsys):
    sys.path.insert(0, str(BENCH))
    try:
        import common
    finally:
        sys.path.remove(str(BENCH))
    t = common.time_it(lambda: None, warmup=1, repeats=3)
    assert t["repeats"] == 3 and 0 <= t["min_s"] <= t["median_s"] <= t["max_s"]
    assert common.quantile([3.0, 1.0, 2.0], 0.5) == 2.0 and common.quantile([], 0.9) == 0.0
    text = common.print_table([{"a": 1, "b": 2.5}, {"a": 10, "c": "x"}], title="T")
    assert "T" in capsys.readouterr().out and text.splitlines()[1].split() == ["a", "b", "c"]
    path = common.write_json(tmp_path / "deep" / "r.json", {"x": 1.0})
    assert json.loads(path.read_text()) == {"x": 1.0}


@pytest.mark.slow
def test_policy_eval_quick(tmp_path):
    data, stdout = run_bench("policy_eval", tmp_path)
    assert "ratio of token hit rate to LRU's" in stdout and "replay speed" in stdout
    assert data["benchmark"] == "policy_eval" and data["quick"] is True
    assert not set(data["tuning_seeds"]) & set(data["reporting_seeds"])
    assert set(data["seeds"]) <= set(data["reporting_seeds"])
    # both splits in the same run, each against LRU, judged on the held-out one
    assert data["judged_on"] == "held_out" and set(data["splits"]) == {"tuning", "held_out"}
    assert set(data["splits"]["tuning"]["seeds"]) <= set(data["tuning_seeds"])
    assert data["splits"]["held_out"]["summary"] == data["summary"]
    assert stdout.count("ratio of token hit rate to LRU's") == 2
    for c in data["cells"]:
        assert c["split"] == ("tuning" if c["seed"] in data["tuning_seeds"] else "held_out")
    assert "adaptive" in data["summary"] and "lru" in data["summary"]
    for name, s in data["summary"].items():
        assert s["cells"] > 0 and _positive(s["geomean"]) and _positive(s["worst"]), name
        assert s["worst"] <= s["geomean"] <= s["best"]
    assert data["summary"]["lru"]["worst"] == data["summary"]["lru"]["geomean"] == 1.0
    assert {"code", "chat", "rag", "agent"} <= {c["source"] for c in data["cells"]}
    assert set(data["meets"]) == {"worst", "geomean", "vs_best_single", "speed"}
    assert all(isinstance(v, bool) for v in data["meets"].values())
    assert data["best_single"] not in ("adaptive", "belady")
    for r in data["speed"]:
        assert _positive(r["block_ops_per_s"]) and _positive(r["x_lru"])


@pytest.mark.slow
def test_daemon_remote_quick(tmp_path):
    import tests.redis_servers as rs

    rs.require()
    data, out = run_bench("daemon_remote", tmp_path, "--blocks", "8", timeout=180)
    assert data["benchmark"] == "daemon_remote" and data["kv_checked"] is True
    assert data["remote_b"]["loaded_blocks"] == 3 * 8 and data["remote_b"]["load_failures"] == 0
    assert all(_positive(r["p50_ms"]) for r in data["rows"])
    assert "cold (from the store)" in out


@pytest.mark.slow
def test_vllm_connector_lookup_quick(tmp_path):
    """The lookup part needs no vLLM (its engine parts are skipped where vLLM is missing)."""
    data, stdout = run_bench("vllm_connector", tmp_path, "--parts", "lookup")
    assert "get_num_new_matched_tokens at 100 cached blocks" in stdout
    rows = {r["path"]: r for r in data["lookup"]["rows"]}
    assert set(rows) == {"in_process", "daemon_socket"}
    for r in rows.values():
        assert r["hit_tokens"] == 3200 and _positive(r["p50_ms"]) and _positive(r["p99_ms"])
        assert r["target_ms"] in (1.0, 2.0)


@pytest.mark.slow
def test_control_plane_quick(tmp_path):
    data, stdout = run_bench("control_plane", tmp_path, "--sizes", "1000", "--sample", "4",
                             "--repeats", "1", "--clock", "cpu")
    assert "control plane (adaptive, cpu time)" in stdout
    assert data["args"]["policy"] == "adaptive"
    assert {r["workload"] for r in data["rows"]} == {"hit", "miss"}
    for r in data["rows"]:
        assert r["policy"] == "adaptive" and r["cached_blocks"] == 1000
        assert _positive(r["ours_ns_per_block"]) and _positive(r["floor_ns_per_block"])
    mem, _ = run_bench("control_plane", tmp_path, "--memory", "--sizes", "2000",
                       "--policy", "lru")
    (row,) = mem["rows"]
    assert row["policy"] == "lru" and row["cached_blocks"] == 2000
    assert _positive(row["bytes_per_block"]) and "rss_bytes_per_block" in row


@pytest.mark.slow
def test_control_plane_peers_says_when_a_peer_is_missing(tmp_path):
    """Where neither peer imports (this suite's venv), the peer benchmark measures nothing,
    says so, and still writes its JSON."""
    data, stdout = run_bench("control_plane_peers", tmp_path, "--sizes", "1024",
                             "--vllm-python", sys.executable, "--sglang-python",
                             sys.executable)
    for peer in ("vllm", "sglang"):
        try:
            __import__({"vllm": "vllm.v1.core.block_pool",
                        "sglang": "sglang.srt.mem_cache.radix_cache"}[peer])
        except ImportError:
            assert peer in data["skipped"] and "skipped" in stdout
    if not data["interpreters"]:
        assert data["rows"] == [] and "no peer importable" in stdout


@pytest.mark.slow
def test_adopt_quick(tmp_path):
    data, stdout = run_bench("adopt", tmp_path)
    assert "adopt, us per block" in stdout
    assert data["benchmark"] == "adopt" and data["quick"] is True
    assert data["rows"] and all(_positive(r["this_us_per_block"]) for r in data["rows"])


@pytest.mark.slow
def test_promotion_quick(tmp_path):
    data, stdout = run_bench("promotion", tmp_path)
    assert "promotion control plane, us per promoted block" in stdout
    assert data["benchmark"] == "promotion" and data["quick"] is True
    assert data["rows"] and all(_positive(r["this_us_per_block"]) for r in data["rows"])
