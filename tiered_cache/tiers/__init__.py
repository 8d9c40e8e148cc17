"""Tier kinds: one module per kind (gpu, host, disk, remote, daemon), each one registered
`TierKind` (base.py) that declares the kind's config section, what it needs of the rest of the
stack, how it builds its pool or store, its copy handlers, its recovery and its stats.
`stack.build_stack(config, role)` assembles an engine's tiers (TieredKVCache) and a daemon
partition's from these declarations; nothing outside this package names a tier kind.

Adding a kind is one module that registers its `TierKind` (docs/architecture.md, "Tier
kinds"): its `tiers.<name>` section is accepted by the config from then on.

NOTE: the stack builder is not imported here: config.py imports this package (for every
kind's section), and the builder sits above the config, the data plane and the migrator.
"""

from tiered_cache.tiers import daemon, disk, gpu, host, remote  # noqa: F401 - built-in kinds
from tiered_cache.tiers.base import (
    DAEMON,
    ENGINE,
    KEYED,
    SLOT,
    Context,
    Needs,
    TierKind,
    get,
    kinds,
    register,
    unregister,
)

__all__ = ["DAEMON", "ENGINE", "KEYED", "SLOT", "Context", "Needs", "TierKind", "get", "kinds",
           "register", "unregister"]
