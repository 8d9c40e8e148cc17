"""`build_stack(config, role)`: one set of tiers, built from the registered tier kinds, for its
owner: the engine's `TieredKVCache` (role ENGINE) or a tenant partition of the node daemon
(role DAEMON). The owner gets a `Stack`: the specs, pools and keyed stores, the copy executor
with every kind's handlers registered, the `BlockIndex` (recovered from persistent tiers), the
cost model, and the migrator and compactor its role runs; and the steps both owners share
(promote, write-through copy, keyed loads, stats, shutdown).

Building, in order (each kind's declarations in tiered_cache/tiers/<kind>.py):
1. the kinds configured in this role, without those another one replaces; a kind another one
   excludes is a ConfigError; so is a kind that needs tensor storage without it;
2. the specs (slot tiers in rank order, then keyed tiers), then each kind's needs (a tier that
   stages its records above it, the migrator) and own checks: all before anything is built;
   then what the slot tiers' pools will take, against what the machine can give (admission);
3. the pools, the cost model with each slow tier's prior, the keyed stores;
4. the index, the executor and the handlers, recovery, the migrator and the compactor.
Anything that fails on the way closes what was built (a disk directory lock, a memfd, a
connection) and raises.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tiered_cache import admission, costs, policies
from tiered_cache.core.index import BlockIndex
from tiered_cache.core.readiness import LayerReadiness
from tiered_cache.core.tier import DEVICE, TierSpec
from tiered_cache.core.transfer import Transfer
from tiered_cache.errors import ConfigError, TransferError
from tiered_cache.hashing import BlockHasher
from tiered_cache.migrator import Compactor, Migrator, ThreadHealth
from tiered_cache.migrator.worker import copy_down, promote
from tiered_cache.tiers.base import DAEMON, ENGINE, KEYED, SLOT, Context, TierKind, kinds

if TYPE_CHECKING:
    from tiered_cache.config import CacheConfig
    from tiered_cache.core.sequence import Sequence

log = logging.getLogger("tiered_cache.tiers")


@dataclass(eq=False)
class Stack:
    """A built set of tiers and what runs them. Slot tier i: `specs[i]`, `pools[i]`,
    `slot_kinds[i]`; keyed tier k: `keyed_specs[k]`, `stores[k]`, `keyed_kinds[k]`."""

    config: CacheConfig
    role: str
    hasher: BlockHasher
    storage: bool
    specs: list[TierSpec]
    pools: list
    slot_kinds: list[TierKind]
    keyed_specs: list[TierSpec]
    stores: list
    keyed_kinds: list[TierKind]
    costs: costs.CostModel | None
    health: ThreadHealth = field(default_factory=ThreadHealth)
    index: BlockIndex = None  # type: ignore[assignment]
    executor: Any = None
    migrator: Migrator | None = None
    compactor: Compactor | None = None
    closed: bool = False

    @property
    def block_size(self) -> int:
        return int(self.config.block_size)

    def section(self, name: str) -> Any:
        return getattr(self.config.tiers, name)

    def tiers(self):
        """(kind, tier) of every slot tier, then (kind, k) of every keyed tier."""
        return [*((kind, i) for i, kind in enumerate(self.slot_kinds)),
                *((kind, k) for k, kind in enumerate(self.keyed_kinds))]

    # ---------------------------------------------------------------- the index's callbacks
    def run(self, plan: list[Transfer]) -> None:
        """Copy a plan now (synchronous eviction, shrink moves). Raises TransferError."""
        self.executor.run(plan)

    def poke(self) -> None:
        if self.migrator is not None:
            self.migrator.poke()

    def promote(self, plan: list[Transfer], readiness: LayerReadiness) -> None:
        """`BlockIndex.open`'s promotion (lock held): the migrator's, or made now."""
        promote(self.index, self.executor, self.migrator, plan, readiness)

    def worth(self, tier: int, nblocks: int, context_blocks: int) -> bool:
        """Whether loading `nblocks` from tier `tier` beats recomputing them (the index asks
        for blocks only a persistent tier holds; keyed kinds before a load)."""
        return self.costs.worth_blocks(self.index.tier_name(tier), nblocks, context_blocks,
                                       block_bytes=self.index.block_bytes,
                                       block_size=self.block_size)

    def observe(self, src: int, dst: int, blocks: int, seconds: float) -> None:
        """A finished copy out of a slow slot tier into the tier records stage in feeds that
        tier's cost estimates. (A store feeds its own: each lookup's latency, each get's
        bandwidth.)"""
        index = self.index
        if self.costs is None or src >= len(index.tiers) or dst != index.keyed.stage_tier:
            return
        cost = self.costs.tiers.get(self.index.tiers[src].name)
        if cost is not None:
            cost.observe(blocks * self.index.block_bytes, seconds, blocks)

    # ---------------------------------------------------------------- shared steps
    def published(self, fresh: list[int]) -> None:
        """Blocks just published: their write-through copy, and their puts to the keyed
        tiers written from the device tier (the node daemon)."""
        self.copy_down(fresh)
        if fresh and self.migrator is not None and any(
                k.put_from == DEVICE for k in self.index.keyed.tiers):
            self.migrator.put_remote(fresh)

    def copy_down(self, fresh: list[int]) -> None:
        copy_down(self.index, self.executor, self.migrator, fresh)

    def load_keyed(self, seq: Sequence) -> None:
        """After open()'s local match (ENGINE): each keyed tier learns of the sequence, then
        loads what it has of the next blocks, until one has loaded something."""
        for kind, k in self.tiers()[len(self.slot_kinds):]:
            kind.note_open(self, k, seq)
        for kind, k in self.tiers()[len(self.slot_kinds):]:
            if kind.load(self, k, seq):
                return

    def load_after(self, seq: Sequence, root: bytes, parent: bytes, tokens) -> int:
        """After a daemon fetch's local match (DAEMON): the keyed tiers' next blocks."""
        for kind, k in self.tiers()[len(self.slot_kinds):]:
            n = kind.load_after(self, k, seq, root, parent, tokens)
            if n:
                return n
        return 0

    def invalidate_keyed(self, root: bytes, tokens) -> int:
        return sum(kind.invalidate(self, k, root, tokens)
                   for kind, k in self.tiers()[len(self.slot_kinds):])

    def stats(self, out: dict) -> dict:
        """The parts of `stats()` the tiers and the workers add to the index's."""
        out["threads"] = self.health.summary()
        out["copies"] = self.migrator.copy_stats() if self.migrator is not None else {}
        for kind, i in self.tiers():
            kind.stats(self, i, out)
        if self.costs is not None:
            out["cost_model"] = {name: c.snapshot() for name, c in self.costs.tiers.items()}
        return out

    # ---------------------------------------------------------------- lifetime
    def start(self) -> None:
        """Start what runs on its own (the daemon link), then warm the copy paths up."""
        for kind, i in self.tiers():
            kind.start(self, i)
        if self.storage:
            self._warm_up()

    def drain(self) -> int:
        """A graceful stop (the workers stopped, the owner's sequences closed): each slot tier
        takes what must outlive the process (the disk: every block only memory holds).
        Returns the blocks written."""
        if self.closed or not self.storage:
            return 0
        return sum(kind.drain(self, i) for kind, i in self.tiers()[:len(self.slot_kinds)])

    def stop_workers(self) -> None:
        for worker in (self.compactor, self.migrator):
            if worker is not None:
                worker.stop()

    def close(self) -> None:
        """After the workers stopped and the owner closed its sequences: each tier writes
        back what must last and lets go (keyed tiers first: their queued puts go out while
        the slot tiers are still there; then slot tiers, slowest first)."""
        self.closed = True
        steps = [*self.tiers()[len(self.slot_kinds):],
                 *reversed(self.tiers()[:len(self.slot_kinds)])]
        for kind, i in steps:
            kind.close(self, i)

    def _warm_up(self) -> None:
        """Run the copy paths between tiers 0 and 1 once on slot 0 (fresh pools: nothing
        observable changes) so that their first real use, an eviction under the lock, does
        not pay for imports and kernel compilation (seconds, once per process). Only between
        memory tiers: a persistent tier's slot 0 is a record."""
        if len(self.specs) < 2 or any(s.persistent for s in self.specs[:2]):
            return
        a, b = self.pools[:2]
        if a is None or b is None or a.num_slots < 1 or b.num_slots < 1:
            return
        kinds_ = (self.specs[0].kind, self.specs[1].kind)
        if not {kinds_, kinds_[::-1]} <= self.executor.handlers.keys():
            return
        try:
            import torch  # NOTE: torch only with tensor storage (pools exist)

            with torch.no_grad():
                self.executor.run([Transfer(0, 0, 0, 1, 0)])
                self.executor.run([Transfer(0, 1, 0, 0, 0)])
        except TransferError:
            pass


