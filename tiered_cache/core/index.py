"""`BlockIndex`: the one owner of block state (the role of vLLM's `BlockPool`).

It owns the blocks (`BlockTable`), the prefix index (key -> block id), every tier's state
(allocator, policy, slot owners, pinned/busy/reserved counts), the open sequences, the clock,
the counters and the lock. Every change to any of them is one of its methods; moves, resize and
the data plane act through those methods and never write a field themselves. No torch.

Invariants (`check_invariants` asserts them; the stateful property tests after every step):

1. Every slot of every tier is free xor held by exactly one block, or reserved by a copy under
   way (`TierState.reserved`).
2. `ref_count[b]` equals the number of open sequences whose block table holds b.
3. The index names only published blocks that hold at least one copy; a published block's
   parent is published (or it is a root), so every published block is reachable from its root.
4. A block is a candidate of tier t's policy iff it is published, has a copy in t, is not in
   flight, has no child with a copy in t, and is unpinned or also held by a faster tier. So
   victims are always leaves of their tier and never a block an open sequence reads. (Kept by
   `_refresh`, the only place that decides candidacy.)
5. Every block of an open sequence has a copy in the device tier (tier 0), unless its
   promotion failed (its waiters then get TransferError).
6. A block registered as being computed (`share_inflight`, core/inflight.py) is an unpublished
   block of the open sequence that registered it, at the depth it was registered for, and its
   key is not published.

The owner is small on purpose: the request path (open, append, writes, close, invalidate,
reads, the daemon's holds) and introspection are its methods; the rest are its parts, each an
object with declared state and its own surface, reaching the block state through the owner:

- `copies` (core/copies.py): where blocks' copies are (set/move/clear/remap; moves in flight);
- `space` (core/eviction.py): room, allocation, eviction, admission, erasure, a tier's size;
- `keyed` (core/keyed.py): keyed tiers: lookups after a match, loads, puts;
- `persist` (core/persist.py): record identity, restart recovery, the daemon's lent slots;
- `inflight` (core/inflight.py): in-flight prefix sharing (writers and waiters).

Every field they share is declared once, in `BlockState` (core/state.py). The mixins
`BlockTree` (core/tree.py: pins, links, candidacy, promotions) and `BatchOps` (core/batch.py:
the vectorised hot loops of open and close) are methods of the owner itself.

NOTE: public methods take the lock themselves (it is re-entrant) inside a commit section
(core/atomic.py): a SIGINT cannot cut a mutation in half. Methods whose names start with `_`
assume the lock is held (the parts call the owner's: `ix._refresh(b)`), as do the parts'
methods that say so. Everything that can fail (room, allocation, the promotion callback) runs
before the first visible change, or is rolled back.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import cast

import numpy as np

from tiered_cache.core.allocator import SlotAllocator
from tiered_cache.core.atomic import atomic, note_hold, on_tear
from tiered_cache.core.batch import _NO_IDS, BatchOps
from tiered_cache.core.blocks import NO_BLOCK, NO_SLOT, BlockTable
from tiered_cache.core.copies import Copies
from tiered_cache.core.eviction import Run, Space, no_copy
from tiered_cache.core.inflight import InFlight, wake_closed
from tiered_cache.core.keyed import KeyedTiers
from tiered_cache.core.persist import Persistence
from tiered_cache.core.readiness import LayerReadiness
from tiered_cache.core.sequence import BROKEN, Sequence
from tiered_cache.core.state import COUNTERS, BlockState, Counters, Worth
from tiered_cache.core.tier import DEVICE, KeyedState, TierSpec, TierState
from tiered_cache.core.transfer import Transfer
from tiered_cache.core.tree import BlockTree
from tiered_cache.core.wakeup import Wakeup
from tiered_cache.errors import (
    BusySequenceError,
    CacheBrokenError,
    SequenceClosedError,
    ShapeError,
    TransferError,
)
from tiered_cache.hashing import BlockHasher
from tiered_cache.jit import LazyModule
from tiered_cache.locking import HoldStats, TimedLock
from tiered_cache.policies.base import CachePolicy

chains = LazyModule("tiered_cache.core.chains")
"""core/chains.py, imported at first use (tiered_cache/jit.py LazyModule: no numba at import)."""

__all__ = ["COUNTERS", "DEVICE", "BlockIndex", "BlockInfo", "Counters", "Promote", "Worth"]

PolicyFactory = Callable[[int, BlockTable], CachePolicy]
Promote = Callable[[list[Transfer], LayerReadiness], None]


@dataclass(frozen=True)
class BlockInfo:
    """A snapshot of one block's metadata (tests, debugging, the daemon's replies)."""

    id: int
    key: bytes | None
    depth: int
    parent: int
    slots: tuple[int, ...]
    ref_count: int
    in_flight: int
    hits: int
    last_access: int
    candidate: tuple[bool, ...]
    resident_children: tuple[int, ...]
    children: tuple[int, ...]
    pending: bool


def _mutator(fn):
    """Public mutator: runs inside a commit section with the lock held (refused once a section
    was torn, see `_torn`)."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with atomic(), self.lock:
            if self.broken is not None:
                _refuse(self.broken)
            return fn(self, *args, **kwargs)

    return wrapper


