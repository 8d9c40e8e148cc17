"""The daemon's shared pool cannot be written by a client, whatever it does with the read-only
descriptor it was sent (issue 23, item 8: wrong KV across engines).

A client of the daemon's own uid (the default allowlist) gets the tenant's pool as an O_RDONLY
memfd. The memfd's mode lets its owner reopen it through /proc/self/fd with write access; the
pool is sealed against future writes (F_SEAL_FUTURE_WRITE once the daemon has mapped it), so
that reopened descriptor can neither be mapped writable, nor written, nor have holes punched
in it. Real processes: `tiered-cache serve`, an engine that publishes, the attacker, and an
engine that reads what the first published and checks every token's KV.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tiered_cache.daemon.process import NodeProcess

pytestmark = pytest.mark.slow     # processes, servers or sweeps (tests/conftest.py)

TESTS = Path(__file__).resolve().parents[1]
ENGINE = str(TESTS / "daemon_engine.py")

ATTACKER = textwrap.dedent("""
    import ctypes, json, mmap, os, sys
    from tiered_cache.wire.client import Client
    from tiered_cache.wire.ops import make_protocol
    c = Client(sys.argv[1], make_protocol(), timeout_s=10).connect()
    c.call("hello")
    reply = c.request("attach")
    pool_fd, staging_fd = reply.fds
    size = os.fstat(pool_fd).st_size
    tried = {}

    def attempt(name, fn):
        try:
            fn()
            tried[name] = "succeeded"
        except OSError as exc:
            tried[name] = f"refused: {exc.errno}"

    rw = None
    try:
        rw = os.open(f"/proc/self/fd/{pool_fd}", os.O_RDWR)
        tried["reopen"] = "succeeded"
    except OSError as exc:
        tried["reopen"] = f"refused: {exc.errno}"
    if rw is not None:
        def mapped_write():
            mm = mmap.mmap(rw, size, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
            mm[:] = b"\\x7f" * size         # every slot: garbage KV
            mm.close()
        attempt("mmap_write", mapped_write)
        attempt("pwrite", lambda: os.pwrite(rw, b"\\x7f" * size, 0))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]

        def punch():            # FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE: zeroes the pool
            if libc.fallocate(rw, 0x02 | 0x01, 0, size) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
        attempt("punch_hole", punch)
    attempt("mmap_write_original_fd", lambda: mmap.mmap(
        pool_fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE))
    print(json.dumps(tried), flush=True)
""")


def run_json(*cmd: object) -> list[dict]:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-3000:]
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_a_client_cannot_write_the_pool_through_its_read_only_descriptor(tmp_path):
    sock = str(tmp_path / "s" / "d.sock")
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        model: {{name: tiny, num_layers: 2, num_kv_heads: 2, head_dim: 8, num_q_heads: 4,
                dtype: float32}}
        block_size: 4
        tiers:
          host: {{num_blocks: 64}}
        daemon: {{socket: {sock}, lease_s: 5}}
        """))
    node = NodeProcess(cfg, sock, log_path=tmp_path / "daemon.log").start()
    try:
        [wrote] = run_json(sys.executable, ENGINE, sock, "write", 1000, 64)
        assert wrote["ok"] and wrote["published"] == 16, wrote
        [tried] = run_json(sys.executable, "-c", ATTACKER, sock)
        # Whatever path it takes, no write reaches the shared pages.
        writes = {k: v for k, v in tried.items() if k != "reopen"}
        assert writes and all(v.startswith("refused") for v in writes.values()), tried
        [read] = run_json(sys.executable, ENGINE, sock, "read", 1000, 64)
        assert read["cached"] == 64 and read["by_tier"]["daemon"] == 64, read
        assert read["ok"], "another engine got the attacker's bytes as KV"
    finally:
        assert node.stop() == 0, node.log()[-3000:]
