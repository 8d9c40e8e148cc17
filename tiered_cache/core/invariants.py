"""`check_invariants(index)`: asserts the control plane's invariants (core/index.py lists them).

O(blocks + slots); for tests, stress runs and debugging, never the hot path. Accepts a
`BlockIndex` or anything with an `index` attribute holding one (the cache facade).
"""

from __future__ import annotations

from collections import Counter

from tiered_cache.core.blocks import NO_BLOCK, NO_SLOT
from tiered_cache.core.index import BlockIndex


class InvariantError(AssertionError):
    pass


def _fail(msg: str) -> None:
    raise InvariantError(msg)


def check_invariants(target) -> None:
    idx: BlockIndex = target if isinstance(target, BlockIndex) else target.index
    with idx.locked():
        t = idx.blocks
        live = t.live_ids()
        live_set = set(live)
        if len(live) != t.num_live:
            _fail(f"block table: {t.num_live} live rows counted, {len(live)} found")
        refs: Counter[int] = Counter()
        for seq in idx.open_sequences():
            failed = any(r.error is not None for r in seq.pending)
            head = seq.match_ids.tolist()
            if seq.blocks[:len(head)] != head:
                _fail(f"open sequence {seq.id}: blocks {seq.blocks[:len(head)]} no longer "
                      f"start with the ids its open matched ({head})")
            for b in seq.blocks:
                if b not in live_set:
                    _fail(f"open sequence {seq.id} holds freed block {b}")
                refs[b] += 1
                if t.slots[0][b] == NO_SLOT and not failed:
                    _fail(f"block {b} of open sequence {seq.id} has no device copy")
        # 2. pin counts equal open users
        for b in live:
            if t.ref_count[b] != refs[b]:
                _fail(f"block {b}: ref_count {t.ref_count[b]} but {refs[b]} open users")
        # 3. the index names only live, reachable, published blocks
        for key, b in idx.prefix.items():
            if b not in live_set:
                _fail(f"index names freed block {b}")
            if t.key[b] != key:
                _fail(f"index key of block {b} does not match its key")
            if not t.is_cached(b):
                _fail(f"published block {b} holds no copy")
            p = t.parent[b]
            pkey = t.key[p] if p != NO_BLOCK else None
            if p != NO_BLOCK and (pkey is None or idx.prefix.get(pkey) != p):
                _fail(f"published block {b} has an unpublished parent")
        for b in live:
            bkey = t.key[b]
            if bkey is not None and idx.prefix.get(bkey) != b:
                _fail(f"block {b} has a key but is not in the index")
            if t.key[b] is None and (t.first_child[b] != NO_BLOCK or t.parent[b] != NO_BLOCK):
                _fail(f"unpublished block {b} keeps tree links")
            if t.key[b] is None and t.ref_count[b] == 0 and t.in_flight[b] == 0:
                _fail(f"block {b}: unpublished, unused and not in flight, but not freed")
        for b in idx.pending:
            if b not in live_set or t.in_flight[b] == 0:
                _fail(f"pending promotion of block {b}, which is not in flight")
        # 6. blocks being computed (core/inflight.py): an open writer's own unpublished block
        for key, (b, writer, depth) in idx.inflight.registry.items():
            if writer.closed or writer.id not in {q.id for q in idx.open_sequences()}:
                _fail(f"in-flight block {b} registered by closed sequence {writer.id}")
            if depth >= len(writer.blocks) or writer.blocks[depth] != b or t.key[b] is not None:
                _fail(f"in-flight block {b} is not sequence {writer.id}'s unpublished block "
                      f"{depth}")
            if key in idx.prefix:
                _fail(f"in-flight block {b}'s key is also published")
        # 1. every slot free xor held by exactly one block (or reserved)
        for tier in idx.tiers:
            i = tier.index
            owner: dict[int, int] = {}
            pinned = 0
            for b in live:
                slot = t.slots[i][b]
                if slot == NO_SLOT:
                    continue
                if slot in owner:
                    _fail(f"tier {tier.name} slot {slot} held by blocks {owner[slot]} and {b}")
                owner[slot] = b
                if tier.allocator.is_free(slot):
                    _fail(f"tier {tier.name} slot {slot} of block {b} is marked free")
                if tier.owner[slot] != b:
                    _fail(f"tier {tier.name} slot {slot}: owner map says {tier.owner[slot]}, "
                          f"block {b} holds it")
                pinned += t.ref_count[b] > 0
            if len(owner) + tier.reserved != tier.allocator.num_used:
                _fail(f"tier {tier.name}: {tier.allocator.num_used} slots used, "
                      f"{len(owner)} held by blocks and {tier.reserved} reserved by copies "
                      "under way (leak)")
            if pinned != tier.pinned_blocks:
                _fail(f"tier {tier.name}: pinned_blocks {tier.pinned_blocks}, counted {pinned}")
            # copies of blocks being moved are busy, exactly those (room never counts them)
            busy = [b for b in live if t.busy_tiers[b] >> i & 1]
            if len(busy) != tier.busy:
                _fail(f"tier {tier.name}: busy {tier.busy}, but {len(busy)} blocks being moved "
                      "have a copy here")
            for b in busy:
                if t.slots[i][b] == NO_SLOT or t.in_flight[b] == 0:
                    _fail(f"block {b}: busy in tier {tier.name} without a copy there in flight")
            # 4. candidates are exactly the evictable blocks
            n_candidates = 0
            for b in live:
                kids = sum(1 for c in t.children(b) if t.slots[i][c] != NO_SLOT)
                if t.key[b] is not None and kids != t.resident_children[i][b]:
                    _fail(f"block {b}: resident_children[{tier.name}] "
                          f"{t.resident_children[i][b]}, counted {kids}")
                faster = any(t.slots[j][b] != NO_SLOT for j in range(i))
                want = (t.key[b] is not None and t.slots[i][b] != NO_SLOT
                        and t.in_flight[b] == 0 and kids == 0
                        and (t.ref_count[b] == 0 or faster))
                if want != bool(t.candidate[b] >> i & 1):
                    _fail(f"block {b}: candidate[{tier.name}]="
                          f"{bool(t.candidate[b] >> i & 1)}, expected {want}")
                n_candidates += want
            if n_candidates != tier.num_candidates():
                _fail(f"tier {tier.name}: policy holds {tier.num_candidates()} candidates, "
                      f"expected {n_candidates}")
