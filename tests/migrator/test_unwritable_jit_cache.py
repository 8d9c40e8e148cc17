"""The CPU block copier (numba, cached on disk) where no cache directory is writable (issue 23,
item 8: a dead thread).

A service user without a home, or a read-only install: numba finds no writable place for its
cache (NUMBA_CACHE_DIR, the package's __pycache__, ~/.cache) and refuses to compile a function
declared `cache=True`. That used to raise in the migrator's warm-up (the thread died, uncounted)
and in every gpu<->host copy. Now such functions compile without the disk cache (logged,
counted in `tiered_cache.jit.uncached()`), and the cache works.

The subprocess runs a copy of the package in which every `__pycache__` is a regular file, with
HOME and NUMBA_CACHE_DIR under a regular file: no directory numba could create or write (this
holds even for root, which file modes would not stop).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow     # processes, servers or sweeps (tests/conftest.py)

REPO = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, logging, sys
    import torch
    import tiered_cache
    from tiered_cache import CacheConfig, TieredKVCache
    from tiered_cache.kernels import host_copy
    assert host_copy.__file__.startswith(sys.argv[1]), host_copy.__file__
    logging.basicConfig(level=logging.WARNING)

    def kv(ids, layer):
        t = torch.tensor(ids, dtype=torch.float32).view(-1, 1, 1)
        return (t * (layer + 1)).expand(-1, 2, 8).contiguous(), (-t).expand(-1, 2, 8).contiguous()

    cfg = CacheConfig.from_dict({
        "model": {"name": "tiny", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
                  "num_q_heads": 4, "dtype": "float32"},
        "block_size": 4,
        "tiers": {"gpu": {"num_blocks": 8, "device": "cpu"}, "host": {"num_blocks": 64}},
        "migrator": {"wait_timeout_s": 30.0},
    })
    prompts = [list(range(1000 * p, 1000 * p + 24)) for p in range(4)]
    ok = True
    with TieredKVCache(cfg) as cache:
        for ids in prompts:             # 6 blocks each on an 8-block gpu tier: demotions
            seq = cache.open(ids)
            for layer in range(2):
                k, v = kv(ids, layer)
                cache.write(seq, layer, k, v)
            cache.close(seq)
        seq = cache.open(prompts[0])    # back from host: a promotion
        cached = seq.num_cached_tokens
        for layer in range(2):
            cache.wait(seq, layer)
            k, v = cache.gather(seq, layer)
            ek, ev = kv(prompts[0][:cached], layer)
            ok = ok and torch.equal(k[:cached], ek) and torch.equal(v[:cached], ev)
        by_tier = dict(seq.cached_tokens_by_tier)
        cache.close(seq)
        health = cache.stats()["threads"]
    from tiered_cache import jit
    print(json.dumps({"ok": ok, "cached": cached, "by_tier": by_tier, "health": health,
                      "uncached": jit.uncached()}))
""")


def _unwritable_copy(tmp: Path) -> Path:
    """The package as installed, with every __pycache__ a regular file."""
    root = tmp / "site"
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(REPO / "tiered_cache", root / "tiered_cache", ignore=ignore)
    for d in [root / "tiered_cache", *[p for p in (root / "tiered_cache").rglob("*")
                                       if p.is_dir()]]:
        (d / "__pycache__").write_text("not a directory\n")
    return root


@pytest.mark.slow                       # numba compiles every kernel again, uncached
def test_the_migrator_copies_when_no_numba_cache_directory_is_writable(tmp_path):
    site = _unwritable_copy(tmp_path)
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("NUMBA_", "XDG_"))}
    env.update(PYTHONPATH=str(site), HOME=str(blocker / "home"),
               NUMBA_CACHE_DIR=str(blocker / "numba"), PYTHONDONTWRITEBYTECODE="1")
    out = subprocess.run([sys.executable, "-c", SCRIPT, str(site)], capture_output=True,
                         text=True, timeout=600, env=env, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-4000:]
    got = json.loads(out.stdout.splitlines()[-1])
    assert got["ok"] and got["cached"] == 24 and got["by_tier"].get("host", 0) > 0, got
    dead = {name: t for name, t in got["health"].items() if not t["alive"] or t["errors"]}
    assert dead == {}, got["health"]
    assert "host_copy" in " ".join(got["uncached"]), got["uncached"]
    assert "without numba's disk cache" in out.stderr, out.stderr[-2000:]
