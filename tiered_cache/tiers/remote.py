"""Tier kind `remote`: a shared keyed store (Redis or Valkey, standalone or cluster) beneath the
slot tiers (data/remote_tier.py over tiered_cache.stores). Consulted after the local match
under a hard deadline, loaded from and written to in the background; the server alone evicts.

In an engine a load is staged through the host tier (a record is verified there before the
device sees it) and blocks that reach the host tier are put. In the node daemon loads land
straight in the partition's shared pool (tier 0, host memory) and blocks published into the pool
are put: daemons on different nodes configured alike share prefixes through the store.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, ClassVar
from urllib.parse import urlsplit

from tiered_cache import records
from tiered_cache.core.keyed import leading
from tiered_cache.core.tier import DEVICE, TierSpec
from tiered_cache.costs import TierCost
from tiered_cache.errors import ConfigError, install_hint
from tiered_cache.sections import (
    Section,
    boolean,
    choice,
    positive_int,
    positive_number,
)
from tiered_cache.sizing import short_repr
from tiered_cache.stores.base import StoreAuthError, StoreUnavailableError, redact_url
from tiered_cache.tiers.base import DAEMON, ENGINE, KEYED, Context, Needs, TierKind, register

log = logging.getLogger("tiered_cache.tiers.remote")

_URL_SCHEMES = ("redis://", "rediss://", "valkey://", "valkeys://")
REMOTE_WRITES = ("on_compute", "on_host", "off")
HOST_KIND, DEVICE_KIND = "host", "gpu"
"""The kinds it copies with: records are staged through host (remote <-> host), and an
engine puts computed blocks from its device tier (gpu -> remote, `write: on_compute`)."""


@dataclass
class RemoteTierConfig(Section):
    """A shared keyed store (Redis or Valkey, standalone or cluster) beneath the slot tiers:
    consulted after a local miss under a hard deadline, loaded from in the background, written
    in the background. The server alone evicts (its maxmemory policy)."""

    _PATH: ClassVar[str] = "tiers.remote"

    url: str | None = None
    """redis://host:port/db, or rediss:// for TLS (valkey:// and valkeys:// alike)."""
    cluster: bool = False
    """Redis Cluster: keys spread over the masters by the cluster's own slot hashing."""
    username: str | None = None
    password: str | None = None
    """Prefer password_env: a password in a YAML file is readable by whoever reads the file."""
    password_env: str | None = None
    """Name of an environment variable holding the password."""
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_check_hostname: bool = True
    prefix: str = "tc"
    """First part of every server key: tc:v1:<namespace>:<tenant root>:<block key>."""
    ttl_s: float | None = None
    """Expire values after this many seconds (null: only the server's eviction removes them)."""
    lookup_deadline_ms: float = 5.0
    """Hard deadline of the existence check in open(): a slow or dead server answers "absent"
    after it, so open() never waits longer for this tier."""
    lookahead_blocks: int = 256
    """Most blocks past the local match one open() looks up."""
    write: str = "on_compute"
    """on_compute: every block this engine computes is put to the store in the background as
    soon as it is published (copied from the device tier), so other processes find it at once;
    on_host: only blocks that reach the host tier (evicted from the device, or copied down by
    write_through) are put; off: this cache only reads. In the node daemon both put every block
    published into its pool."""
    put_queue_mib: int = 256
    """Bound of the background put queue (what does not fit is dropped and counted)."""
    latency_ms: float = 1.0
    """Prior of the load cost model until the tier has been measured."""
    bandwidth_gbps: float = 1.0
    """Prior of the load cost model until the tier has been measured."""

    def __post_init__(self) -> None:
        if not isinstance(self.url, str) or not self.url.startswith(_URL_SCHEMES) \
                or not self.url.isprintable() or len(self.url) > 2048:
            raise ConfigError(self._key("url"), f"expected a URL like redis://host:6379/0 "
                                                f"(or rediss://), got {short_repr(self.url)}")
        boolean(self._key("cluster"), self.cluster)
        _check_url(self._key("url"), self.url, self.cluster)
        boolean(self._key("tls_check_hostname"), self.tls_check_hostname)
        for key in ("username", "password", "password_env", "tls_ca", "tls_cert", "tls_key"):
            v = getattr(self, key)
            if v is not None and (not isinstance(v, str) or not v or len(v) > 4096
                                  or "\0" in v):
                shown = "***" if key == "password" else short_repr(v)
                raise ConfigError(self._key(key), f"expected a string or null, got {shown}")
        if self.password is not None and self.password_env is not None:
            raise ConfigError(self._key("password"), "set password or password_env, not both")
        if not isinstance(self.prefix, str) or not re.fullmatch(r"[A-Za-z0-9_.-]{1,32}",
                                                                 self.prefix):
            raise ConfigError(self._key("prefix"), f"expected 1-32 letters, digits, '_', '.' "
                                                   f"or '-', got {short_repr(self.prefix)}")
        if self.ttl_s is not None:
            self.ttl_s = positive_number(self._key("ttl_s"), self.ttl_s, 365 * 86400)
            if self.ttl_s < 1:
                # NOTE: the server expires in whole seconds (SET EX): below 1 would be 0,
                # which it refuses on every put.
                raise ConfigError(self._key("ttl_s"), f"expected at least 1 second (the "
                                                      f"server expires in whole seconds), got "
                                                      f"{self.ttl_s:g}")
        self.lookup_deadline_ms = positive_number(self._key("lookup_deadline_ms"),
                                                  self.lookup_deadline_ms, 60_000)
        positive_int(self._key("lookahead_blocks"), self.lookahead_blocks, 1 << 20)
        choice(self._key("write"), self.write, REMOTE_WRITES)
        positive_int(self._key("put_queue_mib"), self.put_queue_mib, 1 << 20)
        self.latency_ms = positive_number(self._key("latency_ms"), self.latency_ms, 60_000)
        self.bandwidth_gbps = positive_number(self._key("bandwidth_gbps"),
                                              self.bandwidth_gbps, 10_000)


