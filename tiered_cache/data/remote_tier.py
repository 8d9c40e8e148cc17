"""The remote tier as a pool of the copy executor: `RemoteTier` over a `KeyedStore` (Redis or
Valkey, tiered_cache.stores), and its handlers.

- remote -> host: the first stage of a load: every record is fetched, verified by the store
  (namespace, key, tenant root, payload hash) and copied into its block's host staging slot; a
  record that is gone or fails raises `CorruptBlocks` naming those blocks (a miss for them).
- host -> remote: a block that reached the host tier becomes one record (header + KV, one value
  per block), queued for the store's background writer (the copy into the record is the only
  work done while the block is held).

Lookups (`exists`) are the facade's, under the configured deadline, outside the lock.
"""

from __future__ import annotations

import logging
from collections import defaultdict

import numpy as np
import torch

from tiered_cache import records
from tiered_cache.core.transfer import Transfer
from tiered_cache.data.disk_tier import CorruptBlocks
from tiered_cache.stores.base import KeyedStore

log = logging.getLogger(__name__)


class RemoteTier:
    """The remote tier's pool: a shared store of block records (built by tiers/remote.py)."""

    layout = "record"
    scales = None

    def __init__(self, store: KeyedStore, *, host_kv: torch.Tensor,
                 host_scales: torch.Tensor | None, namespace: bytes) -> None:
        self.store = store
        self.namespace = namespace
        self.kv_bytes = int(host_kv[0].numel() * host_kv.element_size())
        self.scale_bytes = (int(host_scales[0].numel() * 4) if host_scales is not None else 0)

    @property
    def available(self) -> bool:
        return self.store.available

    def exists(self, root: bytes, keys: list[bytes], deadline_s: float) -> list[bool]:
        return self.store.exists(root, keys, deadline_s)

    def delete(self, root: bytes, keys: list[bytes]) -> int:
        """`invalidate` here: delete the records of these blocks (a prefix's own). What was
        stored below them becomes unreachable (a lookup stops at the first missing key) and
        leaves by the server's eviction. Best effort: a dead server deletes nothing, and a put
        already queued may land after the delete."""
        return self.store.delete(root, keys) if keys else 0

    def flush(self, timeout_s: float) -> None:
        """Wait up to `timeout_s` for the background writer's queue to empty."""
        self.store.flush(timeout_s)

    def close(self) -> None:
        self.store.close()

    def stats(self) -> dict:
        return self.store.stats()


def _by_root(transfers: list[Transfer]) -> dict[bytes, list[Transfer]]:
    out: dict[bytes, list[Transfer]] = defaultdict(list)
    for t in transfers:
        out[t.meta.root].append(t)
    return out


def remote_to_host(src: RemoteTier, dst, transfers: list[Transfer], layers, nb) -> None:
    failed: list[int] = []
    want = src.kv_bytes + src.scale_bytes
    for root, group in _by_root(transfers).items():
        got = src.store.get(root, [t.meta.key for t in group])
        for t, record in zip(group, got):
            if record is None:
                failed.append(t.block)
                continue
            header = records.decode_header(record, namespace=src.namespace)
            payload = np.frombuffer(memoryview(record)[header.header_len:], dtype=np.uint8)
            if (payload.size != want or header.key != t.meta.key
                    or header.tokens != t.meta.tokens or header.parent != t.meta.parent):
                failed.append(t.block)          # another block's record under this key
                continue
            kv = dst.kv[t.dst_slot].view(torch.uint8).numpy().reshape(-1)
            kv[:] = payload[:src.kv_bytes]
            if dst.scales is not None:
                dst.scales[t.dst_slot].view(torch.uint8).numpy().reshape(-1)[:] = \
                    payload[src.kv_bytes:]
    if failed:
        raise CorruptBlocks(failed, "the remote store no longer holds them, or they failed "
                                    "verification")


def host_to_remote(src, dst: RemoteTier, transfers: list[Transfer], layers, nb) -> None:
    for root, group in _by_root(transfers).items():
        items = []
        for t in group:
            m = t.meta
            payload = src.kv[t.src_slot].contiguous().view(torch.uint8).numpy().reshape(-1)
            if src.scales is not None:
                payload = np.concatenate([payload, src.scales[t.src_slot].contiguous()
                                          .view(torch.uint8).numpy().reshape(-1)])
            items.append((m.key, records.encode(dst.namespace, m.key, m.parent, m.root,
                                                m.depth, m.tokens, m.hits, payload)))
        dst.store.put_async(root, items)
