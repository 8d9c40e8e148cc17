"""The tier-kind contract, and the registry of kinds.

A tier kind is one object (a `TierKind` subclass instance) registered under its name, which
is also its config key `tiers.<name>`. It declares everything the rest of the library needs to
know of that kind of tier, so that nothing else names it (docs/architecture.md, "Tier kinds"):

- `section`: the dataclass that validates `tiers.<name>` (tiered_cache.sections), and
  `default_section()` for a kind that is always configured (gpu, host);
- `shape` (`SLOT`: a preallocated pool of slots in the speed-ordered list; `KEYED`: a store
  consulted after the slot tiers, that evicts on its own) and `rank` (its place in the order);
- `roles`: the owners it serves in (`ENGINE`: TieredKVCache; `DAEMON`: a tenant partition of
  the node daemon) and `needs`: what it requires of the rest of the stack and what it excludes
  (`Needs`, checked by the stack builder before anything is built);
- `spec()`: its TierSpec, with the capability flags the control plane reads instead of a kind;
- `build()`: its pool (slot kind) or store (keyed kind) in a role; `handlers()`: its copy
  handlers per (source kind, destination kind); `recover()` / `close()`: its lifetime;
- `asks()`: the memory or disk space its pool takes (checked before anything is built);
- `cost()`: its prior for the load-or-recompute model; `stats()`: what it adds to `stats()`
  (under `tiers.<tier name>`, which also labels every `tiered_cache_*{tier=...}` metric);
- keyed kinds: `note_open()` / `load()` after open()'s local match (engine), `load_after()`
  after a daemon fetch's local match (daemon), `invalidate()`; `start()` once the stack is
  whole.

NOTE: config.py imports every registered kind (to accept its section), and config imports no
torch: a kind module imports the data plane inside the functions that build or copy, never at
module level.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar

from tiered_cache.core.tier import TierSpec

if TYPE_CHECKING:
    from tiered_cache.admission import Ask
    from tiered_cache.config import CacheConfig
    from tiered_cache.core.sequence import Sequence
    from tiered_cache.costs import CostModel, TierCost
    from tiered_cache.hashing import BlockHasher
    from tiered_cache.tiers.stack import Stack

ENGINE = "engine"
"""Role: the tiers of one engine process (TieredKVCache): the device tier and beneath it."""
DAEMON = "daemon"
"""Role: one tenant partition of the node daemon: its shared host pool and beneath it."""
ROLES = (ENGINE, DAEMON)

SLOT = "slot"
KEYED = "keyed"

Handler = Callable[[Any, Any, list, "tuple[int, ...] | None", bool], None]
"""handler(src_pool, dst_pool, transfers sorted by source slot, layers, non_blocking)."""


@dataclass(frozen=True)
class Needs:
    """What a kind requires of the rest of its stack; each message is a ConfigError at
    `tiers.<name>`. Checked in this order, before anything is built."""

    storage: str | None = None
    """Refused with `storage: none` (a metadata-only cache). Without this message the kind is
    built as a metadata tier there, and the checks below are skipped (no bytes to move)."""
    excludes: tuple[str, ...] = ()
    """Kinds that may not be configured beside it (in a role it serves)."""
    excludes_message: str = ""
    replaces: tuple[str, ...] = ()
    """Kinds it takes the place of: not built beside it, whatever their sections say."""
    above: str | None = None
    """Needs a slot tier whose records stage through it (`TierSpec.stages_records`): the one
    directly above (a slot kind), or any (a keyed kind)."""
    migrator: str | None = None
    """Needs the migrator (`migrator.enabled: true`): only its threads move this tier's data."""


@dataclass
class Context:
    """What a kind builds from: the config, the role, and the tiers built before it."""

    config: CacheConfig
    role: str
    hasher: BlockHasher
    storage: bool
    """Tensor storage (`storage: tensors`; always in the daemon)."""
    migrator: bool
    """A migrator will run (the daemon always runs one)."""
    tenant: str | None = None
    """DAEMON: the partition's tenant (its disk directory, its pool's name)."""
    provided: Mapping[str, Any] = field(default_factory=dict)
    """Objects the owner hands over, by kind name (an engine's own device pool)."""
    specs: list[TierSpec] = field(default_factory=list)
    """The slot tiers so far (a slot kind being built gets index len(specs))."""
    pools: list = field(default_factory=list)
    """Their pools (None with `storage: none`)."""
    costs: CostModel | None = None
    """The load-or-recompute model, once the slot tiers are built (keyed kinds feed it)."""

    def section(self, name: str) -> Any:
        return getattr(self.config.tiers, name)

    def stage_tier(self) -> int | None:
        """The first slot tier that stages records (host memory), if any."""
        return next((i for i, s in enumerate(self.specs) if s.stages_records), None)


