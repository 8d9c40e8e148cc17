"""migrator/worker.py `Migrator.copy_down`: a write-through copy that finds no room below
(every host slot held by copies under way) is skipped, as without the migrator; the write it
follows has committed, so `write()` never raises for it."""

from __future__ import annotations

from tests.helpers import check_pattern, make_cache, tokens, write_pattern_all
from tiered_cache.errors import CapacityError


def test_no_room_below_skips_the_copy_and_the_write_succeeds(monkeypatch):
    cache = make_cache(gpu_blocks=16, host_blocks=8, write_policy="write_through",
                       migrator={"enabled": True, "wait_timeout_s": 10.0})
    from tiered_cache.core import moves

    def full(*args, **kwargs):
        raise CapacityError("no room in host: every slot held by copies under way")

    monkeypatch.setattr(moves, "plan_copy_down", full)
    seq = cache.open(tokens(16))
    write_pattern_all(cache, seq)                # used to raise CapacityError after publishing
    cache.close(seq)
    monkeypatch.undo()
    again = cache.open(tokens(16))
    assert again.num_cached_tokens >= 12         # published: served from the device
    check_pattern(cache, again)
    cache.close(again)
    cache.shutdown()