def build_stack(config: CacheConfig, role: str, *, hasher: BlockHasher,
                tenant: str | None = None, provided: Mapping[str, Any] | None = None,
                admission_context: str = "") -> Stack:
    """The tiers `config` describes for `role` (ENGINE or DAEMON), built and recovered, with
    the executor, index, migrator and compactor the role runs. `tenant`: the daemon
    partition's. `provided`: objects the owner hands over to kinds, by kind name. Before any
    pool is built, what the pools will take is checked against what the machine can give
    (tiered_cache.admission; `admission_context` ends a refusal's message)."""
    ctx, slot_kinds, keyed_kinds, keyed_specs = _plan(config, role, hasher, tenant, provided)
    if ctx.storage:
        admission.check(_asks(ctx, slot_kinds), config.overcommit, context=admission_context)
    storage = ctx.storage
    built: list = []
    try:
        for kind, spec in zip(slot_kinds, ctx.specs):
            pool = kind.build(ctx, spec) if storage else None
            ctx.pools.append(pool)
            built.append(pool)
        ctx.costs = costs.from_config(config) if storage else None
        if ctx.costs is not None:
            for kind in [*slot_kinds, *keyed_kinds]:
                prior = kind.cost(ctx)
                if prior is not None:
                    ctx.costs.add_tier(prior)
        stores = []
        for kind, spec in zip(keyed_kinds, keyed_specs):
            stores.append(kind.build(ctx, spec))
            built.append(stores[-1])
        stack = Stack(config, role, hasher, storage, ctx.specs, ctx.pools, slot_kinds,
                      keyed_specs, stores, keyed_kinds, ctx.costs)
        stack.index = _index(stack)
        stack.executor = _executor(stack)
        hasher.warm_up()        # NOTE: as the index's chain passes: never inside a request
        for kind, i in stack.tiers()[:len(slot_kinds)]:
            kind.recover(stack, i)
        _workers(stack, ctx)
    except BaseException:
        for obj in reversed(built):
            _discard(obj)
        raise
    return stack


