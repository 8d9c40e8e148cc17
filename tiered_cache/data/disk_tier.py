"""The disk tier as a pool of the copy executor: `DiskTier` over `DiskPool`, and its handlers.

A disk slot holds one record (tiered_cache.records): the block's identity from the plan's
`RecordMeta` and its KV in the host tier's block-major layout (plus, for FP8 storage, the
block's scales). The handlers copy between host (or device) pools and disk slots:

- host -> disk, device -> disk: demotion and the persisted ancestors of demoted blocks;
- disk -> host: the first stage of a promotion from disk (every record verified before a byte
  of it is used; a record that fails is raised as `CorruptBlocks`, a TransferError that names
  the slots, so the commit drops those disk copies and counts them).

NOTE: the payload hash of each slot's record stays in memory (16 bytes a slot), so a read can
verify without rereading the header. Everything here runs on background threads, outside the
control-plane lock.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from tiered_cache.core.transfer import Transfer
from tiered_cache.data.disk import CorruptSlots, DiskPool
from tiered_cache.errors import TierUnavailableError, TransferError
from tiered_cache.records import RecordHeader, encode_header, payload_hash

log = logging.getLogger(__name__)


class CorruptBlocks(TransferError):
    """Blocks whose records could not be read (failed verification, or gone from a store): a
    miss for those blocks, never data. `blocks` names them (block ids)."""

    def __init__(self, blocks: list[int], reason: str) -> None:
        self.blocks = blocks
        super().__init__(f"{len(blocks)} block record(s) unusable: {reason}")


class DiskTier:
    """The disk tier's pool: `num_slots` record slots of one host block each."""

    layout = "record"
    scales = None
    where = "tiers.disk"

    def __init__(self, path: str | Path, num_slots: int, *, host_kv: torch.Tensor,
                 host_scales: torch.Tensor | None, num_tokens: int, namespace: bytes,
                 o_direct: bool = False, max_slots: int | None = None) -> None:
        self.slot_shape = tuple(host_kv.shape[1:])
        self.kv_dtype = host_kv.dtype
        self.kv_bytes = int(host_kv[0].numel() * host_kv.element_size())
        self.scale_shape = tuple(host_scales.shape[1:]) if host_scales is not None else None
        self.scale_bytes = (int(host_scales[0].numel() * 4) if host_scales is not None else 0)
        self.namespace = namespace
        self.pool = DiskPool(path, num_slots=num_slots,
                             payload_bytes=self.kv_bytes + self.scale_bytes,
                             num_tokens=num_tokens, namespace=namespace, o_direct=o_direct,
                             max_slots=max_slots)
        self._hashes = np.zeros((num_slots, 16), dtype=np.uint8)
        self._hits = np.zeros(num_slots, dtype=np.int64)    # use count each record holds
        self._no_tokens = bytes(4 * num_tokens)

    # ------------------------------------------------------------------ lifecycle
    @property
    def num_slots(self) -> int:
        return self.pool.num_slots

    @property
    def max_slots(self) -> int | None:
        return self.pool.max_slots

    def recover(self) -> list[tuple[int, RecordHeader]]:
        """Every valid record on disk (a restart rebuilds the index from them)."""
        found = self.pool.scan()
        for slot, header in found:
            self._hashes[slot] = np.frombuffer(header.payload_hash, dtype=np.uint8)
            self._hits[slot] = header.hits
        return found

    def save_hits(self, slots: list[int], hits: list[int]) -> int:
        """Rewrite the use counts of records whose block was reused since it was written (a
        graceful shutdown), so a restart's policies start from them. Returns how many."""
        changed = [(s, h) for s, h in zip(slots, hits) if self._hits[s] != h]
        if changed:
            try:
                self.pool.update_hits([s for s, _ in changed], [h for _, h in changed])
            except CorruptSlots as exc:
                log.warning("tiers.disk: %s while saving use counts", exc)
            for s, h in changed:
                self._hits[s] = h
        return len(changed)

    def check_resize(self, num_slots: int) -> None:
        if num_slots < self.num_slots:
            raise TierUnavailableError(
                "tiers.disk: shrinking the disk tier while serving is not supported; restart "
                "with a smaller num_blocks (records in the slots cut off are dropped)")
        self.pool.check_resize(num_slots)

    def resize(self, num_slots: int) -> None:
        self.pool.resize(num_slots)
        if num_slots > len(self._hashes):
            grown = np.zeros((num_slots, 16), dtype=np.uint8)
            grown[:len(self._hashes)] = self._hashes
            self._hashes = grown
            self._hits = np.concatenate([self._hits,
                                         np.zeros(num_slots - len(self._hits), np.int64)])

    def erase(self, slots: list[int]) -> None:
        """Tombstone records of dropped blocks (durable on return)."""
        if slots:
            self.pool.erase(slots)
            self._hashes[np.asarray(slots, dtype=np.intp)] = 0

    def close(self) -> None:
        self.pool.close()

    def stats(self) -> dict:
        return self.pool.stats()

    # ------------------------------------------------------------------ records
    def write(self, slots: list[int], metas: list, payloads: list[np.ndarray]) -> None:
        """One record per slot: `metas[i]` (a RecordMeta) and `payloads[i]` (payload bytes)."""
        headers = []
        for meta, payload in zip(metas, payloads):
            if meta is None:
                raise TransferError("a disk write without the block's identity (RecordMeta)")
            digest = payload_hash(payload)
            headers.append(encode_header(self.namespace, meta.key, meta.parent, meta.root,
                                         meta.depth, meta.tokens, meta.hits,
                                         self.kv_bytes + self.scale_bytes, digest))
        written = self.pool.write(slots, headers, payloads)
        for slot, header in zip(slots, written):
            self._hashes[slot] = np.frombuffer(header.payload_hash, dtype=np.uint8)
            self._hits[slot] = header.hits

    def read(self, slots: list[int], outs: list) -> list[int]:
        """Verified payloads of `slots` into `outs`; returns the slots that failed (their outs
        hold garbage; their records are erased)."""
        headers = [self._header(s) for s in slots]
        try:
            self.pool.read_many(slots, headers, outs)
        except CorruptSlots as exc:
            bad = exc.slots
            log.warning("tiers.disk: %d record(s) failed verification on read (%s); they are "
                        "dropped", len(bad), exc)
            try:
                self.erase(bad)
            except Exception:  # noqa: BLE001 - the slots are dropped either way
                log.exception("tiers.disk: erasing corrupt records failed")
            return bad
        return []

    def _header(self, slot: int) -> RecordHeader:
        # Only the namespace, geometry and payload hash take part in a payload check.
        return RecordHeader(self.namespace, b"", b"", b"", 0, self._no_tokens, 0,
                            self.kv_bytes + self.scale_bytes, self._hashes[slot].tobytes())


