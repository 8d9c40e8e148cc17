"""An engine process attached to a node daemon, for tests/test_daemon_*.py (run as a script).

    python tests/daemon_engine.py SOCKET write FIRST N [SALT]   # compute and publish N tokens
    python tests/daemon_engine.py SOCKET read FIRST N [SALT]    # open, check every cached token
    python tests/daemon_engine.py SOCKET loop FIRST N ROUNDS    # two prefixes in turn

With TC_ENGINE_GID=N in the environment it runs as group N (as root: another tenant).

Token ids are FIRST..FIRST+N-1 and the KV of each token is a fixed function of its id,
position and layer (`expected_kv`), so every process knows what the right KV is. Prints one
JSON line per step: cached tokens, by tier, and whether every cached token's KV was right.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from tiered_cache import CacheConfig, TieredKVCache

LAYERS, HEADS, DIM, BLOCK = 2, 2, 8, 4


def config(socket: str, gpu_blocks: int = 64) -> CacheConfig:
    return CacheConfig.from_dict({
        "model": {"name": "tiny", "num_layers": LAYERS, "num_kv_heads": HEADS,
                  "head_dim": DIM, "num_q_heads": 4, "dtype": "float32"},
        "block_size": BLOCK,
        "tiers": {"gpu": {"num_blocks": gpu_blocks, "device": "cpu"},
                  "daemon": {"socket": socket, "timeout_s": 10.0}},
        "migrator": {"wait_timeout_s": 10.0},
    })


def expected_kv(tokens: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[n, H, D] keys and values: a function of (token id, position, layer) only."""
    n = len(tokens)
    t = tokens.to(torch.float64).view(n, 1, 1)
    pos = torch.arange(n, dtype=torch.float64).view(n, 1, 1)
    h = torch.arange(HEADS, dtype=torch.float64).view(1, HEADS, 1)
    d = torch.arange(DIM, dtype=torch.float64).view(1, 1, DIM)
    k = torch.sin(t * 1e-3 * (layer + 1) + h * 0.1 + d * 0.01 + pos * 1e-4)
    v = torch.cos(t * 7e-4 * (layer + 2) - h * 0.2 + d * 0.03 + pos * 3e-4)
    return k.float(), v.float()


def step(cache: TieredKVCache, tokens: list[int], salt: str | None) -> dict:
    """Open, check the cached part against expected_kv, write the rest, close."""
    seq = cache.open(tokens, salt=salt)
    ids = torch.tensor(tokens)
    ok = True
    n = seq.num_cached_tokens
    for layer in range(LAYERS):
        if n:
            cache.wait(seq, layer)
            k, v = cache.gather(seq, layer)
            ek, ev = expected_kv(ids[:n], layer)
            ok = ok and torch.equal(k[:n].cpu(), ek) and torch.equal(v[:n].cpu(), ev)
        ek, ev = expected_kv(ids, layer)
        cache.write(seq, layer, ek[n:], ev[n:])
    out = {"cached": n, "by_tier": dict(seq.cached_tokens_by_tier), "ok": ok}
    cache.close(seq)
    return out


def wait_published(cache: TieredKVCache, blocks: int, timeout: float = 30.0) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = cache.stats()["tiers"]["daemon"]["store"]
        if s["put_blocks"] >= blocks:
            return s["put_blocks"]
        time.sleep(0.01)
    return cache.stats()["tiers"]["daemon"]["store"]["put_blocks"]


def main(argv: list[str]) -> int:
    socket, mode, first, n = argv[0], argv[1], int(argv[2]), int(argv[3])
    if os.environ.get("TC_ENGINE_GID"):             # another tenant (daemon.tenants: gid:N)
        os.setgroups([])
        os.setgid(int(os.environ["TC_ENGINE_GID"]))
    tokens = list(range(first, first + n))
    with TieredKVCache(config(socket, 16 if mode == "loop" else 64)) as cache:
        if mode in ("write", "read"):
            salt = argv[4] if len(argv) > 4 else None
            out = step(cache, tokens, salt)
            if mode == "write":
                out["published"] = wait_published(cache, n // BLOCK - out["cached"] // BLOCK)
            out["daemon"] = cache.stats()["tiers"]["daemon"]["store"]
            print(json.dumps(out), flush=True)
        elif mode == "loop":
            rounds = int(argv[4])
            for r in range(rounds):
                # Two prefixes in turn, of varying lengths, each about as large as the GPU
                # tier: what one round evicts the next finds in the daemon (or recomputes).
                size = BLOCK * (8 + (r * 7) % 8)
                base = first + (r % 2) * 100_000
                out = step(cache, list(range(base, base + size)), None)
                out["round"] = r
                out["attaches"] = cache.stats()["tiers"]["daemon"]["store"]["attaches"]
                print(json.dumps(out), flush=True)
                time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
