"""Identity of a page named by an engine's own hash: its format, its root, its record.

An engine that names its pages by its own hashes (SGLang's page hash strings, vLLM's block
hashes) gives us an opaque key per page, not token ids. Such a page lives under three names:

- the **format digest** (`PageFormat.digest`, 16 bytes): the engine, model, KV dtype, the
  engine's host layout, page size in tokens and bytes, the geometry and the shard layout (TP
  size, replicated MLA or not). It is the records' `namespace` field: pages of another model,
  dtype, layout or sharding are never read;
- the **root** (`page_root`, 16 bytes): the format digest + the tenant salt + the part (a TP
  rank's own pages, or the one replicated copy of MLA). Each (tenant, part) has its own key
  space in every tier;
- the **page key** (`page_key`, 16 bytes): xxh3-128 of the root and the engine's key. It is the
  record's `key` field and the server key's last part.

The record of a page is the block record of `tiered_cache.records` with depth 0, the root as
its parent, and, in the place of the token ids, the engine's key itself (`ident`: 4-byte length,
the key, zeros up to `IDENT_BYTES`). NOTE: so a read compares the stored engine key with the one
asked for, byte for byte: two engine keys whose page keys collide can never return each other's
KV (as a block match compares token ids). The header hash covers that field, the payload hash
the page's bytes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass

import xxhash

from tiered_cache import records
from tiered_cache.errors import TieredCacheError
from tiered_cache.wire.pages import ENGINE_KEY_MAX, MAX_PART

IDENT_BYTES = 4 + ENGINE_KEY_MAX
IDENT_TOKENS = IDENT_BYTES // 4  # the record's `num_tokens` for pages
assert IDENT_BYTES % 4 == 0
_VERSION = b"tiered-cache/page/v1"


class PageKeyError(TieredCacheError, ValueError):
    """An engine key is not a non-empty str or bytes of at most ENGINE_KEY_MAX bytes, or a
    batch names one key twice."""


class PageSizeError(TieredCacheError, ValueError):
    """A page buffer does not hold exactly the store's page size."""


@dataclass(frozen=True)
class PageFormat:
    """Everything besides the engine's key that makes two pages' bytes differ."""

    engine: str                 # "sglang", "vllm", ...
    model: str
    dtype: str                  # the KV dtype as the engine names it
    layout: str                 # the engine's host layout ("page_first", "vllm-cpu-chunk", ...)
    page_tokens: int            # tokens per page
    page_bytes: int             # bytes of one page as the engine lays it out
    geometry: str               # layers / heads / head dims, as the engine describes them
    shards: int = 1             # TP ranks that each hold a part (1: replicated, e.g. MLA)

    def __post_init__(self) -> None:
        for name in ("engine", "model", "dtype", "layout", "geometry"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value or len(value) > 512:
                raise ValueError(f"{name}: expected a non-empty string, got {value!r:.60}")
        for name in ("page_tokens", "page_bytes", "shards"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: expected a positive int, got {value!r}")

    def digest(self) -> bytes:
        body = json.dumps(self.__dict__, sort_keys=True).encode()
        return xxhash.xxh3_128_digest(_VERSION + b"\0format\0" + body)


def _prefixed(data: bytes) -> bytes:
    return len(data).to_bytes(4, "little") + data


def page_root(format_digest: bytes, tenant: bytes, part: bytes) -> bytes:
    """The root of `part` (a rank's pages, or "replicated") of `tenant` in a format."""
    if len(part) > MAX_PART:
        raise PageKeyError(f"part: at most {MAX_PART} bytes, got {len(part)}")
    return xxhash.xxh3_128_digest(_VERSION + b"\0root\0" + format_digest + _prefixed(tenant)
                                  + _prefixed(part))


def check_key(key: object, where: str = "key") -> bytes:
    """An engine key as bytes: a str (UTF-8) or bytes of 1..ENGINE_KEY_MAX bytes."""
    if isinstance(key, str):
        data = key.encode()
    elif isinstance(key, (bytes, bytearray, memoryview)):
        data = bytes(key)
    else:
        raise PageKeyError(f"{where}: expected a str or bytes engine key, got "
                           f"{type(key).__name__}")
    if not 1 <= len(data) <= ENGINE_KEY_MAX:
        raise PageKeyError(f"{where}: an engine key has 1..{ENGINE_KEY_MAX} bytes, got "
                           f"{len(data)}")
    return data


def check_keys(keys: Sequence[object], what: str = "keys") -> list[bytes]:
    """`check_key` of every key; a key named twice is a PageKeyError too (a batch that stores
    or loads one page into two places is a caller's bug, not a cache's decision)."""
    if isinstance(keys, (str, bytes)):
        raise PageKeyError(f"{what}: expected a sequence of keys, got one {type(keys).__name__}")
    out = [check_key(k, f"{what}[{i}]") for i, k in enumerate(keys)]
    if len(set(out)) != len(out):
        seen: set[bytes] = set()
        dup = next(i for i, k in enumerate(out) if k in seen or seen.add(k))
        raise PageKeyError(f"{what}[{dup}]: {out[dup]!r:.80} appears twice in one batch")
    return out


def page_key(root: bytes, engine_key: bytes) -> bytes:
    return xxhash.xxh3_128_digest(root + engine_key)


def ident(engine_key: bytes) -> bytes:
    """The record's identity field for `engine_key` (in the place of token ids)."""
    return len(engine_key).to_bytes(4, "little") + engine_key.ljust(ENGINE_KEY_MAX, b"\0")


def encode_header(format_digest: bytes, root: bytes, engine_key: bytes, payload) -> bytes:
    """The record header of a page whose bytes are `payload` (a buffer or a list of pieces)."""
    nbytes = (sum(memoryview(p).nbytes for p in payload) if isinstance(payload, (list, tuple))
              else memoryview(payload).nbytes)
    return records.encode_header(format_digest, page_key(root, engine_key), root, root, 0,
                                 ident(engine_key), 0, nbytes, records.payload_hash(payload))


def matches(header: records.RecordHeader, root: bytes, engine_key: bytes) -> bool:
    """Whether a verified header is the record of `engine_key` under `root`: key, root, parent,
    depth and the stored engine key itself."""
    return (header.key == page_key(root, engine_key) and header.root == root
            and header.parent == root and header.depth == 0
            and header.tokens == ident(engine_key))


def stored_key(header: records.RecordHeader) -> bytes | None:
    """The engine key a verified page header names (None when the field is malformed)."""
    raw = header.tokens
    if len(raw) != IDENT_BYTES:
        return None
    n = int.from_bytes(raw[:4], "little")
    if not 1 <= n <= ENGINE_KEY_MAX or raw[4 + n:].strip(b"\0"):
        return None
    return raw[4:4 + n]
