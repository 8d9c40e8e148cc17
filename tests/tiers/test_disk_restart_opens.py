"""Opening, in quick succession, prompts that after a restart only the disk holds (issue 23,
item 8: disk). Each open promotes its blocks from disk into device slots; the next open finds
those slots held by promotions still in flight. That shortage ends by itself once the copies
land, so it is waited out (bounded by `migrator.wait_timeout_s`), never a CapacityError. KV is
the pattern of tests/helpers.py: every block read back is checked."""

from __future__ import annotations

from tests.helpers import (
    check_pattern,
    make_cache,
    write_pattern_all,
)

BS = 4


def disk_cache(path, *, gpu: int = 8, host: int = 8):
    """admit_min_hits 0: what host evicts while serving goes to disk too (not only what the
    shutdown drains), so most prompts are on disk alone after the restart."""
    return make_cache(gpu_blocks=gpu, host_blocks=host,
                      migrator={"enabled": True, "wait_timeout_s": 30.0},
                      extra={"tiers": {"disk": {"path": str(path), "num_blocks": 256,
                                                "admit_min_hits": 0}}})


def prompt(i: int, blocks: int = 6) -> list[int]:
    return [i * 1000 + j for j in range(blocks * BS)]


def serve(cache, tokens) -> dict[str, int]:
    seq = cache.open(tokens)
    for layer in range(cache.num_layers):
        cache.wait(seq, layer)
    check_pattern(cache, seq)
    write_pattern_all(cache, seq)
    got = dict(seq.cached_tokens_by_tier)
    cache.close(seq)
    return got


def test_quick_opens_of_disk_only_prompts_after_a_restart_wait_for_the_copies(tmp_path):
    ps = [prompt(i) for i in range(6)]          # 6 blocks each on an 8-block device tier
    cache = disk_cache(tmp_path)
    for p in ps:
        serve(cache, p)
        cache.migrator.settle()                 # the demotions it caused are done
    cache.shutdown()                            # drains what memory held to the disk
    again = disk_cache(tmp_path)
    on_disk = again.stats()["tiers"]["disk"]["used_blocks"]
    assert on_disk >= 8, on_disk                # disk only now
    for _ in range(3):
        for p in ps:                            # open, give up at once, open the next
            seq = again.open(p)
            again.close(seq)
    found = [serve(again, p) for p in ps]       # every block it serves is this prompt's KV
    assert sum(sum(f.values()) for f in found) > 0
    again.shutdown()