def _finisher(fn):
    """The end of something a caller began (a write, a read): runs like a mutator, but is
    never refused, so the caller's `finally` gives back what it holds and its own exception
    (an interrupt) is what it sees. On a torn index it changes nothing but the hold."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        with atomic(), self.lock:
            return fn(self, *args, **kwargs)

    return wrapper


def _refuse(what: str) -> None:
    raise CacheBrokenError(f"the control-plane state may be half changed: a commit section was "
                           f"cut by {what}, which could not be deferred (core/atomic.py); "
                           "this cache refuses every call from now on: build a new one")


class BlockIndex(BatchOps, BlockTree, BlockState):
    __slots__ = ()      # every field is declared in BlockState (core/state.py)

    def __init__(self, specs: list[TierSpec], *, policy: PolicyFactory, block_size: int,
                 num_layers: int, hasher: BlockHasher, block_bytes: int = 0,
                 verify_tokens: bool = True, share_inflight: bool = False,
                 write_through: bool = False,
                 run: Run | None = None, on_pressure: Callable[[], None] | None = None,
                 high_watermark: float = 1.0, keyed: Iterable[TierSpec] = (),
                 worth: Worth | None = None) -> None:
        if not specs:
            raise ValueError("a cache needs at least a device tier")
        self.block_size = block_size
        self.num_layers = num_layers
        self.block_bytes = block_bytes
        self.hasher = hasher
        self.verify_tokens = verify_tokens
        self.write_through = write_through
        self.worth = worth
        # NOTE: every live block holds at least one slot (a private block its device slot, a
        # dropped one the slots its copies still use), so the table never needs more rows
        # than there are slots; it grows anyway if a resize adds slots.
        self.blocks = BlockTable(len(specs), block_size, sum(s.num_slots for s in specs) + 1)
        self.tiers = []
        for i, spec in enumerate(specs):
            self.tiers.append(TierState(spec.name, spec.kind, i, SlotAllocator(spec.num_slots),
                                        policy(spec.num_slots, self.blocks),
                                        persistent=spec.persistent,
                                        sync_target=spec.sync_target,
                                        admit_min_hits=spec.admit_min_hits,
                                        stages_records=spec.stages_records,
                                        zero_copy=spec.zero_copy,
                                        whole_records=spec.whole_records))
        self.prefix = {}
        self.root_keys = {}
        self.pending = {}
        self.open_seqs = {}
        self.clock = 0
        self.counters = Counters()
        self.lock = TimedLock(on_hold=note_hold)
        self.lookups = HoldStats()
        self.readers_done = Wakeup()
        self.broken = None
        on_tear(self._torn)
        self.copies = Copies(self)
        self.space = Space(self, run if run is not None else no_copy, on_pressure,
                           high_watermark)
        # The slot tier a staged keyed tier (remote) lands its loads in before the device.
        stage_tier = next((t.index for t in self.tiers if t.stages_records), None)
        self.keyed = KeyedTiers(self, [KeyedState(spec.name, spec.kind, len(specs) + k, k,
                                                  staged=spec.staged, put_from=spec.put_from,
                                                  whole_records=spec.whole_records)
                                       for k, spec in enumerate(keyed)], stage_tier)
        self.persist = Persistence(self)
        self.inflight = InFlight(self, share_inflight)
        self._bind()
        chains.warm_up(len(specs))

    def _bind(self) -> None:
        """Local aliases of the table's arrays for the hot paths (rebound when it grows)."""
        t = self.blocks
        self._slots, self._kids = t.slots, t.resident_children
        self._ref, self._flight, self._cand = t.ref_count, t.in_flight, t.candidate
        self._parent, self._key = t.parent, t.key

    # ------------------------------------------------------------------ introspection
    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the lock inside a commit section (moves, resize, checks); refused once a
        section was torn."""
        with atomic(), self.lock:
            if self.broken is not None:
                _refuse(self.broken)
            yield

    def _torn(self, what: str) -> None:
        """A commit section was cut by an exception that could not be deferred (core/atomic.py:
        any section of the process; which index it was changing cannot be told): from now on
        every mutator and `locked()` refuse, so nothing is served or moved from a state that
        may be half changed."""
        self.broken = what

    def tier(self, name: str) -> TierState:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(name)

    def lookup(self, key: bytes) -> int | None:
        """Id of the published block with this key, or None."""
        return self.prefix.get(key)

    def info(self, b: int) -> BlockInfo:
        t = self.blocks
        return BlockInfo(b, t.key[b], t.depth[b], t.parent[b], tuple(t.copies(b)),
                         t.ref_count[b], t.in_flight[b], t.hits[b], t.last_access[b],
                         tuple(bool(t.candidate[b] >> i & 1) for i in range(len(self.tiers))),
                         tuple(k[b] for k in t.resident_children), tuple(t.children(b)),
                         b in self.pending)

    def open_sequences(self) -> list[Sequence]:
        return list(self.open_seqs.values())

    def check_open(self, seq: Sequence) -> None:
        if not isinstance(seq, Sequence):
            raise TypeError(f"expected a Sequence from TieredKVCache.open, got "
                            f"{type(seq).__name__}")
        if seq.owner != id(self) or seq.id not in self.open_seqs:
            if seq.closed:
                raise SequenceClosedError(f"sequence {seq.id} is closed")
            raise SequenceClosedError(f"sequence {seq.id} belongs to another cache")

    def count(self, name: str, n: int = 1) -> None:
        """Bump a counter (the data plane reports retries and failures here)."""
        with atomic(), self.lock:
            setattr(self.counters, name, getattr(self.counters, name) + n)

    def stats(self) -> dict:
        with atomic(), self.lock:
            c = self.counters.as_dict()
            q = c["query_tokens"]
            every = self.tiers + self.keyed.tiers
            return {
                **c,
                "hit_rate": c["hit_tokens"] / q if q else 0.0,
                "hit_tokens_by_tier": {t.name: t.hit_tokens for t in every},
                "tiers": {t.name: t.stats() for t in every},
                "lock_hold": self.lock.holds.summary(),
                "lookup": self.lookups.summary(),
                "cached_blocks": len(self.prefix),
                "open_sequences": len(self.open_seqs),
            }

    # ------------------------------------------------------------------ sequences
    @_mutator
    def open(self, tokens: np.ndarray, *, salt: str | bytes | None = None,
             adapter_id: str | None = None, reserve_last: bool = False,
             promote: Promote | None = None) -> Sequence:
        """Start a sequence over `tokens`, reusing the longest cached prefix from any tier.

        The matched blocks are pinned and get device slots; blocks that are only in slower
        tiers are handed to `promote` as a plan (already reserved, in flight, with the
        LayerReadiness their readers wait on), which submits or runs it. Slots for the rest of
        the tokens are allocated. Raises CapacityError (nothing changed) when the device tier
        cannot hold the sequence; an exception from `promote` rolls the open back.
        """
        t0 = time.perf_counter()
        root, root_id = self.hasher.root(salt, adapter_id)
        self.root_keys[root_id] = root
        seq = Sequence(id(self), root, root_id, tokens, self.num_layers, salt, adapter_id)
        matched, ids, joined = self._match_ids(seq)
        shared = self.inflight.match(seq, matched) if self.inflight.enabled else []
        if reserve_last and (len(matched) + len(shared)) * self.block_size >= len(tokens) > 0:
            (shared or matched).pop()
            seq.keys.pop()
        seq.reserve_last = reserve_last
        if self.worth is not None and matched:
            n = len(matched)
            self._trim_slow(seq, matched)
            if len(matched) < n:
                shared = []                 # (their keys went with the trimmed ones)
        # NOTE: the trims above only cut the end of the match, so its id array (and its joined
        # keys) is a prefix.
        if joined is not None:
            joined = joined[:16 * len(matched)]
        return self._start(seq, matched, promote, t0, shared, ids[:len(matched)], joined)

    @_mutator
    def open_blocks(self, root_id: int, parent_key: bytes, tokens: np.ndarray,
                    promote: Promote | None = None) -> Sequence:
        """Pin published blocks that continue the block keyed `parent_key` (the root key: from
        the start), made resident in tier 0: the node daemon's hold on blocks a client is
        copying out. `tokens` are the token ids of the wanted blocks (whole blocks); each is
        verified as in `open` (chained key, parent, token ids, tenant root). The handle holds
        the leading blocks found (`len(seq.blocks)`, maybe 0); close it to let them go."""
        t0 = time.perf_counter()
        root = self.root_keys.get(root_id)
        if root is None:
            raise SequenceClosedError(f"unknown root id {root_id}")
        bs = self.block_size
        seq = Sequence(id(self), root, root_id, tokens, self.num_layers, None, None)
        matched: list[int] = []
        prev = NO_BLOCK
        if parent_key != root:
            prev = self.prefix.get(parent_key, NO_BLOCK)
            t = self.blocks
            if prev == NO_BLOCK or t.root_id[prev] != root_id:
                prev = -2                       # unknown parent: nothing can match
        if prev != -2:
            matched = self._match_after(seq, prev, parent_key)
        asked = seq.num_tokens
        seq.num_tokens = len(matched) * bs      # a hold: no slot for tokens not found
        seq.written = [0] * self.num_layers
        seq = self._start(seq, matched, promote, t0)
        self.counters.query_tokens += asked - seq.num_tokens   # looked up, found or not
        return seq

    def peek(self, root_id: int, parent_key: bytes, tokens: np.ndarray) -> int:
        """How many leading blocks of `tokens` after `parent_key` `open_blocks` would find
        (nothing pinned, nothing counted as a use)."""
        with atomic(), self.lock:
            root = self.root_keys.get(root_id)
            if root is None:
                return 0
            seq = Sequence(id(self), root, root_id, tokens, self.num_layers, None, None)
            prev = NO_BLOCK
            if parent_key != root:
                prev = self.prefix.get(parent_key, NO_BLOCK)
                if prev == NO_BLOCK or self.blocks.root_id[prev] != root_id:
                    return 0
            return len(self._match_after(seq, prev, parent_key))

    def tier_name(self, tier: int) -> str:
        """Name of slot tier `tier`, or of keyed tier `tier - len(tiers)` (as in Transfer)."""
        n = len(self.tiers)
        return self.tiers[tier].name if tier < n else self.keyed.tiers[tier - n].name

    def known(self, keys: list[bytes]) -> list[bool]:
        """Whether each key names a block in the index."""
        with atomic(), self.lock:
            prefix = self.prefix
            return [k in prefix for k in keys]

    def register_root(self, salt: str | bytes | None = None,
                      adapter_id: str | None = None) -> tuple[bytes, int]:
        """(key, id) of the root for this salt and adapter, known to the index from now on
        (the node daemon names roots for its clients; `open` does this itself)."""
        with atomic(), self.lock:
            root, root_id = self.hasher.root(salt, adapter_id)
            self.root_keys[root_id] = root
            return root, root_id

    def set_tenant(self, tenant: bytes) -> None:
        """Key roots under `tenant` from now on (hashing.BlockHasher.set_tenant)."""
        with atomic(), self.lock:
            self.hasher.set_tenant(tenant)

    def held_slots(self, seq: Sequence) -> list[int]:
        """Tier-0 slots of the blocks an `open_blocks` handle holds, in chain order."""
        with atomic(), self.lock:
            self.check_open(seq)
            dev = self._slots[DEVICE]
            return [dev[b] for b in seq.blocks]

    def _match_after(self, seq: Sequence, prev: int, key: bytes) -> list[int]:
        """`_match` continuing the chain after block `prev` (NO_BLOCK: at the root): the key
        match, then its verification (parents, the root at depth 0, token ids) in one pass."""
        bs = self.block_size
        tokens = seq.token_ids
        get = self.prefix.get
        matched: list[int] = []
        keys: list[bytes] = []
        if self.hasher.compiled:
            self._match_keys(key, tokens, 0, keys, matched)
        else:
            nbytes = bs * 4
            data = tokens.tobytes()
            h = self.hasher.hash_fn
            for off in range(0, (len(tokens) // bs) * nbytes, nbytes):
                key = h(key + data[off:off + nbytes])
                b = get(key)
                if b is None:
                    break
                keys.append(key)
                matched.append(b)
        if matched:
            t = self.blocks
            good = chains.verify(np.asarray(matched, dtype=np.intp), t.view("parent"),
                                 t.view("root_id"), t.tokens, tokens, bs, prev, seq.root_id,
                                 self.verify_tokens)
            del matched[good:]
            seq.keys += keys[:good]
        return matched

    def _start(self, seq: Sequence, matched: list[int], promote: Promote | None,
               t0: float, shared: list[int] | None = None,
               ids: np.ndarray | None = None, keys: bytes | None = None) -> Sequence:
        """The rest of `open`: pin the matched blocks, make them resident in tier 0, take the
        `shared` blocks other sequences are computing after them (core/inflight.py), give the
        sequence slots for the tokens after those. `ids`: `matched` as an intp array; `keys`:
        their keys joined, if the match had them."""
        shared = shared if shared is not None else []
        tokens = seq.token_ids
        survey = self._survey(matched, ids)
        promote_ids = survey.promote
        need = (len(promote_ids) + -(-len(tokens) // self.block_size) - len(matched)
                - len(shared))
        # Check room before pinning, so that a refused open leaves even the policies' order
        # untouched: blocks this open would pin stop being evictable.
        busy = 0
        if self.tiers[DEVICE].busy and survey.pinning:
            # NOTE: chain blocks being copied out of the device (a demotion in flight) are
            # busy there, which room already leaves out: not subtracted twice.
            busy = self._busy_pinning(survey)
        self.space.check_room(DEVICE, need, extra_pinned=survey.pinning, busy_pinned=busy)
        self._pin_all(survey)
        try:
            slots = self.space.allocate(DEVICE, need)
        except BaseException:
            self._unpin_survey(survey)
            raise
        plan: list[Transfer] = []
        try:
            if promote_ids:
                readiness = LayerReadiness(self.num_layers, len(promote_ids))
                plan = self._plan_promotion(survey.promote_ids, slots[:len(promote_ids)],
                                            survey.sources, survey.source_slots, readiness)
                if promote is None:
                    self.commit_promotion(plan, True)   # metadata only: nothing to copy
                else:
                    promote(plan, readiness)
        except BaseException:
            # A promotion the callback did not commit (it failed before handing the plan on)
            # is given up here; a committed one already released its device slots.
            if plan and self.pending.get(plan[0].block) is readiness:
                self.commit_promotion(plan, False)
            alloc, owner = self.tiers[DEVICE].allocator, self.tiers[DEVICE].owner
            alloc.free([s for s in slots if not alloc.is_free(s) and owner[s] == NO_BLOCK])
            self._unpin_survey(survey)
            raise
        # A block already on its way (promoted for another sequence) is waited on, not
        # copied again: one in-flight promotion per block.
        pend = self.pending
        if pend:
            seq.pending = list({id(r): r for r in (pend.get(b) for b in matched)
                                if r is not None}.values())
        # ---- nothing below can fail
        self.clock += 1
        served = self._touch(survey, self.clock, keys)
        bs = self.block_size
        by_tier = {}
        for tier, n in zip(self.tiers, served):
            tier.hit_tokens += bs * n
            by_tier[tier.name] = bs * n
        for keyed in self.keyed.tiers:
            by_tier[keyed.name] = 0
        seq.blocks = matched
        seq.match_ids = survey.ids
        seq.chain = matched[-1] if matched else NO_BLOCK
        seq.num_published = len(matched)
        if shared:
            # NOTE: counted as published: the writer publishes them, never this sequence.
            seq.blocks = matched + shared
            seq.chain = shared[-1]
            seq.num_published = len(seq.blocks)
            taken = self.inflight.take(seq, shared, len(matched))
            self.tiers[DEVICE].hit_tokens += taken
            by_tier[self.tiers[DEVICE].name] += taken
        cached = len(seq.blocks) * bs
        self._new_blocks(seq, slots[len(promote_ids):])
        if self.inflight.enabled:
            self.inflight.register(seq)
        seq.num_cached_tokens = cached
        seq.written = [cached] * self.num_layers
        seq.cached_tokens_by_tier = by_tier
        c = self.counters
        c.query_tokens += len(tokens)
        c.collisions += seq.collided
        c.hit_tokens += cached
        self.open_seqs[seq.id] = seq
        self.lookups.observe(time.perf_counter() - t0)
        return seq

    def can_open(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` uncached tokens fits in the device tier now."""
        need = -(-num_tokens // self.block_size)
        with atomic(), self.lock:
            return self.space.room(DEVICE) >= need

    @_mutator
    def append(self, seq: Sequence, tokens: np.ndarray) -> None:
        """Declare the next tokens of a sequence; allocates device slots for new blocks."""
        self.check_open(seq)
        have = len(seq.blocks) * self.block_size
        need = -(-max(0, seq.num_tokens + len(tokens) - have) // self.block_size)
        slots = self.space.allocate(DEVICE, need, hint=self._hint(seq)) if need else []
        seq.extend(tokens)
        self._new_blocks(seq, slots)

    @_mutator
    def begin_write(self, seq: Sequence, layer: int, n: int) -> int:
        """Reserve the next `n` tokens of `layer` for a write; returns the first position.
        The caller copies outside the lock, then calls `end_write` (also on failure)."""
        self.check_open(seq)
        start = seq.written[layer]
        if start + n > seq.num_tokens:
            raise ShapeError(f"write: layer {layer} has {start} of {seq.num_tokens} tokens "
                             f"written; {n} more would pass the declared tokens "
                             "(append them first)")
        if layer in seq.writing:
            raise BusySequenceError(f"write: layer {layer} of sequence {seq.id} is being "
                                    "written by another thread")
        seq.writing.add(layer)
        return start

    @_finisher
    def end_write(self, seq: Sequence, layer: int, start: int, n: int, ok: bool,
                  event: object | None = None) -> list[int]:
        """Finish a write begun by `begin_write`; on success advance the layer and publish the
        blocks that became full in every layer. Returns those fresh blocks. `event`: a device
        event recorded after the copy, for sequences waiting on these blocks."""
        seq.writing.discard(layer)
        if not ok or self.broken is not None:
            return []
        seq.written[layer] = start + n
        if event is not None:
            seq.write_events[layer] = event
        if seq.waiters:
            self.inflight.progress(seq)
        return self._publish_ready(seq)

    @_mutator
    def mark_computed(self, seq: Sequence) -> list[int]:
        """Metadata-only mode: every declared token counts as written in every layer."""
        self.check_open(seq)
        seq.written = [seq.num_tokens] * self.num_layers
        if seq.waiters:
            self.inflight.progress(seq)
        return self._publish_ready(seq)

    def close(self, seq: Sequence, timeout: float | None = None) -> None:
        """Release a sequence: its published blocks stay cached (and become evictable), its
        private blocks are freed. Waits up to `timeout` seconds (None: for ever) for attention
        calls still reading the sequence, then raises BusySequenceError; refuses at once while
        a write is copying."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with atomic(), self.lock:
                if self.broken is not None:
                    return              # torn: nothing is released into a half-changed state
                self.check_open(seq)
                if seq.writing:
                    raise BusySequenceError(f"close: sequence {seq.id} is being written by "
                                            f"another thread (layers {sorted(seq.writing)})")
                if not seq.readers:
                    self._close(seq)
                    return
            # NOTE: a reader's kernel reads these blocks' slots outside the lock; freeing them
            # now would let another request overwrite them under it. Wait outside the lock.
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise BusySequenceError(f"close: sequence {seq.id} is still being read by "
                                        f"{seq.readers} attention call(s)")
            self.readers_done.wait_for(lambda: not seq.readers, left)

    def _close(self, seq: Sequence) -> None:
        self.clock += 1
        t = self.blocks
        blocks = seq.blocks
        if blocks:
            # Leaf first, so ties in recency evict the deepest block of a chain first.
            ids = seq.match_ids
            if len(ids) != len(blocks):
                ids = np.asarray(blocks, dtype=np.intp)
            published = t.view("published")
            every = chains.stamp(ids, published, t.view("last_access"), self.clock) == len(ids)
            if seq.registered or seq.waiters:
                self.inflight.close(seq)
            zero = self._unpin_ids(ids, rev=True)
            # NOTE: only a private block is released here; with every block published (a
            # hit's close) there is none to look for.
            if len(zero) and not every:
                # NOTE: releasing a private block changes no other block's key or flight.
                out = np.empty(len(zero), dtype=np.intp)
                m = chains.releasable(zero, len(zero), published, t.view("in_flight"), out)
                for b in out[:m].tolist():
                    self._release(b)
        elif seq.registered or seq.waiters:
            self.inflight.close(seq)
        seq.blocks = []
        seq.match_ids = _NO_IDS
        seq.closed = True
        del self.open_seqs[seq.id]
        if seq.pending:
            wake_closed(seq)            # a wait on another thread must not outlive the close

    @_mutator
    def invalidate(self, tokens: np.ndarray, *, salt: str | bytes | None = None,
                   adapter_id: str | None = None) -> int:
        """Drop the cached blocks of this prefix and everything cached under them, from every
        tier; returns how many. Blocks open sequences still read leave the index at once and
        are freed when the last one closes."""
        root, root_id = self.hasher.root(salt, adapter_id)
        probe = Sequence(id(self), root, root_id, tokens[:self.block_size], self.num_layers,
                         salt, adapter_id)
        matched = self._match(probe)        # the same verified lookup open() uses
        if not matched:
            return 0
        n = self._drop_subtree(matched[0])
        self.counters.invalidated_blocks += n
        return n

    # ------------------------------------------------------------------ reads
    def device_slots(self, seq: Sequence, first: int, last: int) -> list[int]:
        """Device slots of the sequence's blocks [first, last] (lock held by the caller)."""
        dev = self._slots[DEVICE]
        return [dev[b] for b in seq.blocks[first:last + 1]]

    @_mutator
    def begin_read(self, seqs: list[Sequence], layer: int) -> tuple[list, list[int]]:
        """Block tables of `seqs` for one layer, for a kernel that runs outside the lock.

        Returns (rows, held): per sequence `(slots, tiers, length)`; `held` are blocks whose
        promotion has not landed `layer` yet, read where they are (their slower copy), kept
        in flight until `end_read`. Every sequence counts a reader until `end_read`, so close()
        waits for the kernel instead of freeing slots under it. Raises TransferError (nothing
        held) if a promotion it would read failed."""
        for seq in seqs:
            self.check_open(seq)
        rows: list[tuple[list[int], list[int], int]] = []
        held: list[int] = []
        dev, slots, pend, flight = self._slots[DEVICE], self._slots, self.pending, self._flight
        fastest = self.blocks.fastest_tier
        for seq in seqs:
            s_row, t_row = [], []
            for b in seq.blocks:
                r = pend.get(b)
                if r is not None and r.error is not None:
                    self._unhold(held)
                    raise TransferError(f"promotion of a block of sequence {seq.id} "
                                        f"failed: {r.error}")
                if r is not None and r.ready_layers > layer:
                    # Landed: read the device copy, but hold the block so that a promotion
                    # that fails later cannot free the slot under the kernel.
                    s_row.append(dev[b])
                    t_row.append(DEVICE)
                    flight[b] += 1
                    held.append(b)
                elif r is not None:
                    # NOTE: the fastest copy below the device, the one the promotion reads.
                    src = next((i for i in range(1, len(slots)) if slots[i][b] != NO_SLOT),
                               -1)
                    if src < 0 or not self.tiers[src].zero_copy:
                        # Only a host copy can be read in place; the facade waits for layers
                        # of promotions staged from disk before it builds tables.
                        self._unhold(held)
                        raise TransferError(f"a block of sequence {seq.id} is neither on the "
                                            "device nor in a slower tier")
                    s_row.append(slots[src][b])
                    t_row.append(src)
                    flight[b] += 1
                    held.append(b)
                elif dev[b] == NO_SLOT:
                    self._unhold(held)
                    raise TransferError(f"a block of sequence {seq.id} has no device copy "
                                        f"(fastest copy in tier {fastest(b)})")
                else:
                    s_row.append(dev[b])
                    t_row.append(DEVICE)
            rows.append((s_row, t_row, seq.written[layer]))
        for b in held:
            self._refresh(b)
        for seq in seqs:
            seq.readers += 1
        return rows, held

    def end_read(self, seqs: list[Sequence], held: list[int]) -> None:
        with atomic(), self.lock:
            if self.broken is None:             # (torn: only the readers count goes back)
                self._unhold(held)
            for seq in seqs:
                seq.readers -= 1
        self.readers_done.notify_all()

    def _unhold(self, held: list[int]) -> None:
        flight, ref, key = self._flight, self._ref, self._key
        for b in held:
            flight[b] -= 1
            if key[b] is None and ref[b] == 0 and flight[b] == 0:
                self._release(b)
            else:
                self._refresh(b)
        held.clear()

    # ------------------------------------------------------------------ prefix matching
    def _match(self, seq: Sequence) -> list[int]:
        """`_match_ids` without the id array."""
        return self._match_ids(seq)[0]

    def _match_ids(self, seq: Sequence) -> tuple[list[int], np.ndarray, bytes | None]:
        """Longest run of published blocks that equals the sequence's leading full blocks.

        Keys are computed in rounds (`_match_keys`; block by block without the compiled
        hasher) and only about as far as the first miss: a miss ends the walk, so a 1M-token
        prompt with a short cached prefix hashes about as much as that prefix. Every match
        is then verified: the parent is the block matched before it (the root id at depth 0)
        and, with verify_tokens, the stored token ids equal the request's, so a colliding key
        never returns another prompt's or tenant's KV. Returns the blocks, their ids as an
        intp array (the verification made it; `_start` surveys the chain with it), and their
        keys joined where the match had them (`_match_keys`), else None.
        """
        tokens = seq.token_ids
        bs = self.block_size
        matched: list[int] = []
        keys = seq.keys
        joined = None
        if self.hasher.compiled:
            joined = self._match_keys(seq.root, tokens, 0, keys, matched, seq)
        else:
            get = self.prefix.get
            nbytes = bs * 4
            data = tokens.tobytes()
            key, h = seq.root, self.hasher.hash_fn
            for off in range(0, (len(tokens) // bs) * nbytes, nbytes):
                key = h(key + data[off:off + nbytes])
                b = get(key)
                if b is None:
                    break
                keys.append(key)
                matched.append(b)
        if not matched:
            return matched, _NO_IDS, None
        ids = np.asarray(matched, dtype=np.intp)
        good = self._verified(seq, matched, ids)
        if good < len(matched):
            seq.collided = True     # counted only if the open succeeds
            del matched[good:]
            del keys[good:]
            ids = ids[:good]
            joined = None if joined is None else joined[:16 * good]
        return matched, ids, joined

    _CHUNK = 64
    """Keys computed per compiled call of a match's first round; each later round doubles."""

    def _match_keys(self, key: bytes, tokens: np.ndarray, first: int, keys: list[bytes],
                    matched: list[int], seq: Sequence | None = None) -> bytes | None:
        """The key match of blocks first.. of `tokens` after the block keyed `key`, appended
        to `keys` and `matched`, with the keys computed in compiled rounds
        (`BlockHasher.keys`): 64 blocks, then twice as many each round, so a long prompt with
        a short cached prefix hashes about as far as its match reaches (at most twice, and 64
        blocks).

        NOTE: a round looks up the deepest of its keys first and, when that block is in the
        index, takes the chain above it from the parents (`chains.ancestors`): a published
        block's parent is published (invariant 3), so the whole round hits with one lookup,
        not one per block. The chain is kept only if every block's stored key is the round's
        key at its place (one comparison of the joined keys), exactly what the lookup of
        each key would have found (`prefix[key[b]] == b`); otherwise, and for a round that
        ends in a miss, its keys are looked up one by one up to the first miss. Returns the
        matched blocks' keys joined when every round was taken whole (the policies' chain
        hook reads them: `access_many(keys=)`), else None. With `seq` (whose `keys` these
        are), the round's keys from the miss on are left in `seq.ahead` for publishing."""
        get = self.prefix.get
        key_of = self.blocks.key
        keys_of = self.hasher.keys
        n = len(tokens) // self.block_size
        chunk = self._CHUNK
        joined: list[bytes] | None = []
        while first < n:
            m = min(chunk, n - first)
            kb = keys_of(key, tokens, first, m)
            b = get(kb[16 * m - 16:])
            if b is not None:
                out = np.empty(m, dtype=np.intp)
                if chains.ancestors(self.blocks.view("parent"), b, m, out):
                    ids = out.tolist()
                    found = list(map(key_of.__getitem__, ids))
                    stored = cast("list[bytes]", found)     # (None: checked next)
                    if None not in found and b"".join(stored) == kb:
                        keys += stored
                        matched += ids
                        if joined is not None:
                            joined.append(kb)
                        key = kb[16 * m - 16:]
                        first += m
                        chunk *= 2
                        continue
            add_key, add_block = keys.append, matched.append
            for off in range(0, 16 * m, 16):
                key = kb[off:off + 16]
                b = get(key)
                if b is None:
                    if seq is not None:
                        seq.ahead, seq.ahead_at = kb[off:], first + off // 16
                    return None if joined is None else b"".join(joined)
                add_key(key)
                add_block(b)
                joined = None
            first += m
            chunk *= 2
        return None if joined is None else b"".join(joined)

    def _verified(self, seq: Sequence, matched: list[int], ids: np.ndarray,
                  data: bytes | None = None) -> int:
        """How many leading blocks of a key match really are the request's: each one's parent
        is the block before it (the first a root of this namespace and salt) and, with
        verify_tokens, its stored token ids equal the request's. `data`: the request's token
        ids as int32 bytes (at least the matched blocks'), if the caller has them."""
        t = self.blocks
        return chains.verify(ids, t.view("parent"), t.view("root_id"), t.tokens,
                             seq.token_ids, self.block_size, NO_BLOCK, seq.root_id,
                             self.verify_tokens)

    # ------------------------------------------------------------------ publishing
    def _publish_ready(self, seq: Sequence) -> list[int]:
        """Publish the sequence's blocks that are now full in every layer; returns them."""
        ready = seq.num_written // self.block_size
        if ready <= seq.num_published:
            return []
        t = self.blocks
        bs = self.block_size
        tokens = seq.token_ids
        data = tokens.tobytes()
        nbytes = bs * 4
        key_of, parents, roots, born, last = t.key, t.parent, t.root_id, t.inserted_at, \
            t.last_access
        published, cand, ref = t.published, self._cand, self._ref
        kids0, dev, lower = self._kids[0], self._slots[DEVICE], self._slots[1:]
        prefix, h, keys, clock = self.prefix, self.hasher.hash_fn, seq.keys, self.clock
        first = seq.num_published
        if first == seq.awaiting and key_of[seq.chain] is None and ref[seq.chain] > 1:
            # NOTE: under blocks another sequence is still computing (core/inflight.py): wait
            # for it to publish them (it publishes ours then), or stay private if it never does.
            return []
        ahead, skip = seq.ahead, len(keys) - seq.ahead_at
        if len(keys) < ready and 0 <= skip < len(ahead) // 16:
            # the match's keys past its miss (`_match_keys`): not computed twice. (Read in
            # place: a long prompt published a chunk at a time copies none of them again.)
            end = min(len(ahead) // 16, ready - seq.ahead_at)
            keys += [ahead[off:off + 16] for off in range(16 * skip, 16 * end, 16)]
            if end == len(ahead) // 16:
                seq.ahead = b""             # all taken
        key, add_key = (keys[-1] if keys else seq.root), keys.append
        if len(keys) < ready and self.hasher.compiled:
            kb = self.hasher.keys(key, tokens, len(keys), ready - len(keys))
            keys += [kb[off:off + 16] for off in range(0, len(kb), 16)]
        for off in range(len(keys) * nbytes, ready * nbytes, nbytes):
            key = h(key + data[off:off + nbytes])
            add_key(key)
        parent = seq.chain if first else NO_BLOCK
        if ready - first >= 2 and parent != BROKEN and (parent == NO_BLOCK
                                                         or key_of[parent] is not None):
            run = keys[first:ready]
            # NOTE: distinct too: a hash that collides within the run must meet the scalar
            # path's collision handling, not overwrite its own first block's entry. (The
            # index maps keys to ids, never to None: disjoint keys are keys not found.)
            if prefix.keys().isdisjoint(run) and len(set(run)) == len(run):
                chain = self._publish_chain(seq, first, ready, parent)
                if self.inflight.registry or seq.waiters:
                    chain += self.inflight.published(seq, first, ready)
                return chain
        fresh: list[int] = []
        rows: list[int] = []            # published blocks, and their positions: token ids
        at: list[int] = []              # are stored in one vectorised copy at the end
        for i in range(first, ready):
            b = seq.blocks[i]
            key = keys[i]
            # `chain` is the published block standing for block i-1: the sequence's own, or an
            # equal one another sequence published first. NO_BLOCK at depth 0; BROKEN after a
            # block that could not be published.
            parent = seq.chain if i else NO_BLOCK
            if parent == BROKEN or (parent != NO_BLOCK and key_of[parent] is None):
                seq.chain = BROKEN  # below a block that could not be published: stays private
                continue
            existing = prefix.get(key)
            if existing is not None:
                self._met_published(seq, i, b, existing, parent)
                continue
            key_of[b] = key
            published[b] = 1
            rows.append(b)
            at.append(i)
            parents[b] = parent
            roots[b] = seq.root_id
            born[b] = last[b] = clock
            prefix[key] = b
            if parent != NO_BLOCK:
                self._link(parent, b)
                if dev[b] != NO_SLOT:
                    kids0[parent] += 1
                for j, s in enumerate(lower, 1):
                    if s[b] != NO_SLOT:
                        self._kids[j][parent] += 1
                # NOTE: a new resident child can only end the parent's candidacy.
                if cand[parent]:
                    self._refresh(parent)
            # NOTE: a block the sequence pins with no copy below the device (a block of its
            # own always is) cannot be a candidate anywhere: nothing to tell the policies.
            if not ref[b] or any(s[b] != NO_SLOT for s in lower):
                self._refresh(b)
            fresh.append(b)
            seq.chain = b
        if rows:
            t.tokens[np.asarray(rows, dtype=np.intp)] = \
                tokens[:ready * bs].reshape(ready, bs)[np.asarray(at, dtype=np.intp)]
        seq.num_published = ready
        if self.inflight.registry or seq.waiters:
            fresh += self.inflight.published(seq, first, ready)
        return fresh

    def _met_published(self, seq: Sequence, i: int, b: int, existing: int,
                       parent: int) -> None:
        """Block i of `seq` (its own block b) has the key of a published block."""
        t = self.blocks
        bs = self.block_size
        same = (t.parent[existing] == parent
                and np.array_equal(t.tokens[existing], seq.token_ids[i * bs:(i + 1) * bs])
                and (parent != NO_BLOCK or t.root_id[existing] == seq.root_id))
        if same:
            self.counters.duplicates += 1
        else:
            self.counters.collisions += 1
        seq.chain = BROKEN
        if (same and existing not in self.pending and self._slots[DEVICE][existing] != NO_SLOT
                and not seq.readers and self._ref[b] == 1):
            # NOTE: an equal block another sequence published first, readable on the device:
            # use it instead of ours (pinned like any block of ours) and free ours, so the
            # rest of the chain publishes under it. Otherwise the rest stays private: a parent
            # we do not pin could vanish under us. Not while an attention call reads this
            # sequence (it may read our slot), nor while another sequence shares our block.
            self._pin(existing)
            seq.blocks[i] = existing
            self._unpin(b)
            self._release(b)
            seq.chain = existing

    def _trim_slow(self, seq: Sequence, matched: list[int]) -> None:
        """Drop the matched blocks that only a slow tier holds (disk) when loading them would
        take longer than recomputing them (the cost model): a miss, never a stall.

        NOTE: leaves leave each tier first, so the blocks only a slower tier holds are a
        suffix of the match."""
        fastest = self.blocks.fastest_tier
        tiers = self.tiers
        i = len(matched)
        while i and tiers[fastest(matched[i - 1])].persistent:
            i -= 1
        if i == len(matched):
            return
        tier = fastest(matched[i])
        if self.worth is not None and not self.worth(tier, len(matched) - i, i):
            del matched[i:]
            del seq.keys[i:]
            self.counters.skipped_loads += 1

    # ------------------------------------------------------------------ new blocks
    def _hint(self, seq: Sequence) -> int | None:
        if seq.blocks and self._slots[DEVICE][seq.blocks[-1]] != NO_SLOT:
            return self._slots[DEVICE][seq.blocks[-1]] + 1
        return None

    def _new_blocks(self, seq: Sequence, slots: list[int]) -> None:
        """Private blocks for the sequence's uncached tokens, already holding device slots."""
        if not slots:
            return
        t = self.blocks
        tier = self.tiers[DEVICE]
        ids, at = t.new_run_ids(len(seq.blocks), len(slots), 1)
        if at is None:
            dev, owner = self._slots[DEVICE], tier.owner
            for b, slot in zip(ids, slots):
                dev[b] = slot
                owner[slot] = b
        else:
            where = np.asarray(slots, dtype=np.intp)
            t.view("slots", DEVICE)[at] = where
            # NOTE: a view of the owner map only for this call: the map grows with the tier
            # (an array cannot be resized while a view of it lives).
            np.frombuffer(tier.owner, dtype=np.int32)[where] = at
        seq.blocks.extend(ids)
        tier.pinned_blocks += len(slots)

