"""The embedded node service: what the connector runs when no `tiers.daemon.socket` is given.

The scheduler side starts a `NodeService` (daemon/service.py: partitions, the shared-memory
pool, leases, SO_PEERCRED) from the engine's geometry and the connector's tiers, in its own
threads. It listens on a private socket, `<socket_dir>/tiered-cache-<uid>/vllm-<h>/daemon.sock`
(`h` a hash of the engine's `kv_transfer_config.engine_id`, which every process of the engine
shares), admitting this uid only. Workers in the same process call it directly (the registry
below); workers in other processes (the multiprocess executor) connect to that socket. Either
way both sides map the same shared pool: nothing to set up.

Directories of engines that died without stopping (a SIGKILL leaves the socket file) are
swept at the next start: the transport's lock file beside the socket (flock) is released by
the kernel when its holder dies, so a directory whose lock can be taken is dead.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import logging
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Mapping

import xxhash

from tiered_cache.config import CacheConfig
from tiered_cache.errors import ConfigError
from tiered_cache.wire.transport import SUN_PATH_MAX

log = logging.getLogger(__name__)

SOCKET_NAME = "daemon.sock"
_REGISTRY: dict[str, EmbeddedNode] = {}
_REGISTRY_LOCK = threading.Lock()


def base_dir(socket_dir: str | None) -> str:
    """`<socket_dir>/tiered-cache-<uid>`: created 0700, or checked to be this user's alone."""
    root = socket_dir or os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    path = os.path.join(root, f"tiered-cache-{os.geteuid()}")
    if not os.path.lexists(path):
        with contextlib.suppress(FileExistsError):
            os.makedirs(path, mode=0o700)
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise ConfigError("kv_connector_extra_config.tiered_cache.vllm.socket_dir",
                          f"{path} must be a directory of uid {os.geteuid()} that others "
                          f"cannot write (mode {oct(st.st_mode & 0o777)})")
    return path


def socket_path(engine_id: str, socket_dir: str | None) -> str:
    """The embedded service's socket for this engine (the same in every process of it)."""
    h = xxhash.xxh3_64_hexdigest(engine_id.encode("utf-8", "surrogatepass"))
    path = os.path.join(base_dir(socket_dir), f"vllm-{h}", SOCKET_NAME)
    if len(os.fsencode(path)) + 16 > SUN_PATH_MAX:
        raise ConfigError("kv_connector_extra_config.tiered_cache.vllm.socket_dir",
                          f"the embedded service's socket {path!r} is too long for a Unix "
                          f"socket ({SUN_PATH_MAX - 16} bytes at most): use a shorter directory")
    return path


def sweep_stale(base: str, keep: str) -> int:
    """Remove engine directories under `base` whose service is dead; how many."""
    removed = 0
    for entry in os.listdir(base):
        d = os.path.join(base, entry)
        if not entry.startswith("vllm-") or d == keep or not os.path.isdir(d):
            continue
        lock = os.path.join(d, SOCKET_NAME + ".lock")
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CLOEXEC | os.O_NOFOLLOW)
        except FileNotFoundError:
            continue                        # being set up, or not a service directory
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue                        # alive
        try:
            shutil.rmtree(d, ignore_errors=True)
            removed += 1
        finally:
            os.close(fd)
    if removed:
        log.info("removed %d socket directories of dead engines under %s", removed, base)
    return removed


def service_config(cache: CacheConfig, socket: str, staging_blocks: int | None) -> CacheConfig:
    """The embedded service's config: the connector's, with its socket, this uid only, and
    (unless `daemon.staging_blocks` was given: None) a staging area that holds a step's saves."""
    data = cache.to_dict()
    daemon = dict(data.get("daemon") or {})
    daemon.update(socket=socket, allow_uids=[os.geteuid()], allow_gids=[])
    if staging_blocks is not None:
        daemon["staging_blocks"] = staging_blocks
    data["daemon"] = daemon
    data["tiers"]["daemon"] = None
    return CacheConfig.from_dict(data)


class EmbeddedNode:
    """A NodeService owned by this process's scheduler side, found by engine id."""

    def __init__(self, engine_id: str, config: CacheConfig) -> None:
        from tiered_cache.daemon.service import NodeService

        self.engine_id = engine_id
        self.socket = config.daemon.socket
        self.directory = os.path.dirname(self.socket)
        sweep_stale(os.path.dirname(self.directory), self.directory)
        from tiered_cache.wire.peer import Peer

        self.service = NodeService(config).start()
        try:
            # NOTE: this uid's partition now, not at the first hello: a pool the machine cannot
            # give (memory admission), or a disk directory another process owns, is an error at
            # engine start, not a background attach that fails for ever.
            self.service.partition(self.service.tenant_of(Peer(0, os.getpid(), os.geteuid(),
                                                               os.getegid())))
        except ConfigError as exc:
            self.service.stop(drain=False)
            shutil.rmtree(self.directory, ignore_errors=True)
            raise ConfigError(f"kv_connector_extra_config.tiered_cache.{exc.path}",
                              str(exc)[len(exc.path) + 2:]) from None
        except BaseException:
            self.service.stop(drain=False)
            shutil.rmtree(self.directory, ignore_errors=True)
            raise
        self.has_disk = config.tiers.disk is not None
        self._warm = threading.Thread(target=self._warm_up, args=(config,), daemon=True,
                                      name="tc-vllm-warm-up")
        self._warm.start()
        self._stopped = False
        with _REGISTRY_LOCK:
            _REGISTRY[engine_id] = self
        log.info("embedded tiered-cache service for engine %s on %s", engine_id, self.socket)

    @staticmethod
    def _warm_up(config: CacheConfig) -> None:
        """Compile the publish copy (staging -> pool: the CPU block copier, numba) while vLLM
        starts, on scratch one-slot pools laid out like the service's, so that the engine's
        first save does not wait a few seconds for the JIT."""
        try:
            from tiered_cache import kernels
            from tiered_cache.wire.shm import PoolGeometry, SharedPool

            m = config.model
            g = PoolGeometry(1, m.num_layers, int(config.block_size), m.num_kv_heads,
                             m.head_dim, m.dtype)
            with SharedPool.create(g, name="warm-src", populate=False) as src, \
                    SharedPool.create(g, name="warm-dst", populate=False) as dst:
                kernels.copy_blocks_to_host(src.kv.permute(1, 2, 0, 3, 4, 5), [0], dst.kv, [0])
        except Exception:                # noqa: BLE001 - only a slower first save
            log.debug("warming up the publish copy failed", exc_info=True)

    def stop(self) -> None:
        with _REGISTRY_LOCK:
            if self._stopped:
                return
            self._stopped = True
            if _REGISTRY.get(self.engine_id) is self:
                del _REGISTRY[self.engine_id]
        try:
            self.service.stop(drain=self.has_disk)
        finally:
            shutil.rmtree(self.directory, ignore_errors=True)

    def stats(self) -> Mapping:
        return self.service.stats()


def find(engine_id: str) -> EmbeddedNode | None:
    """The embedded service of this engine, if it runs in this process."""
    with _REGISTRY_LOCK:
        return _REGISTRY.get(engine_id)


@atexit.register
def _stop_all() -> None:
    with _REGISTRY_LOCK:
        nodes = list(_REGISTRY.values())
    for node in nodes:
        with contextlib.suppress(Exception):
            node.stop()
