"""Keyed tiers (a shared store: Redis, Valkey) in the control plane (part of `BlockIndex`).

A keyed tier has no slots: the control plane never knows what it holds. After `open()` has
matched what the local tiers hold, the facade asks the store (outside the lock, under a hard
deadline) which of the next blocks it has; `extend` then turns that many of the sequence's
fresh private blocks into blocks *being loaded*: published under their keys, pinned, in flight,
with a plan that fetches each record into a host staging slot (verified) and copies it to the
block's device slot layer by layer, like a promotion. Another sequence that matches them waits
on the same readiness. A load that fails (the server evicted the value meanwhile, it failed
verification, the server went away) fails the promotion: its waiters get TransferError and
the blocks, which then hold no valid copy, leave the index.

Writing to the store (`plan_puts`) copies blocks that have a host copy, in the background;
`BlockTable.stored` remembers what this process has put, so a block is put once.

A part of `BlockIndex` (`index.keyed`, core/index.py), reaching the block state through its
owner `ix`. `extend` and `load_after` take the lock; `_begin_load` assumes it is held.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from tiered_cache.core.atomic import atomic
from tiered_cache.core.blocks import NO_BLOCK, NO_SLOT
from tiered_cache.core.readiness import LayerReadiness
from tiered_cache.core.sequence import Sequence
from tiered_cache.core.tier import DEVICE, KeyedState
from tiered_cache.core.transfer import RecordMeta, Transfer
from tiered_cache.errors import CapacityError

if TYPE_CHECKING:
    from tiered_cache.core.index import BlockIndex


@dataclass(slots=True, eq=False, repr=False)
class KeyedTiers:
    ix: BlockIndex                  # the owner: block state, `space`, `copies`, `inflight`
    tiers: list[KeyedState]         # the keyed tiers; transfers name tier k as len(ix.tiers) + k
    stage_tier: int | None          # the slot tier a staged tier's loads land in (host), if any

    def loadable(self, seq: Sequence) -> tuple[int, bytes, int]:
        """(first block a keyed tier could add, key of the block before it (the root key at
        depth 0), how many full blocks follow) for a sequence `open` just returned; (0, b"", 0)
        when there is nothing to look up. Lock held by the caller or not: reads the handle."""
        ix = self.ix
        bs = ix.block_size
        m = seq.num_cached_tokens // bs
        full = seq.num_tokens // bs
        if seq.reserve_last and full * bs >= seq.num_tokens:
            full -= 1               # the last token stays for the engine to compute
        if full <= m or any(w != m * bs for w in seq.written):
            return 0, b"", 0
        last = seq.keys[m - 1] if m else seq.root
        return m, last, full - m

    def extend(self, seq: Sequence, tier: int, keys: list[bytes], promote,
               slots: list[int] | None = None, ticket: int = 0) -> int:
        """Blocks [m, m + len(keys)) of `seq` (m: its cached blocks) are in keyed tier `tier`
        (`keys`: their chained keys, from `loadable`): load them. Returns how many are now
        counted as cached (fewer when the sequence moved on, a key was published meanwhile,
        or the host tier has no room to stage them): the rest stay the sequence's to compute.
        `promote` hands the plan on, as in `open`. For an unstaged tier (the node daemon)
        `slots` are where the blocks lie in its pool and `ticket` the hold that keeps them
        there; each transfer carries both, and the tier's handler releases the hold."""
        ix = self.ix
        with atomic(), ix.lock:
            ix.check_open(seq)
            bs = ix.block_size
            m = seq.num_cached_tokens // bs
            if m != seq.num_published or any(w != m * bs for w in seq.written):
                return 0                # written since: those tokens are its own now
            t = ix.blocks
            prefix = ix.prefix
            n = 0
            for key in keys:
                i = m + n
                if (i >= len(seq.blocks) or key in prefix or t.key[seq.blocks[i]] is not None
                        or ix._ref[seq.blocks[i]] != 1):
                    break               # (ref > 1: another sequence waits on us computing it)
                n += 1
            keyed = self.tiers[tier]
            staged = keyed.staged
            if slots is not None:
                n = min(n, len(slots))
            host = self.stage_tier
            if not n or (staged and (host is None or ix.space.room(host) < n)):
                return 0
            parent = seq.chain if m else NO_BLOCK
            if m and (parent < 0 or t.key[parent] is None):
                return 0                # a block before these is not published (yet)
            try:
                stage = ix.space.reserve(host, n)[::-1] if staged and host is not None else []
            except CapacityError:
                # NOTE: room counted slots that copies under way hold: a load is an extra, so
                # the sequence computes these tokens itself (a miss), never a refused open.
                return 0
            self._begin_load(seq, keyed, m, parent, keys[:n], promote, stage, slots, ticket)
            return n

    def load_after(self, seq: Sequence, tier: int, parent_key: bytes, tokens: np.ndarray,
                   keys: list[bytes], promote) -> int:
        """The node daemon's `extend`. The hold `seq` (BlockIndex.open_blocks after
        `parent_key`) took what the local tiers have; the next blocks, `tokens` (whole blocks)
        with chained keys `keys`, are in unstaged keyed tier `tier` (a remote store): give the
        hold new tier-0 slots for as many as there is room for and load them there. Returns how
        many blocks the hold gained (a key published meanwhile, or one that is not the chained
        hash of its tokens, ends the run)."""
        ix = self.ix
        with atomic(), ix.lock:
            ix.check_open(seq)
            keyed = self.tiers[tier]
            t = ix.blocks
            prefix = ix.prefix
            bs = ix.block_size
            m = len(seq.blocks)
            if keyed.staged or m != seq.num_published or seq.num_tokens != m * bs:
                return 0
            if m:
                parent, last = seq.blocks[-1], t.key[seq.blocks[-1]]
                assert last is not None         # (m == num_published: it is published)
                key = last
            elif parent_key == ix.root_keys[seq.root_id]:
                parent, key = NO_BLOCK, parent_key
            else:
                parent, key = prefix.get(parent_key, NO_BLOCK), parent_key
                if parent == NO_BLOCK or t.root_id[parent] != seq.root_id:
                    return 0
            limit = min(len(keys), ix.space.room(DEVICE))
            # NOTE: the keys are the caller's; each is checked against its tokens so that no
            # key can be published over another block's tokens.
            mine = ix.hasher.chain(key, tokens[:limit * bs])
            n = 0
            while n < len(mine) and mine[n] == keys[n] and mine[n] not in prefix:
                n += 1
            if not n:
                return 0
            depth = t.depth[parent] + 1 if parent != NO_BLOCK else 0
            if ix.worth is not None and not ix.worth(keyed.index, n, depth):
                keyed.skipped += 1      # recomputing them is cheaper: a miss
                return 0
            try:
                slots = ix.space.allocate(DEVICE, n)
            except CapacityError:
                return 0                # (as in `extend`: a miss, the engine computes them)
            # ---- nothing below fails but the hand-over (promote), which unwinds itself
            dev, owner = ix._slots[DEVICE], ix.tiers[DEVICE].owner
            for j, slot in enumerate(slots):
                b = t.new(depth + j, 1)
                dev[b] = slot
                owner[slot] = b
                seq.blocks.append(b)
            ix.tiers[DEVICE].pinned_blocks += n
            seq.extend(np.asarray(tokens[:n * bs], dtype=np.int32))
            self._begin_load(seq, keyed, m, parent, keys[:n], promote, [], None, 0)
            return n

    def _begin_load(self, seq: Sequence, keyed, m: int, parent: int, keys: list[bytes],
                    promote, stage: list[int], slots: list[int] | None, ticket: int) -> None:
        """Publish `seq`'s private blocks [m, m + len(keys)) under `keys` as blocks being
        loaded from `keyed` after block `parent` (NO_BLOCK: the root), and hand the plan to
        `promote`: through the host staging slots `stage` (popped from the end) for a staged
        tier; straight into their tier-0 slots otherwise, from the tier's `slots` (None: the
        tier has none, a remote store) under `ticket`. Lock held."""
        ix = self.ix
        t = ix.blocks
        prefix = ix.prefix
        n = len(keys)
        blocks = seq.blocks[m:m + n]
        host = self.stage_tier
        readiness = LayerReadiness(ix.num_layers, n)
        readiness.zero_copy = False
        root = ix.root_keys[seq.root_id]
        dev = ix._slots[DEVICE]
        plan: list[Transfer] = []
        tokens = seq.token_ids
        bs = ix.block_size
        for j, b in enumerate(blocks):
            i = m + j
            key = keys[j]
            t.key[b] = key
            t.published[b] = 1
            t.tokens[b] = tokens[i * bs:(i + 1) * bs]
            t.parent[b] = parent
            t.root_id[b] = seq.root_id
            t.inserted_at[b] = t.last_access[b] = ix.clock
            t.stored[b] |= 1 << keyed.position      # it came from there
            prefix[key] = b
            if parent != NO_BLOCK:
                ix._link(parent, b)
                ix._kids[DEVICE][parent] += 1
                if ix._cand[parent]:
                    ix._refresh(parent)
            if i < len(seq.keys):
                seq.keys[i] = key       # (computed at open: core/inflight.py)
            else:
                seq.keys.append(key)
            pkey = t.key[parent] if parent != NO_BLOCK else root
            assert pkey is not None       # (a parent of a published block is published)
            meta = RecordMeta(key, pkey, root, t.depth[b], t.token_bytes(b), 0)
            if stage and host is not None:      # (staged: host is the stage tier)
                h = stage.pop()
                plan.append(Transfer(b, keyed.index, NO_SLOT, host, h, meta=meta))
                plan.append(Transfer(b, host, h, DEVICE, dev[b]))
            else:
                plan.append(Transfer(b, keyed.index, slots[j] if slots is not None else NO_SLOT,
                                     DEVICE, dev[b], meta=meta, ticket=ticket))
            ix.pending[b] = readiness
            ix._flight[b] += 1
            ix._refresh(b)
            parent = b
        try:
            promote(plan, readiness)
        except BaseException:
            if ix.pending.get(blocks[0]) is readiness:
                ix.commit_promotion(plan, False)
            raise
        cached = (m + n) * bs
        seq.num_cached_tokens = cached
        seq.num_published = m + n
        seq.chain = blocks[-1]
        seq.written = [cached] * ix.num_layers
        seq.pending.append(readiness)
        seq.cached_tokens_by_tier[keyed.name] = \
            seq.cached_tokens_by_tier.get(keyed.name, 0) + n * bs
        keyed.hit_tokens += n * bs
        keyed.loads += n
        ix.counters.hit_tokens += n * bs
        if ix.inflight.registry:
            ix.inflight.published(seq, m, m + n)

    def note_skipped(self, tier: int) -> None:
        """A lookup was not made, or its blocks not loaded: recomputing was cheaper."""
        ix = self.ix
        with atomic(), ix.lock:
            self.tiers[tier].skipped += 1

    def plan_puts(self, blocks: list[int], tier: int) -> list[Transfer]:
        """Copies of published blocks into keyed tier `tier` from its `put_from` slot tier,
        for those not put yet, parents first (each source copy is held in flight until
        `commit_puts`)."""
        ix = self.ix
        with atomic(), ix.lock:
            keyed = self.tiers[tier]
            src = keyed.put_from
            if src is None or ix.broken is not None:    # read only, or torn (core/atomic.py)
                return []
            t = ix.blocks
            bit = 1 << keyed.position
            have = ix._slots[src]
            plan = []
            todo = dict.fromkeys(blocks)
            for b in blocks:
                # NOTE: a block is only taken where its parent is, so ancestors not put yet
                # (their put failed, or the store lost them: a daemon restart) go first.
                p = t.parent[b]
                while p != NO_BLOCK and p not in todo and not t.stored[p] & bit \
                        and have[p] != NO_SLOT:
                    todo[p] = None
                    p = t.parent[p]
            for b in sorted(todo, key=t.depth.__getitem__):
                if t.key[b] is None or have[b] == NO_SLOT or t.stored[b] & bit \
                        or t.in_flight[b]:
                    continue
                plan.append(Transfer(b, src, have[b], keyed.index, NO_SLOT, keep=True,
                                     meta=ix.persist.record_meta(b)))
                ix.copies.begin_move(b)
            return plan

    def forget_puts(self, tier: int) -> None:
        """Keyed tier `tier` lost what it held (the node daemon restarted): every block may
        be put there again."""
        ix = self.ix
        with atomic(), ix.lock:
            bit = 1 << self.tiers[tier].position
            stored = ix.blocks.view("stored")
            stored &= np.uint8(0xFF ^ bit)

    def commit_puts(self, plan: list[Transfer], tier: int, ok: bool) -> None:
        ix = self.ix
        with atomic(), ix.lock:
            keyed = self.tiers[tier]
            bit = 1 << keyed.position
            for tr in plan:
                if ok:
                    ix.blocks.stored[tr.block] |= bit
                    keyed.puts += 1
                ix.copies.end_move(tr.block)


def leading(hits: list[bool]) -> int:
    """How many of the first entries are True."""
    arr = np.asarray(hits, dtype=bool)
    return int(arr.argmin()) if not arr.all() else len(arr)
