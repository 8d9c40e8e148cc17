"""A MemoryError at every line a daemon partition's operation runs (publish, fetch, release,
lookup, invalidate; with a disk tier below the pool and without): an allocation can fail
anywhere, in any of the daemon's connection threads. After each injected failure:

- the partition is torn (a commit section was cut: it refuses every request, a miss for every
  engine; its /health fails: tests/daemon/test_daemon_health.py), or else it is whole:
- `check_invariants` holds; no pool slot is left lent or reserved; once the handles the test
  holds are released nothing stays pinned (an operation that failed handed nothing back and
  kept nothing);
- every chain ever published is either not found or found with exactly its staged KV, and can
  be fetched, checked and released; the failed operation's own chain likewise.

Line events are counted by `sys.settrace` in the package's frames only (the library's own code:
the standard library's locks are not ours to make safe), the MemoryError raised at the k-th,
except where no allocation can fail (a `try:` line, a `with`'s exit: tests/test_interrupts.py
`_unreachable`), where it moves to the next line event.
"""

from __future__ import annotations

import gc
import inspect
import os
import sys

import numpy as np
import pytest
import torch

import tiered_cache
from tests.test_interrupts import _unreachable, quiet
from tiered_cache.config import CacheConfig
from tiered_cache.core import atomic
from tiered_cache.core.invariants import check_invariants
from tiered_cache.daemon.partition import Partition
from tiered_cache.errors import CacheBrokenError
from tiered_cache.wire.shm import PoolGeometry, SharedPool

pytestmark = pytest.mark.slow     # a sweep: hundreds of partitions

PKG = os.path.dirname(tiered_cache.__file__) + os.sep
BS, CHAIN = 4, 4
SETUPS = {"pool": {}, "disk": {"disk": {"num_blocks": 32}}}
OPS = ["publish", "fetch", "release", "lookup", "invalidate"]


class World:
    def __init__(self, tmp: str, setup: str) -> None:
        tiers = {"host": {"num_blocks": 12}, **SETUPS[setup]}
        if "disk" in tiers:
            tiers["disk"] = {**tiers["disk"], "path": os.path.join(tmp, "disk")}
        cfg = CacheConfig.from_dict({
            "model": {"name": "faults", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
                      "dtype": "float32"},
            "block_size": BS, "tiers": tiers, "migrator": {"enabled": False},
            "daemon": {"socket": os.path.join(tmp, "d.sock")}})
        self.part = Partition("t", cfg)
        g = self.part.geometry
        self.staging = SharedPool.create(PoolGeometry(8, g.num_layers, g.block_size,
                                                      g.num_kv_heads, g.head_dim, g.dtype),
                                         populate=False)
        self.root = self.part.root(b"t", None)
        self.kv: dict[bytes, torch.Tensor] = {}     # key -> the KV staged for it
        self.chains: list[np.ndarray] = []
        self.held: list = []
        self.rng = np.random.default_rng(0)

    def tokens(self, seed: int, n: int = CHAIN) -> np.ndarray:
        return np.random.default_rng(seed).integers(1, 1000, n * BS).astype(np.int32)

    def stage(self, toks: np.ndarray) -> list[dict]:
        keys = self.part.hasher.chain(self.root, toks)
        out = []
        for i, key in enumerate(keys):
            kv = torch.from_numpy(self.rng.standard_normal(self.staging.kv[i].shape)
                                  .astype(np.float32))
            self.staging.kv[i].copy_(kv)
            self.kv.setdefault(key, kv)
            out.append({"slot": i, "key": key, "parent": keys[i - 1] if i else self.root,
                        "depth": i, "tokens": toks[i * BS:(i + 1) * BS].astype("<i4")
                        .tobytes(), "hits": 0})
        return out

    def publish(self, toks: np.ndarray) -> list[bool]:
        self.chains.append(toks)
        return self.part.publish(self.root, self.stage(toks), self.staging)

    def fetch(self, toks: np.ndarray):
        return self.part.fetch(self.root, self.root, toks, 5.0)

    def close(self) -> None:
        for seq in self.held:
            self.part.release(seq)
        self.staging.close()
        self.part.close()


def build(tmp: str, setup: str) -> World:
    w = World(tmp, setup)
    for seed in (1, 2):                 # two chains; the second evicts nothing (12 slots)
        assert w.publish(w.tokens(seed)) == [True] * CHAIN
    seq, slots = w.fetch(w.tokens(1))
    assert seq is not None
    w.held.append(seq)                  # a client holds the first chain
    return w


