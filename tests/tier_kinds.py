"""Tier kinds that only the tests register: proof that a new kind is one module.

- `memkv`: an in-memory keyed tier beneath the slot tiers, shared by every cache of the process
  that names the same `tiers.memkv.name` (as a Redis is shared by the processes that name its
  URL). Blocks that reach the host tier are put as self-verifying records (tiered_cache.records);
  `open()` loads the next blocks it holds through a host staging slot, after verifying each one.
- `handed`: a device tier whose pool the owner hands over (`build_stack(..., provided=...)`),
  taking the place of `gpu`: the shape of an engine-owned device tier (a vLLM or SGLang KV
  pool) under the same host tier.

Nothing in cache.py, daemon/partition.py, core/ or migrator/ knows of them. `register()` adds
them (the config accepts `tiers.memkv` / `tiers.handed` from then on), `unregister()` removes
them; tests/tiers/test_tier_kind_contract.py uses both around each test.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from tiered_cache import records, tiers
from tiered_cache.core.keyed import leading
from tiered_cache.core.tier import TierSpec
from tiered_cache.errors import ConfigError
from tiered_cache.sections import Section, TierSize, choice, positive_int
from tiered_cache.tiers.base import ENGINE, KEYED, Context, Needs, TierKind

# ------------------------------------------------------------------------------ memkv


@dataclass
class MemKVConfig(Section):
    """`tiers.memkv`: an in-memory keyed store, shared within the process by name."""

    _PATH: ClassVar[str] = "tiers.memkv"

    name: str = "default"
    """Caches naming the same store share it."""
    write: str = "on_host"
    """on_host: blocks that reach the host tier are put; off: only read."""
    lookahead_blocks: int = 64
    """Most blocks past the local match one open() looks up."""

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise ConfigError(self._key("name"), f"expected an identifier, got {self.name!r}")
        choice(self._key("write"), self.write, ("on_host", "off"))
        positive_int(self._key("lookahead_blocks"), self.lookahead_blocks, 1 << 16)


class MemoryStore:
    """A KeyedStore (tiered_cache.stores.base) in this process's memory: records by (root,
    key). Every record `get` returns passed `records.decode` for this namespace and key."""

    _shared: ClassVar[dict[str, MemoryStore]] = {}
    _shared_lock: ClassVar[threading.Lock] = threading.Lock()

    def __init__(self, namespace: bytes) -> None:
        self.namespace = namespace
        self._values: dict[tuple[bytes, bytes], bytes] = {}
        self._lock = threading.Lock()
        self.counts = {"exists": 0, "gets": 0, "puts": 0, "corrupt": 0}

    @classmethod
    def named(cls, name: str, namespace: bytes) -> MemoryStore:
        with cls._shared_lock:
            store = cls._shared.get(name)
            if store is None or store.namespace != namespace:
                store = cls._shared[name] = cls(namespace)
            return store

    @classmethod
    def forget_all(cls) -> None:
        with cls._shared_lock:
            cls._shared.clear()

    available = True

    def exists(self, root: bytes, keys: Sequence[bytes], deadline_s: float) -> list[bool]:
        with self._lock:
            self.counts["exists"] += 1
            return [(root, k) in self._values for k in keys]

    def get(self, root: bytes, keys: Sequence[bytes],
            deadline_s: float | None = None) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            self.counts["gets"] += len(keys)
            for k in keys:
                value = self._values.get((root, k))
                if value is not None:
                    try:
                        records.decode(value, namespace=self.namespace, expect_key=k)
                    except records.CorruptRecord:
                        self.counts["corrupt"] += 1
                        del self._values[(root, k)]     # as a store drops a corrupt value
                        value = None
                out.append(value)
        return out

    def put(self, root: bytes, items: Sequence[tuple[bytes, bytes]]) -> int:
        with self._lock:
            for key, record in items:
                self._values[(root, key)] = bytes(record)
            self.counts["puts"] += len(items)
        return len(items)

    put_async = put

    def delete(self, root: bytes, keys: Sequence[bytes]) -> int:
        with self._lock:
            return sum(self._values.pop((root, k), None) is not None for k in keys)

    def corrupt(self, root: bytes, key: bytes) -> None:
        """Flip a payload byte of one record (tests: a damaged value must be a miss)."""
        with self._lock:
            value = bytearray(self._values[(root, key)])
            value[-1] ^= 0xFF
            self._values[(root, key)] = bytes(value)

    def keys(self) -> list[tuple[bytes, bytes]]:
        with self._lock:
            return list(self._values)

    def flush(self, timeout_s: float | None = None) -> bool:
        return True

    def close(self) -> None:
        pass

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {**self.counts, "errors": 0, "timeouts": 0, "available": True,
                    "values": len(self._values)}


class MemKVKind(TierKind):
    """An in-memory keyed tier: built like `remote` (a KeyedStore under the data plane's
    record tier, staged through the host tier), with its own section, store and handler keys."""

    name = "memkv"
    section = MemKVConfig
    shape = KEYED
    rank = 390
    roles = frozenset({ENGINE})
    needs = Needs(storage="needs storage: tensors (it stores KV)",
                  above="needs a host tier to stage its records through",
                  migrator="needs the migrator: only its threads load and put")

    def spec(self, ctx: Context) -> TierSpec:
        stage = ctx.stage_tier()
        put_from = stage if ctx.section(self.name).write == "on_host" else None
        return TierSpec(self.name, self.name, 0, staged=True, put_from=put_from,
                        whole_records=True)

    def build(self, ctx: Context, spec: TierSpec) -> Any:
        from tiered_cache.data.remote_tier import RemoteTier

        host = ctx.pools[ctx.stage_tier()]
        namespace = ctx.hasher.namespace_digest()
        store = MemoryStore.named(ctx.section(self.name).name, namespace)
        return RemoteTier(store, host_kv=host.kv, host_scales=host.scales, namespace=namespace)

    def handlers(self):
        from tiered_cache.data import remote_tier

        host = tiers.get("host").name
        return {(self.name, host): remote_tier.remote_to_host,
                (host, self.name): remote_tier.host_to_remote}

    def load(self, stack, k: int, seq) -> bool:
        index, bs = stack.index, stack.block_size
        m, last, n = index.keyed.loadable(seq)
        n = min(n, stack.section(self.name).lookahead_blocks)
        if not n:
            return False
        keys = stack.hasher.chain(last, seq.token_ids[m * bs:(m + n) * bs])
        r = leading(stack.stores[k].exists(seq.root, keys, 1.0))
        return bool(r) and bool(index.keyed.extend(seq, k, keys[:r], stack.promote))

    def invalidate(self, stack, k: int, root: bytes, tokens) -> int:
        return stack.stores[k].delete(root, stack.hasher.chain(root, tokens))

    def stats(self, stack, k: int, out: dict) -> None:
        out["tiers"][stack.index.keyed.tiers[k].name]["store"] = stack.stores[k].stats()


# ------------------------------------------------------------------------------ handed


@dataclass
class HandedConfig(Section, TierSize):
    """`tiers.handed`: a device tier whose pool the owner hands over; its size is the pool's."""

    _PATH: ClassVar[str] = "tiers.handed"
    MIN_BLOCKS: ClassVar[int] = 1

    capacity: str | None = None
    num_blocks: int | None = None
    max_num_blocks: int | None = None
    segment_blocks: int | None = None

    def __post_init__(self) -> None:
        self._check_size(min_blocks=1)


