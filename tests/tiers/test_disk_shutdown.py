"""A disk tier with its defaults keeps what was cached across a graceful restart (issue 23,
item 5): `shutdown()` drains every block that only memory holds to the disk, as the node
daemon does on SIGTERM, whatever `admit_min_hits` says (admission keeps one-shot traffic off
the SSD while serving; at shutdown the memory tiers are about to be lost, and their contents
are the freshest working set), into the disk's free slots, parents before children.

KV is the pattern of tests/helpers.py, so a block read back after the restart is checked."""

from __future__ import annotations

import pytest

from tests.helpers import (
    check_pattern,
    make_cache,
    write_pattern_all,
)
from tiered_cache.core.invariants import check_invariants

BS = 4


def disk_cache(path, *, gpu=8, host=8, disk=256, **disk_keys):
    """A disk tier with its defaults (admit_min_hits 1, drain_on_shutdown true) unless given."""
    return make_cache(gpu_blocks=gpu, host_blocks=host,
                      migrator={"enabled": True, "wait_timeout_s": 20.0},
                      extra={"tiers": {"disk": {"path": str(path), "num_blocks": disk,
                                                **disk_keys}}})


def prompt(i: int, blocks: int = 2) -> list[int]:
    return [i * 1000 + j for j in range(blocks * BS)]


def serve(cache, tokens) -> dict[str, int]:
    seq = cache.open(tokens)
    for layer in range(cache.num_layers):
        cache.wait(seq, layer)
    check_pattern(cache, seq)            # the cached prefix is exactly this prompt's KV
    write_pattern_all(cache, seq)
    got = dict(seq.cached_tokens_by_tier)
    cache.close(seq)
    return got


def test_the_first_restart_finds_what_only_the_device_held(tmp_path):
    cache = disk_cache(tmp_path)
    assert cache.config.tiers.disk.admit_min_hits == 1          # the default
    ps = [prompt(i) for i in range(3)]                          # 6 blocks: all on the device
    for p in ps:
        serve(cache, p)
    cache.migrator.settle()
    assert cache.stats()["tiers"]["disk"]["used_blocks"] == 0   # nothing demoted while serving
    cache.shutdown()
    again = disk_cache(tmp_path)
    assert again.stats()["recovered_blocks"] == 6
    assert [serve(again, p).get("disk", 0) for p in ps] == [2 * BS] * 3   # every hit checked
    again.shutdown()


def test_what_device_and_host_held_both_survive(tmp_path):
    cache = disk_cache(tmp_path)
    ps = [prompt(i) for i in range(8)]                          # 16 blocks: gpu 8 + host 8
    for p in ps:
        serve(cache, p)
    cache.migrator.settle()
    with cache.locked():
        in_memory = {cache.index.blocks.key[b] for b in cache.index.prefix.values()
                     if any(cache.index.blocks.slots[t][b] >= 0 for t in (0, 1))}
    assert len(in_memory) > 8                                   # some of it only on host
    cache.shutdown()
    again = disk_cache(tmp_path)
    assert in_memory <= set(again.index.prefix)                 # every one of them is back
    from tests.helpers import keys_of

    kept = [p for p in ps if set(keys_of(again, p)) <= in_memory]
    # (admission dropped the oldest while serving, and the demoter keeps headroom free)
    assert len(kept) >= 4
    for p in kept:
        assert serve(again, p).get("disk", 0) == 2 * BS
    check_invariants(again)
    again.shutdown()


def test_a_small_disk_takes_what_fits_parents_first_and_chains_stay_whole(tmp_path):
    cache = disk_cache(tmp_path, disk=5)
    ps = [prompt(i, blocks=3) for i in range(2)]                # 6 blocks, 5 slots
    for p in ps:
        serve(cache, p)
    cache.migrator.settle()
    cache.shutdown()                                            # no error: what fits is written
    again = disk_cache(tmp_path, disk=5)
    assert again.stats()["recovered_blocks"] == 5               # every record reachable
    got = [serve(again, p).get("disk", 0) for p in ps]
    assert sorted(got) == [2 * BS, 3 * BS]                      # a chain cut at its end only
    again.shutdown()


def test_drain_on_shutdown_false_writes_nothing_down(tmp_path):
    cache = disk_cache(tmp_path, drain_on_shutdown=False)
    for i in range(3):
        serve(cache, prompt(i))
    cache.shutdown()
    again = disk_cache(tmp_path)
    assert again.stats()["recovered_blocks"] == 0
    again.shutdown()


def test_the_drain_does_not_write_a_block_twice_across_restarts(tmp_path):
    cache = disk_cache(tmp_path)
    p = prompt(0)
    serve(cache, p)
    cache.shutdown()
    again = disk_cache(tmp_path)
    assert serve(again, p).get("disk", 0) == 2 * BS             # back on device and host now
    again.shutdown()                                            # already on disk: kept, not added
    third = disk_cache(tmp_path)
    assert third.stats()["recovered_blocks"] == 2
    assert third.stats()["tiers"]["disk"]["used_blocks"] == 2
    third.shutdown()


@pytest.mark.parametrize("admit", [0, 3])
def test_the_drain_ignores_admission_whatever_its_setting(tmp_path, admit):
    cache = disk_cache(tmp_path, admit_min_hits=admit)
    for i in range(2):
        serve(cache, prompt(i))
    cache.shutdown()
    again = disk_cache(tmp_path, admit_min_hits=admit)
    assert again.stats()["recovered_blocks"] == 4
    again.shutdown()