def op_fn(w: World, op: str):
    toks = w.tokens(3)
    if op == "publish":
        return lambda: w.publish(toks)
    if op == "fetch":
        return lambda: w.fetch(w.tokens(2))
    if op == "release":
        seq = w.held.pop()

        def release():
            try:
                w.part.release(seq)
            finally:
                if not seq.closed:      # raised having changed nothing: still the caller's
                    w.held.append(seq)
        return release
    if op == "lookup":
        return lambda: w.part.lookup(w.root, w.root, w.tokens(2))
    return lambda: w.part.invalidate(w.root, w.tokens(2))


_EXIT = atomic._Section.__exit__.__code__
_EXIT_LINES = inspect.getsourcelines(_EXIT)[0]
_EXIT_BOOKS = range(
    _EXIT.co_firstlineno + next(i for i, x in enumerate(_EXIT_LINES) if "holds = getattr" in x),
    _EXIT.co_firstlineno + next(i for i, x in enumerate(_EXIT_LINES) if "del holds" in x) + 1)


def _no_allocation(code, lineno: int, offset: int) -> bool:
    """Line events where no allocation can fail: those a trace function alone reaches
    (`_unreachable`), and a section's exit but for its timing bookkeeping (the rest reads
    and stores its depth, small ints, and tests `exc_type`; the tear check's own failure
    would be a tear's): what the bookkeeping raises it handles itself."""
    return _unreachable(code, offset) or (code is _EXIT and lineno not in _EXIT_BOOKS)


class Injector:
    def __init__(self, k: int | None) -> None:
        self.k, self.n, self.where = k, 0, None

    def global_trace(self, frame, event, arg):
        if self.where is None and frame.f_code.co_filename.startswith(PKG):
            return self.local_trace
        return None

    def local_trace(self, frame, event, arg):
        if self.where is not None or event != "line":
            return None if self.where is not None else self.local_trace
        self.n += 1
        if self.n == self.k:
            if _no_allocation(frame.f_code, frame.f_lineno, frame.f_lasti):
                self.k += 1         # no allocation can fail there (a `try:`, a with's exit)
                return self.local_trace
            self.where = f"{os.path.relpath(frame.f_code.co_filename)}:{frame.f_lineno}"
            raise MemoryError("injected")
        return self.local_trace

    def run(self, fn):
        gc.disable()
        old = sys.gettrace()
        sys.settrace(self.global_trace)
        try:
            return fn(), False
        except MemoryError:
            return None, True
        finally:
            sys.settrace(old)
            gc.enable()


def verify(w: World, op: str, result, where: str) -> None:
    part, ix = w.part, w.part.index
    if ix.broken is not None:
        with pytest.raises(CacheBrokenError):
            ix.open_blocks(0, w.root, w.tokens(1))
        return
    check_invariants(ix)
    assert quiet(ix), f"{where}: slots left lent or reserved: " + ", ".join(
        f"{t.name} {t.reserved} reserved, {t.busy} busy" for t in ix.tiers)
    if op == "fetch" and result is not None and result[0] is not None:
        w.held.append(result[0])
    for seq in w.held:
        part.release(seq)
    w.held = []
    assert all(t.pinned_blocks == 0 for t in ix.tiers), f"{where}: pins leaked"
    assert not ix.open_sequences(), f"{where}: a hold leaked"
    for toks in w.chains + [w.tokens(3)]:
        seq, slots = w.fetch(toks)
        if seq is None:
            continue
        try:
            keys = part.hasher.chain(w.root, toks)
            for key, slot in zip(keys, slots):
                assert torch.equal(part.shared.kv[slot], w.kv[key]), \
                    f"{where}: a fetched block's KV is not the KV published for its tokens"
        finally:
            part.release(seq)
    check_invariants(ix)


def count(tmp, setup: str, op: str) -> int:
    w = build(str(tmp), setup)
    try:
        inj = Injector(None)
        result, failed = inj.run(op_fn(w, op))
        assert not failed
        verify(w, op, result, "untraced")
        return inj.n
    finally:
        w.close()


@pytest.mark.parametrize("setup", list(SETUPS))
@pytest.mark.parametrize("op", OPS)
def test_a_memory_error_at_every_line_leaves_the_partition_whole_or_refusing(
        tmp_path, setup, op):
    n = count(tmp_path / "count", setup, op)
    assert n > 0
    fired = 0
    for k in range(1, n + 1):
        w = build(str(tmp_path / f"k{k}"), setup)
        try:
            inj = Injector(k)
            result, failed = inj.run(op_fn(w, op))
            fired += inj.where is not None
            verify(w, op, result, f"{op}/{setup}: MemoryError at line event {k} ({inj.where})")
        finally:
            w.close()
    # (background copies can shift the path a little between the counted run and the
    # injected ones: the last few k may then lie past its end)
    assert fired >= n - 8, (fired, n)
