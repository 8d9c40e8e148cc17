"""One tenant's share of the node daemon: its pool in shared memory, its prefix index, its disk
directory, its migrator.

NOTE: a partition per tenant, not one pool for all: a client maps its tenant's pool, and only
that memfd is ever sent to it, so a tenant's KV is not even addressable from another tenant's
processes (a shared mapping would let any client read every tenant's blocks, whatever the
protocol refuses). `tiers.host.num_blocks` and `tiers.disk.num_blocks` are per partition.

Clients never write the pool. A client copies the blocks it publishes into its own staging
area (daemon/service.py) and the daemon copies them in (`publish`): a client whose lease was
reaped while it was stalled can only scribble on its own staging slots, never on a slot the
daemon has since given to another block.

The partition's tiers are a stack built by `build_stack(config, DAEMON)` from the same tier
kinds as an engine's (tiered_cache.tiers): tier 0 is the shared host pool, tier 1 the disk tier
if configured, and beneath them the remote store (`tiers.remote`, a keyed tier) if configured.
The index, migrator, copy handlers and recovery are the engine's own: the daemon adds no
second implementation of eviction, demotion, recovery, puts or loads.

With a remote store, daemons on different nodes configured alike share prefixes through it:
the tenant is part of every root (hashing.tenant_salt), hence of every server key, so tenant
`a` of one node finds what tenant `a` of another wrote, and nothing of tenant `b`. A fetch that
the local tiers end short asks the store which of the next blocks it holds (under
`tiers.remote.lookup_deadline_ms`), and loads those into new pool slots of the hold
(BlockIndex.keyed.load_after) when the cost model (if `model.num_params` is set) says loading beats
recomputing; blocks published into the pool are put to the store in the background
(`tiers.remote.write: on_host`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence as Seq
from operator import gt, itemgetter

import numpy as np
import torch

from tiered_cache import admission, kernels
from tiered_cache.config import CacheConfig
from tiered_cache.core import moves
from tiered_cache.core.atomic import atomic
from tiered_cache.core.blocks import NO_BLOCK
from tiered_cache.core.sequence import Sequence
from tiered_cache.core.tier import DEVICE
from tiered_cache.core.transfer import RecordMeta
from tiered_cache.errors import (
    CapacityError,
    PromotionTimeout,
    TieredCacheError,
    TransferError,
)
from tiered_cache.hashing import BlockHasher, Namespace
from tiered_cache.tiers.base import DAEMON
from tiered_cache.tiers.stack import build_stack, plan_asks
from tiered_cache.wire.errors import DaemonError, register_error
from tiered_cache.wire.ops import MAX_BLOCKS
from tiered_cache.wire.shm import PoolGeometry, SharedPool

log = logging.getLogger(__name__)


@register_error
class UnknownRootError(DaemonError):
    """A request named a root key this client's tenant has not registered (`root` first)."""

    wire_type = "unknown_root"


@register_error
class BadEntryError(DaemonError, ValueError):
    """A published entry is inconsistent (slot outside the staging area, repeated, tokens of
    the wrong length, depths out of order)."""

    wire_type = "bad_entry"


_ENTRY_ROW = itemgetter("slot", "key", "parent", "depth", "tokens", "hits")


def _raise_bad_entry(entries: Seq[dict], n_staging: int, nbytes: int) -> None:
    """BadEntryError naming the first entry that breaks publish's rules (checked one by one:
    the slow path, taken only once the column checks found something wrong)."""
    seen: set[int] = set()
    depth = -1
    for i, e in enumerate(entries):
        slot = e["slot"]
        if slot >= n_staging or slot in seen:
            raise BadEntryError(f"publish.entries[{i}].slot: {slot} is outside the staging "
                                f"area of {n_staging} slots or repeated")
        if len(e["tokens"]) != nbytes:
            raise BadEntryError(f"publish.entries[{i}].tokens: {len(e['tokens'])} bytes, "
                                f"expected {nbytes} (block_size int32 ids)")
        if e["depth"] < depth:
            raise BadEntryError(f"publish.entries[{i}].depth: entries must come parents "
                                "first (depth never decreasing)")
        seen.add(slot)
        depth = e["depth"]
    raise AssertionError("no bad entry found")      # pragma: no cover - the columns disagree