def _check_url(path: str, url: str, cluster: bool) -> None:
    """What redis-py would refuse only when it connects (a plain ValueError or TypeError from
    inside the client), refused here with the key: the port, an IPv6 literal, the host, the
    database, URL options (the client takes unknown ones as keyword arguments) and fragments.

    NOTE: credentials in the URL are allowed (the user part); every other setting has its own
    key under tiers.remote."""
    try:
        parts = urlsplit(url)
        port = parts.port
        host = parts.hostname
    except ValueError as exc:
        what = "an invalid IPv6 literal" if "IPv6" in str(exc) or "[" in url else "a bad port"
        raise ConfigError(path, f"{redact_url(url)} has {what} ({exc}); expected "
                                "redis://host:port/db, an IPv6 host in brackets: "
                                "redis://[::1]:6379/0") from None
    if "[" in parts.netloc:
        literal = parts.netloc.rpartition("@")[2].partition("]")[0].lstrip("[")
        try:
            ipaddress.IPv6Address(literal)
        except ValueError:
            raise ConfigError(path, f"{redact_url(url)}: [{literal}] is not an IPv6 "
                                    "address") from None
    if not host:
        raise ConfigError(path, f"{redact_url(url)} names no host (redis://host:6379/0)")
    if port is not None and not 1 <= port <= 65535:
        raise ConfigError(path, f"{redact_url(url)}: port {port} is out of range 1..65535")
    if parts.query:
        raise ConfigError(path, f"{redact_url(url)}: URL options ('?{parts.query[:40]}') are "
                                "not supported; every option has its own tiers.remote key "
                                "(username, password_env, tls_*, ttl_s, ...)")
    if parts.fragment:
        raise ConfigError(path, f"{redact_url(url)}: a URL fragment ('#...') means nothing "
                                "here")
    db = parts.path.strip("/")
    if db and not (db.isdigit() and db.isascii()):
        raise ConfigError(path, f"{redact_url(url)}: the path must be the database number "
                                f"(redis://host:6379/0), got {short_repr(parts.path)}")
    if cluster and db and int(db) != 0:
        raise ConfigError(path, f"{redact_url(url)}: a Redis Cluster has only database 0 "
                                "(tiers.remote.cluster: true)")


