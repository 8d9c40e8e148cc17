"""Smoke test of benchmarks/disk.py: it runs small, exits 0, prints its tables and writes JSON
with every measurement. Numbers are not checked (this machine is shared and noisy)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow     # processes, servers or sweeps (tests/conftest.py)

REPO = Path(__file__).resolve().parent.parent


def test_disk_benchmark_quick(tmp_path):
    out = tmp_path / "results" / "disk.json"
    proc = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "disk.py"), "--quick", "--blocks", "8",
         "--batch", "4", "--scan-records", "3000", "--repeats", "1", "--dir", str(tmp_path),
         "--out", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "DiskPool vs a plain sequential file" in proc.stdout and "reopen + scan" in proc.stdout
    data = json.loads(out.read_text())
    assert data["benchmark"] == "disk" and data["geometry"]["block_bytes"] == 512 * 1024
    kinds = {(r["direction"], r["slots"], r["cache"]) for r in data["rows"] if "ratio" in r}
    assert kinds == {("write", "fresh slots", "page cache"),
                     ("write", "reused slots", "page cache"), ("read", "", "page cache"),
                     ("read", "", "cold (fadvise DONTNEED)"), ("write", "fresh slots", "O_DIRECT"),
                     ("write", "reused slots", "O_DIRECT"), ("read", "", "O_DIRECT")}
    for r in data["rows"]:
        assert math.isfinite(r["ours_GBps"]) and r["ours_GBps"] > 0
    assert data["scan"]["records"] == 3000 and data["scan"]["reopen_and_scan_cold_s"] > 0
    assert isinstance(data["all_meet_target"], bool)
    assert list(tmp_path.glob("tc-bench-disk-*")) == []          # cleaned up