def plan_asks(config: CacheConfig, role: str, *, hasher: BlockHasher,
              tenant: str | None = None) -> list[admission.Ask]:
    """What `build_stack` would ask of the machine for these tiers, without building any (the
    daemon sums the partitions it builds at start)."""
    ctx, slot_kinds, _, _ = _plan(config, role, hasher, tenant, None)
    return _asks(ctx, slot_kinds) if ctx.storage else []


def _plan(config: CacheConfig, role: str, hasher: BlockHasher, tenant: str | None,
          provided: Mapping[str, Any] | None,
          ) -> tuple[Context, list[TierKind], list[TierKind], list[TierSpec]]:
    """Steps 1 and 2: the kinds, their specs and every check, before anything is built."""
    if role not in (ENGINE, DAEMON):
        raise ValueError(f"role: expected {ENGINE!r} or {DAEMON!r}, got {role!r}")
    storage = role == DAEMON or config.storage == "tensors"
    ctx = Context(config, role, hasher, storage=storage,
                  migrator=role == DAEMON or (storage and config.migrator.enabled),
                  tenant=tenant, provided=dict(provided or {}))
    chosen = _choose(ctx)
    slot_kinds: list[TierKind] = []
    for kind in (k for k in chosen if k.shape == SLOT):
        spec = kind.spec(ctx)
        if spec is not None:
            ctx.specs.append(spec)
            slot_kinds.append(kind)
    keyed_kinds = [k for k in chosen if k.shape == KEYED]
    keyed_specs = [kind.spec(ctx) for kind in keyed_kinds]
    _check(ctx, slot_kinds, keyed_kinds)
    return ctx, slot_kinds, keyed_kinds, keyed_specs


def _asks(ctx: Context, slot_kinds: list[TierKind]) -> list[admission.Ask]:
    return [a for kind, spec in zip(slot_kinds, ctx.specs) for a in kind.asks(ctx, spec)]


def _choose(ctx: Context) -> list[TierKind]:
    """The kinds configured in this role, in order, without the ones another replaces."""
    configured = [kind for kind in kinds().values()
                  if ctx.role in kind.roles and kind.present(ctx, ctx.section(kind.name))]
    names = {kind.name for kind in configured}
    for kind in kinds().values():
        if ctx.role in kind.roles:
            kind.check_config(ctx, kind.name in names)
    for kind in configured:
        if kind.needs.storage and not ctx.storage:
            raise ConfigError(f"tiers.{kind.name}", kind.needs.storage)
        clash = [other for other in kind.needs.excludes if other in names]
        if clash:
            raise ConfigError(f"tiers.{kind.name}", kind.needs.excludes_message or
                              f"cannot be configured together with "
                              f"{', '.join(f'tiers.{n}' for n in clash)}")
    replaced = {name for kind in configured for name in kind.needs.replaces}
    return [kind for kind in configured if kind.name not in replaced]


