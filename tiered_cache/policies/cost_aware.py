"""Cost-aware eviction: GreedyDual-Size-Frequency with the recompute cost of a KV block.

Cherkasova, "Improving WWW proxies performance with Greedy-Dual-Size-Frequency caching policy",
HP Labs technical report HPL-98-69R1, 1998; GreedyDual-Size from Cao and Irani, "Cost-aware WWW
proxy caching algorithms", USITS 1997.
"""

from __future__ import annotations

from tiered_cache.policies.base import PriorityPolicy


class CostAwarePolicy(PriorityPolicy):
    """GDSF: evicts the lowest `clock + frequency * cost / size`.

    - `frequency = hits + 1` (the first use counts, so a block never hit still has a value).
    - `size = 1`: every block takes one slot of the tier.
    - `cost` = compute a hit on the block saves, i.e. the FLOPs to recompute its KV.
    - `clock` = priority of the last victim (GreedyDual inflation), so blocks that stop being
      used age out instead of living forever on an old count.

    Cost from first principles. For a dense transformer with P parameters, L layers and hidden
    size h, producing the KV of the token at position t costs about `2P` FLOPs in the linear
    layers plus `4 L h t` in attention (QK^T and PV against the t tokens before it, 2 h t each
    per layer). So per token `cost(t) = 2P (1 + t / C)` with `C = P / (2 L h)`, the context length
    at which attention equals the linear layers (`cost_context_tokens`, ~53K tokens for a 70B
    model). Block d holds tokens `[d B, (d + 1) B)` with B = block_size; summing over them,
    `sum_t (1 + t / C) = B (1 + (d + 1/2) B / C) - B / (2 C)`. Dropping the constant factor `2PB`
    and the negligible `-B / (2C)` (the continuous midpoint of the block):

        cost(d) = 1 + (d + 0.5) * block_size / cost_context_tokens

    Deep blocks cost more because their attention spans a longer prefix. The effect is real but
    mild (a block 16K tokens deep costs ~1.3x a first block for a 70B model), so frequency
    dominates and depth breaks near-ties: at equal hits the deeper block is kept, at equal depth
    the more frequent one.
    """

    name = "cost_aware"

    def __init__(self, capacity_blocks: int, **kw) -> None:
        super().__init__(capacity_blocks, **kw)
        self.clock = 0.0

    def cost(self, b: int) -> float:
        return 1.0 + (self.blocks.depth[b] + 0.5) * self.block_size / self.cost_context_tokens

    def priority(self, b: int) -> float:
        return self.clock + (self.blocks.hits[b] + 1) * self.cost(b)   # / size, size = 1 block

    def on_evict(self, priority: float, b: int) -> None:
        # GreedyDual: L = H(victim). max() only guards against the clock ever falling.
        self.clock = max(self.clock, priority)
