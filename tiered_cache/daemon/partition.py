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

Tier 0 of the partition's index is the shared host pool (kind "host"), tier 1 the disk tier if
configured, and beneath them the remote store (`tiers.remote`, a keyed tier) if configured. The
index, migrator and copy handlers are the engine's own (core/, migrator/, data/): the daemon
adds no second implementation of eviction, demotion, recovery, puts or loads.

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
import os
import threading
import time
from collections.abc import Sequence as Seq

import numpy as np
import torch

from tiered_cache import assembly, costs, kernels
from tiered_cache.config import CacheConfig
from tiered_cache.core import moves
from tiered_cache.core.blocks import NO_BLOCK
from tiered_cache.core.index import BlockIndex
from tiered_cache.core.keyed import leading
from tiered_cache.core.sequence import Sequence
from tiered_cache.core.tier import TierSpec
from tiered_cache.core.transfer import RecordMeta
from tiered_cache.daemon.errors import DaemonError, register_error
from tiered_cache.daemon.shm import PoolGeometry, SharedPool
from tiered_cache.errors import (
    CapacityError,
    PromotionTimeout,
    TieredCacheError,
    TransferError,
)
from tiered_cache.hashing import BlockHasher, Namespace
from tiered_cache.migrator import Migrator, ThreadHealth
from tiered_cache.sizing import tier_num_blocks

log = logging.getLogger(__name__)

POOL = 0
"""The partition's fastest tier: the shared-memory pool (its BlockIndex's tier 0, as the device
tier is an engine's); `tiers.disk`, when configured, is the next one (`POOL + 1`)."""
REMOTE = 0          # the keyed tier's number (BlockIndex.keyed)


@register_error
class UnknownRootError(DaemonError):
    """A request named a root key this client's tenant has not registered (`root` first)."""

    wire_type = "unknown_root"


@register_error
class BadEntryError(DaemonError, ValueError):
    """A published entry is inconsistent (slot outside the staging area, repeated, tokens of
    the wrong length, depths out of order)."""

    wire_type = "bad_entry"


class ShmHostPool:
    """The partition's host tier for the copy handlers: a block-major `kv` over shared pages."""

    kind = "host"
    layout = "block_major"
    where = "tiers.host"
    scales = None
    resizable = False

    def __init__(self, shared: SharedPool) -> None:
        self.shared = shared
        self.kv = shared.kv
        self.num_slots = shared.geometry.num_slots


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


