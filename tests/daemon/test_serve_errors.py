"""`tiered-cache serve` that cannot start says why in one line, without a traceback, and exits
non-zero (issue 23, items 6 and 8): a bad key, a socket directory it cannot create or that
others may write, a second daemon on the same socket."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tiered_cache.daemon.process import NodeProcess

pytestmark = pytest.mark.slow     # processes, servers or sweeps (tests/conftest.py)

MODEL = ("model: {name: tiny, num_layers: 2, num_kv_heads: 2, head_dim: 8, num_q_heads: 4, "
         "dtype: float32}\nblock_size: 4\n")


def config(tmp: Path, name: str, daemon: str, tiers: str = "{host: {num_blocks: 8}}") -> Path:
    path = tmp / f"{name}.yaml"
    path.write_text(MODEL + f"tiers: {tiers}\ndaemon: {daemon}\n")
    return path


def serve(cfg: Path) -> tuple[int, list[str]]:
    out = subprocess.run([sys.executable, "-m", "tiered_cache.cli", "serve", "--config",
                          str(cfg), "--log-level", "WARNING"], capture_output=True, text=True,
                         timeout=120)
    return out.returncode, [line for line in out.stderr.splitlines() if line.strip()]


def one_error(rc: int, lines: list[str], starts: str) -> None:
    assert rc != 0
    assert not any("Traceback" in line for line in lines), "\n".join(lines)
    errors = [line for line in lines if line.startswith("tiered-cache serve: error:")]
    assert len(errors) == 1 and errors[0] == lines[-1], "\n".join(lines)
    assert errors[0].startswith(f"tiered-cache serve: error: {starts}"), errors[0]


@pytest.mark.parametrize("name, daemon, starts", [
    ("bad-key", "{socket: SOCK, lease_seconds: 3}", "daemon.lease_seconds"),
    ("bad-value", "{socket: SOCK, lease_s: -1}", "daemon.lease_s"),
    ("no-dir", "{socket: /proc/no-such-dir/d.sock}", "daemon.socket"),
])
def test_a_config_that_cannot_serve_is_one_line_and_a_non_zero_exit(tmp_path, name, daemon,
                                                                     starts):
    cfg = config(tmp_path, name, daemon.replace("SOCK", str(tmp_path / "s" / "d.sock")))
    one_error(*serve(cfg), starts)


def test_a_socket_directory_others_can_write_is_refused_in_one_line(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    one_error(*serve(config(tmp_path, "open", f"{{socket: {shared / 'd.sock'}}}")),
              "daemon.socket")


def test_a_second_daemon_on_the_same_socket_is_refused_in_one_line(tmp_path):
    sock = tmp_path / "s" / "d.sock"
    cfg = config(tmp_path, "ok", f"{{socket: {sock}}}")
    first = NodeProcess(cfg, str(sock), log_path=tmp_path / "first.log").start()
    try:
        rc, lines = serve(cfg)
        one_error(rc, lines, "")
        assert "already serves" in lines[-1]
    finally:
        assert first.stop() == 0