def connect(remote: RemoteTierConfig, *, namespace: bytes, num_tokens: int, payload_bytes: int,
            cost=None, delete_corrupt: bool = False):
    """The store `tiers.remote` names (redis-py). An unreachable server is not an error: the
    store starts unverified and its breaker probes the server again later. `delete_corrupt`:
    see RedisStore."""
    try:
        from tiered_cache.stores.redis import RedisStore  # NOTE: redis-py, an extra
    except ImportError as exc:
        raise ConfigError("tiers.remote", f"needs redis-py: {install_hint('remote')} "
                                          f"({exc})") from None
    password = remote.password
    if remote.password_env is not None:
        password = os.environ.get(remote.password_env)
        if password is None:
            raise ConfigError("tiers.remote.password_env",
                              f"environment variable {remote.password_env!r} is not set")
    url = remote.url.replace("valkey://", "redis://", 1).replace("valkeys://", "rediss://", 1)
    kw = dict(namespace=namespace, num_tokens=num_tokens,
              cluster=remote.cluster, username=remote.username, password=password,
              ssl_ca_certs=remote.tls_ca, ssl_certfile=remote.tls_cert,
              ssl_keyfile=remote.tls_key, ssl_check_hostname=remote.tls_check_hostname,
              prefix=remote.prefix,
              ttl_s=int(remote.ttl_s) if remote.ttl_s is not None else None,
              put_queue_bytes=remote.put_queue_mib << 20,
              record_bytes=records.header_len(num_tokens) + payload_bytes, cost=cost,
              delete_corrupt=delete_corrupt)
    try:
        return RedisStore(url, verify=True, **kw)
    except StoreAuthError as exc:
        raise _auth_config_error(remote, exc) from None
    except StoreUnavailableError as exc:
        # NOTE: an unreachable server is not a reason not to serve: the cache starts on its
        # local tiers and the store's breaker probes the server again later.
        log.warning("tiers.remote: %s; serving from the local tiers until it answers", exc)
        return RedisStore(url, verify=False, **kw)


def _auth_config_error(remote: RemoteTierConfig, exc: StoreAuthError) -> ConfigError:
    """The server refused us: a ConfigError naming the key to change, in our words (the
    server's own reply differs by version and means little to an operator)."""
    where = f"the server at {exc.url}"
    if exc.reason == StoreAuthError.NEEDS_PASSWORD:
        return ConfigError(f"{RemoteTierConfig._PATH}.password_env",
                           f"{where} requires a password and this config gives none: set "
                           f"password_env to the name of an environment variable that holds "
                           f"it (or password, or redis://:PASSWORD@host in the url)")
    user = remote.username or "default"
    if exc.reason == StoreAuthError.NO_PERMISSION:
        return ConfigError(f"{RemoteTierConfig._PATH}.username",
                           f"{where} does not let ACL user {user!r} run the store's commands "
                           "(GET, SET, EXISTS, DEL, PING); grant them or use another user")
    key = "password_env" if remote.password_env else "password" if remote.password else "url"
    return ConfigError(f"{RemoteTierConfig._PATH}.{key}",
                       f"{where} refused the credentials (user {user!r}): check the password "
                       f"and the username")


