"""A client's staging area outlives every copy the daemon makes from it (issue 23, item 8:
use after unmap).

`publish` copies blocks out of the client's staging mapping. A lease that expires meanwhile
reaps the client, and the reap unmaps its staging area: the copy must finish from a mapping
that is still there (the unmap waits for the last copy), so the daemon neither dies of SIGSEGV
nor publishes the bytes of whatever memory took the mapping's place.

Real processes: `tiered-cache serve` with a 1 s lease and 192 MiB staging areas, a client that
sends a publish of 192 blocks just before its lease ends (at several offsets, one round each,
so that the reap falls inside one of the copies), and a reader that checks every block the
daemon serves against what was staged for it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from tiered_cache.daemon.process import NodeProcess

pytestmark = pytest.mark.slow     # processes, servers or sweeps (tests/conftest.py)

LAYERS, HEADS, DIM, BS, STAGING = 8, 8, 128, 16, 192      # 1 MiB blocks

COMMON = textwrap.dedent(f"""
    import json, sys, time
    import numpy as np
    from tiered_cache.hashing import xxh3_128
    from tiered_cache.wire.client import Client
    from tiered_cache.wire.errors import LeaseExpiredError
    from tiered_cache.wire.ops import make_protocol
    from tiered_cache.wire.shm import PoolGeometry, SharedPool
    BS, STAGING = {BS}, {STAGING}

    def session(sock):
        c = Client(sock, make_protocol(64 << 20), timeout_s=30).connect()
        sent = time.monotonic()
        lease = c.call("hello")["lease_s"]
        reply = c.request("attach")
        f = reply.fields
        geo = PoolGeometry(f["num_slots"], f["num_layers"], f["block_size"],
                           f["num_kv_heads"], f["head_dim"], f["dtype"])
        pool = SharedPool.attach(reply.fds[0], geo, writable=False)
        sgeo = PoolGeometry(f["staging_slots"], *geo.slot_shape[:1], geo.block_size,
                            geo.num_kv_heads, geo.head_dim, geo.dtype)
        staging = SharedPool.attach(reply.fds[1], sgeo, writable=True)
        root = c.call("root", salt=b"")["root"]
        return c, root, pool, staging, sent + lease

    def blocks(root, first, n):
        tokens = np.arange(first, first + n * BS, dtype=np.int32)
        parent, out = root, []
        for j in range(n):
            t = tokens[j * BS:(j + 1) * BS].tobytes()
            key = xxh3_128(parent + t)
            out.append(dict(key=key, parent=parent, depth=j, tokens=t, hits=0))
            parent = key
        return tokens, out

    def value(r, j):
        return float(r * 1000 + j + 1)
""")

RACER = COMMON + textwrap.dedent("""
    sock = sys.argv[1]
    margins = [float(m) for m in sys.argv[2:]]
    # warm-up: the daemon's copier compiles on its first publish
    c, root, pool, staging, _ = session(sock)
    _, entries = blocks(root, 10**7, 1)
    staging.kv[0].fill_(-1.0)
    try:
        c.call("publish", root=root, entries=[dict(entries[0], slot=0)])
    except Exception:
        pass
    c.close()
    out = []

    def staged(r):
        # a session whose staging area holds round r's blocks, its lease just renewed
        c, root, pool, staging, _ = session(sock)
        _, entries = blocks(root, r * 100_000, STAGING)
        for j in range(STAGING):
            staging.kv[j].fill_(value(r, j))
            if j % 4 == 0:
                c.call("heartbeat")         # filling 192 MiB may take longer than the lease
        sent = time.monotonic()             # the lease ends lease_s after this renewal
        return c, root, entries, sent + c.call("heartbeat")["expires_in_s"]

    for r, margin in enumerate(margins):
        for attempt in range(5):            # a loaded machine may stall the setup past the lease
            try:
                c, root, entries, expires = staged(r)
                break
            except LeaseExpiredError:
                continue
        left = expires - time.monotonic()
        time.sleep(max(0.0, left - margin))
        try:
            taken = sum(c.call("publish", root=root, entries=[
                dict(e, slot=j) for j, e in enumerate(entries)])["taken"])
            out.append({"round": r, "taken": taken, "left_s": left})
        except Exception as exc:
            out.append({"round": r, "error": type(exc).__name__, "left_s": left})
        c.close()
    print(json.dumps(out), flush=True)
""")

READER = COMMON + textwrap.dedent("""
    sock, rounds = sys.argv[1], int(sys.argv[2])
    out = []
    for r in range(rounds):
        for attempt in range(5):
            # copy out under the handle, then check: a handle whose lease ended is void
            c, root, pool, staging, _ = session(sock)
            tokens, _ = blocks(root, r * 100_000, STAGING)
            got = c.call("fetch", root=root, parent=root, tokens=tokens, wait_ms=10_000)
            kv = [pool.kv[slot].clone() for slot in got["slots"]]
            try:
                if got["handle"]:
                    assert c.call("release", handle=got["handle"])["held"]
                break
            except (LeaseExpiredError, AssertionError):
                continue
            finally:
                c.close()
        wrong = [j for j, x in enumerate(kv) if not bool((x == value(r, j)).all())]
        out.append({"round": r, "served": len(kv), "wrong": wrong})
    print(json.dumps(out), flush=True)
""")


MARGINS = ["0.01", "0.04", "0.07", "0.1", "0.14"]


def run_json(*cmd: object, timeout: float = 240) -> list[dict]:
    out = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])


def test_a_lease_that_expires_during_a_publish_never_unmaps_what_is_being_copied(tmp_path):
    sock = str(tmp_path / "s" / "d.sock")
    cfg = tmp_path / "daemon.yaml"
    cfg.write_text(textwrap.dedent(f"""\
        model: {{name: big-blocks, num_layers: {LAYERS}, num_kv_heads: {HEADS},
                head_dim: {DIM}, num_q_heads: {HEADS}, dtype: float32}}
        block_size: {BS}
        tiers:
          host: {{num_blocks: {STAGING * len(MARGINS) + 8}}}
        daemon: {{socket: {sock}, lease_s: 1, staging_blocks: {STAGING}, max_frame_mib: 64}}
        """))
    node = NodeProcess(cfg, sock, log_path=tmp_path / "daemon.log").start()
    try:
        published = run_json(sys.executable, "-c", RACER, sock, *MARGINS)
        assert node.proc.poll() is None, f"the daemon died: {node.log()[-3000:]}"
        served = run_json(sys.executable, "-c", READER, sock, len(MARGINS))
        # A miss is allowed (a publish refused because its client was reaped); wrong KV never.
        assert all(r["wrong"] == [] for r in served), (published, served)
        assert any(r["served"] for r in served), (published, served)
    finally:
        rc = node.stop() if node.proc.poll() is None else node.proc.returncode
    assert rc == 0, node.log()[-3000:]
