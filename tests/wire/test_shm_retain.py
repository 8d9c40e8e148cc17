"""SharedPool.retain: a close while a copy uses the mapping unmaps it only after that copy, and
nothing can retain a closed pool (tests/daemon/test_staging_lifetime.py runs the daemon's race
with real processes)."""

from __future__ import annotations

import pytest

from tiered_cache.wire.shm import PoolGeometry, SharedPool

GEO = PoolGeometry(4, 2, 4, 2, 8, "float32")


def test_close_under_a_retainer_waits_for_it_to_finish():
    pool = SharedPool.create(GEO, populate=False)
    with pool.retain() as held:
        pool.close()                        # the owner's lease ended meanwhile
        held.kv[1].fill_(3.0)               # still mapped: no SIGSEGV, the same pages
        assert float(held.kv[1].sum()) == 3.0 * held.kv[1].numel()
        with pytest.raises(RuntimeError, match="closed"):
            pool.retain()                   # nobody new gets in
    with pytest.raises(RuntimeError, match="closed"):
        _ = pool.kv                         # unmapped by the last retainer
    assert pool.fd is None


def test_close_without_retainers_unmaps_at_once_and_exit_is_idempotent():
    pool = SharedPool.create(GEO, populate=False)
    r = pool.retain()
    with r:
        pass
    r.__exit__(None, None, None)            # a second exit does not release twice
    assert pool._users == 0
    pool.close()
    assert pool.fd is None
    with pytest.raises(RuntimeError, match="closed"):
        pool.retain()
