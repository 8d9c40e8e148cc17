"""RedisStore: the remote tier's keyed store on Redis or Valkey (standalone or Redis Cluster).

One value per block: the whole block record (`tiered_cache.records`) under one server key
(`tiered_cache.stores.keys`), so a server-side eviction removes a whole block and a value can be
checked on its own. Every value read is verified (`records.decode` with this store's namespace,
the expected key and the tenant root); one that fails is a miss, counted as `corrupt`.

What bounds each call:

- `exists` (on the critical path of `open()`): one pipeline of EXISTS, run on a lookup worker
  while the caller waits at most `deadline_s` (`stores.deadline`). Keys not answered by then
  are "not there". The answered part is a prefix of the keys, the part a prefix match needs.
- `get`: pipelines of GET, each of at most `batch_bytes` of expected values (the record size of
  a namespace is fixed, so the size seen last predicts the next), optionally under a deadline
  the same way; a batch finished before the deadline is kept.
- `put`: pipelines of SET of at most `batch_bytes`; `put_async` queues them for one background
  writer (`stores.putqueue`) and never blocks.
- every socket read and connect: `socket_timeout_s` / `connect_timeout_s`; redis-py retries once
  at once on a connection error (a pooled socket the server closed), never on a timeout.
- a server that keeps failing: the circuit breaker (`stores.breaker`) opens after
  `failure_threshold` consecutive failed calls; calls then miss at once until the next probe,
  with exponential backoff from `backoff_initial_s` to `backoff_max_s`.

NOTE: eviction belongs to the server (`maxmemory` + `maxmemory-policy allkeys-lru`, or `ttl_s`);
the store never deletes on its own. A corrupt value is left for the next put of that block to
overwrite (the cache recomputes it on the miss and writes it back).
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import urlsplit

import redis
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import (
    AuthenticationError,
    AuthorizationError,
    NoPermissionError,
    RedisClusterException,
    RedisError,
    ResponseError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.retry import Retry

from tiered_cache import records
from tiered_cache.costs import TierCost
from tiered_cache.stores.base import (
    KEY_BYTES,
    StoreAuthError,
    StoreUnavailableError,
    check_keys,
    redact_url,
)
from tiered_cache.stores.breaker import CircuitBreaker
from tiered_cache.stores.deadline import DeadlineExceeded, DeadlineRunner
from tiered_cache.stores.keys import key_space, server_key
from tiered_cache.stores.putqueue import PutQueue
from tiered_cache.stores.stats import StoreStats

log = logging.getLogger(__name__)

MiB = 1 << 20
# NOTE: only small lookups are latency samples for the cost model: a lookup of a thousand keys
# measures the client encoding them as much as the link.
_LATENCY_SAMPLE_MAX_KEYS = 16
_OK, _TIMEOUT, _FAILED = "ok", "timeout", "failed"
_FAILURES = (RedisError, RedisClusterException, OSError)
# NOTE: no CLIENT SETINFO on connect: more round trips per connection, which a lookup
# over a slow link would pay inside its deadline. Newer redis-py spells it driver_info=None.
_NO_SETINFO: dict[str, Any] = (
    {"driver_info": None}
    if "driver_info" in inspect.signature(redis.connection.AbstractConnection.__init__).parameters
    else {"lib_name": None, "lib_version": None})
_AUTH_MARKERS = ("WRONGPASS", "NOAUTH", "NOPERM", "invalid password", "invalid username")


def _nbytes(buf: bytes | bytearray | memoryview) -> int:
    return buf.nbytes if isinstance(buf, memoryview) else len(buf)


def _is_auth_error(exc: BaseException) -> bool:
    if isinstance(exc, (AuthenticationError, AuthorizationError, NoPermissionError)):
        return True
    text = str(exc)
    return isinstance(exc, (ResponseError, RedisClusterException)) and any(
        m in text for m in _AUTH_MARKERS)


class _Call:
    """One data call's shared state between the caller and the worker running it.

    NOTE: the worker writes finished results into `out` one batch at a time, each value already
    verified, and stops at the next batch once `abandoned` is set; the caller that gave up at
    its deadline copies `out` as it stands. So a deadline can only shorten an answer."""

    __slots__ = ("out", "abandoned")

    def __init__(self, n: int, fill: Any) -> None:
        self.out: list[Any] = [fill] * n
        self.abandoned = False


class RedisStore:
    """A `KeyedStore` on one Redis/Valkey server or one Redis Cluster.

    `url`: `redis://[user[:password]@]host:port[/db]` or `rediss://...` (TLS: `ssl_ca_certs`,
    `ssl_certfile`, `ssl_keyfile`). `cluster=True` uses `redis.cluster.RedisCluster` on the
    node in the URL (the rest are discovered; db must be 0). `username` / `password` override
    the URL's. `namespace`: the cache namespace digest (16 bytes) every record must carry;
    `num_tokens`: the block size every record must have (None: not checked).

    `verify=True` connects and pings now, raising StoreAuthError (bad credentials) or
    StoreUnavailableError (unreachable); with False, the first call finds out and counts.
    `record_bytes`: the size of one record (`records.header_len(block_size)` + the block's KV
    bytes), to size the first get batches before any record was seen.
    `cost`: a `costs.TierCost` fed with each lookup's latency and each get's bandwidth.
    `delete_corrupt`: a value that fails the record check is deleted (best effort, after its
    batch), so that a writer that skips what the server holds (the page store) rewrites it.
    """

    def __init__(self, url: str, *, namespace: bytes, num_tokens: int | None = None,
                 cluster: bool = False, username: str | None = None,
                 password: str | None = None, ssl_ca_certs: str | None = None,
                 ssl_certfile: str | None = None, ssl_keyfile: str | None = None,
                 ssl_check_hostname: bool = True, prefix: str = "tc",
                 ttl_s: int | None = None, socket_timeout_s: float = 2.0,
                 connect_timeout_s: float = 1.0, socket_read_size: int = 1 * MiB,
                 batch_bytes: int = 64 * MiB, batch_keys: int = 1024,
                 lookup_threads: int = 4, failure_threshold: int = 3,
                 backoff_initial_s: float = 0.1, backoff_max_s: float = 10.0,
                 put_queue_bytes: int = 256 * MiB, record_bytes: int | None = None,
                 cost: TierCost | None = None, verify: bool = True,
                 delete_corrupt: bool = False) -> None:
        if len(namespace) != KEY_BYTES:
            raise ValueError(f"namespace: expected {KEY_BYTES} bytes, got {len(namespace)}")
        if batch_bytes < 1 or batch_keys < 1:
            raise ValueError("batch_bytes and batch_keys must be >= 1")
        if ttl_s is not None and ttl_s < 1:
            raise ValueError(f"ttl_s: expected None or >= 1 second, got {ttl_s}")
        scheme = urlsplit(url).scheme
        if scheme not in ("redis", "rediss"):
            raise ValueError(f"{redact_url(url)}: expected a redis:// or rediss:// URL")
        self.url = redact_url(url)
        self.namespace = bytes(namespace)
        self.num_tokens = num_tokens
        self.cluster = cluster
        self.ttl_s = ttl_s
        self.batch_bytes = batch_bytes
        self.batch_keys = batch_keys
        self.cost = cost
        self.delete_corrupt = delete_corrupt
        self._space = key_space(prefix, self.namespace)
        self._record_bytes = record_bytes or 0      # last record size seen: sizes get batches
        self._stats = StoreStats()
        self._breaker = CircuitBreaker(failure_threshold=failure_threshold,
                                       backoff_initial_s=backoff_initial_s,
                                       backoff_max_s=backoff_max_s)
        self._closed = False
        self._close_lock = threading.Lock()

        options: dict[str, Any] = dict(
            socket_timeout=socket_timeout_s, socket_connect_timeout=connect_timeout_s,
            socket_read_size=socket_read_size, health_check_interval=0, **_NO_SETINFO)
        if username is not None:
            options["username"] = username
        if password is not None:
            options["password"] = password
        if scheme == "rediss":
            options.update(ssl_ca_certs=ssl_ca_certs, ssl_certfile=ssl_certfile,
                           ssl_keyfile=ssl_keyfile, ssl_check_hostname=ssl_check_hostname)
        # NOTE: redis-py's default retries ten times with backoff up to 1 s, which would hold
        # a caller for seconds on a dead server. One immediate retry on a connection error
        # covers a pooled socket the server closed; timeouts are never retried.
        retry = Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,))
        try:
            if cluster:
                self._client: Any = RedisCluster.from_url(url, retry=retry, **options)
            else:
                self._client = redis.Redis.from_url(url, retry=retry, **options)
        except _FAILURES as exc:
            raise self._typed(exc, "cannot connect") from None

        self._runner = DeadlineRunner(lookup_threads, "tiered-cache-store-lookup",
                                      on_late_error=self._late_error)
        self._puts = PutQueue(self._put_batches, self._stats, max_bytes=put_queue_bytes,
                              batch_bytes=batch_bytes)
        if verify:
            try:
                self.ping()
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------ health

    @property
    def available(self) -> bool:
        return self._breaker.closed and not self._closed

    @property
    def breaker(self) -> CircuitBreaker:
        return self._breaker

    def ping(self) -> None:
        """Round trip to the server now; raises StoreAuthError / StoreUnavailableError."""
        try:
            self._client.ping()
        except _FAILURES as exc:
            self._fail(exc)
            raise self._typed(exc, "ping failed") from None
        self._ok()

    def server_key(self, root: bytes, key: bytes) -> bytes:
        """The server key of block `key` of tenant `root` (see `stores.keys`)."""
        return server_key(self._space, root, key)

    # ------------------------------------------------------------------ lookups

    def exists(self, root: bytes, keys: Sequence[bytes], deadline_s: float) -> list[bool]:
        check_keys([root], "root")
        check_keys(keys)
        n = len(keys)
        if n == 0:
            return []
        if deadline_s <= 0 or not self._admit():
            # NOTE: no time left is the caller's choice, not the server's failure: it must not
            # count towards opening the breaker.
            self._stats.add(exists_false=n)
            return [False] * n
        skeys = [self.server_key(root, k) for k in keys]
        call = _Call(n, False)
        t0 = time.perf_counter()
        outcome = self._run(lambda: self._exists_into(call, skeys), deadline_s, call)
        dt = time.perf_counter() - t0
        self._stats.observe("exists", dt)
        # NOTE: a lookup cut at its deadline is a latency sample too (a lower bound): without
        # it, a server that got slow would keep the estimate it had while it was fast.
        if outcome != _FAILED and self.cost is not None and n <= _LATENCY_SAMPLE_MAX_KEYS:
            self.cost.observe(0, dt, 0)
        found: list[bool] = call.out[:]
        hits = sum(found)
        self._stats.add(exists_true=hits, exists_false=n - hits)
        return found

    def _exists_into(self, call: _Call, skeys: list[bytes]) -> None:
        for a in range(0, len(skeys), self.batch_keys):
            if call.abandoned:
                return
            batch = skeys[a:a + self.batch_keys]
            pipe = self._client.pipeline(transaction=False)
            for k in batch:
                pipe.exists(k)
            results = pipe.execute(raise_on_error=False)
            errors = 0
            for i, r in enumerate(results):
                if isinstance(r, Exception):
                    errors += 1
                else:
                    call.out[a + i] = bool(r)
            if errors:
                self._stats.add(errors=errors)

    # ------------------------------------------------------------------ reads

    def get(self, root: bytes, keys: Sequence[bytes],
            deadline_s: float | None = None) -> list[bytes | None]:
        check_keys([root], "root")
        check_keys(keys)
        n = len(keys)
        if n == 0:
            return []
        if (deadline_s is not None and deadline_s <= 0) or not self._admit():
            self._stats.add(misses=n)
            return [None] * n
        skeys = [self.server_key(root, k) for k in keys]
        call = _Call(n, None)
        t0 = time.perf_counter()
        outcome = self._run(lambda: self._get_into(call, root, list(keys), skeys), deadline_s,
                            call)
        dt = time.perf_counter() - t0
        self._stats.observe("get", dt)
        out: list[bytes | None] = call.out[:]
        nbytes = sum(len(v) for v in out if v is not None)
        hits = sum(v is not None for v in out)
        self._stats.add(hits=hits, misses=n - hits)
        if outcome == _OK and nbytes and self.cost is not None:
            self.cost.observe(nbytes, dt, hits)
        return out

    def _get_into(self, call: _Call, root: bytes, keys: list[bytes],
                  skeys: list[bytes]) -> None:
        a = 0
        blind = 1
        while a < len(skeys):
            if call.abandoned:
                return
            # NOTE: records of one namespace all have one size, so the size seen last bounds
            # the next batch's reply. With none seen yet (no hint, no put, no hit), batches
            # start at one key and double while they find nothing.
            size = self._record_bytes
            if size:
                count = min(self.batch_keys, max(1, self.batch_bytes // size))
            else:
                count, blind = blind, min(blind * 2, self.batch_keys)
            batch = skeys[a:a + count]
            pipe = self._client.pipeline(transaction=False)
            for k in batch:
                pipe.get(k)
            values = pipe.execute(raise_on_error=False)
            nbytes = errors = corrupt = 0
            bad: list[bytes] = []
            for i, v in enumerate(values):
                if v is None:
                    continue
                if isinstance(v, Exception):
                    errors += 1
                    continue
                nbytes += len(v)
                if self._verified(v, root, keys[a + i]):
                    call.out[a + i] = v
                    self._record_bytes = len(v)
                else:
                    corrupt += 1
                    bad.append(batch[i])
            self._stats.add(bytes_in=nbytes, errors=errors, corrupt=corrupt)
            if bad and self.delete_corrupt:
                self._delete_server_keys(bad)
            a += len(batch)

    def _verified(self, value: bytes, root: bytes, key: bytes) -> bool:
        """The record check: the one gate between server bytes and the cache."""
        try:
            header, _ = records.decode(value, namespace=self.namespace,
                                       num_tokens=self.num_tokens, expect_key=key)
        except Exception as exc:      # CorruptRecord, and anything a hostile value might raise
            log.debug("remote value for %s failed the record check: %s", key.hex(), exc)
            return False
        if header.root != root:
            log.debug("remote value for %s holds another tenant's record", key.hex())
            return False
        return True

    # ------------------------------------------------------------------ writes

    def put(self, root: bytes, items: Sequence[tuple[bytes, bytes]]) -> int:
        # NOTE: any C-contiguous buffer will do here (the caller holds it for the call); as
        # flat bytes, because redis-py frames a value by len(), an item count for other formats.
        flat = [(k, r if isinstance(r, bytes) else memoryview(r).cast("B")) for k, r in items]
        self._check_items(root, flat)
        return self._put_batches(root, flat)

    def put_async(self, root: bytes, items: Sequence[tuple[bytes, bytes]]) -> int:
        # NOTE: only immutable `bytes` are queued: a memoryview of a pool slot could be
        # rewritten before the writer sends it, and the server would hold a torn record.
        self._check_items(root, items, require_bytes=True)
        if self._closed:
            self._stats.add(dropped_puts=len(items))
            return 0
        return self._puts.offer(root, items)

    def flush(self, timeout_s: float | None = None) -> bool:
        return self._puts.flush(timeout_s)

    def _check_items(self, root: bytes, items: Sequence[tuple[bytes, bytes]],
                     require_bytes: bool = False) -> None:
        """Refuse, before anything is sent, a record that would sit under the wrong key."""
        check_keys([root], "root")
        for key, record in items:
            check_keys([key])
            if require_bytes and not isinstance(record, bytes):
                raise TypeError(f"put_async: record of {key.hex()} must be bytes, got "
                                f"{type(record).__name__}")
            try:
                header = records.decode_header(record, namespace=self.namespace,
                                               num_tokens=self.num_tokens)
            except records.CorruptRecord as exc:
                raise ValueError(f"record of {key.hex()}: {exc}") from None
            if header.key != key:
                raise ValueError(f"record of {header.key.hex()} offered under {key.hex()}")
            if header.root != root:
                raise ValueError(f"record of {key.hex()} belongs to another tenant root")
            size = _nbytes(record)
            if size != header.header_len + header.payload_len:
                raise ValueError(f"record of {key.hex()}: {size} bytes, the header "
                                 f"says {header.header_len + header.payload_len}")

    def _put_batches(self, root: bytes, items: Sequence[tuple[bytes, bytes]]) -> int:
        if not items:
            return 0
        if not self._admit():
            self._stats.add(put_failed=len(items))
            return 0
        t0 = time.perf_counter()
        stored = sent = 0
        try:
            start = 0
            while start < len(items):
                pipe = self._client.pipeline(transaction=False)
                end, size = start, 0
                while end < len(items) and (end == start
                                            or size + _nbytes(items[end][1]) <= self.batch_bytes):
                    key, record = items[end]
                    pipe.set(self.server_key(root, key), record, ex=self.ttl_s)
                    size += _nbytes(record)
                    end += 1
                results = pipe.execute(raise_on_error=False)
                sent = end
                nbytes = errors = 0
                for (_, record), r in zip(items[start:end], results):
                    if isinstance(r, Exception):
                        errors += 1
                    else:
                        stored += 1
                        nbytes += _nbytes(record)
                self._record_bytes = _nbytes(items[start][1])
                self._stats.add(puts=len(results) - errors, bytes_out=nbytes, errors=errors,
                                put_failed=errors)
                start = end
        except _FAILURES as exc:
            self._stats.add(put_failed=len(items) - sent)
            self._fail(exc)
            return stored
        finally:
            self._stats.observe("put", time.perf_counter() - t0)
        self._ok()
        return stored

    def delete(self, root: bytes, keys: Sequence[bytes]) -> int:
        check_keys([root], "root")
        check_keys(keys)
        if not keys or not self._admit():
            return 0
        return self._delete_server_keys([self.server_key(root, k) for k in keys])

    def _delete_server_keys(self, skeys: Sequence[bytes]) -> int:
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in skeys:
                pipe.delete(k)
            results = pipe.execute(raise_on_error=False)
        except _FAILURES as exc:
            self._fail(exc)
            return 0
        self._ok()
        return sum(r for r in results if isinstance(r, int))

    # ------------------------------------------------------------------ plumbing

    def _admit(self) -> bool:
        if self._closed or not self._breaker.allow():
            self._stats.add(skipped=1)
            return False
        return True

    def _run(self, fn: Callable[[], None], deadline_s: float | None, call: _Call) -> str:
        """Run a data call (under a deadline when given); count and absorb its failure.
        Returns _OK, _TIMEOUT (cut at the deadline) or _FAILED."""
        try:
            if deadline_s is None:
                fn()
            else:
                self._runner.run(fn, deadline_s)
        except DeadlineExceeded:
            call.abandoned = True
            self._stats.add(timeouts=1)
            self._breaker_failure()
            return _TIMEOUT
        except _FAILURES as exc:
            call.abandoned = True
            self._fail(exc)
            return _FAILED
        self._ok()
        return _OK

    def _ok(self) -> None:
        was_closed = self._breaker.closed
        self._breaker.success()
        if not was_closed and self._breaker.closed:
            self._stats.add(reconnects=1)
            log.info("remote store %s: reachable again", self.url)

    def _fail(self, exc: BaseException) -> None:
        if isinstance(exc, RedisTimeoutError):
            self._stats.add(timeouts=1)
        else:
            self._stats.add(errors=1)
        log.debug("remote store %s: %s: %s", self.url, type(exc).__name__, exc)
        if isinstance(exc, ResponseError) and not _is_auth_error(exc):
            return          # the server answered: it is up, the command was refused
        self._breaker_failure()

    def _breaker_failure(self) -> None:
        if self._breaker.failure():
            self._stats.add(breaker_opened=1)
            log.warning("remote store %s: unavailable, next probe in %.2f s", self.url,
                        self._breaker.next_probe_in_s)
            if not self.cluster:
                # NOTE: drop pooled sockets now: after a server restart every one of them is
                # dead, and the probe should reconnect rather than find them one by one.
                try:
                    self._client.connection_pool.disconnect(inuse_connections=False)
                except Exception:                        # pragma: no cover - best effort
                    log.debug("disconnecting the pool failed", exc_info=True)

    def _late_error(self, exc: BaseException) -> None:
        self._stats.add(errors=1)

    def _typed(self, exc: BaseException, what: str) -> Exception:
        detail = f"{what}: {type(exc).__name__}: {exc}"
        if _is_auth_error(exc):
            return StoreAuthError(self.url, detail)
        return StoreUnavailableError(self.url, detail)

    def stats(self) -> dict[str, Any]:
        snap = self._stats.snapshot()
        snap.update(available=self.available, breaker=self._breaker.state,
                    put_queue_bytes=self._puts.queued_bytes, url=self.url,
                    cluster=self.cluster)
        return snap

    def close(self) -> None:
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        self._puts.close()
        self._runner.close()
        try:
            self._client.close()
        except Exception:                                # pragma: no cover - best effort
            log.debug("closing the client failed", exc_info=True)

    def __enter__(self) -> RedisStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

