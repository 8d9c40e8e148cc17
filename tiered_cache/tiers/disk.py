"""Tier kind `disk`: a local disk (SSD) beneath host memory, one verified record per slot in a
preallocated file, kept across restarts (data/disk_tier.py, data/disk.py). Written and read only
by background threads; its records are staged through the host tier above it. In the node
daemon each tenant has its own directory, `<tiers.disk.path>/<tenant>/`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from tiered_cache import sizing
from tiered_cache.admission import FILESYSTEM, Ask, size_key
from tiered_cache.core.tier import TierSpec
from tiered_cache.costs import TierCost
from tiered_cache.errors import ConfigError
from tiered_cache.hashing import BlockHasher, Namespace
from tiered_cache.sections import Section, boolean, non_negative_int, positive_int, size
from tiered_cache.sizing import MAX_NUM_BLOCKS, format_bytes, short_repr
from tiered_cache.tiers.base import DAEMON, ENGINE, Context, Needs, TierKind, register

HOST_KIND, DEVICE_KIND = "host", "gpu"
"""The kinds its copy handlers pair with: host <-> disk, and gpu -> disk (persisted
ancestors of demoted blocks may be only on the device)."""


@dataclass
class DiskTierConfig(Section):
    """A local disk (SSD) beneath host memory: one verified record per slot in a preallocated
    file, kept across restarts. Written and read only by background threads, never under the
    control-plane lock."""

    _PATH: ClassVar[str] = "tiers.disk"
    MIN_BLOCKS: ClassVar[int] = 0

    path: str | None = None
    """Directory of the tier (created if missing). Records of each namespace (model, dtype,
    geometry, block size) live in their own subdirectory. Required with `storage: tensors`."""
    capacity: str | None = None
    """"2TiB", "500GB", or "80%" of the free space at `path`."""
    num_blocks: int | None = None
    """Exactly one of capacity / num_blocks; 0 means no disk tier."""
    max_num_blocks: int | None = None
    """Largest size `cache.resize` may grow the tier to (null: as many as the disk holds)."""
    o_direct: bool = False
    """Payload I/O bypasses the page cache (so demoted blocks do not compete with the host tier
    for RAM); falls back, with a warning, where the filesystem refuses O_DIRECT."""
    admit_min_hits: int = 1
    """Only blocks reused at least this many times are written to disk (0: every demoted
    block), so one-shot traffic does not wear the SSD."""

    def __post_init__(self) -> None:
        if self.path is not None:
            ok = isinstance(self.path, str) and self.path.strip() and "\0" not in self.path \
                and self.path.isprintable() and len(self.path) <= 4096
            if not ok:
                raise ConfigError(self._key("path"), f"expected a directory path (printable, "
                                                     f"no NUL), got {short_repr(self.path)}")
        size(self._key("capacity"), self.capacity)
        if self.num_blocks is not None:
            non_negative_int(self._key("num_blocks"), self.num_blocks, MAX_NUM_BLOCKS)
        if self.max_num_blocks is not None:
            positive_int(self._key("max_num_blocks"), self.max_num_blocks, MAX_NUM_BLOCKS)
            if self.num_blocks is not None and self.max_num_blocks < self.num_blocks:
                raise ConfigError(self._key("max_num_blocks"),
                                  f"{self.max_num_blocks} is below num_blocks {self.num_blocks}")
        if (self.capacity is None) == (self.num_blocks is None):
            got = "both" if self.capacity is not None else "neither"
            raise ConfigError(self._PATH,
                              f"set exactly one of 'capacity' or 'num_blocks', got {got}")
        boolean(self._key("o_direct"), self.o_direct)
        non_negative_int(self._key("admit_min_hits"), self.admit_min_hits, 1 << 20)

    SLOT_WORD: ClassVar[str] = "slots"

    def free_bytes(self, config: Any, tenant: str | None = None) -> int:
        # NOTE: a restart must find the room its own files take, or every restart of an
        # "80%" tier would shrink it (and cut off the records past the new end).
        return sizing.disk_free_bytes(self.path) + sizing.held_bytes(pool_dir(config, tenant))

    def slot_bytes(self, config: Any) -> int:
        """A record's header area plus its payload area, each aligned to 4 KiB
        (data/disk_layout.py): what one slot takes on disk."""
        from tiered_cache.data.disk_layout import slot_footprint

        return slot_footprint(int(config.block_size), config.block_bytes)


def pool_dir(config: Any, tenant: str | None = None) -> Path | None:
    """The directory the disk tier's files of this config's namespace live in:
    `tiers.disk.path[/<tenant>]/<namespace hex>` (data/disk.py; a daemon partition's disk
    directory is named after its tenant). None without a disk path."""
    disk = getattr(config.tiers, DiskKind.name)
    if disk is None or disk.path is None:
        return None
    m = config.model
    ns = Namespace(m.name, m.dtype, m.num_layers, m.num_kv_heads, m.head_dim,
                   int(config.block_size), None)
    root = Path(disk.path) if tenant is None else Path(disk.path) / tenant
    return root / BlockHasher(ns).namespace_digest().hex()


class DiskKind(TierKind):
    name = "disk"
    section = DiskTierConfig
    rank = 200
    roles = frozenset({ENGINE, DAEMON})
    needs = Needs(
        above="needs a host tier above it (tiers.host with num_blocks > 0): disk records are "
              "read through it",
        migrator="needs the migrator (migrator.enabled: true): only its background threads "
                 "write and read the disk")

    def check(self, ctx: Context) -> None:
        if ctx.storage and ctx.section(self.name).path is None:
            raise ConfigError(f"tiers.{self.name}.path", "required with storage: tensors (the "
                                                         "directory the tier's records live in)")

    def spec(self, ctx: Context) -> TierSpec | None:
        cfg = ctx.section(self.name)
        n = sizing.tier_num_blocks(ctx.config, self.name, tenant=ctx.tenant)
        if n == 0:
            return None
        # With `storage: none` a disk tier is metadata like any other (replay, planning).
        return TierSpec(self.name, self.name, n, persistent=ctx.storage,
                        sync_target=not ctx.storage, admit_min_hits=cfg.admit_min_hits,
                        whole_records=ctx.storage)

    def build(self, ctx: Context, spec: TierSpec) -> Any:
        from tiered_cache.data.disk_tier import DiskTier

        cfg = ctx.section(self.name)
        path = os.path.join(cfg.path, ctx.tenant) if ctx.role == DAEMON else cfg.path
        above = ctx.pools[-1]           # the host tier (Needs.above)
        return DiskTier(path, spec.num_slots, host_kv=above.kv, host_scales=above.scales,
                        num_tokens=int(ctx.config.block_size),
                        namespace=ctx.hasher.namespace_digest(), o_direct=cfg.o_direct,
                        max_slots=cfg.max_num_blocks)

    def asks(self, ctx: Context, spec: TierSpec) -> list[Ask]:
        cfg, config = ctx.section(self.name), ctx.config
        n, slot = spec.num_slots, cfg.slot_bytes(config)
        owner = f" of tenant {ctx.tenant!r}" if ctx.tenant is not None else ""
        return [Ask(self.name, size_key(cfg, self.name), n * slot, FILESYSTEM,
                    f"tiers.{self.name}{owner} {n:,} slots of {format_bytes(slot)} (header + "
                    f"payload, 4 KiB aligned)", path=cfg.path,
                    held=sizing.held_bytes(pool_dir(config, ctx.tenant)))]

    def handlers(self):
        from tiered_cache.data import disk_tier

        return {(HOST_KIND, self.name): disk_tier.host_to_disk,
                (DEVICE_KIND, self.name): disk_tier.gpu_to_disk,
                (self.name, HOST_KIND): disk_tier.disk_to_host}

    def cost(self, ctx: Context) -> TierCost:
        cm = ctx.config.cost_model
        return TierCost(self.name, latency_s=cm.disk_latency_ms / 1e3,
                        bandwidth_bps=cm.disk_bandwidth_gbps * 1e9)

    def recover(self, stack, tier: int) -> None:
        """Rebuild the index entries of every record the directory holds (a restart); the
        records the index refuses are erased."""
        pool = stack.pools[tier]
        if pool is None:
            return
        reject = stack.index.persist.restore(tier, pool.recover())
        if reject:
            pool.erase(reject)

    def close(self, stack, tier: int) -> None:
        """Erase the records of blocks dropped since the eraser last ran (they must not come
        back), save use counts, close the files."""
        pool, index = stack.pools[tier], stack.index
        if pool is None:
            return
        slots = index.space.take_erasures(tier)
        try:
            pool.erase(slots)
            index.space.erased(tier, slots)
            pool.save_hits(*index.persist.copies_with_hits(tier))
        finally:
            pool.close()

    def stats(self, stack, tier: int, out: dict) -> None:
        pool = stack.pools[tier]
        if pool is not None and not stack.closed:
            out["tiers"][stack.index.tiers[tier].name]["pool"] = pool.stats()


register(DiskKind())
