"""The cost model of a replay: the prefill time a cache hit saves.

- Recomputing the prefix of n tokens costs `2 P n + 2 L h n^2` FLOPs: `2P` per token in the
  linear layers and `4 L h t` for the attention of the token at position t (QK^T and PV, each
  `2 h t` per layer, h = query heads * head_dim); summed over t < n. At `peak_tflops * mfu`.
- A host hit instead moves its KV over PCIe at `pcie_gbps` (`bytes_per_token` per token).
- Seconds saved per request = compute time of its hit prefix - transfer time of its host hits.

Default: a 70B model (P = 70.6e9, 80 layers, 64 query heads and 8 KV heads of 128, bf16 KV:
327,680 bytes per token), an H100/H200 at 989 bf16 TFLOP/s dense and 50% MFU, PCIe 5.0 x16 at
50 GB/s sustained. Every constant is printed with the results, so a reader can redo the sums.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from tiered_cache import costs
from tiered_cache.errors import ConfigError

MODEL_70B: dict[str, Any] = {
    "name": "llama-3-70b", "num_layers": 80, "num_kv_heads": 8, "head_dim": 128,
    "num_q_heads": 64, "dtype": "bfloat16", "num_params": 70.6e9,
}
"""Default geometry: Llama-3-70B, bf16 KV (327,680 bytes per token)."""


@dataclass(frozen=True)
class CostModel:
    """Prefill time a hit saves: recompute FLOPs at an MFU versus PCIe bytes for host hits.

    Every field must be a finite number above 0 (`mfu` at most 1): a zero rate would turn the
    seconds saved into a division by zero or an infinity in the report."""

    num_params: float = 70.6e9
    num_layers: int = 80
    hidden: int = 8192                  # query heads * head_dim
    bytes_per_token: int = 327_680      # K and V, every layer
    peak_tflops: float = 989.0          # H100/H200 SXM bf16 dense
    mfu: float = 0.5
    pcie_gbps: float = 50.0             # PCIe 5.0 x16, sustained host -> device

    def __post_init__(self) -> None:
        for f in fields(self):
            v = getattr(self, f.name)
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or v <= 0):
                raise ConfigError(f.name, f"expected a finite number above 0, got {v!r}")
        if self.mfu > 1:
            raise ConfigError("mfu", f"expected a fraction in (0, 1], got {self.mfu!r}")

    @classmethod
    def for_model(cls, model: Mapping[str, Any], **kw: Any) -> CostModel:
        """The cost model of a model geometry (the `model:` section of a config, as a mapping;
        checked like one). Without `num_params`, the usual `12 L h^2` estimate."""
        from tiered_cache.config import CacheConfig

        m = CacheConfig.from_dict({"model": dict(model), "storage": "none"}).model
        hidden = m.num_q_heads * m.head_dim
        params = m.num_params or 12 * m.num_layers * hidden**2
        return cls(num_params=float(params), num_layers=m.num_layers, hidden=hidden,
                   bytes_per_token=m.bytes_per_token, **kw)

    def prefix_flops(self, n: float) -> float:
        """FLOPs to compute the KV of a prefix of n tokens (tiered_cache.costs' FLOPs, with
        the attention pairs of the prefix taken as n^2 / 2)."""
        return (costs.linear_flops(self.num_params, n)
                + costs.attention_flops(self.num_layers, self.hidden, n * n / 2))

    def compute_seconds(self, n: float) -> float:
        """Seconds to compute the KV of a prefix of n tokens."""
        return self.prefix_flops(n) / (self.peak_tflops * 1e12 * self.mfu)

    def transfer_seconds(self, tokens: float) -> float:
        """Seconds to move the KV of `tokens` tokens from host to device."""
        return tokens * self.bytes_per_token / (self.pcie_gbps * 1e9)