def _copy_slots(src: torch.Tensor, src_slots: list[int], dst: torch.Tensor,
                dst_slots: list[int]) -> None:
    """dst[dst_slots[i]] = src[src_slots[i]] between two block-major pools (staging -> pool).

    NOTE: through the CPU block copier (kernels/host_copy.py: one pass on every core, streaming
    stores for copies larger than the cache) with the source seen layer-major (a permuted
    view, no copy); a `copy_` per run of consecutive slots took 1.1x its time at 32 MiB."""
    kernels.copy_blocks_to_host(src.permute(1, 2, 0, *range(3, src.dim())), src_slots, dst,
                                dst_slots)


def namespace_of(config: CacheConfig) -> Namespace:
    model = config.model
    return Namespace(model.name, model.dtype, model.num_layers, model.num_kv_heads,
                     model.head_dim, int(config.block_size), None)


def partition_asks(config: CacheConfig, tenant: str) -> list[admission.Ask]:
    """What one tenant's partition asks of the machine (its shared pool, its disk directory),
    without building it: the daemon sums the partitions it builds at start."""
    return plan_asks(config, DAEMON, hasher=BlockHasher(namespace_of(config)), tenant=tenant)


def pool_bytes(config: CacheConfig) -> int:
    """Shared memory one partition's pool takes (page-aligned slots)."""
    return sum(a.nbytes for a in partition_asks(config, "-") if a.place == admission.RAM)


