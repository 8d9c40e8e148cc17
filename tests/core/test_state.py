"""core/state.py: the owner of block state declares every field once, its parts hold it, and its
surface (and each part's) is the one listed here.

The lists below are the control plane's surfaces on purpose: a method added to the owner or to
a part is a decision this test makes visible. Behaviour is tested where it lives (test_cache,
test_eviction, test_keyed_load_after, test_inflight, test_disk_tier, ...).
"""

from __future__ import annotations

import dataclasses
import inspect
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tiered_cache.core.copies import Copies
from tiered_cache.core.eviction import Space
from tiered_cache.core.index import BlockIndex
from tiered_cache.core.inflight import InFlight
from tiered_cache.core.invariants import check_invariants
from tiered_cache.core.keyed import KeyedTiers
from tiered_cache.core.persist import Persistence
from tiered_cache.core.state import BlockState
from tiered_cache.core.tier import TierSpec
from tiered_cache.hashing import BlockHasher, Namespace
from tiered_cache.policies.lru import LRUPolicy

BS = 4
ROOT = Path(__file__).resolve().parents[2]

OWNER = {
    # sequences
    "open", "append", "begin_write", "end_write", "mark_computed", "close", "invalidate",
    "can_open", "check_open",
    # reads and promotions
    "begin_read", "end_read", "device_slots", "commit_promotion",
    # the node daemon's holds
    "open_blocks", "peek", "held_slots", "known",
    # roots and tenants
    "register_root", "set_tenant",
    # introspection
    "locked", "tier", "tier_name", "lookup", "info", "open_sequences", "stats", "count",
}
PARTS = {
    "copies": (Copies, {"set_slot", "set_slots", "move_copy", "clear_slot", "remap",
                        "drop_if_uncached", "begin_move", "end_move"}),
    "space": (Space, {"room", "check_room", "allocate", "reserve", "reserve_at", "unreserve",
                      "free_slot", "evict", "admits", "turned_away", "take_victims", "recheck",
                      "note_evictions", "take_erasures", "erased", "grow_tier",
                      "finish_shrink", "copy_ended", "wait_for_copies", "copies_hold"}),
    "keyed": (KeyedTiers, {"loadable", "extend", "load_after", "note_skipped", "plan_puts",
                           "forget_puts", "commit_puts"}),
    "persist": (Persistence, {"record_meta", "lend", "unlend", "blocks_in", "adopt",
                              "copies_with_hits", "restore"}),
    "inflight": (InFlight, {"match", "take", "register", "progress", "published", "close"}),
}


def make_index(**kw) -> BlockIndex:
    hasher = BlockHasher(Namespace("tiny", "float32", 2, 2, 8, BS, None))
    specs = [TierSpec("gpu", "gpu", 8), TierSpec("host", "host", 8),
             TierSpec("disk", "disk", 8, persistent=True, sync_target=False)]
    return BlockIndex(specs, policy=lambda n, blocks: LRUPolicy(n, blocks=blocks, block_size=BS),
                      block_size=BS, num_layers=2, hasher=hasher,
                      keyed=[TierSpec("remote", "remote", 0)], **kw)


def public(cls: type) -> set[str]:
    """Methods and properties of `cls` (its bases included) not starting with `_`."""
    return {name for name, v in inspect.getmembers(cls)
            if not name.startswith("_") and (inspect.isfunction(v) or isinstance(v, property))}


def test_the_constructor_sets_every_declared_field():
    idx = make_index(share_inflight=True)
    for f in dataclasses.fields(BlockState):
        getattr(idx, f.name)            # AttributeError if the constructor left it unset


def test_the_block_table_declares_each_column_it_makes():
    """BlockTable's columns come from `_FIELDS` / `_PER_TIER`; its class annotations name
    them for the type checker: the two lists agree, and each column is what is made."""
    from tiered_cache.core.blocks import BlockTable

    made = [name for name, _, _ in (*BlockTable._FIELDS, *BlockTable._PER_TIER)]
    declared = [n for n, a in BlockTable.__annotations__.items() if "array" in str(a)]
    assert declared == made
    t = BlockTable(num_tiers=2, block_size=BS)
    for name, _, _ in BlockTable._PER_TIER:
        assert isinstance(getattr(t, name), list) and len(getattr(t, name)) == 2


@pytest.mark.parametrize("part", [None, *PARTS])
def test_no_undeclared_attribute_can_be_set_on_the_owner_or_a_part(part):
    idx = make_index()
    obj = idx if part is None else getattr(idx, part)
    assert not hasattr(obj, "__dict__")
    with pytest.raises(AttributeError):
        obj.undeclared = 1


def test_each_part_is_held_by_the_owner_and_holds_it():
    idx = make_index()
    for name, (cls, _) in PARTS.items():
        part = getattr(idx, name)
        assert type(part) is cls and part.ix is idx
        for f in dataclasses.fields(cls):
            getattr(part, f.name)


def test_the_owner_surface_is_the_listed_one():
    assert public(BlockIndex) == OWNER
    assert len(OWNER) <= 30


@pytest.mark.parametrize("name", PARTS)
def test_each_part_surface_is_the_listed_one(name):
    cls, surface = PARTS[name]
    assert public(cls) == surface
    assert not surface & OWNER - {"close"}, "a method is on the owner and on a part"


def test_parts_work_together_through_the_owner():
    """One round trip through every part: open (space), publish, demote (copies, persist),
    take the erasures a persistent tier's freed slot waits for (space)."""
    from tiered_cache.core import moves

    idx = make_index()
    seq = idx.open(np.arange(4 * BS, dtype=np.int32))
    idx.mark_computed(seq)
    idx.close(seq)
    plan = moves.plan_demotion(idx, 0, 1, 4)
    assert len(plan) == 4
    moves.commit_demotion(idx, plan, True)
    plan = moves.plan_demotion(idx, 1, 2, 4)
    assert plan and all(tr.meta is not None for tr in plan)      # persist.record_meta
    moves.commit_demotion(idx, plan, True)
    check_invariants(idx)
    assert idx.invalidate(np.arange(4 * BS, dtype=np.int32)) == 4
    assert sorted(idx.space.take_erasures(2)) == sorted(tr.dst_slot for tr in plan)
    check_invariants(idx)


@pytest.mark.slow
def test_importing_the_owner_loads_no_torch():
    code = "import sys, tiered_cache.core.index; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)
