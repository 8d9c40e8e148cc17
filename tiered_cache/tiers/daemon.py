"""Tier kind `daemon`: an engine attached to the node daemon (`tiered-cache serve`). The
daemon's tiers (its shared host pool, and disk or remote when it has them) sit beneath this
engine's device tier as one keyed tier (data/daemon_tier.py over tiered_cache.wire): loads
copy out of the shared pool this process maps read-only, puts go through its staging area.

NOTE: the daemon's shared pool is the node's host tier, so an engine attached to it builds no
host tier of its own (`replaces`), and its disk and remote tiers belong to the daemon's config
(`excludes`): two host tiers would store the same blocks twice per node.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from typing import Any, ClassVar

from tiered_cache.core.tier import DEVICE, TierSpec
from tiered_cache.errors import ConfigError
from tiered_cache.sections import Section, boolean, choice, positive_number
from tiered_cache.sizing import short_repr
from tiered_cache.tiers.base import ENGINE, KEYED, Context, Needs, TierKind, register
from tiered_cache.wire.ops import MAX_BLOCKS
from tiered_cache.wire.shm import PoolGeometry

DEVICE_KIND = "gpu"
"""The kind its copy handlers pair with (daemon <-> gpu)."""
DAEMON_WRITES = ("on_compute", "off")
SHARED_DTYPES = ("float32", "float16", "bfloat16")
"""KV dtypes the daemon's pool can hold (it keeps no per-block FP8 scales)."""


@dataclass
class DaemonTierConfig(Section):
    """An engine attached to the node daemon (`tiered-cache serve`): the daemon's tiers (its
    shared host pool, and disk when configured) sit beneath this engine's GPU tier. The engine
    keeps its GPU tier and kernels; KV moves through shared memory, never the socket."""

    _PATH: ClassVar[str] = "tiers.daemon"

    socket: str | None = None
    """The daemon's Unix socket (daemon.socket in its config)."""
    timeout_s: float = 5.0
    """Longest wait for one reply of the daemon (then it counts as gone)."""
    lookup_deadline_ms: float = 2000.0
    """Longest the daemon may take in open() to make the blocks it found ready (a read from
    its disk tier) before it answers "absent"; the reply itself is bounded by timeout_s."""
    write: str = "on_compute"
    """on_compute: every block this engine computes is published to the daemon (in the
    background), where the other engine processes of the node find it; off: only read."""
    required: bool = False
    """true: the engine does not start without the daemon (DaemonUnavailableError when nothing
    answers at the socket); false: it serves from its GPU tier alone until the daemon answers."""

    def __post_init__(self) -> None:
        if not isinstance(self.socket, str) or not self.socket or "\0" in self.socket \
                or len(self.socket) > 107 or not self.socket.isprintable():
            raise ConfigError(self._key("socket"), f"expected a Unix socket path (at most 107 "
                                                   f"bytes), got {short_repr(self.socket)}")
        self.timeout_s = positive_number(self._key("timeout_s"), self.timeout_s, 3600)
        self.lookup_deadline_ms = positive_number(self._key("lookup_deadline_ms"),
                                                  self.lookup_deadline_ms, 60_000)
        choice(self._key("write"), self.write, DAEMON_WRITES)
        boolean(self._key("required"), self.required)


