"""`tiered-cache run-vllm --quick` in the vLLM venv: three engines, identical outputs, the
connector serving what vLLM's own (small) cache lost, the JSON written."""

from __future__ import annotations

import json
import subprocess
import sys


def test_run_vllm_quick(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tiered_cache", "run-vllm", "--quick",
                           "--vllm-blocks", "6", "--no-plot", "--out-dir", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout[-3000:], proc.stderr[-3000:])
    assert "greedy outputs identical across modes: True" in proc.stdout
    report = json.loads((tmp_path / "vllmjob.json").read_text())
    modes = report["modes"]
    assert set(modes) == {"no_reuse", "vllm_prefix", "connector"}
    assert modes["no_reuse"]["prefill_tokens"] == modes["no_reuse"]["prompt_tokens"]
    assert modes["connector"]["connector_hit_tokens"] > 0
    assert modes["connector"]["prefill_tokens"] < modes["vllm_prefix"]["prefill_tokens"]
