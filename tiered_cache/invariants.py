"""`check_invariants(cache)`: asserts the control plane's invariants (see cache.py's docstring).

O(cached blocks); for tests, stress runs and debugging, never the hot path.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from tiered_cache.block import NO_SLOT, Block

if TYPE_CHECKING:
    from tiered_cache.cache import TieredKVCache


class InvariantError(AssertionError):
    pass


def _fail(msg: str) -> None:
    raise InvariantError(msg)


def check_invariants(cache: TieredKVCache) -> None:
    with cache.locked():
        seqs = cache.open_sequences()
        blocks: dict[int, Block] = {b.id: b for b in cache.index.values()}
        refs: Counter[int] = Counter()
        for seq in seqs:
            failed = any(r.error is not None for r in seq.pending)
            for b in seq.blocks:
                blocks[b.id] = b
                refs[b.id] += 1
                if b.slots[0] == NO_SLOT and not failed:
                    _fail(f"block {b.id} of open sequence {seq.id} has no device copy")
        for tier in cache.tiers:        # blocks dropped while a copy was under way
            for b in tier.owner:
                if b is not None:
                    blocks.setdefault(b.id, b)
        # 2. pin counts equal open users
        for bid, b in blocks.items():
            if b.ref_count != refs[bid]:
                _fail(f"block {bid}: ref_count {b.ref_count} but {refs[bid]} open users")
        # 3. the index names only live, reachable, published blocks
        for key, b in cache.index.items():
            if b.key != key:
                _fail(f"index key of block {b.id} does not match its key")
            if not b.cached:
                _fail(f"published block {b.id} holds no copy")
            if b.parent is not None and cache.index.get(b.parent.key) is not b.parent:
                _fail(f"published block {b.id} has an unpublished parent")
        # 1. every slot free xor held by exactly one block
        for tier in cache.tiers:
            t = tier.index
            owner: dict[int, int] = {}
            pinned = 0
            for b in blocks.values():
                slot = b.slots[t]
                if slot == NO_SLOT:
                    continue
                if slot in owner:
                    _fail(f"tier {tier.name} slot {slot} held by blocks {owner[slot]} and {b.id}")
                owner[slot] = b.id
                if tier.allocator.is_free(slot):
                    _fail(f"tier {tier.name} slot {slot} of block {b.id} is marked free")
                pinned += b.ref_count > 0
            if len(owner) + tier.reserved != tier.allocator.num_used:
                _fail(f"tier {tier.name}: {tier.allocator.num_used} slots used, "
                      f"{len(owner)} held by blocks and {tier.reserved} reserved by copies "
                      "under way (leak)")
            if pinned != tier.pinned_blocks:
                _fail(f"tier {tier.name}: pinned_blocks {tier.pinned_blocks}, counted {pinned}")
            # 4. candidates are exactly the evictable blocks
            n_candidates = 0
            for b in blocks.values():
                kids = sum(1 for c in b.children.values() if c.slots[t] != NO_SLOT)
                if b.key is not None and kids != b.resident_children[t]:
                    _fail(f"block {b.id}: resident_children[{tier.name}] "
                          f"{b.resident_children[t]}, counted {kids}")
                faster = any(s != NO_SLOT for s in b.slots[:t])
                want = (b.key is not None and b.slots[t] != NO_SLOT and b.in_flight == 0
                        and kids == 0 and (b.ref_count == 0 or faster))
                if want != b.candidate[t]:
                    _fail(f"block {b.id}: candidate[{tier.name}]={b.candidate[t]}, expected {want}")
                n_candidates += want
            if n_candidates != len(tier.policy):
                _fail(f"tier {tier.name}: policy holds {len(tier.policy)} candidates, "
                      f"expected {n_candidates}")