class Partition:
    """A tenant's tiers. Thread-safe: every method may run on any connection's thread."""

    def __init__(self, tenant: str, config: CacheConfig) -> None:
        self.tenant = tenant
        self.health = ThreadHealth()
        model = config.model
        self.block_size = bs = int(config.block_size)
        self.num_layers = model.num_layers
        self.hasher = BlockHasher(namespace_of(config))
        self.geometry = PoolGeometry(tier_num_blocks(config, "host"), model.num_layers, bs,
                                     model.num_kv_heads, model.head_dim, model.dtype)
        self.shared = SharedPool.create(self.geometry, name=f"host-{tenant}")
        self.pools: list = [ShmHostPool(self.shared)]
        self.remote = None          # data/remote_tier.RemoteTier when tiers.remote is set
        specs = [TierSpec("host", "host", self.geometry.num_slots)]
        keyed: list[TierSpec] = []
        try:
            disk = config.tiers.disk
            n_disk = tier_num_blocks(config, "disk") if disk is not None else 0
            if n_disk:
                from tiered_cache.data.disk_tier import DiskTier

                path = os.path.join(disk.path, tenant)
                self.pools.append(DiskTier(path, n_disk, host_kv=self.shared.kv,
                                           host_scales=None, num_tokens=bs,
                                           namespace=self.hasher.namespace_digest(),
                                           o_direct=disk.o_direct,
                                           max_slots=disk.max_num_blocks))
                specs.append(TierSpec("disk", "disk", n_disk, persistent=True,
                                      sync_target=False, admit_min_hits=disk.admit_min_hits))
            self.costs = costs.from_config(config, [s.kind for s in specs])
            remote = config.tiers.remote
            if remote is not None:
                from tiered_cache.data.remote_tier import RemoteTier, connect

                store = connect(remote, namespace=self.hasher.namespace_digest(),
                                num_tokens=bs, payload_bytes=config.block_bytes,
                                cost=self.costs.tiers.get("remote") if self.costs else None)
                self.remote = RemoteTier(store, host_kv=self.shared.kv, host_scales=None,
                                         namespace=self.hasher.namespace_digest())
                # NOTE: unstaged: a load lands straight in the pool slot the hold was given.
                keyed.append(TierSpec("remote", "remote", 0, staged=False,
                                      put_from=POOL if remote.write == "on_host" else None))
            self.index = BlockIndex(specs, policy=assembly.policy_factory(config),
                                    block_size=bs, num_layers=model.num_layers,
                                    hasher=self.hasher, block_bytes=config.block_bytes,
                                    verify_tokens=True, run=self._run, on_pressure=self._poke,
                                    high_watermark=config.migrator.high_watermark,
                                    keyed=keyed, worth=self._worth if self.costs else None)
            from tiered_cache.data import disk_tier, remote_tier
            from tiered_cache.data.executor import Executor

            stores = [self.remote] if self.remote is not None else []
            self.executor = Executor(self.pools + stores, [s.kind for s in specs + keyed])
            for (src, dst), handler in (*disk_tier.HANDLERS.items(),
                                        *remote_tier.HANDLERS.items()):
                self.executor.register(src, dst, handler)
            if len(specs) > 1:
                assembly.recover(self.index, self.pools)
            puts = [REMOTE] if keyed and keyed[0].put_from is not None else []
            self.migrator = Migrator(self.index, self.executor, config.migrator, self.health,
                                     put_tiers=puts)
        except BaseException:
            for pool in self.pools[1:]:
                pool.close()
            if self.remote is not None:
                self.remote.close()
            self.shared.close()
            raise
        self.lookup_deadline_s = remote.lookup_deadline_ms / 1e3 if remote else 0.0
        self.lookahead = remote.lookahead_blocks if remote else 0
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
        tokens = tokens[:len(tokens) // self.block_size * self.block_size]
        root_id = self._root_id(root)
        found, remote_failed = self._hold(root, root_id, parent, tokens, wait_s,
                                          self.remote is not None)
        if found is None and remote_failed:
            # NOTE: a block from the store failed its load (a corrupt or vanished record, a
            # dropped connection): what this node holds itself is still good, so that much is
            # served rather than nothing (the store is asked again next time).
            found, _ = self._hold(root, root_id, parent, tokens, wait_s, False)
        if found is None:
            self._count("fetch_misses")
            return None, []
        seq, slots = found
        self._count("fetched_blocks", len(slots))
        return seq, slots

    def _hold(self, root: bytes, root_id: int, parent: bytes, tokens: np.ndarray,
              wait_s: float, remote: bool) -> tuple[tuple[Sequence, list[int]] | None, bool]:
        """`fetch` once: pin what the pool (and the disk) hold, with the store's next blocks
        loaded after them if `remote`; wait for the copies. Returns ((hold, slots) or None for
        nothing held: a miss, a refusal or a copy that failed, counted; whether blocks loaded
        from the store were among the copies that failed)."""
        try:
            seq = self.index.open_blocks(root_id, parent, tokens, promote=self._promote)
        except (CapacityError, TransferError) as exc:
            log.debug("%s: fetch refused: %s", self.tenant, exc)
            return None, False
        loaded = 0
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
        except TieredCacheError as exc:     # PromotionTimeout, TransferError
            timeout = isinstance(exc, PromotionTimeout)
            self._count("fetch_timeouts" if timeout else "fetch_failures")
            log.info("%s: fetch gave up: %s", self.tenant, exc)
            self.index.close(seq)
            return None, loaded > 0 and not timeout
        except BaseException:
            self.index.close(seq)
            raise
        return (seq, slots), False

    def _load_remote(self, seq: Sequence, root: bytes, parent: bytes,
                     tokens: np.ndarray) -> int:
        """The hold ends before `tokens` do: ask the remote store for the next blocks (under
        its lookup deadline, no lock held) and load those it has into the hold, if that beats
        recomputing them (BlockIndex.keyed.load_after asks the cost model). Returns how many."""
        bs = self.block_size
        m = len(seq.blocks)
        rest = tokens[m * bs:(m + self.lookahead) * bs]
        keys = self.hasher.chain(seq.keys[m - 1] if m else parent, rest)
        if not keys:
            return 0
        # NOTE: asked even while the store's breaker is open: it answers "absent" at once
        # then, and lets one probe through after each backoff, which is how it comes back.
        r = leading(self.remote.exists(root, keys, self.lookup_deadline_s))
        if not r:
            return 0
        n = self.index.keyed.load_after(seq, REMOTE, parent, rest[:r * bs], keys[:r], self._promote)
        self._count("remote_blocks", n)
        return n

    def release(self, seq: Sequence) -> None:
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
        n_staging = staging.geometry.num_slots
        nbytes = 4 * self.block_size
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
        # Blocks already here (another engine computed them too) are not copied at all.
        new = [i for i, known in enumerate(self.index.known([e["key"] for e in entries]))
               if not known]
        taken = [False] * len(entries)
        if not new:
            self._count("duplicate_blocks", len(entries))
            return taken
        try:
            lent = self.index.persist.lend(POOL, len(new))
        except CapacityError:
            self._count("rejected_blocks", len(entries))
            return taken
        try:
            _copy_slots(staging.kv, [entries[i]["slot"] for i in new], self.shared.kv, lent)
        except BaseException:
            self.index.persist.unlend(POOL, lent)
            raise
        metas = [(slot, RecordMeta(entries[i]["key"], entries[i]["parent"], root,
                                   entries[i]["depth"], entries[i]["tokens"],
                                   entries[i]["hits"])) for i, slot in zip(new, lent)]
        adopted = self.index.persist.adopt(POOL, root_id, metas)
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
        n = self.index.invalidate(tokens, salt=salt, adapter_id=adapter)
        if self.remote is not None:
            self.remote.delete(root, self.hasher.chain(root, tokens))
        return n

    # data plane hooks -------------------------------------------------------------------------

    def _run(self, plan) -> None:
        self.executor.run(plan)

    def _worth(self, tier: int, nblocks: int, context_blocks: int) -> bool:
        """Loading `nblocks` from `tier` beats recomputing them (the cost model)."""
        return self.costs.worth_blocks(self.index.tier_name(tier), nblocks, context_blocks,
                                       block_bytes=self.index.block_bytes,
                                       block_size=self.block_size)

    def _poke(self) -> None:
        self.migrator.poke()

    def _promote(self, plan, readiness) -> None:
        assembly.promote(self.index, self.executor, self.migrator, plan, readiness)

    # lifetime ---------------------------------------------------------------------------------

    def stats(self) -> dict:
        out = self.index.stats()
        if self.remote is not None:
            out["tiers"]["remote"]["store"] = self.remote.stats()
        out["copies"] = self.migrator.copy_stats()
        out["threads"] = self.health.summary()
        with self._lock:
            out["daemon"] = dict(self.counters, roots=len(self._roots))
        return out

    def drain(self) -> int:
        """Copy every block whose only copy is in the pool to disk (a graceful stop: the pool
        is memory and goes with the process). Returns how many were written."""
        if len(self.index.tiers) < 2:
            return 0
        written = 0
        blocks = self.index.persist.blocks_in(POOL)
        for first in range(0, len(blocks), 256):
            plan = moves.plan_copy_down(self.index, blocks[first:first + 256], POOL, POOL + 1)
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
        self.migrator.stop()
        for seq in self.index.open_sequences():
            self.index.close(seq, timeout=5.0)
        if drain:
            n = self.drain()
            if n:
                log.info("%s: %d blocks written to disk before stopping", self.tenant, n)
        assembly.close_persistent(self.index, self.pools)
        if self.remote is not None:
            self.remote.flush(5.0)          # puts queued before the stop reach the server
            self.remote.close()
        self.shared.close()

    def describe(self) -> str:
        return json.dumps({"tenant": self.tenant, "slots": self.geometry.num_slots,
                           "tiers": [t.name for t in self.index.tiers]})

    def _count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] += n