class TierKind:
    """One kind of tier. Subclass, set the class attributes, override what the kind does, and
    `register()` an instance. The defaults describe a plain slot tier of host memory."""

    name: ClassVar[str]
    section: ClassVar[type]
    shape: ClassVar[str] = SLOT
    rank: ClassVar[int]
    """Order: slot kinds by rank, fastest first (gpu 0, host 100, disk 200); keyed kinds after
    every slot kind, by rank (remote 300, daemon 310)."""
    roles: ClassVar[frozenset[str]] = frozenset({ENGINE})
    needs: ClassVar[Needs] = Needs()
    aliases: ClassVar[tuple[str, ...]] = ()
    """Other names users give this kind of tier (`tiers.redis` for remote): an unknown
    `tiers.<alias>` suggests this kind instead of the closest spelling."""

    # ---------------------------------------------------------------- config
    def default_section(self) -> Any:
        """The section a config without `tiers.<name>` gets; None: the kind is optional."""
        return None

    def present(self, ctx: Context, section: Any) -> bool:
        """Whether this kind is a tier of the stack being built (configured, non-empty)."""
        return section is not None

    def check(self, ctx: Context) -> None:
        """Checks of its own (after `needs`), raising ConfigError."""

    def check_config(self, ctx: Context, configured: bool) -> None:
        """Checks of the rest of the config in a role where this kind could be a tier, whether
        or not it is (`configured`): a setting that means nothing without it. ConfigError."""

    def where(self, section: Any) -> tuple[str, str]:
        """For the capacity planner (tools/planner.py): where this tier's blocks live, and
        what bounds how many it keeps."""
        return f"tiers.{self.name}", "its own section"

    # ---------------------------------------------------------------- building
    def spec(self, ctx: Context) -> TierSpec:
        """Its TierSpec: name, kind, slots, capability flags. A slot kind's index is
        len(ctx.specs); a keyed kind's spec has 0 slots."""
        raise NotImplementedError

    def build(self, ctx: Context, spec: TierSpec) -> Any:
        """Its pool (slot kind; called only with tensor storage) or store (keyed kind): the
        object its copy handlers get as `src_pool` / `dst_pool`."""
        raise NotImplementedError

    def handlers(self) -> Mapping[tuple[str, str], Handler]:
        """The copy handlers this kind brings, per (source kind, destination kind)."""
        return {}

    def cost(self, ctx: Context) -> TierCost | None:
        """Its prior in the load-or-recompute model (a slow tier), or None: never priced."""
        return None

    def asks(self, ctx: Context, spec: TierSpec) -> list[Ask]:
        """What its pool will allocate and where (tiered_cache.admission): checked against
        what the machine can give before any pool of the stack is built (tensor storage)."""
        return []

    # ---------------------------------------------------------------- lifetime
    # NOTE: `tier` is the slot tier's index for a slot kind, the keyed tier's position k
    # (BlockIndex.keyed, Stack.stores) for a keyed kind.
    def recover(self, stack: Stack, tier: int) -> None:
        """After the index is built: rebuild what a persistent tier holds (a restart)."""

    def start(self, stack: Stack, tier: int) -> None:
        """Once the stack is whole (index, executor, migrator): start what runs on its own."""

    def drain(self, stack: Stack, tier: int) -> int:
        """A graceful stop, after the workers stopped and the owner closed its sequences,
        before `close`: a persistent tier takes what only memory holds. Returns blocks
        written."""
        return 0

    def close(self, stack: Stack, tier: int) -> None:
        """At shutdown, after the workers stopped: write back what must last, free the pool."""

    def stats(self, stack: Stack, tier: int, out: dict) -> None:
        """Add this tier's own figures to `stats()` (out["tiers"][<tier name>] exists)."""

    # ---------------------------------------------------------------- keyed tiers
    def note_open(self, stack: Stack, k: int, seq: Sequence) -> None:
        """ENGINE: a sequence was opened (keyed tier k learns how its root was derived)."""

    def load(self, stack: Stack, k: int, seq: Sequence) -> bool:
        """ENGINE: after open()'s local match, load what keyed tier k has of the next blocks
        (`BlockIndex.keyed.extend`). True once something was loaded: later keyed tiers are not
        asked."""
        return False

    def load_after(self, stack: Stack, k: int, seq: Sequence, root: bytes, parent: bytes,
                   tokens: Any) -> int:
        """DAEMON: a fetch's hold ends before `tokens` do: load the next blocks keyed tier k
        has into it (`BlockIndex.keyed.load_after`). Returns how many."""
        return 0

    def invalidate(self, stack: Stack, k: int, root: bytes, tokens: Any) -> int:
        """Drop this prefix's blocks from keyed tier k; how many it reports dropping."""
        return 0


# -------------------------------------------------------------------- the registry
_KINDS: dict[str, TierKind] = {}
_RESERVED = frozenset({"items", "to_dict", "compute_device"})
"""TiersConfig's own methods: a kind cannot be named like them (its section is an attribute)."""


def register(kind: TierKind, *, replace: bool = False) -> TierKind:
    """Make `kind` known to the config (`tiers.<kind.name>`) and to the stack builder."""
    name = getattr(kind, "name", None)
    if not isinstance(name, str) or not name.isidentifier() or name.startswith("_") \
            or name in _RESERVED:
        raise ValueError(f"a tier kind's name must be an identifier (its config key), got "
                         f"{name!r}")
    if kind.shape not in (SLOT, KEYED) or not set(kind.roles) <= set(ROLES):
        raise ValueError(f"tier kind {name!r}: shape must be {SLOT!r} or {KEYED!r}, roles a "
                         f"subset of {ROLES}")
    if name in _KINDS and not replace:
        raise ValueError(f"a tier kind named {name!r} is already registered")
    _KINDS[name] = kind
    return kind


def unregister(name: str) -> None:
    """Forget a kind (tests that register one of their own)."""
    _KINDS.pop(name, None)


def kinds() -> dict[str, TierKind]:
    """Every registered kind, slot kinds first, each group in rank order."""
    return dict(sorted(_KINDS.items(), key=lambda item: (item[1].shape == KEYED,
                                                         item[1].rank, item[0])))


def get(name: str) -> TierKind:
    return _KINDS[name]
