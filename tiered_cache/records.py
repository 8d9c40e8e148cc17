"""The block record: one block's identity, tokens and KV bytes, self-verifying.

The disk tier stores one record per slot and the remote tier one record per key, in the same
format, so a record can move between them (or between processes and nodes) unchanged. The remote
tier stores header and payload as one value, laid out as below; the disk tier keeps the same two
byte strings apart, the header in its slot of a header table and the payload in the slot's payload
area (`tiered_cache.data.disk_layout`), so a restart reads headers without touching payloads:

```
offset  size  field
     0     8  magic          b"TCKVREC1"
     8     2  version        1
    10     2  flags          0 (reserved)
    12     4  header_len     bytes of the header, tokens included (HEADER_FIXED + 4 * num_tokens)
    16    16  namespace      digest of the cache namespace (model, KV dtype, geometry, block size)
    32    16  key            the block's 128-bit chained key
    48    16  parent         the parent block's key; the root key for a depth-0 block
    64    16  root           the root key: namespace + adapter + tenant salt (tiered_cache.hashing)
    80     4  depth          block index in its sequence
    84     4  num_tokens     tokens in the block (the cache's block_size)
    88     8  hits           times the block was reused (a hint for eviction policies)
    96     8  payload_len    bytes of KV that follow the header
   104    16  payload_hash   xxh3-128 of the payload
   120    16  header_hash    xxh3-128 of bytes [0, 120) and of the token ids
   136  4*n   tokens         token ids, int32 little-endian
     h     p  payload        the KV bytes (the host tier's block-major slot layout)
```

NOTE: why two hashes. The header hash lets a reader trust identity (key, parent, tokens) from a
header alone, which is what a restart reads to rebuild the index without touching payloads; the
payload hash is checked on every read of the KV. A record written only in part (a crash, a torn
write, a server that evicted or truncated a value) fails one of the two, so it can only ever be
a miss, never another block's KV. All integers are little-endian; every field is fixed size.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import numpy as np
import xxhash

from tiered_cache.errors import TieredCacheError

MAGIC = b"TCKVREC1"
VERSION = 1
_FIXED = struct.Struct("<8sHHI16s16s16s16sIIQQ16s16s")
HEADER_FIXED = _FIXED.size                  # 136 bytes before the token ids
_HASHED = 120                               # header bytes covered by header_hash (before it)
assert HEADER_FIXED == _HASHED + 16


class CorruptRecord(TieredCacheError, ValueError):
    """A record failed verification: bad magic or version, a hash mismatch, a short read, or
    fields that contradict what the reader expected. Always a miss, never data."""


class RecordHeader(NamedTuple):
    """A verified header. NOTE: a NamedTuple (immutable like a frozen dataclass, built 3x
    faster): a restart decodes one per block on disk, 10^5 and more."""

    namespace: bytes
    key: bytes
    parent: bytes
    root: bytes
    depth: int
    tokens: bytes                   # int32 little-endian token ids
    hits: int
    payload_len: int
    payload_hash: bytes

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4

    @property
    def header_len(self) -> int:
        return HEADER_FIXED + len(self.tokens)

    def encode(self, *, hits: int | None = None) -> bytes:
        """The header's bytes again (with another use count when `hits` is given): a use count
        can be rewritten without touching, or even reading, the payload."""
        h = self if hits is None else self._replace(hits=hits)
        return encode_header(h.namespace, h.key, h.parent, h.root, h.depth, h.tokens, h.hits,
                             h.payload_len, h.payload_hash)


def header_len(num_tokens: int) -> int:
    return HEADER_FIXED + 4 * num_tokens


def payload_hash(payload) -> bytes:
    """xxh3-128 of a payload: one buffer, or a list/tuple of buffers taken back to back (the
    pieces of a page that lies in several places of an engine's pool; the same digest as of
    their concatenation, without making it)."""
    if isinstance(payload, (list, tuple)):
        h = xxhash.xxh3_128()
        for piece in payload:
            h.update(piece)
        return h.digest()
    return xxhash.xxh3_128_digest(payload)


def encode_header(namespace: bytes, key: bytes, parent: bytes, root: bytes, depth: int,
                  tokens: bytes, hits: int, payload_len: int, payload_digest: bytes) -> bytes:
    """The header of a record whose payload has `payload_len` bytes hashing to
    `payload_digest` (see `payload_hash`)."""
    for name, value in (("namespace", namespace), ("key", key), ("parent", parent),
                        ("root", root), ("payload_digest", payload_digest)):
        if len(value) != 16:
            raise ValueError(f"{name}: expected 16 bytes, got {len(value)}")
    if len(tokens) % 4:
        raise ValueError(f"tokens: expected int32 bytes, got {len(tokens)} bytes")
    # NOTE: range checks here, not struct.error from pack: a caller's bad value is a ValueError
    # naming the field. hits is a hint and saturates instead.
    if not 0 <= depth < 2**32:
        raise ValueError(f"depth: expected 0 <= depth < 2**32, got {depth}")
    if not 0 <= payload_len < 2**64:
        raise ValueError(f"payload_len: expected a non-negative 64-bit size, got {payload_len}")
    if hits < 0:
        raise ValueError(f"hits: expected a non-negative count, got {hits}")
    hlen = HEADER_FIXED + len(tokens)
    head = _FIXED.pack(MAGIC, VERSION, 0, hlen, namespace, key, parent, root, depth,
                       len(tokens) // 4, min(hits, 2**63 - 1), payload_len, payload_digest,
                       b"\0" * 16)
    h = xxhash.xxh3_128()
    h.update(head[:_HASHED])
    h.update(tokens)
    return head[:_HASHED] + h.digest() + tokens


def encode(namespace: bytes, key: bytes, parent: bytes, root: bytes, depth: int, tokens: bytes,
           hits: int, payload) -> bytes:
    """A whole record (header + payload) as one bytes object (the remote tier's value)."""
    view = memoryview(payload).cast("B")
    head = encode_header(namespace, key, parent, root, depth, tokens, hits, view.nbytes,
                         payload_hash(view))
    return head + view.tobytes()


def decode_header(buf, *, namespace: bytes | None = None, num_tokens: int | None = None,
                  payload_len: int | None = None) -> RecordHeader:
    """Parse and verify a header (`buf` starts with it; anything after it is ignored). With
    `namespace` / `num_tokens` / `payload_len`, a record of another namespace, block size or
    block geometry is CorruptRecord too. Raises CorruptRecord on any mismatch."""
    view = buf if type(buf) is bytes else memoryview(buf).cast("B")
    size = len(view)
    if size < HEADER_FIXED:
        raise CorruptRecord(f"short record: {size} bytes, a header needs {HEADER_FIXED}")
    (magic, version, _flags, hlen, ns, key, parent, root, depth, ntok, hits, plen, phash,
     hhash) = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise CorruptRecord("bad magic: not a tiered-cache block record")
    if version != VERSION:
        raise CorruptRecord(f"record format version {version}, this build reads {VERSION}")
    if hlen != HEADER_FIXED + 4 * ntok or size < hlen:
        raise CorruptRecord(f"header length {hlen} does not match {ntok} tokens or the "
                            f"{size} bytes available")
    tokens = bytes(view[HEADER_FIXED:hlen])
    # one-shot over the concatenation: the same digest as streaming both parts, and cheaper
    if xxhash.xxh3_128_digest(bytes(view[:_HASHED]) + tokens) != hhash:
        raise CorruptRecord("header hash mismatch (torn or corrupted header)")
    if namespace is not None and ns != namespace:
        raise CorruptRecord("record of another namespace (model, dtype, geometry or block "
                            "size differ)")
    if num_tokens is not None and ntok != num_tokens:
        raise CorruptRecord(f"record of {ntok} tokens per block, expected {num_tokens}")
    if payload_len is not None and plen != payload_len:
        raise CorruptRecord(f"record of {plen} payload bytes, expected {payload_len}")
    return _new_header(RecordHeader, (ns, key, parent, root, depth, tokens, hits, plen, phash))


_new_header = tuple.__new__             # RecordHeader(...) without its Python-level __new__


def check_payload(header: RecordHeader, payload) -> None:
    """Raise CorruptRecord unless `payload` is exactly the KV the header describes."""
    view = memoryview(payload).cast("B")
    if view.nbytes != header.payload_len:
        raise CorruptRecord(f"payload of {view.nbytes} bytes, the header says "
                            f"{header.payload_len}")
    if payload_hash(view) != header.payload_hash:
        raise CorruptRecord("payload hash mismatch (torn, truncated or corrupted KV)")


def decode(buf, *, namespace: bytes | None = None, num_tokens: int | None = None,
           expect_key: bytes | None = None) -> tuple[RecordHeader, memoryview]:
    """Parse and verify a whole record; returns the header and a view of the payload."""
    header = decode_header(buf, namespace=namespace, num_tokens=num_tokens)
    if expect_key is not None and header.key != expect_key:
        raise CorruptRecord("record holds another block's key")
    view = memoryview(buf).cast("B")
    payload = view[header.header_len:]
    check_payload(header, payload)
    return header, payload


def tokens_bytes(tokens: np.ndarray) -> bytes:
    """Token ids as the int32 little-endian bytes a record stores."""
    return np.ascontiguousarray(tokens, dtype="<i4").tobytes()
