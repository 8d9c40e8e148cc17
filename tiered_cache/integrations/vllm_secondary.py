"""TieredCacheTier: tiered-cache's disk, remote and daemon tiers behind vLLM's CPU offloading pool.

vLLM's `OffloadingConnector` with `TieringOffloadingSpec` keeps a CPU primary pool and cascades
every chunk stored there to its secondary tiers; a chunk that the primary pool no longer holds
is looked up in them and promoted back (secondary -> primary -> GPU). This class is such a
secondary tier, over the page store (tiered_cache.pages)::

    kv_connector_extra_config = {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8 << 30,
        "secondary_tiers": [{"type": "TieredCacheTier",
                             "module_path": "tiered_cache.integrations.vllm_secondary",
                             "config": "/etc/tiered-cache/vllm-tier.yaml"}]}

It runs in vLLM's scheduler process. Bytes move through the memoryview vLLM gives it of its
shared CPU pool (`primary_kv_view`, one row per chunk): a store writes row `chunk_id` of each
job to the page store (a disk write from the row itself, a Redis value made from it, or one copy
into the daemon's staging area), a load fills rows from it. Every method vLLM calls returns at
once: lookups of a shared tier (remote, daemon) go through vLLM's own AsyncLookupManager (one
batched existence check per scheduler step, RETRY meanwhile), a local disk answers from its
in-memory index, and stores and loads run on two worker threads (loads never wait behind
stores) that report through `get_finished_jobs`.

Identity: a chunk is a page named by vLLM's OffloadKey (block hash + KV group) within a format
naming the model, KV dtype, vLLM's KV layout (direct or canonical, replicated or not), the
chunk's tokens and bytes, the KV groups and the parallel sizes. A chunk row holds every worker's
part of the block (`|W0|W1|...|`), so it is stored whole: a hit has every rank's part by
construction. A load that fails (a corrupt record, a server gone, a page evicted since the
lookup) reports the keys loaded before it as successful and the rest as failed, and marks them
missing for the lookups, so vLLM recomputes them; it never fills a row with wrong bytes that is
reported loaded.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import weakref
from collections.abc import Iterable
from typing import Any, ClassVar

from vllm.v1.kv_offload.base import (
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from tiered_cache.errors import ConfigError
from tiered_cache.pages.config import PageStoreConfig
from tiered_cache.pages.identity import PageFormat
from tiered_cache.pages.store import PageStore

log = logging.getLogger(__name__)

PART = b"all-ranks"                 # a chunk row holds every worker's part of the block
WHERE = "secondary_tiers[].config"


def page_format(offloading_spec, chunk_bytes: int) -> PageFormat:
    """The format digest inputs of vLLM's offloaded chunks (see the module docstring)."""
    cfg = offloading_spec.config
    p = cfg.parallel
    layout = (f"offload-chunk/{cfg.kv_cache_layout or 'default'}"
              f"/{'canonical' if cfg.canonical_layout else 'direct'}"
              f"/{'replicated' if offloading_spec.replicated_layout else 'per-worker'}")
    geometry = json.dumps({
        "groups": [[g.group_id, g.tokens_per_block, len(g.layer_names)] for g in cfg.groups],
        "worker_kv_bytes_per_block": cfg.worker_kv_bytes_per_block,
        "blocks_per_chunk": cfg.cache.blocks_per_chunk,
        "tokens_per_hash": cfg.cache.tokens_per_hash,
        "parallel": [p.tp_size, p.pp_size, p.pcp_size, p.dcp_size],
    }, sort_keys=True)
    return PageFormat("vllm", cfg.model.name, str(cfg.model.dtype), layout,
                      cfg.cache.tokens_per_hash * cfg.cache.blocks_per_chunk, chunk_bytes,
                      geometry, shards=max(1, p.world_size))


class _Lookups(AsyncLookupManager):
    """Batched existence checks of a shared tier, on vLLM's lookup thread."""

    def __init__(self, tier: TieredCacheTier, tier_type: str) -> None:
        self._tier = tier
        super().__init__(tier_type=tier_type)

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier.present(keys)


