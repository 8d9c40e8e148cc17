"""Keyed stores beneath the slot tiers: the remote tier (Redis / Valkey, standalone or cluster).

`KeyedStore` is the protocol; `RedisStore` (in `tiered_cache.stores.redis`, needs the `remote`
extra: redis-py with hiredis) is the implementation. `RedisStore` is imported lazily so that
`import tiered_cache.stores` works without redis-py installed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from tiered_cache.stores.base import (
    KeyedStore,
    StoreAuthError,
    StoreError,
    StoreUnavailableError,
)

if TYPE_CHECKING:
    from tiered_cache.stores.redis import RedisStore

__all__ = ["KeyedStore", "RedisStore", "StoreAuthError", "StoreError", "StoreUnavailableError"]


def __getattr__(name: str) -> Any:
    if name == "RedisStore":
        from tiered_cache.stores.redis import RedisStore

        return RedisStore
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
