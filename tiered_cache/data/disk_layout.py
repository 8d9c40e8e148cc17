"""The disk tier's on-disk format: one directory per namespace, an immutable superblock, a
header table and a payload area, and where each slot's bytes live in them.

```
<path>/<namespace hex>/       caches of other namespaces (models, geometries) live beside it
    lock         the owner's flock; holds its pid (tiered_cache.data.dirlock)
    superblock   written once, atomically (temp + fsync + rename): format, namespace, geometry
    headers      num_slots x header_stride bytes; slot i's record header at i * header_stride
    payloads     num_slots x payload_stride bytes; slot i's KV bytes at i * payload_stride
```

A slot's header area holds a `tiered_cache.records` header followed by zeros up to the stride,
or only zeros (an empty slot: never written, or erased; a tombstone is a zeroed header area).
Anything else is corrupt. A slot's payload area holds the record's `payload_len` KV bytes, then
zeros up to the stride. The payload hash in the header binds the two.

Superblock (all integers little-endian):

```
offset  size  field
     0     8  magic            b"TCDISKSB"
     8     4  format_version   1
    12     4  body_len         48
    16    16  namespace        the cache namespace digest (the records' namespace field)
    32     2  record_version   tiered_cache.records.VERSION
    34     2  reserved         0
    36     4  num_tokens       tokens per block
    40     8  payload_bytes    KV bytes per block
    48     4  header_stride
    52     4  reserved         0
    56     8  payload_stride
    64    16  hash             xxh3-128 of bytes [0, 64)
```

NOTE: the envelope (magic, version, body length, trailing hash over everything before it) is
the same in every format version, so a reader tells "written by another version" (hash valid,
version differs: a clear error, the files are left alone) from "damaged" (hash invalid: the pool
starts empty), even for versions it cannot parse. The slot count is not in the superblock: it
is whatever the opener asks for (the files are grown or cut to it), so the superblock never
changes after it is written.

NOTE: why 4 KiB strides, for headers too. Payload slots are aligned for O_DIRECT. Header slots
are aligned so that no two slots' headers share a 4 KiB sector: a write torn by a power loss can
damage only the slot being written, never a neighbour's durable record. The cost is a header
table of 4 KiB per slot (0.08% of a 70B block), read sequentially on restart.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

from tiered_cache import records
from tiered_cache.errors import TierUnavailableError

ALIGN = 4096
FORMAT_VERSION = 1
SUPERBLOCK = "superblock"
HEADERS = "headers"
PAYLOADS = "payloads"

_MAGIC = b"TCDISKSB"
_ENVELOPE = struct.Struct("<8sII")
_BODY = struct.Struct("<16sHHIQIIQ")
_HASH_LEN = 16


class FormatVersionError(TierUnavailableError):
    """The directory was written by another version of the disk format or record format."""


class SuperblockError(ValueError):
    """The superblock is missing, damaged or describes another pool (the pool starts empty)."""


def round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def slot_footprint(num_tokens: int, payload_bytes: int) -> int:
    """Bytes one slot takes on disk: its header area plus its payload area, each rounded up to
    ALIGN. A disk tier's capacity is divided by this, never by the KV bytes of a block."""
    return round_up(records.header_len(num_tokens), ALIGN) + round_up(payload_bytes, ALIGN)


@dataclass(frozen=True, slots=True)
class Layout:
    """What a pool's files look like: one namespace, one block geometry."""

    namespace: bytes
    num_tokens: int
    payload_bytes: int

    @property
    def header_bytes(self) -> int:
        return records.header_len(self.num_tokens)

    @property
    def header_stride(self) -> int:
        return round_up(self.header_bytes, ALIGN)

    @property
    def slot_bytes(self) -> int:
        return slot_footprint(self.num_tokens, self.payload_bytes)

    @property
    def payload_stride(self) -> int:
        return round_up(self.payload_bytes, ALIGN)

    def headers_size(self, num_slots: int) -> int:
        return num_slots * self.header_stride

    def payloads_size(self, num_slots: int) -> int:
        return num_slots * self.payload_stride

    def encode_superblock(self) -> bytes:
        body = _BODY.pack(self.namespace, records.VERSION, 0, self.num_tokens,
                          self.payload_bytes, self.header_stride, 0, self.payload_stride)
        head = _ENVELOPE.pack(_MAGIC, FORMAT_VERSION, len(body)) + body
        return head + xxhash.xxh3_128_digest(head)

    def check_superblock(self, data: bytes, where: Path) -> None:
        """Return if `data` is this layout's superblock. Raise FormatVersionError for one of
        another format version, SuperblockError (with what differs) for anything else."""
        if len(data) < _ENVELOPE.size + _HASH_LEN:
            raise SuperblockError(f"superblock of {len(data)} bytes (truncated)")
        magic, version, body_len = _ENVELOPE.unpack_from(data)
        if magic != _MAGIC:
            raise SuperblockError("superblock without the tiered-cache magic")
        end = _ENVELOPE.size + body_len
        if len(data) != end + _HASH_LEN or xxhash.xxh3_128_digest(data[:end]) != data[end:]:
            raise SuperblockError("superblock hash mismatch (torn or corrupted)")
        if version != FORMAT_VERSION:
            raise FormatVersionError(
                f"tiers.disk: {where} was written by disk format version {version}; this build "
                f"reads version {FORMAT_VERSION}. Delete that directory or give this cache "
                "another tiers.disk.path")
        if body_len != _BODY.size:
            raise SuperblockError(f"superblock body of {body_len} bytes, expected {_BODY.size}")
        (ns, rec_version, _r0, num_tokens, payload_bytes, header_stride, _r1,
         payload_stride) = _BODY.unpack_from(data, _ENVELOPE.size)
        if rec_version != records.VERSION:
            raise FormatVersionError(
                f"tiers.disk: {where} holds records of format version {rec_version}; this "
                f"build reads version {records.VERSION}. Delete that directory or give this "
                "cache another tiers.disk.path")
        found = {"namespace": ns.hex(), "num_tokens": num_tokens, "payload_bytes": payload_bytes,
                 "header_stride": header_stride, "payload_stride": payload_stride}
        want = {"namespace": self.namespace.hex(), "num_tokens": self.num_tokens,
                "payload_bytes": self.payload_bytes, "header_stride": self.header_stride,
                "payload_stride": self.payload_stride}
        diff = [f"{k} {found[k]} (expected {want[k]})" for k in want if found[k] != want[k]]
        if diff:
            raise SuperblockError("superblock of another pool: " + ", ".join(diff))
