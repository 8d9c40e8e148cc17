"""The keyed-store protocol: what a tier beneath the slot tiers must offer.

Slot tiers (gpu, host, disk) own their slots: the control plane decides what lives where and
evicts. A keyed store (Redis, Valkey) is different in three ways that shape this protocol:

- it is addressed by key, not slot: the cache's 16-byte block key, inside a tenant's root key;
- it is shared by other processes and nodes, so a value may be written by someone else, be
  evicted by the server at any time, or be damaged: every value read is verified, and anything
  that fails is a miss;
- it is remote and can be slow or gone: every call is bounded (a deadline, or socket timeouts)
  and a failing server is skipped by a circuit breaker (`available`), so the cache keeps serving
  from its local tiers.

NOTE: the one authority for eviction in a keyed store is the server (`maxmemory-policy`). The
store never evicts on its own; `delete` exists for explicit invalidation (and corrupt values).

Values are whole block records (`tiered_cache.records`): header + tokens + payload, one value per
block, never two keys per block, so an eviction can only ever remove a whole block.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from tiered_cache.errors import TieredCacheError, TierUnavailableError

KEY_BYTES = 16


class StoreError(TieredCacheError):
    """A keyed store failed. The message names the server URL without its password."""

    def __init__(self, url: str, message: str) -> None:
        self.url = url
        super().__init__(f"{url}: {message}")


class StoreUnavailableError(StoreError, TierUnavailableError):
    """The server cannot be reached (refused, timed out, TLS failure)."""


class StoreAuthError(StoreError):
    """The server refused the credentials (wrong password, unknown ACL user, no permission).
    A configuration error: retrying will not help. `reason`: NEEDS_PASSWORD (none was given
    and the server wants one), REFUSED (wrong user or password), NO_PERMISSION (an ACL user
    that may not run the store's commands)."""

    NEEDS_PASSWORD, REFUSED, NO_PERMISSION = "needs_password", "refused", "no_permission"

    def __init__(self, url: str, message: str, reason: str = REFUSED) -> None:
        super().__init__(url, message)
        self.reason = reason


@runtime_checkable
class KeyedStore(Protocol):
    """A shared key-value store of block records, consulted after a local miss.

    Every key is the 16-byte block key of the cache (`tiered_cache.hashing`); `root` is the
    tenant's root key (namespace + adapter + salt), so tenants live in disjoint key spaces. The
    store is bound to one cache namespace digest (the records' `namespace` field).

    Failures never raise out of the data calls: they count in `stats()` and answer as misses
    (`exists` False, `get` None, `put` stores fewer). Bad input (a key of the wrong length, a
    record for another key) raises ValueError before anything is sent.
    """

    namespace: bytes

    @property
    def available(self) -> bool:
        """True while the circuit breaker is closed. Otherwise calls skip the server and miss,
        except the one probe let through after each backoff period."""
        ...

    def exists(self, root: bytes, keys: Sequence[bytes], deadline_s: float) -> list[bool]:
        """Which keys the server holds, answered within `deadline_s` seconds: after it, every
        key not yet answered is False. A hint: a True may still miss on `get` (evicted since)."""
        ...

    def get(self, root: bytes, keys: Sequence[bytes],
            deadline_s: float | None = None) -> list[bytes | None]:
        """The verified record of each key, or None (absent, evicted, corrupt, or the server
        failed). A record returned passed `records.decode` for this namespace, key and root, so
        callers may slice it with `records.decode_header` without hashing the payload again."""
        ...

    def put(self, root: bytes, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Store (key, record) pairs now, in batches; returns how many the server took."""
        ...

    def put_async(self, root: bytes, items: Sequence[tuple[bytes, bytes]]) -> int:
        """Queue (key, record) pairs for a background writer; returns how many were queued.
        Never blocks: what does not fit in the queue is dropped and counted."""
        ...

    def delete(self, root: bytes, keys: Sequence[bytes]) -> int:
        """Remove keys; returns how many existed."""
        ...

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every queued put has been attempted; False on timeout."""
        ...

    def close(self) -> None:
        """Stop the background writer (queued puts are dropped) and close connections."""
        ...

    def stats(self) -> dict[str, Any]:
        """Counters and latency summaries (see `stores.stats.StoreStats`)."""
        ...


def check_keys(keys: Sequence[bytes], what: str = "key") -> None:
    for k in keys:
        if not isinstance(k, (bytes, bytearray)) or len(k) != KEY_BYTES:
            raise ValueError(f"{what}: expected {KEY_BYTES} bytes, got {k!r:.60}")


def redact_url(url: str) -> str:
    """`url` with its password replaced by `***` (for messages and logs). A URL that does not
    parse (a bad port or IPv6 literal) loses everything before its last '@'."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return url.rpartition("@")[2] if "@" in url else url
    netloc, query = parts.netloc, parts.query
    if parts.password is not None:
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{parts.username or ''}:***@{host}" + (f":{port}" if port else "")
    if "password" in query.lower():
        query = urlencode([(k, "***" if k.lower() == "password" else v)
                           for k, v in parse_qsl(query, keep_blank_values=True)], safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
