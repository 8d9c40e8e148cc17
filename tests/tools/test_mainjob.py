"""`tiered-cache run --quick`: the main job end to end through the CLI dispatcher."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from tiered_cache.errors import install_hint
from tiered_cache.tools import cli, mainjob  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs" / "default.yaml")
CONFIG_70B = ROOT / "configs" / "llama-70b-h200.yaml"


pytestmark = pytest.mark.slow     # runs the main job (a model, three modes)


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
    rc = cli.main(["run", "--quick", "--modes", "tiered,nope", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err == ("tiered-cache run: error: --modes: expected a subset of "
                   "no_reuse,gpu_only,tiered, got 'tiered,nope'\n")


# --- targets of a quick run ----------------------------------------------------------------------


def test_quick_run_says_its_targets_do_not_apply(report):
    data = {k: v for k, v in report.items() if k != "_out"}
    for tgt in data["targets"].values():
        assert tgt["applies"] is False and tgt["met"] is None
    text = mainjob.format_table(data)
    lines = [line for line in text.splitlines() if "target >=" in line]
    assert len(lines) == 2
    for line in lines:
        assert line.endswith("does not apply to a --quick run (the targets are for the full "
                             "workload)"), line
    assert "NOT met" not in text and ": met" not in text


def test_full_run_says_met_or_not_met(report):
    data = {k: v for k, v in report.items() if k != "_out"}
    data["targets"] = {
        "tiered_vs_no_reuse": {**data["targets"]["tiered_vs_no_reuse"], "applies": True,
                               "met": True},
        "tiered_vs_gpu_only": {**data["targets"]["tiered_vs_gpu_only"], "applies": True,
                               "met": False},
    }
    lines = [line for line in mainjob.format_table(data).splitlines() if "target >=" in line]
    assert lines[0].startswith("tiered vs no_reuse") and lines[0].endswith(": met")
    assert lines[1].startswith("tiered vs gpu_only") and lines[1].endswith(": NOT met")


# --- flag and config errors ----------------------------------------------------------------------


@pytest.mark.parametrize("argv,message", [
    (["--gpu-blocks", "0"], "--gpu-blocks: expected a positive integer, got 0"),
    (["--gpu-blocks", "2"], "--gpu-blocks: the largest request needs 10 device blocks, got 2"),
    (["--host-blocks", "-1"], "--host-blocks: expected a non-negative integer, got -1"),
    (["--users", "0"], "--users: expected a positive integer, got 0"),
    (["--threads", "many"], "--threads: expected a positive integer, got 'many'"),
    (["--prefill-chunk-size", "0"], "--prefill-chunk-size: expected a positive integer, got 0"),
])
def test_flag_errors_name_the_flag(tmp_path, capsys, argv, message):
    rc = cli.main(["run", "--quick", "--no-progress", "--no-plot", "--out-dir", str(tmp_path),
                   *argv])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"tiered-cache run: error: {message}"), err
    assert len(err.splitlines()) == 1 and "tiers." not in err
    assert not (tmp_path / "mainjob.json").exists()


def test_config_file_errors_name_the_file_and_the_key(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  num_kv_heads: 0\n")
    rc = cli.main(["run", "--config", str(bad), "--quick", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith(f"tiered-cache run: error: {bad}: model.num_kv_heads: "), err
    meta = tmp_path / "meta.yaml"
    meta.write_text("storage: none\n")
    rc = cli.main(["run", "--config", str(meta), "--quick", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith(f"tiered-cache run: error: {meta}: storage: "), err


# --- memory --------------------------------------------------------------------------------------


def test_parameter_count_matches_the_model_it_builds():
    from tiered_cache.config import CacheConfig

    for data in ({}, {"model": {"num_layers": 3, "num_kv_heads": 2, "head_dim": 16,
                                "num_q_heads": 6}}):
        config = CacheConfig.from_dict(data)
        model = mainjob.build_model(config, "cpu", 0)
        assert mainjob.llama_parameters(config) == sum(p.numel() for p in model.parameters())


def test_allocations_count_every_mode():
    from tiered_cache.config import CacheConfig

    config = CacheConfig.from_yaml(CONFIG_70B)
    w = mainjob.QUICK
    allocs = mainjob.allocations(config, w, list(mainjob.MODES), gpu_blocks=18, host_blocks=100,
                                 chunk=512, device="cpu")
    by = {a.what: a for a in allocs}
    assert by["model weights"].nbytes == mainjob.llama_parameters(config) * 4
    assert by["tiered host tier"].nbytes == 100 * config.block_bytes
    assert by["gpu_only device tier"].nbytes == by["tiered device tier"].nbytes == (
        18 * config.block_bytes)
    assert all(a.where in ("host", "cpu") for a in allocs)
    only_tiered = mainjob.allocations(config, w, ["tiered"], 18, 100, 512, "cpu")
    assert {a.what for a in only_tiered} == {"model weights", "prefill activations",
                                             "tiered device tier", "tiered host tier"}
    on_gpu = mainjob.allocations(config, w, ["tiered"], 18, 100, 512, "cuda:0")
    weights = [a.where for a in on_gpu if a.what == "model weights"]
    assert sorted(weights) == ["cuda:0", "host"]   # built on the host, then moved


def _needed_for_70b() -> int:
    from tiered_cache.config import CacheConfig
    from tiered_cache.sizing import tier_num_blocks

    config = CacheConfig.from_yaml(CONFIG_70B)
    return sum(a.nbytes for a in mainjob.allocations(
        config, mainjob.QUICK, list(mainjob.MODES), 18, tier_num_blocks(config, "host"), 512,
        "cpu"))


@pytest.mark.slow
def test_70b_config_is_refused_before_anything_is_allocated(tmp_path):
    psutil = pytest.importorskip("psutil")
    if psutil.virtual_memory().available > _needed_for_70b():
        pytest.skip("this machine has the memory the 70B main job needs")
    # NOTE: the address-space limit only matters if the check is broken: the job then fails
    # with MemoryError at 16 GiB instead of building a ~100 GiB model until the OOM killer.
    code = ("import resource, sys; resource.setrlimit(resource.RLIMIT_AS, (16 << 30, 16 << 30));"
            "from tiered_cache.tools.cli import main; sys.exit(main(sys.argv[1:]))")
    proc = subprocess.run(
        [sys.executable, "-c", code, "run", "--config", str(CONFIG_70B), "--quick",
         "--no-progress", "--out-dir", str(tmp_path)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    err = proc.stderr
    assert err.startswith(f"tiered-cache run: error: {CONFIG_70B}: needs at least "), err
    assert "GiB of host memory (tiered host tier 480.00 GiB, model weights" in err
    assert "is available; refusing before allocating any of it" in err
    assert len(err.splitlines()) == 1 and proc.stdout == ""
    assert not (tmp_path / "mainjob.json").exists()


# --- the tools extra -----------------------------------------------------------------------------

def _run_without(modules: tuple[str, ...], *argv: str) -> subprocess.CompletedProcess:
    block = "".join(f"sys.modules[{m!r}] = None; " for m in modules)
    code = (f"import sys; {block}from tiered_cache.tools.cli import main; "
            "sys.exit(main(sys.argv[1:]))")
    return subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_without_matplotlib_run_names_the_extra_or_does_without(tmp_path):
    # NOTE: only matplotlib: transformers (the hf extra, which `run` needs) brings tqdm itself.
    base = ["run", "--config", CONFIG, "--quick", "--modes", "tiered", "--out-dir",
            str(tmp_path)]
    proc = _run_without(("matplotlib",), *base)
    assert proc.returncode == 1
    assert proc.stderr == ("tiered-cache run: error: the plot needs matplotlib, which is not "
                           f"installed: {install_hint('tools')}, or pass --no-plot\n")
    assert not (tmp_path / "mainjob.json").exists()
    proc = _run_without(("matplotlib",), *base, "--no-plot", "--no-progress")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "mainjob.json").read_text())["modes"]["tiered"]["requests"]


@pytest.mark.slow
def test_without_transformers_run_names_the_hf_extra(tmp_path):
    proc = _run_without(("transformers",), "run", "--quick", "--out-dir", str(tmp_path))
    assert proc.returncode == 1
    assert proc.stderr == ("tiered-cache run: error: the model needs transformers, which is not "
                           f"installed: {install_hint('hf')}\n")
