"""Tier kind `host`: host memory, block-major (all layers of a block contiguous).

In an engine it is tier 1, beneath the device: pinned, CUDA-managed or pageable memory, the
kernels' zero-copy view of blocks still being promoted, and the tier records (disk, remote)
are staged through. In the node daemon it is each partition's tier 0: a pool in shared memory
that the tenant's engines map (`tiered_cache.wire.shm`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from tiered_cache import sizing
from tiered_cache.admission import RAM, Ask, size_key
from tiered_cache.core.tier import TierSpec
from tiered_cache.errors import ConfigError
from tiered_cache.sections import Section, TierSize, choice
from tiered_cache.sizing import format_bytes
from tiered_cache.tiers.base import DAEMON, ENGINE, Context, TierKind, register
from tiered_cache.wire.shm import PoolGeometry, SharedPool

HOST_MEMORY = ("pinned", "managed", "pageable")
DEVICE_KIND = "gpu"
"""The device kind its copy handlers pair with (gpu <-> host)."""


@dataclass
class HostTierConfig(Section, TierSize):
    """The slow tier: host memory. num_blocks 0 (or a capacity that holds no block) means no
    host tier."""

    _PATH: ClassVar[str] = "tiers.host"

    capacity: str | None = None
    num_blocks: int | None = None
    memory: str = "pinned"
    """pinned | managed | pageable. pinned falls back to pageable without CUDA; managed needs
    CUDA (and cupy)."""
    max_num_blocks: int | None = None
    """As for tiers.gpu."""
    segment_blocks: int | None = None
    """As for tiers.gpu."""

    def __post_init__(self) -> None:
        self._check_size(min_blocks=0)
        choice(self._key("memory"), self.memory, HOST_MEMORY)

    def free_bytes(self, config: Any, tenant: str | None = None) -> int:
        return sizing.free_bytes("cpu")


class HostKind(TierKind):
    name = "host"
    aliases = ("cpu", "dram", "ram", "memory", "pinned")
    section = HostTierConfig
    rank = 100
    roles = frozenset({ENGINE, DAEMON})

    def default_section(self) -> HostTierConfig:
        return HostTierConfig(num_blocks=1024)

    def check(self, ctx: Context) -> None:
        if ctx.role == DAEMON and sizing.tier_num_blocks(ctx.config, self.name) < 1:
            raise ConfigError(f"tiers.{self.name}", "the node daemon needs a host tier of at "
                                                    "least one block (its shared pool)")

    def spec(self, ctx: Context) -> TierSpec | None:
        n = (_shared_geometry(ctx.config, self.name).num_slots if ctx.role == DAEMON
             else sizing.tier_num_blocks(ctx.config, self.name))
        if n == 0:
            return None             # `num_blocks: 0`: a device-only cache
        # NOTE: the kernels read a promotion's source in place only from tier 1 (their one
        # host view): zero-copy beneath the device, not as the daemon's tier 0.
        return TierSpec(self.name, self.name, n, stages_records=True,
                        zero_copy=len(ctx.specs) == 1)

    def asks(self, ctx: Context, spec: TierSpec) -> list[Ask]:
        cfg, n = ctx.section(self.name), spec.num_slots
        key = size_key(cfg, self.name)
        if ctx.role == DAEMON:
            geometry = _shared_geometry(ctx.config, self.name)
            return [Ask(self.name, key, geometry.nbytes, RAM,
                        f"the shared pool of tenant {ctx.tenant!r}, {n:,} slots "
                        f"({format_bytes(geometry.slot_stride)} each, page aligned)")]
        block = ctx.config.block_bytes
        device = sizing.resolve_device(ctx.config.tiers.compute_device())
        where = device if cfg.memory == "managed" and device != "cpu" else RAM
        return [Ask(self.name, key, n * block, where,
                    f"tiers.{self.name} {n:,} blocks of {format_bytes(block)} ({cfg.memory})")]

    def build(self, ctx: Context, spec: TierSpec) -> Any:
        from tiered_cache.data.pools import HostPool, SharedHostPool, make_pool

        cfg, model, bs = ctx.section(self.name), ctx.config.model, int(ctx.config.block_size)
        if ctx.role == DAEMON:
            geometry = _shared_geometry(ctx.config, self.name)
            return SharedHostPool(SharedPool.create(geometry, name=f"{self.name}-{ctx.tenant}",
                                                     read_only_clients=True))
        return make_pool(HostPool.layout, spec.num_slots, memory=cfg.memory,
                         max_slots=cfg.max_num_blocks, segment_slots=cfg.segment_blocks,
                         num_layers=model.num_layers, block_size=bs,
                         num_kv_heads=model.num_kv_heads, head_dim=model.head_dim,
                         dtype=model.dtype)

    def handlers(self):
        from tiered_cache.data.executor import gpu_to_host, host_to_gpu, within_pool

        return {(DEVICE_KIND, self.name): gpu_to_host, (self.name, DEVICE_KIND): host_to_gpu,
                (self.name, self.name): within_pool}

    def close(self, stack, tier: int) -> None:
        pool = stack.pools[tier]
        if stack.role == DAEMON and pool is not None:
            pool.close()            # the shared pool's memfd (engines drop their mappings)


def _shared_geometry(config: Any, name: str) -> PoolGeometry:
    """A daemon partition's shared pool: the tier sized by the pool's slot stride (a block's KV
    rounded up to whole pages), so that the pool fits in the capacity it was given."""
    m, bs = config.model, int(config.block_size)
    stride = PoolGeometry(1, m.num_layers, bs, m.num_kv_heads, m.head_dim, m.dtype).slot_stride
    return PoolGeometry(sizing.tier_num_blocks(config, name, slot_bytes=stride), m.num_layers,
                        bs, m.num_kv_heads, m.head_dim, m.dtype)


register(HostKind())
