"""`tiered-cache replay`: trace loading, the replay report, the cost model, the CLI and sweep."""

from __future__ import annotations

import json

import pytest

from tiered_cache.errors import install_hint
from tiered_cache.tools import cli
from tiered_cache.tools.replay import (
    MODEL_70B,
    CostModel,
    SweepSpec,
    TraceError,
    load_trace,
    replay,
    split_capacity,
    sweep,
    sweep_figure,
)

# Three requests: [1 2 3], [1 2 4] (hits 1 2), [1 2 3] (hits 1 2 3): 5 of 9 blocks.
TINY = [
    {"timestamp": 0, "input_length": 6, "output_length": 1, "hash_ids": [1, 2, 3]},
    {"timestamp": 5, "input_length": 6, "output_length": 1, "hash_ids": [1, 2, 4]},
    {"timestamp": 9, "input_length": 5, "output_length": 1, "hash_ids": [1, 2, 3]},
]


@pytest.fixture
def tiny_path(tmp_path):
    p = tmp_path / "tiny.jsonl"
    p.write_text("".join(json.dumps(r) + "\n" for r in TINY) + "\n")
    return p


def run_cli(capsys, *argv):
    rc = cli.main(["replay", *map(str, argv)])
    out = capsys.readouterr()
    return rc, out.out, out.err


# --- traces -------------------------------------------------------------------------------------


def test_load_trace(tiny_path):
    recs = load_trace(tiny_path)
    assert [r["hash_ids"] for r in recs] == [r["hash_ids"] for r in TINY]
    assert len(load_trace(tiny_path, limit=2)) == 2


@pytest.mark.parametrize("line,match", [
    ("not json", "not JSON"),
    ("[1, 2]", "JSON object"),
    ('{"timestamp": 0}', "hash_ids"),
    ('{"hash_ids": [1, -2]}', r"\[0, 2\*\*31\)"),
    ('{"hash_ids": [1, 2.5]}', r"\[0, 2\*\*31\)"),
    ('{"hash_ids": [true]}', r"\[0, 2\*\*31\)"),
])
def test_bad_trace_lines_name_the_line(tmp_path, line, match):
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(TINY[0]) + "\n" + line + "\n")
    with pytest.raises(TraceError, match=match) as exc:
        load_trace(p)
    assert "bad.jsonl:2" in str(exc.value)


def test_missing_trace_file(tmp_path):
    with pytest.raises(TraceError, match="cannot read"):
        load_trace(tmp_path / "nope.jsonl")


# --- replay ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", [2, 16, 512])
def test_known_answer_for_any_block_size(block_size):
    r = replay(TINY, gpu_blocks=8, block_size=block_size, policy="lru")
    assert r["requests"] == 3 and r["requested_blocks"] == 9 and r["hit_blocks"] == 5
    assert r["token_hit_rate"] == pytest.approx(5 / 9)
    assert r["hit_rate_by_tier"] == {"gpu": pytest.approx(5 / 9)}
    assert r["hit_tokens_by_tier"] == {"gpu": 5 * block_size}
    assert r["evictions"] == {"gpu": 0}
    assert r["block_ops"] == 9 + 4                # 9 looked up, 4 published
    assert r["block_ops_per_s"] > 0


def test_report_bytes_and_seconds_use_the_geometry():
    r = replay(TINY, gpu_blocks=8, block_size=16, policy="lru")
    assert r["block_bytes"] == 327_680 * 16       # 70B bf16: 80 * 2 * 8 * 128 * 2 per token
    cost = CostModel.for_model(MODEL_70B)
    expected = (cost.compute_seconds(2 * 16) + cost.compute_seconds(3 * 16))
    assert r["prefill_seconds_saved"] == pytest.approx(expected)
    assert r["host_transfer_seconds"] == 0.0


def test_oversized_requests_are_counted_as_misses():
    reqs = TINY + [{"hash_ids": list(range(100, 120))}]
    r = replay(reqs, gpu_blocks=8, block_size=2, policy="lru")
    assert r["oversized_requests"] == 1
    assert r["requested_blocks"] == 29 and r["hit_blocks"] == 5


