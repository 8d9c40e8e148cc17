"""`TieredKVCache`: the public facade over the prefix index, the tiers and their storage.

Invariants (checked by the stateful property tests after every step):

1. Every slot of every tier is free xor held by exactly one block.
2. `block.ref_count` equals the number of open sequences whose block table holds the block.
3. The index names only published blocks that hold at least one copy; a published block's parent
   is published (or it is a root), so every published block is reachable from its root.
4. A block is a candidate of tier t's policy iff it is published, has a copy in t, is not in
   flight, has no child with a copy in t, and is unpinned or also held by a faster tier. So
   victims are always leaves of their tier and never a block an open sequence reads.
5. Every block of an open sequence has a copy in the device tier (tier 0).

NOTE: one re-entrant lock guards the control plane. Public calls validate their input before
they take it, and every step that can fail (allocation, copies) runs before the first visible
change, or is rolled back, so a raised error leaves the cache as it was.
"""

from __future__ import annotations

import atexit
import itertools
import threading
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np

from tiered_cache import moves, policies
from tiered_cache.allocator import SlotAllocator
from tiered_cache.block import NO_SLOT, Block
from tiered_cache.config import CacheConfig
from tiered_cache.errors import (
    BusySequenceError,
    CapacityError,
    DTypeError,
    LayerError,
    SequenceClosedError,
    ShapeError,
    StorageDisabledError,
    TransferError,
)
from tiered_cache.hashing import BlockHasher, HashFn, Namespace, as_token_array, xxh3_128
from tiered_cache.locking import HoldStats, TimedLock
from tiered_cache.sequence import Sequence
from tiered_cache.sizing import resolve_device, tier_num_blocks
from tiered_cache.tier import Tier
from tiered_cache.transfer import Transfer, execute

GPU, HOST = 0, 1