def _check(ctx: Context, slot_kinds: list[TierKind], keyed_kinds: list[TierKind]) -> None:
    """Every kind's needs, then its own checks: before anything is built."""
    specs = ctx.specs
    if not specs:
        raise ConfigError("tiers", "no slot tier is configured (a stack needs at least its "
                                   "fastest tier)")
    for i, spec in enumerate(specs):
        if spec.zero_copy and i != 1:
            raise ValueError(f"tier kind {spec.kind!r}: zero_copy is the kernels' host view, "
                             f"tier 1 only (it would be tier {i})")
    for kind in [*slot_kinds, *keyed_kinds]:
        needs = kind.needs
        if ctx.storage:
            if needs.above is not None:
                if kind.shape == SLOT:
                    i = next(i for i, s in enumerate(specs) if s.name == kind.name)
                    ok = i > 0 and specs[i - 1].stages_records
                else:
                    ok = ctx.stage_tier() is not None
                if not ok:
                    raise ConfigError(f"tiers.{kind.name}", needs.above)
            if needs.migrator is not None and not ctx.migrator:
                raise ConfigError(f"tiers.{kind.name}", needs.migrator)
        kind.check(ctx)


def policy_factory(config: CacheConfig) -> Callable:
    """(capacity, blocks) -> the configured eviction policy of one tier. The cost-aware
    policies weigh depth against the context length where attention costs as much as the
    linear layers (tiered_cache.costs), ~53K tokens when the model's size is not known."""
    policy_cls = policies.resolve(config.policy)
    model = config.model
    cost_ctx = (costs.crossover_context_tokens(model.num_params, model.num_layers,
                                               config.num_q_heads * model.head_dim)
                if model.num_params else 53_000.0)
    block_size = int(config.block_size)

    def make(capacity, blocks):
        return policy_cls(capacity, blocks=blocks, block_size=block_size,
                          cost_context_tokens=cost_ctx)
    return make


def _index(stack: Stack) -> BlockIndex:
    config = stack.config
    engine = stack.role == ENGINE
    return BlockIndex(stack.specs, policy=policy_factory(config),
                      block_size=stack.block_size, num_layers=config.model.num_layers,
                      hasher=stack.hasher, block_bytes=config.block_bytes,
                      verify_tokens=config.verify_tokens if engine else True,
                      share_inflight=config.share_inflight if engine else False,
                      write_through=engine and config.write_policy == "write_through",
                      run=stack.run, on_pressure=stack.poke,
                      high_watermark=config.migrator.high_watermark,
                      keyed=stack.keyed_specs,
                      worth=stack.worth if stack.costs is not None else None)


def _executor(stack: Stack):
    from tiered_cache.data.executor import Executor, NullExecutor

    if not stack.storage:
        return NullExecutor()
    executor = Executor(stack.pools + stack.stores,
                        [s.kind for s in stack.specs + stack.keyed_specs])
    for kind in [*stack.slot_kinds, *stack.keyed_kinds]:
        for (src, dst), handler in kind.handlers().items():
            executor.register(src, dst, handler)
    return executor


def _workers(stack: Stack, ctx: Context) -> None:
    """The migrator (puts to the keyed tiers that are written) and, in an engine, the
    compactor."""
    config, index = stack.config, stack.index
    if ctx.storage and ctx.migrator:
        puts = [k for k, keyed in enumerate(index.keyed.tiers) if keyed.put_from is not None]
        stack.migrator = migrator = Migrator(index, stack.executor, config.migrator,
                                             stack.health, put_tiers=puts,
                                             on_copy=stack.observe)
        froms = {index.keyed.tiers[k].put_from for k in puts}
        if froms:
            # Blocks a synchronous eviction demoted into a tier keyed tiers are put from.
            index.space.on_copied = lambda tier, blocks: (
                migrator.put_remote(blocks) if tier in froms else None)
    if stack.role == ENGINE and ctx.storage and config.compactor.enabled:
        stack.compactor = Compactor(index, stack.executor, config.compactor,
                                    health=stack.health)


def _discard(obj: Any) -> None:
    """Let go of a pool or store built before a later step failed."""
    close = getattr(obj, "close", None)
    if close is None:
        return
    try:
        close()
    except Exception:  # noqa: BLE001 - the build's own error is the one raised
        log.warning("closing a tier after a failed build", exc_info=True)