def test_cost_model():
    c = CostModel()
    assert c.prefix_flops(1) == pytest.approx(2 * 70.6e9 + 2 * 80 * 8192)
    n = 10_000
    assert c.prefix_flops(n) == pytest.approx(2 * 70.6e9 * n + 2 * 80 * 8192 * n * n)
    assert c.compute_seconds(n) == pytest.approx(c.prefix_flops(n) / (989e12 * 0.5))
    assert c.transfer_seconds(1000) == pytest.approx(1000 * 327_680 / 50e9)
    m = CostModel.for_model(MODEL_70B, mfu=0.4)
    assert m.hidden == 8192 and m.bytes_per_token == 327_680 and m.mfu == 0.4
    # A host hit is far cheaper than recomputing it.
    assert c.transfer_seconds(512) < c.compute_seconds(512) / 10


def test_split_capacity():
    assert split_capacity(1000, 0.25, 100) == (250, 750)
    assert split_capacity(1000, 0.25, 400) == (400, 600)      # device holds any request
    assert split_capacity(300, 0.25, 400) == (300, 0)


# --- CLI ------------------------------------------------------------------------------------------


def test_cli_json(capsys, tiny_path):
    rc, out, _ = run_cli(capsys, tiny_path, "--block-size", 2, "--gpu-blocks", 8, "--json")
    assert rc == 0
    data = json.loads(out)
    assert {"token_hit_rate", "hit_rate_by_tier", "requests", "evictions", "promotions",
            "demotions", "bytes_moved", "prefill_seconds_saved", "block_ops_per_s",
            "cost_model"} <= set(data)
    assert data["requests"] == 3 and data["token_hit_rate"] == pytest.approx(5 / 9)
    assert data["policy"] == "adaptive"


def test_cli_text_two_tiers_and_belady(capsys, tiny_path):
    rc, out, _ = run_cli(capsys, tiny_path, "--block-size", 2, "--gpu-blocks", 3,
                         "--host-blocks", 3, "--policy", "belady")
    assert rc == 0
    assert "token hit rate" in out and "gpu" in out and "host" in out
    assert "promotions" in out and "demotions" in out and "block ops/s" in out


def test_cli_generated_workload(capsys):
    rc, out, _ = run_cli(capsys, "--workload", "chat", "--requests", 60, "--gpu-blocks", 400,
                         "--json")
    assert rc == 0
    data = json.loads(out)
    assert data["requests"] == 60 and 0 < data["token_hit_rate"] < 1


def test_cli_errors(capsys, tiny_path, tmp_path):
    rc, _, err = run_cli(capsys, tiny_path)
    assert rc == 2 and "--gpu-blocks" in err
    rc, _, err = run_cli(capsys, "--gpu-blocks", 4)
    assert rc == 2 and "TRACE" in err
    rc, _, err = run_cli(capsys, tiny_path, "--gpu-blocks", 4, "--policy", "mru")
    assert rc == 2 and "unknown policy" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text("{}\n")
    rc, _, err = run_cli(capsys, bad, "--gpu-blocks", 4)
    assert rc == 2 and "hash_ids" in err