# ---------------------------------------------------------------- handlers
def _payloads(kv: torch.Tensor, scales: torch.Tensor | None, slots: list[int]) -> list:
    """One payload per slot of a block-major pool: the slot's bytes (plus its scales)."""
    out = []
    for s in slots:
        data = kv[s].contiguous().view(torch.uint8).numpy().reshape(-1)
        if scales is not None:
            data = np.concatenate([data, scales[s].contiguous().view(torch.uint8).numpy()
                                   .reshape(-1)])
        out.append(data)
    return out


def host_to_disk(src, dst: DiskTier, transfers: list[Transfer], layers, nb) -> None:
    slots = [t.src_slot for t in transfers]
    dst.write([t.dst_slot for t in transfers], [t.meta for t in transfers],
              _payloads(src.kv, src.scales, slots))


def gpu_to_disk(src, dst: DiskTier, transfers: list[Transfer], layers, nb) -> None:
    """Device blocks to disk through a block-major staging tensor (the persisted ancestors of
    demoted blocks may only be on the device)."""
    from tiered_cache import kernels

    n = len(transfers)
    stage = torch.empty((n, *dst.slot_shape), dtype=dst.kv_dtype)
    kernels.copy_blocks_to_host(src.kv, [t.src_slot for t in transfers], stage, list(range(n)),
                                non_blocking=False)
    scales = None
    if src.scales is not None:
        si = torch.as_tensor([t.src_slot for t in transfers], device=src.scales.device)
        scales = src.scales[:, :, si].permute(2, 0, 1).cpu().contiguous()
    if stage.is_cuda:
        torch.cuda.current_stream().synchronize()
    dst.write([t.dst_slot for t in transfers], [t.meta for t in transfers],
              _payloads(stage, scales, list(range(n))))


def disk_to_host(src: DiskTier, dst, transfers: list[Transfer], layers, nb) -> None:
    """Whole records into host slots, verified (never layer by layer: a record is trusted
    only once every byte of it has been checked)."""
    src_slots = [t.src_slot for t in transfers]
    if dst.scales is None:
        outs = [dst.kv[t.dst_slot].view(torch.uint8).numpy().reshape(-1) for t in transfers]
        bad = set(src.read(src_slots, outs))
    else:
        outs = [np.empty(src.kv_bytes + src.scale_bytes, dtype=np.uint8) for _ in transfers]
        bad = set(src.read(src_slots, outs))
        for t, buf in zip(transfers, outs):
            dst.kv[t.dst_slot].view(torch.uint8).numpy().reshape(-1)[:] = buf[:src.kv_bytes]
            dst.scales[t.dst_slot].view(torch.uint8).numpy().reshape(-1)[:] = buf[src.kv_bytes:]
    if bad:
        raise CorruptBlocks([t.block for t in transfers if t.src_slot in bad],
                            f"disk slots {sorted(bad)[:8]} failed verification")
