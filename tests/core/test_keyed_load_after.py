"""`BlockIndex.keyed.load_after`: the node daemon's load of blocks a remote store holds into a hold
(`open_blocks`), on the control plane alone (no torch, no server): what it publishes, what
it refuses, the cost model's veto, a failed load, and an interrupt at every line.

The daemon's end to end behaviour (two daemons and a real redis-server) is in
tests/daemon/test_daemon_remote.py.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.test_interrupts import Injector
from tiered_cache.core import atomic
from tiered_cache.core.index import BlockIndex
from tiered_cache.core.invariants import check_invariants
from tiered_cache.core.tier import TierSpec
from tiered_cache.hashing import BlockHasher, Namespace
from tiered_cache.policies.lru import LRUPolicy

BS, LAYERS = 4, 2
REMOTE = 0


def make_index(slots: int = 16, worth=None) -> BlockIndex:
    hasher = BlockHasher(Namespace("tiny", "float32", LAYERS, 2, 8, BS, None))
    return BlockIndex([TierSpec("host", "host", slots, stages_records=True)],
                      policy=lambda n, blocks: LRUPolicy(n, blocks=blocks, block_size=BS),
                      block_size=BS, num_layers=LAYERS, hasher=hasher, verify_tokens=True,
                      keyed=[TierSpec("remote", "remote", 0, staged=False, put_from=0)],
                      worth=worth)


class Promotions:
    """`promote` of the data plane: records plans; `land` commits them as the copy would."""

    def __init__(self) -> None:
        self.plans: list = []

    def __call__(self, plan, readiness) -> None:
        self.plans.append((plan, readiness))

    def land(self, index: BlockIndex, ok: bool = True) -> None:
        for plan, _ in self.plans:
            index.commit_promotion(plan, ok, frozenset() if ok else {t.block for t in plan})
        self.plans.clear()


def setup(blocks: int, start: int = 0, **index_kw):
    """An index, the root of salt "t" (key, id), `blocks` blocks of token ids from `start`, and
    their chained keys from that root."""
    idx = make_index(**index_kw)
    root, rid = idx.register_root(b"t")
    tokens = np.arange(start, start + blocks * BS, dtype=np.int32)
    return idx, root, rid, tokens, idx.hasher.chain(root, tokens)


def test_loads_into_the_hold_and_later_holds_find_them():
    idx, root, rid, tokens, keys = setup(5, 100)
    seq = idx.open_blocks(rid, root, tokens)
    assert seq.blocks == []
    promote = Promotions()
    assert idx.keyed.load_after(seq, REMOTE, root, tokens, keys, promote) == 5
    assert len(idx.held_slots(seq)) == 5 and seq.num_cached_tokens == 5 * BS
    [(plan, _)] = promote.plans
    assert [t.meta.depth for t in plan] == list(range(5))
    assert [t.meta.key for t in plan] == keys
    promote.land(idx)
    check_invariants(idx)
    idx.close(seq)
    check_invariants(idx)
    assert idx.stats()["tiers"]["remote"]["loaded_blocks"] == 5
    # Published: the next hold finds all five locally, after the root or after block 2.
    again = idx.open_blocks(rid, root, tokens)
    assert len(again.blocks) == 5
    idx.close(again)
    tail = idx.open_blocks(rid, keys[1], tokens[2 * BS:])
    assert len(tail.blocks) == 3
    idx.close(tail)
    check_invariants(idx)


def test_continues_a_local_match_with_the_right_depths_and_parents():
    idx, root, rid, tokens, keys = setup(6)
    first = idx.open_blocks(rid, root, tokens[:2 * BS])
    promote = Promotions()
    idx.keyed.load_after(first, REMOTE, root, tokens[:2 * BS], keys[:2], promote)
    promote.land(idx)
    idx.close(first)
    # Blocks 0-1 are local now; the hold after the root takes them and loads 2-5.
    seq = idx.open_blocks(rid, root, tokens)
    assert len(seq.blocks) == 2
    n = idx.keyed.load_after(seq, REMOTE, root, tokens[2 * BS:], keys[2:], promote)
    assert n == 4
    [(plan, _)] = promote.plans
    assert [t.meta.depth for t in plan] == [2, 3, 4, 5]
    assert plan[0].meta.parent == keys[1]
    promote.land(idx)
    idx.close(seq)
    check_invariants(idx)
    whole = idx.open_blocks(rid, root, tokens)
    assert len(whole.blocks) == 6
    idx.close(whole)


def test_refuses_keys_that_are_not_the_chain_of_their_tokens():
    idx, root, rid, tokens, keys = setup(4)
    keys[2] = b"\x00" * 16                          # another block's key
    seq = idx.open_blocks(rid, root, tokens)
    assert idx.keyed.load_after(seq, REMOTE, root, tokens, keys, Promotions()) == 2
    idx.close(seq)
    # A root of another tenant cannot be continued: its parent key is not in this root.
    other_root, other_id = idx.register_root(b"u")
    seq = idx.open_blocks(other_id, other_root, tokens)
    good = idx.hasher.chain(root, tokens)
    assert idx.keyed.load_after(seq, REMOTE, good[0], tokens[BS:], good[1:], Promotions()) == 0
    idx.close(seq)
    check_invariants(idx)


def test_takes_only_what_the_pool_has_room_for():
    idx, root, rid, tokens, keys = setup(8, slots=3)
    seq = idx.open_blocks(rid, root, tokens)
    assert idx.keyed.load_after(seq, REMOTE, root, tokens, keys,
                          Promotions()) == 3
    idx.close(seq)
    check_invariants(idx)


def test_the_cost_model_can_veto_the_load():
    asked = []
    idx, root, rid, tokens, keys = setup(
        3, worth=lambda tier, n, context: asked.append((tier, n, context)) or False)
    seq = idx.open_blocks(rid, root, tokens)
    assert idx.keyed.load_after(seq, REMOTE, root, tokens, keys,
                          Promotions()) == 0
    assert asked == [(1, 3, 0)]                     # keyed tier 0 is tier 1 of the index
    assert idx.stats()["tiers"]["remote"]["skipped_loads"] == 1
    assert seq.blocks == []
    idx.close(seq)
    check_invariants(idx)


def test_a_failed_load_leaves_nothing_published():
    idx, root, rid, tokens, keys = setup(3)
    seq = idx.open_blocks(rid, root, tokens)
    promote = Promotions()
    idx.keyed.load_after(seq, REMOTE, root, tokens, keys, promote)
    promote.land(idx, ok=False)
    assert idx.stats()["tiers"]["remote"]["load_failures"] == 3
    idx.close(seq)
    check_invariants(idx)
    assert not any(idx.known(keys))
    assert idx.tiers[0].allocator.num_free == 16


def test_a_promote_that_raises_rolls_the_load_back():
    idx, root, rid, tokens, keys = setup(3)
    seq = idx.open_blocks(rid, root, tokens)

    def boom(plan, readiness):
        raise RuntimeError("the copy queue is gone")

    with pytest.raises(RuntimeError):
        idx.keyed.load_after(seq, REMOTE, root, tokens, keys, boom)
    idx.close(seq)
    check_invariants(idx)
    assert not any(idx.known(keys))
    assert idx.tiers[0].allocator.num_free == 16


def _attempt(k: int | None):
    # NOTE: SIGINT's handler deferred inside commit sections, as a TieredKVCache installs it
    # when it is built (core/atomic.py): this index is built alone, and the sweep would
    # otherwise depend on whether an earlier test in the same worker had built a cache.
    atomic.install()
    idx, root, rid, tokens, keys = setup(4)
    seq = idx.open_blocks(rid, root, tokens)
    promote = Promotions()
    inj = Injector(k)
    n, interrupted = inj.run(lambda: idx.keyed.load_after(seq, REMOTE, root, tokens, keys, promote))
    return idx, seq, promote, inj, n, interrupted, keys


@pytest.mark.slow
def test_an_interrupt_at_any_line_leaves_the_index_whole():
    idx, seq, promote, inj, n, _, _ = _attempt(None)
    total = inj.n
    assert n == 4 and total > 20
    for k in range(1, total + 1):
        idx, seq, promote, inj, n, interrupted, keys = _attempt(k)
        check_invariants(idx)
        # Loaded, or not at all: every key published has its block in the hold, in flight.
        published = sum(idx.known(keys))
        assert published in (0, 4), (k, inj.where, published)
        promote.land(idx)
        idx.close(seq)
        check_invariants(idx)
        used = idx.tiers[0].allocator.num_used
        assert used == published, (k, inj.where, used, published)
