"""Tier kind `gpu`: the device tier (tier 0), a layer-major pool on the device attention runs on
(CPU memory when there is no CUDA). Engines only: the node daemon owns no device."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar

from tiered_cache import sizing
from tiered_cache.admission import RAM, Ask, size_key
from tiered_cache.core.tier import TierSpec
from tiered_cache.errors import ConfigError
from tiered_cache.sections import Section, TierSize, boolean
from tiered_cache.sizing import format_bytes, short_repr
from tiered_cache.tiers.base import ENGINE, Context, TierKind, register

DEVICES_HINT = "'auto', 'cpu', 'cuda' or 'cuda:N'"


@dataclass
class GpuTierConfig(Section, TierSize):
    """The fast tier: a device pool (CPU memory when there is no CUDA and device is auto/cpu)."""

    _PATH: ClassVar[str] = "tiers.gpu"
    MIN_BLOCKS: ClassVar[int] = 1

    device: str = "auto"
    """auto | cpu | cuda | cuda:N. auto: cuda when available, else cpu."""
    capacity: str | None = None
    """"40GiB", "512MiB" or "70%" (of the device's free memory)."""
    num_blocks: int | None = None
    """Exactly one of capacity / num_blocks must be set."""
    max_num_blocks: int | None = None
    """Largest size `cache.resize` may grow the tier to; address space for it is reserved up
    front (no memory). null: the machine's physical memory in blocks."""
    segment_blocks: int | None = None
    """Blocks per memory segment: resize backs and frees memory in these steps. null: about
    64 MiB of KV."""
    resizable: bool = False
    """CUDA only: lay the device pool over reserved device addresses mapped segment by segment
    (CUDA virtual memory API; needs the `cuda` extra), so cache.resize works on it. Off: one
    allocation. A device tier in CPU memory is always resizable."""

    def __post_init__(self) -> None:
        # fullmatch: re.match with `$` would accept "cpu\n" (`$` matches before a final newline)
        if not isinstance(self.device, str) or not sizing.DEVICE_RE.fullmatch(self.device):
            hint = DEVICES_HINT
            if isinstance(self.device, str) and re.fullmatch(r"cuda:[0-9]+", self.device,
                                                             re.ASCII):
                hint += " with N in 0..999 and no leading zeros"
            raise ConfigError(self._key("device"),
                              f"expected one of {hint}, got {short_repr(self.device)}")
        boolean(self._key("resizable"), self.resizable)
        self._check_size(min_blocks=1)

    def free_bytes(self, config: Any, tenant: str | None = None) -> int:
        return sizing.free_bytes(self.device)


class GpuKind(TierKind):
    name = "gpu"
    section = GpuTierConfig
    rank = 0
    roles = frozenset({ENGINE})

    def default_section(self) -> GpuTierConfig:
        return GpuTierConfig(num_blocks=256)

    def spec(self, ctx: Context) -> TierSpec:
        return TierSpec(self.name, self.name, sizing.tier_num_blocks(ctx.config, self.name))

    def build(self, ctx: Context, spec: TierSpec) -> Any:
        from tiered_cache.data.pools import DevicePool, make_pool

        cfg, model = ctx.section(self.name), ctx.config.model
        return make_pool(DevicePool.layout, spec.num_slots,
                         device=sizing.resolve_device(cfg.device),
                         max_slots=cfg.max_num_blocks, segment_slots=cfg.segment_blocks,
                         resizable=cfg.resizable, num_layers=model.num_layers,
                         block_size=int(ctx.config.block_size), num_kv_heads=model.num_kv_heads,
                         head_dim=model.head_dim, dtype=model.dtype)

    def asks(self, ctx: Context, spec: TierSpec) -> list[Ask]:
        cfg, block = ctx.section(self.name), ctx.config.block_bytes
        device = sizing.resolve_device(cfg.device)
        note = " (the device tier lives in CPU memory: no CUDA device)" if device == "cpu" else ""
        n = spec.num_slots
        return [Ask(self.name, size_key(cfg, self.name), n * block,
                    RAM if device == "cpu" else device,
                    f"tiers.{self.name} {n:,} blocks of {format_bytes(block)}{note}")]

    def handlers(self):
        from tiered_cache.data.executor import within_pool

        return {(self.name, self.name): within_pool}


register(GpuKind())