class HandedKind(TierKind):
    """Tier 0 from a pool the owner provides, instead of `gpu`: the device-side copy handlers
    are the memory tiers' own, registered under this kind's pairs."""

    name = "handed"
    section = HandedConfig
    rank = 0
    roles = frozenset({ENGINE})
    needs = Needs(replaces=("gpu",))

    def spec(self, ctx: Context) -> TierSpec:
        return TierSpec(self.name, self.name, ctx.section(self.name).num_blocks)

    def build(self, ctx: Context, spec: TierSpec) -> Any:
        pool = ctx.provided.get(self.name)
        if pool is None or pool.num_slots != spec.num_slots:
            raise ConfigError(f"tiers.{self.name}", "needs the owner's pool of num_blocks "
                                                   "slots (build_stack(provided=...))")
        return pool

    def handlers(self):
        from tiered_cache.data.executor import gpu_to_host, host_to_gpu, within_pool

        host = tiers.get("host").name
        return {(self.name, host): gpu_to_host, (host, self.name): host_to_gpu,
                (self.name, self.name): within_pool}


KINDS = (MemKVKind(), HandedKind())


def register() -> None:
    for kind in KINDS:
        tiers.register(kind)


def unregister() -> None:
    for kind in KINDS:
        tiers.unregister(kind.name)
    MemoryStore.forget_all()