class Partition:
    """A tenant's tiers. Thread-safe: every method may run on any connection's thread.

    `existing`: partitions the daemon already has (their pools are no longer available memory;
    the admission check names them)."""

    def __init__(self, tenant: str, config: CacheConfig, *, existing: int = 0) -> None:
        self.tenant = tenant
        self.block_size = int(config.block_size)
        self.num_layers = config.model.num_layers
        self.hasher = BlockHasher(namespace_of(config))
        self.stack = stack = build_stack(
            config, DAEMON, hasher=self.hasher, tenant=tenant,
            admission_context=admission.partitions_context(1, existing, pool_bytes(config)))
        self.index, self.pools, self.executor = stack.index, stack.pools, stack.executor
        self.migrator, self.health, self.costs = stack.migrator, stack.health, stack.costs
        self.shared: SharedPool = self.pools[DEVICE].shared   # the host kind's shared pool
        self.geometry: PoolGeometry = self.shared.geometry
        self._roots: dict[bytes, tuple[int, bytes, str | None]] = {}  # key -> id, salt, adapter
        self._lock = threading.Lock()
        self.counters = {"fetches": 0, "fetched_blocks": 0, "fetch_misses": 0,
                         "published_blocks": 0, "rejected_blocks": 0, "lookups": 0,
                         "fetch_timeouts": 0, "fetch_failures": 0, "duplicate_blocks": 0,
                         "remote_blocks": 0}
        self._closed = False

    # roots ------------------------------------------------------------------------------------

    def root(self, salt: bytes, adapter: str | None) -> bytes:
        """Register the root of (tenant salt + request salt, adapter); its key."""
        key, root_id = self.index.register_root(salt, adapter)
        with self._lock:
            self._roots[key] = (root_id, salt, adapter)
        return key

    def _root_id(self, key: bytes) -> int:
        with self._lock:
            found = self._roots.get(key)
        if found is None:
            raise UnknownRootError("this root was not registered by the client's tenant "
                                   "(call `root` first; roots are forgotten by a restart)")
        return found[0]

    # reads ------------------------------------------------------------------------------------

    def fetch(self, root: bytes, parent: bytes, tokens: np.ndarray,
              wait_s: float) -> tuple[Sequence | None, list[int]]:
        """Pin the leading cached blocks of `tokens` after `parent` and make them resident in
        the pool (read from disk if need be, waiting up to `wait_s`); (hold, their slots), or
        (None, []) for a miss."""
        self._count("fetches")
        # NOTE: at most a reply's worth (MAX_BLOCKS slots): a longer match is answered with
        # its first blocks, and nothing past them is pinned; the client fetches on after them.
        n = min(len(tokens) // self.block_size, MAX_BLOCKS)
        tokens = tokens[:n * self.block_size]
        root_id = self._root_id(root)
        found = None
        try:
            found, remote_failed = self._hold(root, root_id, parent, tokens, wait_s,
                                              bool(self.stack.stores))
            if found is None and remote_failed:
                # NOTE: a block from the store failed its load (a corrupt or vanished record,
                # a dropped connection): what this node holds itself is still good, so that
                # much is served rather than nothing (the store is asked again next time).
                found, _ = self._hold(root, root_id, parent, tokens, wait_s, False)
            if found is None:
                self._count("fetch_misses")
                return None, []
            self._count("fetched_blocks", len(found[1]))
            return found
        except BaseException:
            if found is not None:           # a hold the caller will never get: given back
                self.release(found[0])
            raise

    def _hold(self, root: bytes, root_id: int, parent: bytes, tokens: np.ndarray,
              wait_s: float, remote: bool) -> tuple[tuple[Sequence, list[int]] | None, bool]:
        """`fetch` once: pin what the pool (and the disk) hold, with the store's next blocks
        loaded after them if `remote`; wait for the copies. Returns ((hold, slots) or None for
        nothing held: a miss, a refusal or a copy that failed, counted; whether blocks loaded
        from the store were among the copies that failed)."""
        loaded = 0
        seq = None
        try:
            # NOTE: in a section of its own: an exception landing after the index pinned the
            # blocks but before `seq` is set here tears it (the partition then refuses), as
            # nothing could give those pins back.
            with atomic():
                seq = self.index.open_blocks(root_id, parent, tokens, promote=self._promote)
        except (CapacityError, TransferError) as exc:
            log.debug("%s: fetch refused: %s", self.tenant, exc)
            return None, False
        try:
            if remote:
                loaded = self._load_remote(seq, root, parent, tokens)
            if not seq.blocks:
                self.index.close(seq)
                return None, False
            deadline = time.monotonic() + wait_s
            for r in seq.pending:
                r.wait(self.num_layers - 1, max(0.0, deadline - time.monotonic()))
            slots = self.index.held_slots(seq)
            return (seq, slots), False
        except TieredCacheError as exc:     # PromotionTimeout, TransferError
            timeout = isinstance(exc, PromotionTimeout)
            self._count("fetch_timeouts" if timeout else "fetch_failures")
            log.info("%s: fetch gave up: %s", self.tenant, exc)
            self.index.close(seq)
            return None, loaded > 0 and not timeout
        except BaseException:
            self.index.close(seq)
            raise

    def _load_remote(self, seq: Sequence, root: bytes, parent: bytes,
                     tokens: np.ndarray) -> int:
        """The hold ends before `tokens` do: the keyed tiers (the remote store) load the next
        blocks they have into it, if that beats recomputing them. Returns how many."""
        n = self.stack.load_after(seq, root, parent, tokens)
        self._count("remote_blocks", n)
        return n

    def release(self, seq: Sequence) -> None:
        """Let a fetch's hold go. Raises only having changed nothing (the hold is still the
        caller's: it keeps it, to release later) or having torn the index."""
        if not seq.closed:
            self.index.close(seq)

    def lookup(self, root: bytes, parent: bytes, tokens: np.ndarray) -> int:
        self._count("lookups")
        return self.index.peek(self._root_id(root), parent, tokens)

    # writes -----------------------------------------------------------------------------------

    def publish(self, root: bytes, entries: Seq[dict], staging: SharedPool) -> list[bool]:
        """Copy staged blocks into the pool and index them (parents first). A block is taken
        only if its chained key, parent and tokens check out (BlockIndex.persist.adopt); the
        rest are answered False and cost nothing."""
        root_id = self._root_id(root)
        if not entries:
            return []
        # NOTE: column by column (C loops over the entries); the entry-by-entry checks run
        # only to name a bad entry (benchmarks/daemon.py measures the publish request).
        slots, keys, parents, depths, tokens, hits = map(list, zip(*map(_ENTRY_ROW, entries)))
        n_staging = staging.geometry.num_slots
        nbytes = 4 * self.block_size
        if (max(slots) >= n_staging or len(set(slots)) != len(slots)
                or set(map(len, tokens)) != {nbytes} or any(map(gt, depths, depths[1:]))):
            _raise_bad_entry(entries, n_staging, nbytes)
        # Blocks already here (another engine computed them too) are not copied at all.
        new = [i for i, known in enumerate(self.index.known(keys)) if not known]
        taken = [False] * len(entries)
        if not new:
            self._count("duplicate_blocks", len(entries))
            return taken
        # NOTE: the lent slots are this call's from the moment the index lends them until
        # `adopt` takes them: each hand-over runs in a section of its own (an exception that
        # lands between the index's commit and this frame getting the result tears it: the
        # partition refuses, nothing leaks into a state that serves), and a failure between
        # them (a copy that raised, a MemoryError building the metas) unlends them, or they
        # would stay reserved for good.
        adopted = None
        try:
            with atomic():
                lent = self.index.persist.lend(DEVICE, len(new))
        except CapacityError:
            self._count("rejected_blocks", len(entries))
            return taken
        try:
            _copy_slots(staging.kv, [slots[i] for i in new], self.shared.kv, lent)
            metas = [(slot, RecordMeta(keys[i], parents[i], root, depths[i], tokens[i],
                                       hits[i])) for i, slot in zip(new, lent)]
            with atomic():
                adopted = self.index.persist.adopt(DEVICE, root_id, metas)
        except BaseException:
            if adopted is None and self.index.broken is None:
                self.index.persist.unlend(DEVICE, lent)
            raise
        for i, b in zip(new, adopted):
            taken[i] = b != NO_BLOCK
        if self.migrator.put_tiers:
            self.migrator.put_remote([b for b in adopted if b != NO_BLOCK])
        n = sum(taken)
        self._count("published_blocks", n)
        self._count("duplicate_blocks", len(entries) - len(new))
        self._count("rejected_blocks", len(new) - n)
        return taken

    def invalidate(self, root: bytes, tokens: np.ndarray) -> int:
        root_id = self._root_id(root)
        with self._lock:
            _, salt, adapter = next(v for v in self._roots.values() if v[0] == root_id)
        return (self.index.invalidate(tokens, salt=salt, adapter_id=adapter)
                + self.stack.invalidate_keyed(root, tokens))

    def _promote(self, plan, readiness) -> None:
        self.stack.promote(plan, readiness)

    # lifetime ---------------------------------------------------------------------------------

    def stats(self) -> dict:
        out = self.stack.stats(self.index.stats())
        with self._lock:
            out["daemon"] = dict(self.counters, roots=len(self._roots))
        out["daemon"]["pool_prefaulted_bytes"] = self.shared.prefaulted
        return out

    def drain(self) -> int:
        """Copy every block whose only copy is in the pool to disk (a graceful stop: the pool
        is memory and goes with the process). Returns how many were written."""
        if len(self.index.tiers) < 2:
            return 0
        written = 0
        blocks = self.index.persist.blocks_in(DEVICE)
        for first in range(0, len(blocks), 256):
            plan = moves.plan_copy_down(self.index, blocks[first:first + 256], DEVICE,
                                        DEVICE + 1)
            ok = False
            try:
                self.executor.run(plan)
                ok = True
            except TransferError as exc:
                log.error("%s: draining %d blocks to disk failed: %s", self.tenant, len(plan),
                          exc)
            finally:
                moves.commit_copy_down(self.index, plan, ok)
            written += len(plan) if ok else 0
        return written

    def close(self, *, drain: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        self.stack.stop_workers()
        for seq in self.index.open_sequences():
            self.index.close(seq, timeout=5.0)
        if drain and self.index.broken is not None:
            # NOTE: a torn index (it refuses every call) writes nothing down: its state may be
            # half changed, and disk records written from it would outlive the process.
            log.error("%s: not drained to disk: %s", self.tenant, self.index.broken)
        elif drain:
            n = self.drain()
            if n:
                log.info("%s: %d blocks written to disk before stopping", self.tenant, n)
        self.stack.close()

    def describe(self) -> str:
        return json.dumps({"tenant": self.tenant, "slots": self.geometry.num_slots,
                           "tiers": [t.name for t in self.index.tiers]})

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] += n
