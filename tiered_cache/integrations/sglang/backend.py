"""TieredCacheStorage: SGLang's HiCache storage backend (L3) over the tiered-cache page store.

Loaded by SGLang's `dynamic` backend::

    --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "tiered_cache",
        "module_path": "tiered_cache.integrations.sglang", "class_name": "TieredCacheStorage",
        "interface_v1": 1, "config": "/etc/tiered-cache/sglang.yaml"}'

`config` is a tiered-cache YAML path or the same keys inline (tiered_cache.pages.config):
`tiers.disk`, `tiers.remote` or `tiers.daemon`, and `pages`. SGLang's cache controller drives
the backend from two threads: prefetch (`batch_exists` -> `batch_get_v1` into host-pool slots
it allocated) and write-back (`batch_set_v1` from host-pool slots), one storage batch (128
pages) at a time; its pages are named by SGLang's page hash strings.

Identity: every page is stored under a format digest naming the engine, the model (SGLang's
storage model name, which carries the host pool's format tag), the KV dtype, the host layout,
the page size and shape and the TP size, and under a part naming the TP rank (and PP stage and
attention-CP rank), or, for MLA (KV replicated over the ranks), the one replicated copy that
SGLang's storage writer (`is_storage_writer`) writes. A hit counts only pages present for every
rank's part wherever a shared tier can see them (remote, daemon); SGLang then takes the minimum
of the ranks' counts, so a page set missing one rank's part (a rank died mid-store) is a miss.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from tiered_cache.errors import ConfigError
from tiered_cache.integrations.sglang.host_pages import HostPages
from tiered_cache.pages.config import PageStoreConfig
from tiered_cache.pages.identity import PageFormat
from tiered_cache.pages.store import PageStore

log = logging.getLogger(__name__)

WHERE = "hicache-storage-backend-extra-config"


class TieredCacheStorage(HiCacheStorage):
    """One TP rank's view of the page store. Thread-safe (the page store is)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Any = None) -> None:
        extra = dict(storage_config.extra_config or {})
        if "config" not in extra:
            raise ConfigError(f"{WHERE}.config", "required: a tiered-cache YAML path or an "
                                                 "inline mapping of tiers.disk / remote / daemon")
        self.config = PageStoreConfig.load(extra["config"], f"{WHERE}.config")
        if storage_config.dcp_size > 1:
            raise ConfigError(f"{WHERE}", "decode context parallelism (dcp_size > 1) is not "
                                          "supported by this backend")
        model = storage_config.model_name or extra.get("model")
        if not model:
            raise ConfigError(f"{WHERE}.model", "SGLang gave no model name: name the model, "
                                                "which keys the pages")
        self.model = str(model)
        sc = storage_config
        self.storage_config = sc
        self.replicated = bool(sc.is_mla_model)
        self.writer = sc.is_storage_writer
        self.part = _part(sc.tp_rank, sc.tp_size, self.replicated, sc.pp_rank, sc.pp_size,
                          sc.attn_cp_rank, sc.attn_cp_size)
        self.other_parts = ([] if self.replicated else
                            [_part(r, sc.tp_size, False, sc.pp_rank, sc.pp_size,
                                   sc.attn_cp_rank, sc.attn_cp_size)
                             for r in range(sc.tp_size) if r != sc.tp_rank])
        if (self.replicated and sc.tp_size > 1 and self.config.daemon is None
                and self.config.remote is None):
            raise ConfigError("tiers.disk", f"with an MLA model over {sc.tp_size} TP ranks only "
                              "the storage writer rank stores pages, and a disk directory has "
                              "one owner: the other ranks could never read them. Use "
                              "tiers.daemon (its disk serves every rank of the node) or "
                              "tiers.remote")
        self.enable_metrics = bool(sc.enable_storage_metrics)
        self.store: PageStore | None = None
        self.pages: HostPages | None = None
        self._metrics_lock = threading.Lock()
        self._metrics: dict[str, list] = {"prefetch_pgs": [], "backup_pgs": [],
                                          "prefetch_bandwidth": [], "backup_bandwidth": []}

    # attach -----------------------------------------------------------------------------------

    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pages = HostPages(mem_pool_host)
        fmt = PageFormat("sglang", self.model, str(pages.dtype).removeprefix("torch."),
                         pages.layout, pages.page_size, pages.page_bytes,
                         f"{type(mem_pool_host).__name__}{list(pages.page_shape)}",
                         shards=1 if self.replicated else self.storage_config.tp_size)
        store = PageStore.from_config(self.config, fmt,
                                      disk_dir=re.sub(r"[^A-Za-z0-9_.-]", "_",
                                                      self.part.decode()),
                                      use_disk=self.writer or not self.replicated)
        if self.store is not None:
            self.store.close()
        self.pages, self.store = pages, store
        log.info("tiered-cache HiCache backend: part %s, %d-byte pages (%s, %d piece(s) each, "
                 "zero copy: %s), tiers %s", self.part.decode(), pages.page_bytes, pages.layout,
                 pages.pieces_per_page, pages.zero_copy, [t.name for t in store.tiers])

    def on_host_pools_registered(self) -> None:
        """Refuse, at attach, host pools besides KV: their pages move through SGLang's v2
        interface (batch_*_v2 with per-pool hit policies), which this backend does not serve."""
        names = [str(n) for n in getattr(self, "registered_pools", {}) if str(n) != "kv"]
        if names:
            raise ConfigError(WHERE, f"host pools {names} (a hybrid model's sidecar state) need "
                                     "SGLang's v2 storage interface, which tiered-cache's "
                                     "backend does not serve yet: only the KV pool is stored")

    def _ready(self) -> tuple[PageStore, HostPages]:
        if self.store is None or self.pages is None:
            raise RuntimeError("the host pool is not registered yet (register_mem_pool_host)")
        return self.store, self.pages

    # lookups ----------------------------------------------------------------------------------

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info=None) -> int:
        store, _ = self._ready()
        return store.exists(keys, self.part, self.other_parts)

    # the v1 interface: host-pool slots --------------------------------------------------------

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info=None) -> list[bool]:
        store, pages = self._ready()
        pages.check_indices(host_indices, len(keys))
        t0 = time.perf_counter()
        idx = [pages.page_index(host_indices, i) for i in range(len(keys))]
        if pages.zero_copy:
            ok = store.get(keys, [pages.pieces(j) for j in idx], self.part)
        else:
            bufs = [pages.scratch() for _ in keys]
            ok = store.get(keys, bufs, self.part)
            for j, buf, hit in zip(idx, bufs, ok):
                if hit:
                    pages.store_flat(j, buf)
        self._observe("prefetch", sum(ok), pages.page_bytes, time.perf_counter() - t0)
        return ok

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info=None) -> list[bool]:
        store, pages = self._ready()
        pages.check_indices(host_indices, len(keys))
        if not self.writer:
            # NOTE: SGLang's controller never calls this on a rank that is not the storage
            # writer (replicated KV: one writer); if something does, nothing is claimed stored.
            return [False] * len(keys)
        t0 = time.perf_counter()
        idx = [pages.page_index(host_indices, i) for i in range(len(keys))]
        payloads = ([pages.pieces(j) for j in idx] if pages.zero_copy
                    else [pages.flat(j) for j in idx])
        ok = store.put(keys, payloads, self.part)
        self._observe("backup", sum(ok), pages.page_bytes, time.perf_counter() - t0)
        return ok

    # the generic interface: flat page tensors -------------------------------------------------

    def get(self, key: str, target_location: Any = None, target_sizes: Any = None):
        [got] = self.batch_get([key], [target_location])
        return got

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        store, pages = self._ready()
        if target_locations is None:
            target_locations = [pages.scratch() for _ in keys]
        ok = store.get(keys, list(target_locations), self.part)
        return [t if hit else None for t, hit in zip(target_locations, ok)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        store, _ = self._ready()
        if not self.writer:
            return False
        flat = [v.contiguous() if isinstance(v, torch.Tensor) else v for v in values]
        return all(store.put(keys, flat, self.part))

    # the rest ---------------------------------------------------------------------------------

    def clear(self) -> None:
        """Drops this rank's pages from its own disk. Pages in shared tiers (remote, daemon)
        belong to every engine using them and are left to their eviction."""
        if self.store is not None and self.store.disk is not None:
            n = self.store.disk.clear()
            log.info("tiered-cache HiCache backend: %d page(s) cleared from this rank's disk", n)

    def _observe(self, what: str, pages: int, page_bytes: int, seconds: float) -> None:
        if not self.enable_metrics or not pages:
            return
        with self._metrics_lock:
            self._metrics[f"{what}_pgs"].append(pages)
            self._metrics[f"{what}_bandwidth"].append(pages * page_bytes / 1e9
                                                      / max(seconds, 1e-9))

    def get_stats(self):
        if not self.enable_metrics:
            return None
        from sglang.srt.observability.metrics_collector import StorageMetrics

        out = StorageMetrics()
        with self._metrics_lock:
            for name, values in self._metrics.items():
                getattr(out, name).extend(values)
                values.clear()
        return out

    def stats(self) -> dict:
        """The page store's counters (not SGLang's StorageMetrics)."""
        return self.store.stats() if self.store is not None else {}

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None


def _part(tp_rank: int, tp_size: int, replicated: bool, pp_rank: int, pp_size: int,
          cp_rank: int, cp_size: int) -> bytes:
    name = "replicated" if replicated else f"tp{tp_rank}of{tp_size}"
    if pp_size > 1:
        name += f".pp{pp_rank}of{pp_size}"
    if cp_size > 1:
        name += f".cp{cp_rank}of{cp_size}"
    return name.encode()