class DaemonKind(TierKind):
    name = "daemon"
    aliases = ("node", "serve", "shared")
    section = DaemonTierConfig
    shape = KEYED
    rank = 310
    roles = frozenset({ENGINE})
    needs = Needs(
        storage="needs storage: tensors (a metadata-only cache has no KV to share)",
        excludes=("disk", "remote"),
        excludes_message="an engine attached to the node daemon uses the daemon's tiers: "
                         "configure tiers.disk and tiers.remote in the daemon's config, not "
                         "here",
        replaces=("host",),
        migrator="needs the migrator (migrator.enabled: true): only its background threads "
                 "copy to and from the daemon")

    def where(self, section: Any) -> tuple[str, str]:
        return (f"the node daemon at {section.socket}",
                "the daemon's config (tiers.host and tiers.disk per tenant)")

    def check(self, ctx: Context) -> None:
        dtype = ctx.config.model.dtype
        if dtype not in SHARED_DTYPES:
            raise ConfigError("model.dtype", f"{dtype!r} KV cannot go through the daemon yet "
                                             "(its pool has no per-block scales): use float16 "
                                             "or bfloat16, or no tiers.daemon")

    def check_config(self, ctx: Context, configured: bool) -> None:
        """The top-level `daemon:` section configures `tiered-cache serve`. In an engine's
        config without tiers.daemon it would be ignored (the engine runs alone): refused.

        NOTE: only a section that differs from the default counts, so a config written back by
        `to_dict()` (which always has one) still builds an engine."""
        served = ctx.config.daemon
        if configured or served == type(served)():
            return
        raise ConfigError("daemon", f"this section configures the node daemon (`tiered-cache "
                                    f"serve`), and this engine is not attached to one: to "
                                    f"attach, set tiers.{self.name}.socket: {served.socket}; "
                                    f"to run the daemon, pass this file to `tiered-cache "
                                    f"serve`; else remove the section")

    def spec(self, ctx: Context) -> TierSpec:
        on_compute = ctx.section(self.name).write == "on_compute"
        # NOTE: unstaged: the shared pool is host memory the device copies from directly.
        return TierSpec(self.name, self.name, 0, staged=False,
                        put_from=DEVICE if on_compute else None, whole_records=True)

    def build(self, ctx: Context, spec: TierSpec) -> Any:
        from tiered_cache.data.daemon_tier import DaemonTier

        d, model = ctx.section(self.name), ctx.config.model
        geometry = PoolGeometry(1, model.num_layers, int(ctx.config.block_size),
                                model.num_kv_heads, model.head_dim, model.dtype)
        return DaemonTier(d.socket, timeout_s=d.timeout_s, geometry=geometry,
                          namespace=ctx.hasher.namespace_digest(), gpu=ctx.pools[DEVICE],
                          required=d.required)

    def handlers(self):
        from tiered_cache.data import daemon_tier

        return {(self.name, DEVICE_KIND): daemon_tier.daemon_to_gpu,
                (DEVICE_KIND, self.name): daemon_tier.gpu_to_daemon}

    def start(self, stack, k: int) -> None:
        on_compute = stack.section(self.name).write == "on_compute"
        stack.stores[k].start(on_attach=functools.partial(
            _attached, stack.index, k, stack.migrator if on_compute else None))

    def note_open(self, stack, k: int, seq) -> None:
        """The daemon learns how the sequence's root was derived (salt, adapter)."""
        adapter = seq.adapter_id if seq.adapter_id is not None else stack.config.adapter_id
        stack.stores[k].note_root(seq.root, seq.salt, adapter)

    def load(self, stack, k: int, seq) -> bool:
        """Ask the daemon to pin the next blocks (one round trip); extend the sequence over what
        it found; the load handler copies them out of the shared pool and releases the pins."""
        index = stack.index
        m, last, n = index.keyed.loadable(seq)
        n = min(n, MAX_BLOCKS)
        daemon = stack.stores[k]
        if not n or not daemon.available:
            return False
        bs = stack.block_size
        handle, slots = daemon.fetch(seq.root, last, seq.token_ids[m * bs:(m + n) * bs],
                                     int(stack.section(self.name).lookup_deadline_ms))
        if not handle:
            return False
        taken = 0
        try:
            keys = stack.hasher.chain(last, seq.token_ids[m * bs:(m + len(slots)) * bs])
            taken = index.keyed.extend(seq, k, keys, stack.promote, slots=slots, ticket=handle)
        finally:
            if not taken:
                # NOTE: nothing will copy under this handle (extend took nothing, or raised
                # before handing the plan on), so it is released here; a copy still queued
                # would find it gone and fail its blocks, never read slots the daemon reused.
                daemon.release(handle)
        return bool(taken)

    def invalidate(self, stack, k: int, root: bytes, tokens) -> int:
        return stack.stores[k].invalidate(root, tokens)

    def stats(self, stack, k: int, out: dict) -> None:
        """The store's own counters, and the daemon's tiers (this tenant's partition) under
        their own names beneath ours: `daemon.host`, `daemon.disk`. Asked at most once a
        second."""
        daemon = stack.stores[k]
        name = stack.index.keyed.tiers[k].name
        out["tiers"][name]["store"] = daemon.stats()
        if stack.closed:
            return
        now = time.monotonic()
        cached = getattr(daemon, "_stats_cache", None)
        if cached is None or now - cached[0] > 1.0:
            cached = (now, daemon.daemon_stats() if daemon.available else None)
            daemon._stats_cache = cached
        theirs = cached[1]
        if not theirs:
            return
        for tier_name, tier in theirs["partition"]["tiers"].items():
            out["tiers"][f"{name}.{tier_name}"] = tier

    def close(self, stack, k: int) -> None:
        store = stack.stores[k]
        store.flush(5.0)
        store.close()


def _attached(index, k: int, migrator, tenant_salt: bytes) -> None:
    """The node daemon tier (re)attached (on its thread): key roots under the tenant it
    assigned, and publish what the device tier holds.

    NOTE: a new daemon may have lost everything (a restart without a disk tier), and blocks
    computed while it was away were never published: every published device block is put
    again (blocks whose root the daemon keys differently are skipped by the put, and a block
    the daemon already has is answered "not taken" and costs no copy there)."""
    index.set_tenant(tenant_salt)
    index.keyed.forget_puts(k)
    if migrator is not None and not migrator.stopped:
        migrator.put_remote(index.persist.blocks_in(DEVICE))


register(DaemonKind())