class TieredCacheTier(SecondaryTierManager):
    medium: ClassVar[Medium] = Medium.STORAGE
    # NOTE: vLLM keeps its tiers deep inside the connector; this lets a process find its own
    # (stats, tests) without walking vLLM's internals.
    instances: ClassVar[weakref.WeakSet] = weakref.WeakSet()

    def __init__(self, offloading_spec, primary_kv_view: memoryview, tier_type: str,
                 config: str | dict | None = None, backpressure_detector=None,
                 locality: str | None = None) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if config is None:
            raise ConfigError(WHERE, "required: a tiered-cache YAML path or an inline mapping "
                                     "of tiers.disk / remote / daemon")
        self.settings = PageStoreConfig.load(config, WHERE)
        view = primary_kv_view
        self._rows = view if view.ndim == 1 else view.cast("B")
        self.chunk_bytes = self.block_size_bytes
        self.format = page_format(offloading_spec, self.chunk_bytes)
        # NOTE: a disk directory has one owner: each data-parallel replica's scheduler has its
        # own; two engines on one node need two tiers.disk.path (or share the daemon's disk).
        par = offloading_spec.config.parallel
        dp = getattr(par, "data_parallel_index", 0) if getattr(par, "data_parallel_size", 1) > 1 \
            else None
        self.store = PageStore.from_config(self.settings, self.format,
                                           disk_dir="vllm" if dp is None else f"vllm-dp{dp}")
        self._lookups = _Lookups(self, tier_type) if self.store.shared else None
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        # worker -> scheduler: keys to mark missing (the AsyncLookupManager is the scheduler's)
        self._missing: queue.SimpleQueue[list[OffloadKey]] = queue.SimpleQueue()
        self.counts = {"stores": 0, "stored_chunks": 0, "loads": 0, "loaded_chunks": 0,
                       "failed_loads": 0, "failed_stores": 0, "errors": 0}
        self._counts_lock = threading.Lock()
        self._pending = 0
        self._idle = threading.Condition()
        self._queues = {"load": queue.SimpleQueue(), "store": queue.SimpleQueue()}
        self._threads = [threading.Thread(target=self._work, args=(q,), daemon=True,
                                          name=f"tc-vllm-tier-{kind}")
                         for kind, q in self._queues.items()]
        for t in self._threads:
            t.start()
        TieredCacheTier.instances.add(self)
        log.info("tiered-cache secondary tier: %d-byte chunks, tiers %s", self.chunk_bytes,
                 [t.name for t in self.store.tiers])

    # lookups (scheduler thread) ---------------------------------------------------------------

    def present(self, keys: list[OffloadKey]) -> list[bool]:
        """Which keys the store holds now (vLLM's lookup thread, or inline for a disk)."""
        n = self.store.exists(keys, PART) if keys else 0
        return [i < n for i in range(len(keys))]

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        disk = self.store.disk
        if disk is not None and disk.contains(self.store.root(PART), [bytes(key)])[0]:
            return LookupResult.HIT
        if self._lookups is None:
            return LookupResult.MISS
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        if self._lookups is not None:
            self._lookups.cleanup(req_context.req_id)

    def on_schedule_end(self, context) -> None:
        if self._lookups is not None:
            self._lookups.flush()

    # transfers --------------------------------------------------------------------------------

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._submit("store", job_metadata)

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._submit("load", job_metadata)

    def _submit(self, kind: str, job: TransferJob) -> None:
        keys = list(job.keys)
        if len(keys) != len(job.chunk_ids):
            raise ValueError(f"job {job.job_id}: {len(keys)} keys but {len(job.chunk_ids)} "
                             "chunk ids")
        with self._idle:
            self._pending += 1
        self._queues[kind].put((kind, job.job_id, keys, [int(c) for c in job.chunk_ids]))

    def _row(self, chunk: int) -> memoryview:
        at = chunk * self.chunk_bytes
        return self._rows[at:at + self.chunk_bytes]

    def _work(self, q: queue.SimpleQueue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            kind, job_id, keys, chunks = item
            try:
                result = (self._load(job_id, keys, chunks) if kind == "load"
                          else self._store(job_id, keys, chunks))
            except Exception:
                # NOTE: never dies silently: the job fails (a load's chunks are recomputed,
                # a store is simply not in this tier) and the thread carries on.
                log.exception("tiered-cache secondary tier: %s job %d failed", kind, job_id)
                self._count(errors=1)
                if kind == "load" and self._lookups is not None:
                    self._missing.put(keys)
                result = JobResult(job_id=job_id, success=False)
            self._finished.put(result)
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

    def _store(self, job_id: int, keys: list[OffloadKey], chunks: list[int]) -> JobResult:
        have = self.present(keys)
        todo = [i for i, h in enumerate(have) if not h]
        ok = self.store.put([keys[i] for i in todo], [self._row(chunks[i]) for i in todo],
                            PART) if todo else []
        success = all(ok)
        self._count(stores=1, stored_chunks=sum(ok), failed_stores=int(not success))
        return JobResult(job_id=job_id, success=success, transfer_bytes=len(todo) *
                         self.chunk_bytes)

    def _load(self, job_id: int, keys: list[OffloadKey], chunks: list[int]) -> JobResult:
        ok = self.store.get(keys, [self._row(c) for c in chunks], PART)
        lead = ok.index(False) if False in ok else len(ok)
        self._count(loads=1, loaded_chunks=lead, failed_loads=int(lead < len(keys)))
        if lead == len(keys):
            return JobResult(job_id=job_id, success=True,
                             transfer_bytes=lead * self.chunk_bytes)
        # NOTE: only the leading run is reported loaded: what vLLM loads is a prefix, and a
        # row after a miss is never claimed whatever it holds. The rest are marked missing so
        # the scheduler stops promoting them (vLLM #49176) and recomputes them.
        self._missing.put(keys[lead:])
        return JobResult(job_id=job_id, success=False,
                         successful_keys=tuple(keys[:lead]) if lead else None,
                         transfer_bytes=lead * self.chunk_bytes)

    def _count(self, **deltas: int) -> None:
        with self._counts_lock:
            for k, v in deltas.items():
                self.counts[k] += v

    def get_finished_jobs(self) -> Iterable[JobResult]:
        if self._lookups is not None:
            while not self._missing.empty():
                self._lookups.mark_miss(self._missing.get())
        out = []
        while not self._finished.empty():
            out.append(self._finished.get())
        return out

    def has_pending_work(self) -> bool:
        with self._idle:
            return self._pending > 0 or not self._finished.empty()

    def drain_jobs(self) -> None:
        with self._idle:
            self._idle.wait_for(lambda: self._pending == 0)

    def stats(self) -> dict[str, Any]:
        with self._counts_lock:
            counts = dict(self.counts)
        return {**counts, "store": self.store.stats()}

    def shutdown(self) -> None:
        for q in self._queues.values():
            q.put(None)
        for t in self._threads:
            t.join(timeout=30)
        if self._lookups is not None:
            self._lookups.shutdown()
        self.store.close()
