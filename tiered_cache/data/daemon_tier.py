"""The engine's side of the node daemon: `DaemonTier`, a keyed tier whose blocks lie in the
daemon's shared pool, and its copy handlers.

- daemon -> gpu (a load): `open()` asked the daemon to `fetch` the next blocks; the daemon
  pinned them under a handle and named their slots in the pool, which this process maps
  read-only. The handler copies them from the mapping into their device slots, then `release`s
  the handle. The daemon answers whether the handle was still held: if its lease had expired
  meanwhile, the slots may have been reused under the copy, and the blocks fail (a miss).
- gpu -> daemon (a put): blocks this engine computed are copied into its own staging area (a
  second mapping, read-write, that only this client and the daemon see) and `publish`ed; the
  daemon copies them into the pool after checking each block's chained key, parent and tokens.

A `tc-daemon-link` thread renews the lease (a third of it between beats) and, while the daemon
is away, tries to attach again with a backoff. Until it is back the tier is simply absent:
lookups are not made, puts fail (the blocks stay cached here), nothing waits on it.

NOTE: a copy out of the pool runs under `_lock` and only for a handle of the current
connection, and a new connection swaps the mapping under the same lock: a handle of a dead
connection (whose pins the daemon has reaped) is never copied from.
"""

from __future__ import annotations

import logging
import threading
from collections import defaultdict
from typing import Any

import torch

from tiered_cache.core.transfer import Transfer
from tiered_cache.data.disk_tier import CorruptBlocks
from tiered_cache.errors import ConfigError, TransferError
from tiered_cache.wire.client import Client
from tiered_cache.wire.errors import DaemonError, DaemonUnavailableError, LeaseExpiredError
from tiered_cache.wire.ops import MAX_BLOCKS, make_protocol
from tiered_cache.wire.shm import PoolGeometry, SharedPool

log = logging.getLogger(__name__)

_MAX_ROOTS = 1 << 16
_MODEL_KEYS = (("num_layers", "model.num_layers"), ("num_kv_heads", "model.num_kv_heads"),
               ("head_dim", "model.head_dim"), ("dtype", "model.dtype"),
               ("block_size", "block_size"))
"""The pool's geometry fields and the engine's config keys they come from."""