def test_sweep_writes_json_and_png(capsys, tiny_path, tmp_path):
    out_dir = tmp_path / "sweep"
    rc, out, _ = run_cli(capsys, tiny_path, "--block-size", 2, "--sweep", "--capacities",
                         "3,4,8", "--policies", "lru,reuse_credit,belady", "--out", out_dir,
                         "--no-progress")
    assert rc == 0
    assert "lru" in out and "belady" in out and "x)" in out
    data = json.loads((out_dir / "sweep.json").read_text())
    png = (out_dir / "sweep.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    rows = data["rows"]
    assert len(rows) == 3 * 3 * 2                    # capacities x policies x tier layouts
    assert {r["tiers"] for r in rows} == {"single", "two"}
    at8 = {r["policy"]: r for r in rows if r["capacity"] == 8 and r["tiers"] == "single"}
    assert at8["lru"]["token_hit_rate"] == pytest.approx(5 / 9)
    assert at8["lru"]["vs_lru"] == pytest.approx(1.0)
    assert all(r["token_hit_rate"] <= at8["belady"]["token_hit_rate"] + 1e-12
               for r in at8.values())


def test_sweep_api_single_tier_only():
    res = sweep(TINY, SweepSpec(capacities=[3, 8], policies=["lru", "belady"],
                                tiers=["single"]), block_size=2, progress=False)
    assert [(r["capacity"], r["policy"]) for r in res["rows"]] == [
        (3, "lru"), (3, "belady"), (8, "lru"), (8, "belady")]
    assert all(r["host_blocks"] == 0 for r in res["rows"])


@pytest.mark.slow
def test_benchmark_quick_runs(tmp_path):
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "replay.py"
    out = tmp_path / "replay.json"
    proc = subprocess.run([sys.executable, str(bench), "--quick", "--requests", "300",
                           "--speed-repeats", "1", "--out", str(out)],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    assert data["benchmark"] == "replay" and data["single_tier"] and data["speed"]
    assert {"meets_target", "meets_floor", "meets_speed", "two_tier"} <= set(data)
    assert "x_lru" in proc.stdout and "block_ops_per_s" in proc.stdout


# --- the sweep plot's ratio-to-LRU panel ---------------------------------------------------------


def _lines(ax):
    return {line.get_label(): (list(line.get_xdata()), list(line.get_ydata()))
            for line in ax.get_lines() if not line.get_label().startswith("_")}


def test_sweep_figure_has_a_ratio_to_lru_row():
    res = sweep(TINY, SweepSpec(capacities=[3, 4, 8], policies=["lru", "reuse_credit",
                                                                "belady"]),
                block_size=2, progress=False)
    fig = sweep_figure(res, title="tiny")
    try:
        axes = fig.axes
        assert len(axes) == 4                       # (hit rate, ratio) x (single, two)
        for col, mode in enumerate(res["tiers"]):
            hit_ax, ratio_ax = axes[col], axes[2 + col]
            assert hit_ax.get_ylabel() == "token hit rate"
            assert ratio_ax.get_ylabel() == "token hit rate / lru's"
            rows = {(r["policy"], r["capacity"]): r for r in res["rows"] if r["tiers"] == mode}
            hits = _lines(hit_ax)
            assert set(hits) == {"lru", "reuse_credit", "belady"}
            assert hits["belady"] == ([3, 4, 8], [rows["belady", c]["token_hit_rate"]
                                                  for c in (3, 4, 8)])
            ratios = _lines(ratio_ax)
            # LRU is the 1.0 line itself; Belady, the offline optimum, only in the top row.
            assert set(ratios) == {"reuse_credit"}
            expected = [rows["reuse_credit", c]["token_hit_rate"]
                        / rows["lru", c]["token_hit_rate"] for c in (3, 4, 8)]
            assert ratios["reuse_credit"] == ([3, 4, 8], pytest.approx(expected))
            assert [line.get_ydata()[0] for line in ratio_ax.get_lines()
                    if line.get_label().startswith("_")] == [1.0]   # the baseline line
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


def test_sweep_figure_without_lru_has_no_ratio_row():
    res = sweep(TINY, SweepSpec(capacities=[3, 8], policies=["belady"], tiers=["single"]),
                block_size=2, progress=False)
    assert all(r["vs_lru"] is None for r in res["rows"])
    fig = sweep_figure(res)
    try:
        assert len(fig.axes) == 1
    finally:
        import matplotlib.pyplot as plt

        plt.close(fig)


# --- flags name themselves; cost model and sweep spec check their values -------------------------


@pytest.mark.parametrize("argv,message", [
    (["--gpu-blocks", "0"], "--gpu-blocks: expected a positive integer, got 0"),
    (["--gpu-blocks", "4", "--host-blocks", "-1"],
     "--host-blocks: expected a non-negative integer, got -1"),
    (["--gpu-blocks", "4", "--block-size", "3"], "--block-size: expected a power of two"),
    (["--gpu-blocks", "4", "--layers", "0"], "--layers: expected a positive integer, got 0"),
    (["--gpu-blocks", "4", "--q-heads", "3"],
     "--q-heads: must be a multiple of --kv-heads (8), got 3"),
    (["--gpu-blocks", "4", "--mfu", "0"], "--mfu: expected a number in (0, 1], got 0"),
    (["--gpu-blocks", "4", "--pcie-gbps", "-5"], "--pcie-gbps: expected a positive number"),
    (["--gpu-blocks", "4", "--policy", ":Foo"], "--policy: "),
    (["--gpu-blocks", "4", "--requests", "-1"],
     "--requests: expected a non-negative integer, got -1"),
    (["--sweep", "--capacities", "0"], "--capacities: expected comma-separated positive"),
    (["--sweep", "--tiers", "three", "--no-plot"], "--tiers: expected 'single', 'two' or both"),
    (["--sweep", "--policies", "lru,mru", "--no-plot"], "--policies: unknown policy 'mru'"),
])
def test_flag_errors_name_the_flag(capsys, tiny_path, argv, message):
    rc, out, err = run_cli(capsys, tiny_path, *argv)
    assert rc == 2 and out == ""
    assert err.startswith(f"tiered-cache replay: error: {message}"), err
    assert len(err.splitlines()) == 1
    for key in ("tiers.", "model.", "block_size:", "num_blocks"):
        assert key not in err


def test_cost_model_rejects_values_that_would_divide_by_zero():
    from tiered_cache.errors import ConfigError

    for kw in ({"mfu": 0}, {"mfu": 1.5}, {"pcie_gbps": 0}, {"peak_tflops": float("inf")},
               {"num_layers": -1}):
        with pytest.raises(ConfigError, match=next(iter(kw))):
            CostModel(**kw)
    with pytest.raises(ConfigError, match="model.num_layers"):
        CostModel.for_model({**MODEL_70B, "num_layers": 0})


def test_sweep_spec_checks_its_values():
    from tiered_cache.errors import ConfigError

    with pytest.raises(ConfigError, match="capacities"):
        SweepSpec(capacities=[0])
    with pytest.raises(ConfigError, match="tiers"):
        SweepSpec(tiers=["three"])
    with pytest.raises(ConfigError, match="gpu_fraction"):
        SweepSpec(gpu_fraction=0)


# --- the tools extra -----------------------------------------------------------------------------


def _cli_without(modules, *argv):
    import subprocess
    import sys

    block = "".join(f"sys.modules[{m!r}] = None; " for m in modules)
    code = (f"import sys; {block}from tiered_cache.tools.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *map(str, argv)], capture_output=True,
                          text=True, timeout=120)


@pytest.mark.slow
def test_sweep_without_the_tools_extra_names_it_or_does_without(tiny_path, tmp_path):
    base = ["replay", tiny_path, "--block-size", 2, "--sweep", "--capacities", "3,8",
            "--policies", "lru,belady", "--out", tmp_path / "sweep"]
    proc = _cli_without(("matplotlib", "tqdm"), *base)
    assert proc.returncode == 1 and proc.stdout == ""
    assert proc.stderr == ("tiered-cache replay: error: the plot needs matplotlib, which is not "
                           f"installed: {install_hint('tools')}, or pass --no-plot\n")
    proc = _cli_without(("matplotlib", "tqdm"), *base, "--no-plot")
    assert proc.returncode == 1
    assert "the progress bar needs tqdm" in proc.stderr and "--no-progress" in proc.stderr
    assert not (tmp_path / "sweep" / "sweep.json").exists()    # refused before any work
    proc = _cli_without(("matplotlib", "tqdm"), *base, "--no-plot", "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "sweep" / "sweep.json").read_text())["rows"]
    single = _cli_without(("matplotlib", "tqdm"), "replay", tiny_path, "--block-size", 2,
                          "--gpu-blocks", 8, "--json")
    assert single.returncode == 0, single.stderr
    assert json.loads(single.stdout)["token_hit_rate"] == pytest.approx(5 / 9)