class RemoteKind(TierKind):
    name = "remote"
    aliases = ("redis", "valkey", "store", "cluster")
    section = RemoteTierConfig
    shape = KEYED
    rank = 300
    roles = frozenset({ENGINE, DAEMON})
    needs = Needs(
        storage="needs storage: tensors (a metadata-only cache has no KV to share)",
        above="needs a host tier (tiers.host with num_blocks > 0): records are staged "
              "through it",
        migrator="needs the migrator (migrator.enabled: true): only its background threads "
                 "load and store")

    def where(self, section: Any) -> tuple[str, str]:
        return (f"the store at {redact_url(section.url)}",
                "the server (its maxmemory and eviction policy)")

    def spec(self, ctx: Context) -> TierSpec:
        stage = ctx.stage_tier()
        write = ctx.section(self.name).write
        # NOTE: on_compute puts from the device tier, as the node daemon's engines publish
        # (tiers.daemon.write): with write_back a block would otherwise reach the store only
        # once the device evicts it, and a second process would find nothing of a prompt the
        # first has just computed. (In the daemon the pool is tier 0 and the stage: the same.)
        put_from = None if write == "off" else DEVICE if write == "on_compute" else stage
        # NOTE: unstaged when the host tier is tier 0 (the daemon's pool): a load lands
        # straight in the slot the hold was given.
        return TierSpec(self.name, self.name, 0, staged=stage != DEVICE, put_from=put_from,
                        whole_records=True)

    def build(self, ctx: Context, spec: TierSpec) -> Any:
        from tiered_cache.data.remote_tier import RemoteTier

        host = ctx.pools[ctx.stage_tier()]
        namespace = ctx.hasher.namespace_digest()
        # NOTE: delete_corrupt: a record that fails verification must leave the store, or
        # every later open would find its key, load it and fail again, and the block could
        # never be recomputed and written back (the documented recovery).
        store = connect(ctx.section(self.name), namespace=namespace,
                        num_tokens=int(ctx.config.block_size),
                        payload_bytes=ctx.config.block_bytes,
                        cost=ctx.costs.tiers.get(self.name) if ctx.costs is not None else None,
                        delete_corrupt=True)
        return RemoteTier(store, host_kv=host.kv, host_scales=host.scales, namespace=namespace)

    def handlers(self):
        from tiered_cache.data import remote_tier

        return {(self.name, HOST_KIND): remote_tier.remote_to_host,
                (HOST_KIND, self.name): remote_tier.host_to_remote,
                (DEVICE_KIND, self.name): remote_tier.gpu_to_remote}

    def cost(self, ctx: Context) -> TierCost:
        remote = ctx.section(self.name)
        return TierCost(self.name, latency_s=remote.latency_ms / 1e3,
                        bandwidth_bps=remote.bandwidth_gbps * 1e9)

    def load(self, stack, k: int, seq) -> bool:
        """Which of the next blocks the store holds (under the lookup deadline, outside the
        lock), and, if loading them beats recomputing, load them (`BlockIndex.keyed.extend`).
        A slow, dead or empty store costs at most the deadline."""
        index, remote = stack.index, stack.section(self.name)
        m, last, n = index.keyed.loadable(seq)
        n = min(n, remote.lookahead_blocks)
        if not n:
            return False
        bs = stack.block_size
        keys = stack.hasher.chain(last, seq.token_ids[m * bs:(m + n) * bs])
        # NOTE: asked even while its breaker is open: it answers "absent" at once then, and
        # lets one probe through after each backoff, which is how it comes back.
        r = leading(stack.stores[k].exists(seq.root, keys, remote.lookup_deadline_ms / 1e3))
        if not r:
            return False
        if stack.costs is not None and not stack.worth(index.keyed.tiers[k].index, r, m):
            index.keyed.note_skipped(k)
            return False
        return bool(index.keyed.extend(seq, k, keys[:r], stack.promote))

    def load_after(self, stack, k: int, seq, root: bytes, parent: bytes, tokens) -> int:
        """The hold ends before `tokens` do: ask the store for the next blocks (under its
        lookup deadline, no lock held) and load those it has into the hold, if that beats
        recomputing them (BlockIndex.keyed.load_after asks the cost model). Returns how many."""
        remote, bs = stack.section(self.name), stack.block_size
        m = len(seq.blocks)
        rest = tokens[m * bs:(m + remote.lookahead_blocks) * bs]
        keys = stack.hasher.chain(seq.keys[m - 1] if m else parent, rest)
        if not keys:
            return 0
        # NOTE: asked even while the store's breaker is open (as in `load`).
        r = leading(stack.stores[k].exists(root, keys, remote.lookup_deadline_ms / 1e3))
        if not r:
            return 0
        return stack.index.keyed.load_after(seq, k, parent, rest[:r * bs], keys[:r], stack.promote)

    def invalidate(self, stack, k: int, root: bytes, tokens) -> int:
        stack.stores[k].delete(root, stack.hasher.chain(root, tokens))
        return 0                # what the store dropped is not known (best effort)

    def stats(self, stack, k: int, out: dict) -> None:
        out["tiers"][stack.index.keyed.tiers[k].name]["store"] = stack.stores[k].stats()

    def close(self, stack, k: int) -> None:
        store = stack.stores[k]
        store.flush(5.0)                # puts queued before the stop reach the server
        store.close()


register(RemoteKind())
