"""`tiered-cache run --quick`: the main job end to end through the CLI dispatcher."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tiered_cache import cli  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CONFIG = str(ROOT / "configs" / "default.yaml")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("mainjob")
    rc = cli.main(["run", "--config", CONFIG, "--quick", "--no-progress", "--out-dir", str(out)])
    assert rc == 0
    data = json.loads((out / "mainjob.json").read_text())
    data["_out"] = out
    return data


def test_writes_json_and_png(report):
    out = report["_out"]
    assert (out / "mainjob.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for key in ("config", "quick", "device", "model", "workload", "tiers", "modes", "speedup",
                "targets", "outputs_identical_across_modes", "elapsed_s"):
        assert key in report, key
    assert report["quick"] is True
    assert list(report["modes"]) == ["no_reuse", "gpu_only", "tiered"]


def test_mode_metrics(report):
    n = report["workload"]["requests"]
    for mode, s in report["modes"].items():
        for key in ("requests", "requests_per_s", "ttft_p50_ms", "ttft_p99_ms",
                    "prefill_tokens", "prompt_tokens", "hit_rate", "hit_rate_by_tier"):
            assert key in s, (mode, key)
        assert s["requests"] == n
        assert s["requests_per_s"] > 0
        assert 0 < s["ttft_p50_ms"] <= s["ttft_p99_ms"]
        assert set(s["hit_rate_by_tier"]) == {"gpu", "host"}
    modes = report["modes"]
    assert modes["no_reuse"]["prefill_tokens"] == modes["no_reuse"]["prompt_tokens"]
    assert modes["no_reuse"]["hit_rate"] == 0
    assert modes["gpu_only"]["hit_rate_by_tier"]["host"] == 0
    assert modes["tiered"]["prefill_tokens"] < modes["no_reuse"]["prefill_tokens"]
    assert modes["tiered"]["prefill_tokens"] <= modes["gpu_only"]["prefill_tokens"]
    assert modes["tiered"]["hit_rate"] > 0


def test_model_geometry_comes_from_the_config(report):
    m = report["model"]
    assert (m["num_layers"], m["num_kv_heads"], m["head_dim"], m["num_q_heads"]) == (4, 2, 64, 8)
    assert m["hidden_size"] == 8 * 64
    assert report["outputs_identical_across_modes"] is True
    assert set(report["targets"]) == {"tiered_vs_no_reuse", "tiered_vs_gpu_only"}


def test_mode_subset_and_bad_modes(tmp_path, capsys):
    rc = cli.main(["run", "--config", CONFIG, "--quick", "--no-progress", "--no-plot",
                   "--modes", "tiered", "--users", "2", "--turns", "2",
                   "--out-dir", str(tmp_path)])
    assert rc == 0
    data = json.loads((tmp_path / "mainjob.json").read_text())
    assert list(data["modes"]) == ["tiered"] and data["targets"] == {}
    assert "tiered" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        cli.main(["run", "--quick", "--modes", "nope", "--out-dir", str(tmp_path)])
