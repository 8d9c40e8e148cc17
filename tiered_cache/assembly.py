"""Steps shared by the two owners of a set of tiers: the engine's `TieredKVCache` and each
tenant partition of the node daemon (daemon/partition.py). Each takes the parts it is given;
none keeps state.
"""

from __future__ import annotations

from collections.abc import Callable

from tiered_cache import policies
from tiered_cache.config import CacheConfig
from tiered_cache.core.index import BlockIndex
from tiered_cache.core.readiness import LayerReadiness
from tiered_cache.core.transfer import Transfer
from tiered_cache.errors import TransferError


def policy_factory(config: CacheConfig) -> Callable:
    """(capacity, blocks) -> the configured eviction policy of one tier."""
    policy_cls = policies.resolve(config.policy)
    model = config.model
    hidden = config.num_q_heads * model.head_dim
    cost_ctx = (model.num_params / (2 * model.num_layers * hidden)
                if model.num_params else 53_000.0)
    block_size = int(config.block_size)

    def make(capacity, blocks):
        return policy_cls(capacity, blocks=blocks, block_size=block_size,
                          cost_context_tokens=cost_ctx)
    return make


def recover(index: BlockIndex, pools: list) -> None:
    """Rebuild the index entries of every record a persistent tier holds (a restart)."""
    for tier in index.tiers:
        if not tier.persistent:
            continue
        pool = pools[tier.index]
        reject = index.persist.restore(tier.index, pool.recover())
        if reject:
            pool.erase(reject)


def close_persistent(index: BlockIndex, pools: list) -> None:
    """Erase the records of blocks dropped since the eraser last ran (they must not come
    back), save use counts, close the files."""
    for tier in index.tiers:
        if tier.persistent:
            pool = pools[tier.index]
            slots = index.space.take_erasures(tier.index)
            try:
                pool.erase(slots)
                index.space.erased(tier.index, slots)
                pool.save_hits(*index.persist.copies_with_hits(tier.index))
            finally:
                pool.close()


def promote(index: BlockIndex, executor, migrator, plan: list[Transfer],
            readiness: LayerReadiness) -> None:
    """Called by `BlockIndex.open` (lock held): hand a promotion to the migrator, or run it
    now. A failed synchronous copy is committed as failed and raises TransferError."""
    if migrator is not None and not migrator.stopped:
        migrator.promote(plan, readiness)
        return
    try:
        executor.run(plan)
    except TransferError as exc:
        index.count("transfer_failures")
        index.commit_promotion(plan, False)
        readiness.fail(exc)
        raise
    index.commit_promotion(plan, True)
    for layer in range(index.num_layers):
        readiness.layer_done(layer)
