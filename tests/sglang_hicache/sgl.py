"""SGLang's own parts for the contract tests: host KV pools built on CPU, the backend loaded by
SGLang's `dynamic` storage factory, and a cache controller whose storage methods (prefetch:
`_storage_hit_query` -> `_page_transfer`; write-back: `_page_backup`) are SGLang's code, run on
an instance that skips only its GPU and process-group setup."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from queue import Queue

import torch

from tests.sglang_hicache.conftest import STUBS

REPO = Path(__file__).resolve().parents[2]
L, H, D, PAGE, TOKENS = 2, 2, 8, 4, 256          # layers, heads, head dim, page, device tokens
MODEL = "tiny-llama-test"


def env() -> dict:
    """The environment of a subprocess that imports SGLang here."""
    out = dict(os.environ)
    paths = [str(REPO)]
    if str(STUBS) in sys.path:
        paths.append(str(STUBS))
    out["PYTHONPATH"] = os.pathsep.join(paths + [out.get("PYTHONPATH", "")])
    return out


def mha_pool(layout: str, *, heads: int = H):
    from sglang.srt.mem_cache.device_pool_info import KVBufferLayout, KVBuffers, MHABufferInfo
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    k = tuple(torch.zeros(TOKENS, heads, D) for _ in range(L))
    v = tuple(torch.zeros(TOKENS, heads, D) for _ in range(L))
    ptrs = [torch.tensor([t.data_ptr() for t in kv], dtype=torch.uint64) for kv in (k, v)]
    info = MHABufferInfo(buffers=KVBuffers(k=k, v=v, k_data_ptrs=ptrs[0], v_data_ptrs=ptrs[1],
                                           layout=KVBufferLayout.NHD),
                         page_size=PAGE, head_num=heads, head_dim=D, v_head_dim=D,
                         dtype=torch.float32, device=torch.device("cpu"))
    return MHATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=TOKENS, start_layer=0, end_layer=L)


def mla_pool(layout: str):
    from sglang.srt.mem_cache.device_pool_info import MLABufferInfo
    from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost

    lora, rope = 16, 8
    bufs = tuple(torch.zeros(TOKENS, 1, lora + rope) for _ in range(L))
    info = MLABufferInfo(buffers=bufs, data_ptrs=torch.tensor([b.data_ptr() for b in bufs],
                                                              dtype=torch.uint64),
                         layer_indices=tuple(range(L)), device_layer_num=L, page_size=PAGE,
                         kv_lora_rank=lora, qk_rope_head_dim=rope, kv_cache_dim=lora + rope,
                         dtype=torch.float32, device=torch.device("cpu"))
    return MLATokenToKVPoolHost(info, 2.0, 0, PAGE, layout, pin_memory=False, device="cpu",
                                device_capacity_tokens=TOKENS, start_layer=0, end_layer=L,
                                target_layer_num=L)


def storage_config(config, *, tp_rank: int = 0, tp_size: int = 1, mla: bool = False,
                   v1: bool = True, metrics: bool = False, **extra):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=mla, enable_storage_metrics=metrics,
        is_page_first_layout=False, model_name=MODEL,
        extra_config={"backend_name": "tiered_cache",
                      "module_path": "tiered_cache.integrations.sglang",
                      "class_name": "TieredCacheStorage", "interface_v1": int(v1),
                      "config": config, **extra})


def backend(config, pool, **kw):
    """The backend as SGLang's attach_storage_backend makes it: through the factory's
    `dynamic` loader, then register_mem_pool_host."""
    from sglang.srt.mem_cache.storage import StorageBackendFactory

    b = StorageBackendFactory.create_backend("dynamic", storage_config(config, **kw), pool)
    b.register_mem_pool_host(pool)
    return b


def controller(storage, pool, *, v1: bool = True):
    """A HiCacheController carrying what its storage methods read; its methods are SGLang's."""
    from sglang.srt.managers.cache_controller import HiCacheController

    c = HiCacheController.__new__(HiCacheController)
    c.storage_backend = storage
    c.storage_host_pool = c.mem_pool_host = pool
    c.page_size = pool.page_size
    c.prefetch_sync_queue = Queue()
    c.storage_backend_type = "dynamic"
    if v1:      # what attach_storage_backend picks for `dynamic` with interface_v1
        c.page_get_func, c.page_set_func = c._page_get_zero_copy, c._page_set_zero_copy
    else:
        c.page_get_func, c.page_set_func = c._generic_page_get, c._generic_page_set
    return c


def fill(pool, slots: torch.Tensor, seed: int) -> None:
    """Distinct KV in the pages at `slots` (what a device -> host backup would leave)."""
    g = torch.Generator().manual_seed(seed)
    for p in range(0, len(slots), pool.page_size):
        index = int(slots[p])
        page = pool.get_data_page(index, flat=False)
        pool.set_from_flat_data_page(index, torch.randn(page.numel(), generator=g))


def pages_of(pool, slots: torch.Tensor) -> list[torch.Tensor]:
    return [pool.get_data_page(int(slots[p]), flat=True).clone()
            for p in range(0, len(slots), pool.page_size)]


def write_back(ctrl, pool, tokens: list[int], slots: torch.Tensor) -> int:
    """The controller's write-back of `tokens` held at host `slots`; tokens written."""
    from sglang.srt.managers.cache_controller import StorageOperation
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    hashes = get_storage_hash_str(tokens, None, page_size=pool.page_size)
    op = StorageOperation(slots, tokens, hash_value=hashes)
    ctrl._page_backup(op)
    return op.completed_tokens


def prefetch(ctrl, pool, tokens: list[int]) -> tuple[int, int, torch.Tensor | None]:
    """The controller's prefetch: storage hit query, then page transfer into host slots it
    allocates. Returns (tokens the query found, tokens transferred, the slots)."""
    from sglang.srt.managers.cache_controller import PrefetchOperation

    op = PrefetchOperation("req", tokens)
    hashes, hit_tokens = ctrl._storage_hit_query(op)
    if not hit_tokens:
        return 0, 0, None
    op.hash_value = hashes[:hit_tokens // pool.page_size]
    op.host_indices = pool.alloc(hit_tokens)
    pages = ctrl._page_transfer(op)
    return hit_tokens, pages * pool.page_size, op.host_indices
