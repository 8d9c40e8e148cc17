"""`Partition.publish` rolls back what it lent: a failure between `lend` and `adopt` (the
staging -> pool copy raising, a MemoryError while the metas are built) gives every lent slot
back, so the pool keeps its capacity, and the next publish of the same blocks is taken whole."""

from __future__ import annotations

import os

import numpy as np
import pytest

from tiered_cache.config import CacheConfig
from tiered_cache.core.tier import DEVICE
from tiered_cache.daemon import partition as P
from tiered_cache.daemon.partition import Partition
from tiered_cache.wire.shm import PoolGeometry, SharedPool

BS, SLOTS = 4, 8


@pytest.fixture
def part(tmp_path):
    cfg = CacheConfig.from_dict({
        "model": {"name": "pub", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8,
                  "dtype": "float32"},
        "block_size": BS, "tiers": {"host": {"num_blocks": SLOTS}},
        "daemon": {"socket": os.path.join(tmp_path, "d.sock")}})
    p = Partition("t", cfg)
    yield p
    p.close()


def _entries(part, root: bytes, n: int) -> list[dict]:
    toks = np.arange(1, n * BS + 1, dtype=np.int32)
    keys = part.hasher.chain(root, toks)
    return [{"slot": i, "key": keys[i], "parent": keys[i - 1] if i else root, "depth": i,
             "tokens": toks[i * BS:(i + 1) * BS].astype("<i4").tobytes(), "hits": 0}
            for i in range(n)]


class _Fails:
    """Raise `exc` at the `at`-th call, else call through."""

    def __init__(self, fn, exc, at: int) -> None:
        self.fn, self.exc, self.at, self.n = fn, exc, at, 0

    def __call__(self, *args):
        self.n += 1
        if self.n == self.at:
            raise self.exc("injected")
        return self.fn(*args)


@pytest.mark.parametrize("where", ["copy", "metas"])
def test_a_failure_between_lend_and_adopt_gives_the_slots_back(part, monkeypatch, where):
    g = part.geometry
    staging = SharedPool.create(PoolGeometry(SLOTS, g.num_layers, g.block_size, g.num_kv_heads,
                                             g.head_dim, g.dtype), populate=False)
    try:
        root = part.root(b"t", None)
        entries = _entries(part, root, 6)
        if where == "copy":
            monkeypatch.setattr(P, "_copy_slots", _Fails(P._copy_slots, RuntimeError, 1))
            exc = RuntimeError
        else:
            monkeypatch.setattr(P, "RecordMeta", _Fails(P.RecordMeta, MemoryError, 3))
            exc = MemoryError
        with pytest.raises(exc, match="injected"):
            part.publish(root, entries, staging)
        assert part.index.tiers[DEVICE].reserved == 0       # nothing left lent
        assert part.index.known([e["key"] for e in entries]) == [False] * 6
        monkeypatch.undo()
        assert part.publish(root, entries, staging) == [True] * 6
        # the whole pool is still there: two more blocks fit without evicting the six
        more = _entries(part, part.root(b"t-other", None), 2)
        assert part.publish(more[0]["parent"], more, staging) == [True, True]
        assert part.index.known([e["key"] for e in entries]) == [True] * 6
    finally:
        staging.close()


def test_a_page_put_that_fails_mid_copy_gives_its_slots_back(monkeypatch):
    """The page spaces' `put` (SGLang's pages through the daemon): the same rule."""
    from tiered_cache.daemon.pages import PageSpace
    from tiered_cache.wire.pages import PageGeometry

    space = PageSpace("t", b"d" * 16, 4096, num_slots=4, staging_slots=4)
    staging = SharedPool.create(PageGeometry(4, 4096), populate=False)
    try:
        entries = [{"slot": i, "key": bytes([i]) * 16} for i in range(4)]
        views = space.slot_view
        monkeypatch.setattr(space, "slot_view", _Fails(views, MemoryError, 2))
        with pytest.raises(MemoryError, match="injected"):
            space.put(b"part", entries, staging)
        assert sorted(space._free) == [0, 1, 2, 3] and not space._index
        monkeypatch.undo()
        assert space.put(b"part", entries, staging) == [True] * 4
        assert space.counts["evicted"] == 0
    finally:
        staging.close()
        space.shared.close()