class DaemonTier:
    """The daemon tier's pool: a connection to the node daemon and its two mappings."""

    layout = "record"
    scales = None

    def __init__(self, socket_path: str, *, timeout_s: float, geometry: PoolGeometry,
                 namespace: bytes, gpu, max_frame: int = 8 << 20,
                 required: bool = False) -> None:
        self.path = socket_path
        self.timeout_s = timeout_s
        self.required = required                # tiers.daemon.required: no start without it
        self.geometry = geometry                # what this engine expects (num_slots unused)
        self.namespace = namespace
        self.gpu = gpu                          # this engine's device pool (for warm-up)
        self.device = gpu.kv.device
        self._protocol = make_protocol(max_frame)
        self._lock = threading.Lock()           # connection state; copies out of the pool
        self._put_lock = threading.Lock()       # one user of the staging area at a time
        self._client: Client | None = None
        self._pool: SharedPool | None = None
        self._staging: SharedPool | None = None
        self._gen = 0
        self._live: set[int] = set()            # handles of the current connection
        self._roots: dict[bytes, bytes | None] = {}     # our root -> daemon's (this connection)
        self._names: dict[bytes, tuple[bytes, str | None]] = {}    # root -> (salt, adapter)
        self.lease_s = 10.0
        self.tenant = ""
        self.on_attach = None                   # called with the tenant salt on each attach
        self.counters = {"attaches": 0, "attach_failures": 0, "lost": 0, "fetches": 0,
                         "fetched_blocks": 0, "void_copies": 0, "put_blocks": 0,
                         "taken_blocks": 0, "errors": 0, "timeouts": 0, "root_mismatches": 0}
        self.last_error = ""
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None

    # connection -------------------------------------------------------------------------------

    @property
    def available(self) -> bool:
        return self._client is not None

    def start(self, on_attach) -> DaemonTier:
        """Attach now if the daemon answers (else keep trying in the background).
        `on_attach(tenant_salt)` runs after every attach: a new daemon may have lost what the
        old one held, and keys roots under the salt it assigns."""
        self.on_attach = on_attach
        self._warm_up()
        try:
            self._attach()
        except ConfigError:
            raise                       # a daemon of another model: no waiting fixes that
        except Exception as exc:         # noqa: BLE001 - the daemon may simply not be up yet
            self._failed(exc)
            if self.required:
                raise DaemonUnavailableError(
                    f"tiers.daemon.required: no daemon answers at {self.path} ({exc}); start "
                    "`tiered-cache serve` first, or set required: false to serve from the GPU "
                    "tier alone until it answers") from exc
            log.warning("tiers.daemon: no daemon at %s yet (%s); serving from the GPU tier "
                        "until it answers", self.path, exc)
        self._thread = threading.Thread(target=self._run, name="tc-daemon-link", daemon=True)
        self._thread.start()
        return self

    def _attach(self) -> None:
        client = Client(self.path, self._protocol, timeout_s=self.timeout_s).connect()
        pool = staging = None
        try:
            hello = client.call("hello")
            reply = client.request("attach")
            fds = list(reply.fds)
            fields = dict(reply.fields)
            n_staging = fields.pop("staging_slots")
            if len(fds) != 2:
                for fd in fds:
                    _close(fd)
                raise DaemonError(f"attach sent {len(fds)} file descriptors, expected 2")
            try:
                self._check_model(fields, hello["namespace"])
                g = PoolGeometry.from_fields(fields)
            except BaseException:
                for fd in fds:
                    _close(fd)
                raise
            pool = SharedPool.attach(fds[0], g, writable=False)
            staging = SharedPool.attach(fds[1], PoolGeometry(
                n_staging, g.num_layers, g.block_size, g.num_kv_heads, g.head_dim, g.dtype))
            if self.device.type == "cuda":
                pool.register_cuda()
                staging.register_cuda()
        except BaseException:
            for p in (pool, staging):
                if p is not None:
                    p.close()
            client.close()
            raise
        with self._lock:
            old = (self._pool, self._staging, self._client)
            self._client, self._pool, self._staging = client, pool, staging
            self._gen += 1
            self._live.clear()
            self._roots.clear()
            self.lease_s = hello["lease_s"]
            self.tenant = hello["tenant"]
            self.counters["attaches"] += 1
        _close_all(*old)
        if self.on_attach is not None:
            self.on_attach(hello["salt"])
        log.info("tiers.daemon: attached to %s as client %d (tenant %s, %d pool slots)",
                 self.path, hello["client"], self.tenant, g.num_slots)

    def _check_model(self, fields: dict[str, Any], namespace: bytes) -> None:
        """ConfigError naming this engine's key that differs from the daemon's (its pool's
        geometry, then its namespace: the model name), if any.

        NOTE: the daemon keys blocks by its namespace (model, KV dtype, geometry, block size):
        an engine of another one could share nothing, and waiting does not change that."""
        want = self.geometry
        for name, key in _MODEL_KEYS:
            theirs, ours = fields[name], getattr(want, name)
            if theirs != ours:
                raise ConfigError(key, f"{ours!r} here, but the daemon at {self.path} serves "
                                       f"{theirs!r}: an engine attached to a daemon needs the "
                                       "daemon's model, KV dtype and geometry")
        if namespace != self.namespace:
            raise ConfigError("model.name", f"the daemon at {self.path} serves another model "
                                            "of the same geometry (its namespace differs "
                                            "from this engine's): name the model as the "
                                            "daemon's config does")
        if fields["slot_stride"] != want.slot_stride:
            raise DaemonError(f"the daemon's slot stride {fields['slot_stride']} differs from "
                              f"ours ({want.slot_stride}): another page size")

    def _warm_up(self) -> None:
        """Both copy paths once, before attaching, so that the first real ones (a put, a load)
        do not pay for kernel compilation (about a second on CPU) and no lease waits on it.
        Reads device slot 0 into a private one-slot mapping laid out like the daemon's, and
        copies that into a scratch device tensor: no slot anyone uses is written."""
        from tiered_cache import kernels

        kv = self.gpu.kv
        if kv.shape[2] < 1:
            return
        g = self.geometry
        with SharedPool.create(PoolGeometry(1, g.num_layers, g.block_size, g.num_kv_heads,
                                            g.head_dim, g.dtype), name="warm-up",
                               populate=False) as scratch_pool:
            kernels.copy_blocks_to_host(kv, [0], scratch_pool.kv, [0])
            scratch = torch.empty((*kv.shape[:2], 1, *kv.shape[3:]), dtype=kv.dtype,
                                  device=kv.device)
            kernels.copy_blocks_to_gpu(scratch_pool.kv, [0], scratch, [0])

    def _lost(self, exc: BaseException) -> None:
        """The connection failed: forget it (the daemon reaps what it held) and reattach in the
        background."""
        with self._lock:
            if self._client is None:
                return
            old = (self._pool, self._staging, self._client)
            self._client = self._pool = self._staging = None
            self._live.clear()
            self._roots.clear()
            self.counters["lost"] += 1
        self._failed(exc)
        log.warning("tiers.daemon: lost the daemon at %s (%s); serving from the GPU tier until "
                    "it is back", self.path, exc)
        _close_all(*old)
        self._wake.set()

    def _failed(self, exc: BaseException) -> None:
        self.last_error = f"{type(exc).__name__}: {exc}"
        self.counters["timeouts" if isinstance(exc, TimeoutError) else "errors"] += 1

    def _run(self) -> None:
        backoff = 0.1
        while not self._stop.is_set():
            client = self._client
            if client is None:
                try:
                    self._attach()
                    backoff = 0.1
                    continue
                except Exception as exc:  # noqa: BLE001 - logged, counted, retried
                    self.counters["attach_failures"] += 1
                    error = f"{type(exc).__name__}: {exc}"
                    if isinstance(exc, ConfigError) and error != self.last_error:
                        # a daemon restarted with another model: said once, retried quietly
                        log.error("tiers.daemon: cannot attach: %s", exc)
                    self.last_error = error
                    self._wake.wait(backoff)
                    self._wake.clear()
                    backoff = min(2.0, backoff * 2)
                    continue
            if self._stop.wait(self.lease_s / 3):
                return
            if self._client is not client:
                continue
            try:
                client.call("heartbeat")
            except Exception as exc:     # noqa: BLE001 - the daemon went away, or reaped us
                self._lost(exc)

    def _call(self, op: str, **fields: Any) -> dict[str, Any] | None:
        """A request on the current connection; None (the connection given up) if it fails."""
        client = self._client
        if client is None:
            return None
        try:
            return client.call(op, **fields)
        except Exception as exc:         # noqa: BLE001 - every failure is a miss, counted
            if isinstance(exc, LeaseExpiredError) or not client.connected:
                self._lost(exc)         # the connection (or our lease) is gone
            else:
                self._failed(exc)       # the daemon refused this request; the link is fine
                log.debug("tiers.daemon: %s refused: %s", op, exc)
            return None

    # roots ------------------------------------------------------------------------------------

    def note_root(self, root: bytes, salt: str | bytes | None, adapter: str | None) -> None:
        """Remember how this engine's root `root` was derived (open() calls it), so that its
        blocks can be named to the daemon."""
        if root not in self._names:
            if len(self._names) >= _MAX_ROOTS:
                self._names.clear()
            own = salt if isinstance(salt, bytes) else (salt or "").encode()
            self._names[root] = (own, adapter)

    def _daemon_root(self, root: bytes) -> bytes | None:
        """The daemon's key for our root (registered once per connection); None when the two
        disagree (this root was keyed before the tenant salt arrived) or it is unknown."""
        if root in self._roots:
            return self._roots[root]
        names = self._names.get(root)
        if names is None:
            return None
        salt, adapter = names
        fields: dict[str, Any] = {"salt": salt}
        if adapter is not None:
            fields["adapter"] = adapter
        reply = self._call("root", **fields)
        if reply is None:
            return None
        theirs = reply["root"] if reply["root"] == root else None
        if theirs is None:
            self.counters["root_mismatches"] += 1
        self._roots[root] = theirs
        return theirs

    # loads ------------------------------------------------------------------------------------

    def fetch(self, root: bytes, parent: bytes, tokens, wait_ms: int) -> tuple[int, list[int]]:
        """Pin the leading blocks of `tokens` after `parent` in the daemon; (handle, slots),
        or (0, []) for a miss or an absent daemon."""
        if self._daemon_root(root) is None:
            return 0, []
        gen = self._gen
        reply = self._call("fetch", root=root, parent=parent, tokens=tokens, wait_ms=wait_ms)
        self.counters["fetches"] += 1
        if reply is None or not reply["handle"]:
            return 0, []
        with self._lock:
            if gen != self._gen:
                return 0, []        # reconnected meanwhile: that handle is gone with its pins
            self._live.add(reply["handle"])
        self.counters["fetched_blocks"] += len(reply["slots"])
        return reply["handle"], list(reply["slots"])

    def release(self, handle: int) -> bool:
        """Let the daemon unpin a handle; whether it still held it (False: the lease expired,
        so whatever was copied under it cannot be trusted)."""
        with self._lock:
            if handle not in self._live:
                return False
            self._live.discard(handle)
        reply = self._call("release", handle=handle)
        return bool(reply and reply["held"])

    def load(self, gpu, transfers: list[Transfer]) -> None:
        """daemon -> gpu: copy each handle's blocks out of the pool, then release it."""
        from tiered_cache import kernels

        by_ticket: dict[int, list[Transfer]] = defaultdict(list)
        for t in transfers:
            by_ticket[t.ticket].append(t)
        failed: list[int] = []
        for ticket, group in by_ticket.items():
            with self._lock:
                pool = self._pool if ticket in self._live else None
                if pool is not None:
                    kernels.copy_blocks_to_gpu(pool.kv, [t.src_slot for t in group], gpu.kv,
                                               [t.dst_slot for t in group])
                    if gpu.kv.is_cuda:
                        torch.cuda.current_stream(gpu.kv.device).synchronize()
            if pool is None or not self.release(ticket):
                self.counters["void_copies"] += len(group)
                failed.extend(t.block for t in group)
        if failed:
            raise CorruptBlocks(failed, "the daemon no longer held them (its lease on them "
                                        "expired, or the daemon went away)")

    # puts -------------------------------------------------------------------------------------

    def put(self, gpu, transfers: list[Transfer]) -> None:
        """gpu -> daemon: stage and publish blocks, parents first, a staging area at a time."""
        from tiered_cache import kernels

        by_root: dict[bytes, list[Transfer]] = defaultdict(list)
        for t in transfers:
            by_root[t.meta.root].append(t)
        with self._put_lock:
            for root, group in by_root.items():
                if self._daemon_root(root) is None:
                    if not self.available:
                        raise TransferError("the daemon is not attached")
                    continue            # a root the daemon keys differently: never shared
                group.sort(key=lambda t: t.meta.depth)
                staging = self._staging
                if staging is None:
                    raise TransferError("the daemon is not attached")
                step = min(staging.geometry.num_slots, MAX_BLOCKS)
                for first in range(0, len(group), step):
                    chunk = group[first:first + step]
                    kernels.copy_blocks_to_host(gpu.kv, [t.src_slot for t in chunk],
                                                staging.kv, list(range(len(chunk))))
                    if gpu.kv.is_cuda:
                        torch.cuda.current_stream(gpu.kv.device).synchronize()
                    entries = [{"slot": i, "key": t.meta.key, "parent": t.meta.parent,
                                "depth": t.meta.depth, "tokens": t.meta.tokens,
                                "hits": t.meta.hits} for i, t in enumerate(chunk)]
                    reply = self._call("publish", root=root, entries=entries)
                    if reply is None:
                        raise TransferError(f"publishing to the daemon failed: {self.last_error}")
                    self.counters["put_blocks"] += len(chunk)
                    self.counters["taken_blocks"] += sum(reply["taken"])

    # misc -------------------------------------------------------------------------------------

    def lookup(self, root: bytes, parent: bytes, tokens) -> int:
        if self._daemon_root(root) is None:
            return 0
        reply = self._call("lookup", root=root, parent=parent, tokens=tokens)
        return reply["blocks"] if reply else 0

    def invalidate(self, root: bytes, tokens) -> int:
        if self._daemon_root(root) is None:
            return 0
        reply = self._call("invalidate", root=root, tokens=tokens)
        return reply["blocks"] if reply else 0

    def daemon_stats(self) -> dict | None:
        """The daemon's view of this tenant (its partition's tiers), or None when away."""
        import json

        reply = self._call("stats")
        return json.loads(reply["json"]) if reply else None

    def stats(self) -> dict:
        return {**self.counters, "available": self.available, "tenant": self.tenant,
                "errors": self.counters["errors"], "timeouts": self.counters["timeouts"],
                "last_error": self.last_error, "live_handles": len(self._live)}

    def flush(self, timeout_s: float) -> None:
        """Puts are synchronous requests: nothing is queued here."""

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        with self._lock:
            old = (self._pool, self._staging, self._client)
            self._client = self._pool = self._staging = None
            self._live.clear()
        _close_all(*old)


def _close(fd: int) -> None:
    import os
    try:
        os.close(fd)
    except OSError:
        pass


def _close_all(pool, staging, client) -> None:
    for p in (pool, staging):
        if p is not None:
            p.close()
    if client is not None:
        client.close()


def daemon_to_gpu(src: DaemonTier, dst, transfers, layers, nb) -> None:
    src.load(dst, transfers)


def gpu_to_daemon(src, dst: DaemonTier, transfers, layers, nb) -> None:
    dst.put(src, transfers)
