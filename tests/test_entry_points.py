"""Every documented way to start the command runs it: `tiered-cache`, `python -m
tiered_cache` and `python -m tiered_cache.cli` (which used to import and exit, doing nothing)."""

from __future__ import annotations

import subprocess
import sys

import pytest

import tiered_cache

pytestmark = pytest.mark.slow     # processes, servers or sweeps (tests/conftest.py)


@pytest.mark.parametrize("module", ["tiered_cache", "tiered_cache.cli"])
def test_python_dash_m_runs_the_command(module):
    proc = subprocess.run([sys.executable, "-m", module, "--version"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"tiered-cache {tiered_cache.__version__}"


def test_python_dash_m_cli_without_a_command_is_a_usage_error():
    proc = subprocess.run([sys.executable, "-m", "tiered_cache.cli"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2
    assert "COMMAND" in proc.stderr