class TieredKVCache:
    """A KV cache whose blocks live in a device tier and a host tier, shared across requests.

    ```
    with TieredKVCache(CacheConfig.from_yaml("configs/default.yaml")) as cache:
        seq = cache.open(prompt_ids)          # longest cached prefix, pinned
        for layer in range(L):                # KV of the uncached tokens only
            cache.write(seq, layer, k, v)
        k, v = cache.gather(seq, layer)
        cache.close(seq)                      # full blocks stay cached and evictable
    ```
    """

    def __init__(self, config: CacheConfig | None = None, *, registry=None,
                 hash_fn: HashFn = xxh3_128) -> None:
        self.config = config = config if config is not None else CacheConfig.default()
        model = config.model
        self.block_size: int = int(config.block_size)
        self.num_layers = model.num_layers
        self.num_kv_heads = model.num_kv_heads
        self.head_dim = model.head_dim
        self.has_storage = config.storage == "tensors"
        self.device = resolve_device(config.tiers.gpu.device) if self.has_storage else "cpu"
        self.block_bytes = config.block_bytes
        self.hasher = BlockHasher(
            Namespace(model.name, model.dtype, model.num_layers, model.num_kv_heads,
                      model.head_dim, self.block_size, config.adapter_id), hash_fn)
        self.verify_tokens = config.verify_tokens
        self.write_through = config.write_policy == "write_through"
        self.tiers = self._build_tiers(config)
        self.index: dict[bytes, Block] = {}
        self._lock = TimedLock()
        self._resize_lock = threading.Lock()    # one resize at a time (see resize.py)
        self.lookups = HoldStats()      # open(): prefix match + pin + reserve, per call
        self._clock = 0
        self._block_ids = itertools.count()
        self._open: dict[int, Sequence] = {}
        self._spare: list[Block] = []   # released blocks, reused by _make_block
        self.counters = dict.fromkeys(
            ("query_tokens", "hit_tokens", "promotions", "promotion_bytes", "demotions",
             "demotion_bytes", "write_through_blocks", "collisions", "duplicates",
             "invalidated_blocks", "dropped_blocks", "sync_evictions", "transfer_failures",
             "transfer_retries", "compaction_moves"), 0)
        if registry is None and config.metrics.http_port is not None:
            from prometheus_client import CollectorRegistry
            registry = CollectorRegistry()
        self.registry = registry
        if registry is not None:
            from tiered_cache.metrics import CacheCollector
            registry.register(CacheCollector(self))
        if config.metrics.http_port is not None:
            from tiered_cache.metrics import serve_metrics
            serve_metrics(registry, config.metrics.http_port)
        # Background data plane: only meaningful when there is data to move.
        self.migrator = self.compactor = None
        self._closed = False
        if self.has_storage and config.migrator.enabled:
            from tiered_cache.migrator import Migrator
            self.migrator = Migrator(self, config.migrator)
        if self.has_storage and config.compactor.enabled:
            from tiered_cache.migrator import Compactor
            self.compactor = Compactor(self, config.compactor)
        if self.migrator or self.compactor:
            # Stop threads at interpreter exit even if the user never closes the cache.
            ref = weakref.ref(self)
            atexit.register(lambda: (c := ref()) is not None and c.shutdown())

    def _build_tiers(self, config: CacheConfig) -> list[Tier]:
        from tiered_cache.storage import make_pool

        policy_cls = policies.resolve(config.policy)
        model = config.model
        hidden = config.num_q_heads * model.head_dim
        cost_ctx = (model.num_params / (2 * model.num_layers * hidden)
                    if model.num_params else 53_000.0)
        geometry = dict(num_layers=model.num_layers, block_size=self.block_size,
                        num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                        dtype=model.dtype)
        tiers = []
        for name in ("gpu", "host"):
            n = tier_num_blocks(config, name)
            if name == "host" and n == 0:
                continue                        # `num_blocks: 0`: a device-only cache
            pool = None
            tcfg = getattr(config.tiers, name)
            if self.has_storage:
                pool = make_pool(name, n, device=self.device, memory=config.tiers.host.memory,
                                 max_slots=tcfg.max_num_blocks,
                                 segment_slots=tcfg.segment_blocks,
                                 resizable=getattr(tcfg, "resizable", False), **geometry)
            policy = policy_cls(n, block_size=self.block_size, cost_context_tokens=cost_ctx)
            tiers.append(Tier(name, len(tiers), SlotAllocator(n), policy, pool))
        return tiers

    # ------------------------------------------------------------------ context manager
    def __enter__(self) -> TieredKVCache:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def shutdown(self) -> None:
        """Finish in-flight copies, stop background threads, close every open sequence (their
        full blocks stay cached). Idempotent."""
        if self._closed:
            return
        self._closed = True
        for worker in (self.compactor, self.migrator):
            if worker is not None:
                worker.stop()
        # Writes copying outside the lock finish first (they hold no lock while copying).
        deadline = time.monotonic() + 30.0
        while any(s.writing for s in list(self._open.values())) and \
                time.monotonic() < deadline:
            time.sleep(0.001)
        with self._lock:
            for seq in list(self._open.values()):
                if seq.writing:         # still copying after 30 s: leave it open
                    continue
                self.close(seq)

    # ------------------------------------------------------------------ public API
    def open(self, token_ids, *, salt: str | bytes | None = None, adapter_id: str | None = None,
             reserve_last: bool = False) -> Sequence:
        """Start a sequence over `token_ids`, reusing the longest cached prefix from any tier.

        The matched blocks are pinned and made resident in the device tier; slots for the rest
        of the tokens are reserved. `reserve_last=True` never counts the final token as cached
        (an engine that needs the last position's logits must compute at least one token).
        Raises CapacityError (cache unchanged) when the device tier cannot hold the sequence.
        """
        tokens = as_token_array(token_ids)
        _check_salt(salt)
        return self._when_settled(self._open_locked, tokens, salt, adapter_id, reserve_last)

    def _when_settled(self, fn, *args):
        """Run `fn` under the lock; if it lacks room only because background copies still hold
        slots they are about to free, wait for them outside the lock and try again."""
        deadline = time.monotonic() + self.config.migrator.wait_timeout_s
        while True:
            try:
                with self._lock:
                    return fn(*args)
            except CapacityError as exc:
                if not exc.transient or time.monotonic() > deadline:
                    raise
            time.sleep(0.0005)

    def _open_locked(self, tokens, salt, adapter_id, reserve_last) -> Sequence:
        t0 = time.perf_counter()
        (root, root_id) = self.hasher.root(salt, adapter_id)
        seq = Sequence(id(self), root, tokens, self.num_layers, salt, adapter_id)
        seq.root_id = root_id
        matched = self._match(seq)
        if reserve_last and matched and len(matched) * self.block_size >= len(tokens):
            matched.pop()
            seq.keys.pop()
        promote = [b for b in matched if b.slots[GPU] == NO_SLOT]
        need = len(promote) + -(-len(tokens) // self.block_size) - len(matched)
        # Check room before pinning, so that a refused open leaves even the policies' order
        # untouched: blocks this open would pin stop being evictable.
        pinning = sum(1 for b in matched if b.ref_count == 0 and b.slots[GPU] != NO_SLOT)
        self._check_room(GPU, need, extra_pinned=pinning)
        source_tiers = [GPU if b.slots[GPU] != NO_SLOT else b.fastest_tier() for b in matched]
        for b in matched:
            self._pin(b)
        try:
            slots = self._allocate(GPU, need)
        except BaseException:
            for b in matched:
                self._unpin(b)
            raise
        try:
            if self.migrator is not None:
                self.migrator.promote(promote, slots[:len(promote)])
            else:
                self._move_now(moves.plan_promotion, moves.commit_promotion, promote,
                               slots[:len(promote)], None)
        except BaseException:
            # A failed promotion's commit already released its device slots.
            gpu = self.tiers[GPU]
            gpu.allocator.free([s for s in slots
                                if not gpu.allocator.is_free(s) and gpu.owner[s] is None])
            for b in matched:
                self._unpin(b)
            raise
        # A block already on its way (promoted for another sequence) is waited on, not
        # copied again: one in-flight promotion per block.
        seq.pending = list({id(b.pending): b.pending for b in matched
                            if b.pending is not None}.values())
        # ---- nothing below can fail
        self._clock += 1
        clock, tiers = self._clock, self.tiers
        for b in matched:
            b.hits += 1
            b.last_access = clock
            copies = b.slots
            for tier in tiers:
                # NOTE: every tier holding a copy hears of the reuse, candidate or not (the
                # block is pinned by now): policies keep history across pins (policies/base.py)
                if copies[tier.index] != NO_SLOT:
                    tier.policy.access(b)
        for tier in tiers:
            tier.hit_tokens += self.block_size * source_tiers.count(tier.index)
        seq.blocks = list(matched)
        self._new_blocks(seq, slots[len(promote):])
        cached = len(matched) * self.block_size
        seq.num_cached_tokens = cached
        seq.num_published = len(matched)
        seq.chain = matched[-1] if matched else None
        seq.written = [cached] * self.num_layers
        seq.cached_tokens_by_tier = {
            tier.name: self.block_size * source_tiers.count(tier.index) for tier in self.tiers}
        self.counters["query_tokens"] += len(tokens)
        self.counters["collisions"] += seq.collided
        self.counters["hit_tokens"] += cached
        self._open[seq.id] = seq
        self.lookups.observe(time.perf_counter() - t0)
        return seq

    def can_open(self, num_tokens: int) -> bool:
        """Whether a sequence of `num_tokens` uncached tokens fits in the device tier now."""
        need = -(-num_tokens // self.block_size)
        with self._lock:
            return self._room(GPU) >= need

    def append(self, seq: Sequence, token_ids) -> None:
        """Declare the next tokens of a sequence (decode steps, the next turn of a chat)."""
        self._check_open(seq)
        tokens = as_token_array(token_ids)
        self._when_settled(self._append_locked, seq, tokens)

    def _append_locked(self, seq: Sequence, tokens: np.ndarray) -> None:
        self._check_open(seq)
        have = len(seq.blocks) * self.block_size
        need = -(-max(0, seq.num_tokens + len(tokens) - have) // self.block_size)
        slots = self._allocate(GPU, need, hint=self._hint(seq)) if need else []
        seq.extend(tokens)
        self._new_blocks(seq, slots)

    def write(self, seq: Sequence, layer: int, key, value) -> None:
        """Write the KV of the next `n` unwritten tokens of `layer` (`key`/`value`: `[n, H, D]`).

        A block is published to the prefix index once every layer has written all its tokens.
        """
        self._check_open(seq)
        self._check_layer(layer)
        n = self._check_kv(key, value)
        with self._lock:
            self._check_open(seq)       # again: another thread may have closed it meanwhile
            start = seq.written[layer]
            if start + n > seq.num_tokens:
                raise ShapeError(f"write: layer {layer} has {start} of {seq.num_tokens} tokens "
                                 f"written; {n} more would pass the declared tokens "
                                 "(append them first)")
            if layer in seq.writing:
                raise BusySequenceError(f"write: layer {layer} of sequence {seq.id} is being "
                                        "written by another thread")
            if not (self.has_storage and n):
                seq.written[layer] = start + n
                self._publish_ready(seq)
                return
            index = self._flat_index(seq, start, start + n)
            seq.writing.add(layer)
        # NOTE: the copy runs without the lock. The slots belong to this sequence's own
        # blocks past its cached prefix: pinned (never moved, evicted or compacted), private
        # until every layer is written, and close() refuses while `writing` is set, so no
        # other thread reads or reuses them meanwhile. Writes to different layers may run in
        # parallel; publishing waits for the lock again.
        ok = False
        try:
            pool = self.tiers[GPU].pool
            pool.write_tokens(layer, index, key.to(pool.kv.device), value.to(pool.kv.device))
            ok = True
        finally:
            with self._lock:
                seq.writing.discard(layer)
                if ok:
                    seq.written[layer] = start + n
                    self._publish_ready(seq)

    def mark_computed(self, seq: Sequence) -> None:
        """Metadata-only mode (`storage: none`): treat every declared token as written in every
        layer and publish the full blocks. Used by simulation and trace replay."""
        self._check_open(seq)
        if self.has_storage:
            raise StorageDisabledError("mark_computed is only for `storage: none`; with tensor "
                                       "storage, write the KV with write()")
        with self._lock:
            self._check_open(seq)
            seq.written = [seq.num_tokens] * self.num_layers
            self._publish_ready(seq)

    def wait(self, seq: Sequence, layer: int, timeout: float | None = None) -> None:
        """Block until every block this sequence reads has `layer` in the device tier.

        Promotions land layer by layer, so layer l can be used while later layers still copy.
        Raises PromotionTimeout after `timeout` (default `migrator.wait_timeout_s`) and
        TransferError if a promotion failed (the block stays valid in the host tier).
        """
        self._check_open(seq)
        self._check_layer(layer)
        if not seq.pending:
            return
        timeout = self.config.migrator.wait_timeout_s if timeout is None else timeout
        for readiness in seq.pending:
            readiness.wait(layer, timeout)
        if all(r.done and r.error is None for r in seq.pending):
            seq.pending = []

    def gather(self, seq: Sequence, layer: int):
        """Contiguous `(key, value)`, each `[written, H, D]`, of everything written so far."""
        self._check_open(seq)
        self._check_layer(layer)
        if not self.has_storage:
            raise StorageDisabledError("gather needs tensor storage; this cache has storage: none")
        self.wait(seq, layer)
        with self._lock:
            self._check_open(seq)
            index = self._flat_index(seq, 0, seq.written[layer])
            return self.tiers[GPU].pool.read_tokens(layer, index)

    def attention(self, q, seqs: list[Sequence], layer: int, *, scale: float | None = None):
        """Paged decode attention: `q` `[len(seqs), num_q_heads, head_dim]`, one query per
        sequence, over every token written for `layer` (the newest included). Returns the same
        shape. Blocks still being promoted are read from host (`kernels.missing_blocks`)."""
        from tiered_cache import attention

        self._need_storage("attention")
        return attention.decode(self, q, list(seqs), layer, scale)

    def prefill_attention(self, q, seq: Sequence, layer: int, *, scale: float | None = None):
        """Attention of the last `n` written tokens (`q` `[n, num_q_heads, head_dim]`): causal
        among them, full over everything before (chunked prefill over a cached prefix)."""
        from tiered_cache import attention

        self._need_storage("prefill_attention")
        return attention.prefill(self, q, seq, layer, scale)

    def close(self, seq: Sequence) -> None:
        """Release a sequence: its published blocks stay cached (and become evictable), its
        private blocks (partial, or never fully written) are freed."""
        self._check_open(seq)
        with self._lock:
            self._check_open(seq)
            if seq.writing:
                raise BusySequenceError(f"close: sequence {seq.id} is being written by another "
                                        f"thread (layers {sorted(seq.writing)})")
            self._clock += 1
            # Leaf first, so ties in recency evict the deepest block of a chain first.
            for b in reversed(seq.blocks):
                if b.key is not None:
                    b.last_access = self._clock
                self._unpin(b)
                if b.ref_count == 0 and b.key is None and b.in_flight == 0:
                    self._release(b)
            seq.blocks = []
            seq.closed = True
            del self._open[seq.id]

    def invalidate(self, token_ids, *, salt: str | bytes | None = None,
                   adapter_id: str | None = None) -> int:
        """Drop the cached blocks of this prefix and everything cached under them, from every
        tier. Returns the number of blocks dropped.

        NOTE: keys chain, so once a block is gone nothing below it is reachable; dropping the
        prefix's first block therefore drops every cached continuation of it. Blocks that open
        sequences still read leave the index at once and are freed when the last one closes.
        """
        tokens = as_token_array(token_ids)
        _check_salt(salt)
        with self._lock:
            root, root_id = self.hasher.root(salt, adapter_id)
            probe = Sequence(id(self), root, tokens[:self.block_size], self.num_layers, salt,
                             adapter_id)
            probe.root_id = root_id
            matched = self._match(probe)        # the same verified lookup open() uses
            if not matched:
                return 0
            n = self._drop_subtree(matched[0])
            self.counters["invalidated_blocks"] += n
            return n

    def stats(self) -> dict:
        with self._lock:
            c = self.counters
            return {
                "query_tokens": c["query_tokens"],
                "hit_tokens": c["hit_tokens"],
                "hit_rate": c["hit_tokens"] / c["query_tokens"] if c["query_tokens"] else 0.0,
                "hit_tokens_by_tier": {t.name: t.hit_tokens for t in self.tiers},
                "tiers": {t.name: t.stats() for t in self.tiers},
                "promotions": c["promotions"],
                "promotion_bytes": c["promotion_bytes"],
                "demotions": c["demotions"],
                "demotion_bytes": c["demotion_bytes"],
                "write_through_blocks": c["write_through_blocks"],
                "collisions": c["collisions"],
                "duplicates": c["duplicates"],
                "invalidated_blocks": c["invalidated_blocks"],
                "dropped_blocks": c["dropped_blocks"],
                "sync_evictions": c["sync_evictions"],
                "transfer_failures": c["transfer_failures"],
                "transfer_retries": c["transfer_retries"],
                "compaction_moves": c["compaction_moves"],
                "lock_hold": self._lock.holds.summary(),
                "lookup": self.lookups.summary(),
                "cached_blocks": len(self.index),
                "open_sequences": len(self._open),
            }

    def resize(self, tier: str, num_blocks: int, *, timeout: float | None = 30.0) -> int:
        """Grow or shrink a tier to `num_blocks` slots while the cache serves; returns the new
        size. Growing backs new memory segments (CapacityError when the machine lacks the
        memory or `max_num_blocks` is passed); shrinking moves the blocks above the new size
        down, evicts by policy when they do not fit, and frees the emptied segments. Pinned
        blocks are waited for up to `timeout` seconds; on timeout the tier keeps its size and
        no block is lost. See `tiered_cache.resize`."""
        from tiered_cache.resize import resize
        return resize(self, tier, num_blocks, timeout)

    def tier(self, name: str) -> Tier:
        for t in self.tiers:
            if t.name == name:
                return t
        raise KeyError(f"no tier named {name!r}; tiers: {[t.name for t in self.tiers]}")

    # ------------------------------------------------------------------ prefix matching
    def _match(self, seq: Sequence) -> list[Block]:
        """Longest run of published blocks that equals the sequence's leading full blocks.

        Keys are computed block by block and only up to the first miss: a miss ends the walk,
        so a 1M-token prompt with a short cached prefix hashes only that prefix.
        """
        tokens = seq.token_ids
        nbytes = self.block_size * 4
        data = tokens.tobytes()
        key, parent, root_id = seq.root, None, seq.root_id
        matched: list[Block] = []
        keys = seq.keys
        h, get, verify = self.hasher.hash_fn, self.index.get, self.verify_tokens
        for off in range(0, (len(tokens) // self.block_size) * nbytes, nbytes):
            chunk = data[off:off + nbytes]
            key = h(key + chunk)
            b = get(key)
            if b is None:
                break
            # The parent identity and root checks are free and make a colliding key harmless
            # even with verify_tokens off for everything but the block's own tokens.
            if (b.parent is not parent or (verify and b.tokens != chunk)
                    or (parent is None and b.root_id != root_id)):
                seq.collided = True     # counted only if the open succeeds
                break
            keys.append(key)
            matched.append(b)
            parent = b
        return matched

    # ------------------------------------------------------------------ publishing
    def _publish_ready(self, seq: Sequence) -> None:
        ready = seq.num_written // self.block_size
        if ready <= seq.num_published:
            return
        tokens = seq.token_ids.tobytes()
        nbytes = self.block_size * 4
        fresh: list[Block] = []
        for i in range(seq.num_published, ready):
            b = seq.blocks[i]
            chunk = tokens[i * nbytes:(i + 1) * nbytes]
            if len(seq.keys) == i:
                seq.keys.append(self.hasher.key(seq.keys[-1] if i else seq.root, chunk))
            key = seq.keys[i]
            # `chain` is the published block standing for block i-1: the sequence's own, or an
            # equal one another sequence published first. None at depth 0; False once broken.
            parent = seq.chain if i else None
            if parent is False or (parent is not None and parent.key is None):
                seq.chain = False   # below a block that could not be published: stays private
                continue
            existing = self.index.get(key)
            if existing is not None:
                same = existing.parent is parent and existing.tokens == chunk and (
                    parent is not None or existing.root_id == seq.root_id)
                self.counters["duplicates" if same else "collisions"] += 1
                seq.chain = False
                if same and existing.pending is None and existing.slots[GPU] != NO_SLOT:
                    # NOTE: an equal block another sequence published first, readable on the
                    # device: use it instead of ours (pinned like any block of ours) and
                    # free ours, so the rest of the chain publishes under it. Otherwise the
                    # rest stays private: a parent we do not pin could vanish under us.
                    self._pin(existing)
                    seq.blocks[i] = existing
                    self._unpin(b)
                    self._release(b)
                    seq.chain = existing
                continue
            b.key, b.tokens, b.parent = key, chunk, parent
            if parent is None:
                b.root_id = seq.root_id
            b.inserted_at = b.last_access = self._clock
            self.index[key] = b
            if parent is not None:
                parent.children[b.id] = b
                for t, slot in enumerate(b.slots):
                    if slot != NO_SLOT:
                        parent.resident_children[t] += 1
                self._refresh(parent)
            self._refresh(b)
            fresh.append(b)
            seq.chain = b
        seq.num_published = ready
        if self.write_through and fresh and len(self.tiers) > 1:
            if self.migrator is not None:
                self.migrator.copy_down(fresh)
            else:
                # write_through: a host copy now, so evicting the block later costs no copy.
                self._move_now(moves.plan_copy_down, moves.commit_copy_down, fresh)

    # ------------------------------------------------------------------ tiers and slots
    def _room(self, t: int) -> int:
        """Slots tier t can provide: free ones plus those eviction can free.

        NOTE: not just the current candidates: evicting a leaf makes its parent a candidate,
        and an open sequence pins whole chains, so every unpinned block can be reached by
        evicting leaves first. Pinned copies and the destinations of copies under way cannot.
        (In the host tier this is conservative: a host copy of a pinned block that also has a
        device copy is evictable but not counted.)
        """
        tier = self.tiers[t]
        a = tier.allocator
        return a.num_free + a.num_used - tier.pinned_blocks - tier.reserved - tier.busy

    def _check_room(self, t: int, n: int, extra_pinned: int = 0) -> None:
        tier = self.tiers[t]
        room = self._room(t) - extra_pinned
        if room < n:
            exc = CapacityError(
                f"tier {tier.name!r} cannot provide {n} blocks: {tier.allocator.num_free} "
                f"free, {tier.pinned_blocks + extra_pinned} pinned, "
                f"{tier.reserved + tier.busy} held by copies under way, of "
                f"{tier.capacity_blocks}")
            exc.transient = room + tier.busy + tier.reserved >= n
            raise exc

    def _allocate(self, t: int, n: int, hint: int | None = None) -> list[int]:
        tier = self.tiers[t]
        if n <= 0:
            return []
        if tier.allocator.num_free < n:
            self._check_room(t, n)
            if t == GPU:
                # The migrator's watermark keeps free slots; reaching here means it fell behind.
                self.counters["sync_evictions"] += 1
            self._evict(t, n - tier.allocator.num_free)
        slots = tier.allocator.allocate(n, hint)
        if t == GPU and self.migrator is not None and (
                tier.allocator.num_used > self.config.migrator.high_watermark
                * tier.capacity_blocks):
            self.migrator.poke()
        return slots

    def _evict(self, t: int, n: int, need=None) -> None:
        """Free `n` slots of tier t by the tier's policy (or, with `need`, evict until
        `need()`, the slots still missing, drops to 0). Victims with no copy in a slower tier
        are demoted to the next tier when it has room, and dropped otherwise.

        NOTE: victims are taken one at a time, and each leaves the tier (in the metadata)
        before the next is chosen, so a parent whose last child just left competes at once by
        its own priority: a stale chain goes before fresher leaves of other chains. The copies
        are batched and run before the lock is released; the source slots they read are free
        in the allocator but nothing can take them meanwhile (only lower tiers allocate here).
        """
        tier = self.tiers[t]
        below = t + 1 if t + 1 < len(self.tiers) else None
        if need is None:
            alloc, target = tier.allocator, tier.allocator.num_free + n

            def need() -> int:
                return target - alloc.num_free
        plan: list[Transfer] = []
        try:
            self._pick_victims(t, below, need, plan)
        finally:
            # Even if the loop stopped early, every metadata move above must get its data.
            # A block demoted above may have been dropped again by a later host eviction in
            # this loop (and its host slot reused): its copy is void.
            plan = self._coalesce([p for p in plan if p.block.slots[p.dst_tier] == p.dst_slot])
            try:
                self._run(plan)
            except TransferError:
                self._undo_demotions(t, plan)
                raise
            self.counters["demotions"] += len(plan)
            self.counters["demotion_bytes"] += len(plan) * self.block_bytes

    def _pick_victims(self, t: int, below: int | None, need,
                      plan: list[Transfer]) -> None:
        tier = self.tiers[t]
        # Lower-tier slots reserved in batches: one lower-tier eviction pass serves many
        # demotions instead of one per victim. Unused ones are given back at the end.
        reserve: list[int] = []
        try:
            while need() > 0:
                got = tier.policy.victims(1)
                if not got:
                    # Room counted blocks that are not candidates yet (a parent whose child
                    # is in flight): transient when copies under way will change that.
                    exc = CapacityError(f"tier {tier.name!r}: no evictable block left")
                    exc.transient = tier.busy + tier.reserved > 0
                    raise exc
                v = got[0]
                v.candidate[t] = False
                if below is not None and all(s == NO_SLOT for s in v.slots[t + 1:]):
                    if not reserve:
                        k = min(need(), self._room(below))
                        reserve = self._allocate(below, k)[::-1] if k > 0 else []
                    if reserve and v.slots[t] != NO_SLOT:
                        dst = reserve.pop()
                        plan.append(Transfer(v, t, v.slots[t], below, dst))
                        tier.evictions += 1
                        self._move_copy(v, t, below, dst)
                        continue
                if v.slots[t] == NO_SLOT:       # dropped by the lower tier's eviction
                    continue
                tier.evictions += 1
                if not v.children and v.ref_count == 0 and v.in_flight == 0 and \
                        v.slots.count(NO_SLOT) == len(v.slots) - 1:
                    self._drop_leaf(v, t)       # the common case, in one step
                    continue
                self._clear_slot(v, t)
                if v.fastest_tier() < 0:
                    self.counters["dropped_blocks"] += self._drop_subtree(v)
        finally:
            if reserve:
                self.tiers[below].allocator.free(reserve)

    def _drop_leaf(self, v: Block, t: int) -> None:
        """Drop a published, unpinned, childless block whose only copy is in tier t: what
        _clear_slot + _drop_subtree + _release do, without their general bookkeeping."""
        tier = self.tiers[t]
        slot = v.slots[t]
        tier.allocator.free_one(slot)
        tier.owner[slot] = None
        v.slots[t] = NO_SLOT
        del self.index[v.key]
        v.key = None
        parent = v.parent
        if parent is not None:
            del parent.children[v.id]
            parent.resident_children[t] -= 1
            self._refresh(parent)
            v.parent = None
        self.counters["dropped_blocks"] += 1
        self._spare.append(v)

    def _coalesce(self, plan: list[Transfer]) -> list[Transfer]:
        """Pair ascending source slots with ascending destination slots (a permutation of the
        destinations among the plan's blocks, none of which anyone has read yet), so adjacent
        slots on both sides merge into one large copy."""
        if len(plan) < 2:
            return plan
        plan = sorted(plan, key=lambda p: p.src_slot)
        out = []
        for p, d in zip(plan, sorted(p.dst_slot for p in plan)):
            if p.dst_slot != d:
                p.block.slots[p.dst_tier] = d
                self.tiers[p.dst_tier].owner[d] = p.block
                p = Transfer(p.block, p.src_tier, p.src_slot, p.dst_tier, d, p.layers)
            out.append(p)
        return out

    def _undo_demotions(self, t: int, plan: list[Transfer]) -> None:
        """A synchronous demotion copy failed: put the victims back in their (still free,
        still intact) source slots and drop the host copies that never got their data."""
        tier = self.tiers[t]
        for p in plan:
            v = p.block
            if tier.allocator.is_free(p.src_slot):
                tier.allocator.allocate_at(p.src_slot)
                self._set_slot(v, t, p.src_slot)
                tier.evictions -= 1
            self._clear_slot(v, p.dst_tier)
            if v.fastest_tier() < 0:
                self.counters["dropped_blocks"] += self._drop_subtree(v)

    def _move_now(self, plan_fn, commit_fn, *args) -> None:
        """A background move run synchronously (no migrator): the same plan and commit from
        tiered_cache.moves, with the copy in between; a failed copy is rolled back."""
        plan = plan_fn(self, *args)
        try:
            self._run(plan)
        except TransferError:
            commit_fn(self, plan, False)
            raise
        commit_fn(self, plan, True)

    def _run(self, plan: list[Transfer]) -> None:
        if not self.has_storage or not plan:
            return
        try:
            execute(plan, [t.pool for t in self.tiers])
        except Exception as exc:
            raise TransferError(f"copy of {len(plan)} blocks failed: {exc}") from exc

    def _set_slot(self, b: Block, t: int, slot: int) -> None:
        b.slots[t] = slot
        self.tiers[t].owner[slot] = b
        if b.ref_count:
            self.tiers[t].pinned_blocks += 1
        if b.key is not None and b.parent is not None:
            b.parent.resident_children[t] += 1
            self._refresh(b.parent)
        self._refresh(b)

    def _move_copy(self, b: Block, src: int, dst: int, slot: int) -> None:
        """b's copy leaves tier src for `slot` of tier dst: `_set_slot` + `_clear_slot` in one
        step, so b and its parent are re-derived once (the demotion hot path)."""
        s_tier, d_tier = self.tiers[src], self.tiers[dst]
        old = b.slots[src]
        s_tier.allocator.free_one(old)
        s_tier.owner[old] = None
        b.slots[src] = NO_SLOT
        b.slots[dst] = slot
        d_tier.owner[slot] = b
        if b.ref_count:
            s_tier.pinned_blocks -= 1
            d_tier.pinned_blocks += 1
        p = b.parent
        if b.key is not None and p is not None:
            kids = p.resident_children
            kids[src] -= 1
            kids[dst] += 1
            self._refresh(p)
        self._refresh(b)

    def _clear_slot(self, b: Block, t: int) -> None:
        self.tiers[t].allocator.free_one(b.slots[t])
        self.tiers[t].owner[b.slots[t]] = None
        b.slots[t] = NO_SLOT
        if b.ref_count:
            self.tiers[t].pinned_blocks -= 1
        if b.key is not None and b.parent is not None:
            b.parent.resident_children[t] -= 1
            self._refresh(b.parent)
        self._refresh(b)

    def _release(self, b: Block) -> None:
        """Free every copy of an unpublished, unpinned block no copy is using, and keep the
        object for reuse (see block.py on why blocks are recycled)."""
        for t, slot in enumerate(b.slots):
            if slot != NO_SLOT:
                self._clear_slot(b, t)
        self._spare.append(b)

    def _make_block(self, depth: int, ref_count: int) -> Block:
        if self._spare:
            b = self._spare.pop()
            b.reset(next(self._block_ids), depth, ref_count=ref_count)
            return b
        return Block(next(self._block_ids), depth, len(self.tiers), ref_count=ref_count)

    def _refresh(self, b: Block) -> None:
        """Re-derive b's candidacy in every tier (invariant 4) and tell the policies."""
        faster = False
        eligible = b.key is not None and b.in_flight == 0
        unpinned = b.ref_count == 0
        slots, kids, cand = b.slots, b.resident_children, b.candidate
        for tier in self.tiers:
            t = tier.index
            has = slots[t] != NO_SLOT
            want = eligible and has and kids[t] == 0 and (unpinned or faster)
            if want != cand[t]:
                cand[t] = want
                if want:
                    tier.policy.insert(b)
                else:
                    tier.policy.remove(b)
            faster = faster or has

    def _pin(self, b: Block) -> None:
        b.ref_count += 1
        if b.ref_count == 1:
            for tier in self.tiers:
                if b.slots[tier.index] != NO_SLOT:
                    tier.pinned_blocks += 1
            self._refresh(b)

    def _unpin(self, b: Block) -> None:
        b.ref_count -= 1
        if b.ref_count == 0:
            for tier in self.tiers:
                if b.slots[tier.index] != NO_SLOT:
                    tier.pinned_blocks -= 1
            self._refresh(b)

    def _new_blocks(self, seq: Sequence, slots: list[int]) -> None:
        """Private blocks for the sequence's uncached tokens, already holding device slots."""
        for slot in slots:
            b = self._make_block(len(seq.blocks), ref_count=1)
            b.slots[GPU] = slot
            self.tiers[GPU].owner[slot] = b
            self.tiers[GPU].pinned_blocks += 1
            seq.blocks.append(b)

    def _drop_subtree(self, top: Block) -> int:
        """Unpublish `top` and every published block below it; free the copies of those no
        open sequence reads (the rest are freed when their last reader closes)."""
        dropped = 0
        stack = [top]
        while stack:
            b = stack.pop()
            stack.extend(b.children.values())
            if b.key is None:
                continue
            parent = b.parent
            del self.index[b.key]
            b.key = None
            b.children.clear()
            held = [t for t, slot in enumerate(b.slots) if slot != NO_SLOT]
            # A parent dropped earlier in this walk has already forgotten its children.
            if parent is not None and parent.key is not None:
                parent.children.pop(b.id, None)
                for t in held:
                    parent.resident_children[t] -= 1
                if held:
                    self._refresh(parent)
            b.parent = None
            b.resident_children[:] = [0] * len(self.tiers)
            if held:                    # only a block with a copy can be a candidate
                self._refresh(b)
            # NOTE: an in-flight block's slots are being copied; the move's commit frees them.
            if b.ref_count == 0 and b.in_flight == 0:
                self._release(b)
            dropped += 1
        return dropped

    def _hint(self, seq: Sequence) -> int | None:
        if seq.blocks and seq.blocks[-1].slots[GPU] != NO_SLOT:
            return seq.blocks[-1].slots[GPU] + 1
        return None

    def _flat_index(self, seq: Sequence, start: int, end: int):
        import torch

        bs = self.block_size
        first, last = start // bs, (end - 1) // bs if end > start else start // bs
        slots = np.fromiter((b.slots[GPU] for b in seq.blocks[first:last + 1]), dtype=np.int64)
        pos = np.arange(start, end, dtype=np.int64)
        flat = slots[pos // bs - first] * bs + pos % bs
        return torch.from_numpy(flat).to(self.tiers[GPU].pool.kv.device)

    # ------------------------------------------------------------------ validation
    def _need_storage(self, what: str) -> None:
        if not self.has_storage:
            raise StorageDisabledError(f"{what} needs tensor storage; this cache has "
                                       "storage: none")

    def _check_open(self, seq: Sequence) -> None:
        if not isinstance(seq, Sequence):
            raise TypeError(f"expected a Sequence from TieredKVCache.open, got "
                            f"{type(seq).__name__}")
        if seq.owner != id(self) or seq.id not in self._open:
            if seq.closed:
                raise SequenceClosedError(f"sequence {seq.id} is closed")
            raise SequenceClosedError(f"sequence {seq.id} belongs to another cache")

    def _check_layer(self, layer: int) -> None:
        if not isinstance(layer, (int, np.integer)) or isinstance(layer, bool):
            raise LayerError(f"layer: expected an int, got {type(layer).__name__}")
        if not 0 <= layer < self.num_layers:
            raise LayerError(f"layer: expected 0 <= layer < {self.num_layers}, got {layer}")

    def _check_kv(self, key, value) -> int:
        import torch

        for name, x in (("key", key), ("value", value)):
            if not isinstance(x, torch.Tensor):
                raise DTypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
            want = (self.num_kv_heads, self.head_dim)
            if x.dim() != 3 or tuple(x.shape[1:]) != want:
                raise ShapeError(f"{name}: expected shape [n, {want[0]}, {want[1]}] "
                                 f"(tokens, kv heads, head_dim), got {list(x.shape)}")
            if not self.has_storage:
                continue
            pool_dtype = self.tiers[GPU].pool.kv.dtype
            if pool_dtype == torch.float8_e4m3fn:
                # FP8 storage quantizes on write; the model computes in a wider type.
                if x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
                    raise DTypeError(f"{name}: fp8_e4m3 storage takes float16, bfloat16 or "
                                     f"float32 KV to quantize, got {x.dtype}")
                if not bool(torch.isfinite(x).all()):
                    raise DTypeError(f"{name}: fp8_e4m3 storage needs finite values "
                                     "(a NaN or inf would poison the block's scale)")
            elif x.dtype != pool_dtype:
                raise DTypeError(f"{name}: expected dtype {pool_dtype} (model.dtype), "
                                 f"got {x.dtype}")
        if key.shape != value.shape:
            raise ShapeError(f"key and value shapes differ: {list(key.shape)} vs "
                             f"{list(value.shape)}")
        return int(key.shape[0])

    # ------------------------------------------------------------------ introspection
    @contextmanager
    def locked(self) -> Iterator[None]:
        """Hold the control-plane lock (tests and the migrator read a consistent state)."""
        with self._lock:
            yield

    def open_sequences(self) -> list[Sequence]:
        return list(self._open.values())


def _check_salt(salt: object) -> None:
    if salt is not None and not isinstance(salt, (str, bytes)):
        from tiered_cache.errors import TokenError
        raise TokenError(f"salt: expected a str, bytes or None, got {type(salt).__name__}")
