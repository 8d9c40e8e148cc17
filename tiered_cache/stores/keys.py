"""The server key schema of keyed stores.

```
<prefix>:v<record version>:<namespace hex>:<root hex>:<block key hex>
tc:v1:9f0c...(32 hex):5a71...(32 hex):e3b0...(32 hex)
```

- `prefix` (default `tc`) separates deployments sharing one server; letters, digits, `_.-`.
- `v<N>` is `records.VERSION`: a build that writes another record format uses other keys, so
  builds never read each other's values (they would fail the record check anyway, as misses).
- `namespace` is the cache namespace digest (model, KV dtype, geometry, block size), the same
  16 bytes as the records' `namespace` field: caches of different models never share keys.
- `root` is the tenant's root key (namespace + adapter + tenant salt): each tenant has its own
  key space, so one tenant can never read another's block even under a block-key collision, and
  a tenant's blocks can be found (`SCAN MATCH tc:v1:<ns>:<root>:*`) and dropped on their own.
- the block key is the cache's 128-bit chained key.

NOTE: no `{hash tag}`: in Redis Cluster the whole key is hashed to a slot, so the blocks of one
prompt spread over every master instead of piling onto one. Hex (not raw bytes) keeps keys
readable in `redis-cli` and `MONITOR`; at 104 bytes a key costs nothing next to a 5 MiB value.
"""

from __future__ import annotations

import re

from tiered_cache import records

_PREFIX = re.compile(r"[A-Za-z0-9_.\-]{1,64}")


def check_prefix(prefix: str) -> str:
    if not _PREFIX.fullmatch(prefix):
        raise ValueError(f"key prefix {prefix!r}: expected 1-64 characters of A-Z a-z 0-9 _ . -")
    return prefix


def key_space(prefix: str, namespace: bytes) -> bytes:
    """The part of every server key that a store bound to `namespace` shares."""
    return f"{check_prefix(prefix)}:v{records.VERSION}:{namespace.hex()}:".encode()


def server_key(space: bytes, root: bytes, key: bytes) -> bytes:
    """`space` from `key_space`; `root` and `key` are 16 bytes each."""
    return b"%s%s:%s" % (space, root.hex().encode(), key.hex().encode())
