"""`tiered-cache run-shared --quick`: two real engine processes, with and without a real
`tiered-cache serve` daemon between them, through the CLI dispatcher."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow     # processes, servers or sweeps (tests/conftest.py)

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out = tmp_path_factory.mktemp("sharedjob")
    proc = subprocess.run([sys.executable, "-m", "tiered_cache", "run-shared", "--quick",
                           "--out-dir", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    data = json.loads((out / "sharedjob.json").read_text())
    data["_stdout"] = proc.stdout
    return data


def test_outputs_identical_and_table_printed(report):
    assert report["outputs_identical_across_modes"] is True
    assert list(report["modes"]) == ["separate", "shared"]
    assert "prefill computed with the daemon" in report["_stdout"]
    for mode in report["modes"].values():
        assert mode["requests"] == report["workload"]["users"] * report["workload"]["turns"]
        assert sum(mode["requests_by_engine"]) == mode["requests"]
        assert all(n > 0 for n in mode["requests_by_engine"])


def test_the_daemon_shares_prefixes_between_engines(report):
    sep, sh = report["modes"]["separate"], report["modes"]["shared"]
    assert sep["prompt_tokens"] == sh["prompt_tokens"]
    assert "daemon" not in sep["reused_tokens"] or sep["reused_tokens"]["daemon"] == 0
    assert sh["reused_tokens"]["daemon"] > 0
    # Every token the daemon served is one the engine did not compute.
    assert sh["prefill_tokens"] == sep["prefill_tokens"] - sh["reused_tokens"]["daemon"]


def test_bad_config_is_a_usage_error(tmp_path):
    bad = tmp_path / "c.yaml"
    bad.write_text("storage: none\n")
    proc = subprocess.run([sys.executable, "-m", "tiered_cache", "run-shared", "--quick",
                           "--config", str(bad)], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "storage" in proc.stderr and "Traceback" not in proc.stderr
