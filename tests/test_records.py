"""The block record format: round trips, and every damaged or mismatched record is CorruptRecord
(a miss), never data."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tiered_cache import records
from tiered_cache.errors import TieredCacheError
from tiered_cache.records import HEADER_FIXED, CorruptRecord, RecordHeader

digest16 = st.binary(min_size=16, max_size=16)
token_ids = st.lists(st.integers(0, 2**31 - 1), min_size=0, max_size=64)

# (offset, size) of each field in the fixed header (see the records docstring)
FIELDS = {"magic": (0, 8), "version": (8, 2), "flags": (10, 2), "header_len": (12, 4),
          "namespace": (16, 16), "key": (32, 16), "parent": (48, 16), "root": (64, 16),
          "depth": (80, 4), "num_tokens": (84, 4), "hits": (88, 8), "payload_len": (96, 8),
          "payload_hash": (104, 16), "header_hash": (120, 16)}


@st.composite
def record_args(draw):
    payload = draw(st.binary(min_size=0, max_size=2048))
    return dict(namespace=draw(digest16), key=draw(digest16), parent=draw(digest16),
                root=draw(digest16), depth=draw(st.integers(0, 2**32 - 1)),
                tokens=records.tokens_bytes(np.array(draw(token_ids), dtype=np.int64)),
                hits=draw(st.integers(0, 2**63 - 1)), payload=payload)


def _header(args) -> bytes:
    a = dict(args)
    payload = a.pop("payload")
    return records.encode_header(**a, payload_len=len(payload),
                                 payload_digest=records.payload_hash(payload))


@settings(max_examples=200, deadline=None)
@given(record_args())
def test_header_round_trip(args):
    head = _header(args)
    assert len(head) == records.header_len(len(args["tokens"]) // 4)
    h = records.decode_header(head + b"trailing bytes are ignored",
                              namespace=args["namespace"],
                              num_tokens=len(args["tokens"]) // 4,
                              payload_len=len(args["payload"]))
    assert (h.namespace, h.key, h.parent, h.root, h.depth, h.tokens, h.hits) == (
        args["namespace"], args["key"], args["parent"], args["root"], args["depth"],
        args["tokens"], args["hits"])
    assert h.payload_len == len(args["payload"]) and h.header_len == len(head)
    assert h.encode() == head
    records.check_payload(h, args["payload"])


@settings(max_examples=200, deadline=None)
@given(record_args())
def test_whole_record_round_trip(args):
    blob = records.encode(**args)
    h, payload = records.decode(blob, namespace=args["namespace"], expect_key=args["key"])
    assert bytes(payload) == args["payload"] and h.key == args["key"]


@settings(max_examples=300, deadline=None)
@given(record_args(), st.data())
def test_any_flipped_header_byte_is_corrupt(args, data):
    head = bytearray(_header(args))
    pos = data.draw(st.integers(0, len(head) - 1), label="pos")
    head[pos] ^= data.draw(st.integers(1, 255), label="xor")
    with pytest.raises(CorruptRecord):
        records.decode_header(bytes(head))


@settings(max_examples=300, deadline=None)
@given(record_args(), st.sampled_from(sorted(FIELDS)), st.data())
def test_every_field_mismatch_is_detected(args, field, data):
    """A header whose field differs from what its hash covers (any field, any new value)."""
    head = bytearray(_header(args))
    off, size = FIELDS[field]
    new = data.draw(st.binary(min_size=size, max_size=size).filter(
        lambda b: b != bytes(head[off:off + size])), label="value")
    head[off:off + size] = new
    with pytest.raises(CorruptRecord):
        records.decode_header(bytes(head))


@settings(max_examples=200, deadline=None)
@given(record_args(), st.data())
def test_tokens_mismatch_is_detected(args, data):
    head = bytearray(_header(args))
    if len(head) == HEADER_FIXED:
        return
    pos = data.draw(st.integers(HEADER_FIXED, len(head) - 1))
    head[pos] ^= 0x80
    with pytest.raises(CorruptRecord):
        records.decode_header(bytes(head))


@settings(max_examples=200, deadline=None)
@given(record_args(), st.data())
def test_any_damaged_payload_is_corrupt(args, data):
    blob = bytearray(records.encode(**args))
    hlen = records.header_len(len(args["tokens"]) // 4)
    if len(blob) == hlen:
        return
    pos = data.draw(st.integers(hlen, len(blob) - 1))
    blob[pos] ^= data.draw(st.integers(1, 255))
    with pytest.raises(CorruptRecord, match="payload hash"):
        records.decode(bytes(blob))


@settings(max_examples=200, deadline=None)
@given(record_args(), st.data())
def test_any_truncation_is_corrupt(args, data):
    blob = records.encode(**args)
    cut = data.draw(st.integers(0, len(blob) - 1))
    with pytest.raises(CorruptRecord):
        records.decode(blob[:cut])


@settings(max_examples=100, deadline=None)
@given(record_args(), digest16, st.integers(1, 64), st.integers(0, 4096))
def test_expectations_mismatch_is_corrupt(args, other, ntok, plen):
    head = _header(args)
    n = len(args["tokens"]) // 4
    if other != args["namespace"]:
        with pytest.raises(CorruptRecord, match="another namespace"):
            records.decode_header(head, namespace=other)
    if ntok != n:
        with pytest.raises(CorruptRecord, match="tokens per block"):
            records.decode_header(head, num_tokens=ntok)
    if plen != len(args["payload"]):
        with pytest.raises(CorruptRecord, match="payload bytes"):
            records.decode_header(head, payload_len=plen)
    if other != args["key"]:
        with pytest.raises(CorruptRecord, match="another block's key"):
            records.decode(records.encode(**args), expect_key=other)


def test_payload_of_another_length_or_content_is_corrupt():
    args = dict(namespace=b"n" * 16, key=b"k" * 16, parent=b"p" * 16, root=b"r" * 16, depth=0,
                tokens=records.tokens_bytes(np.arange(4)), hits=0)
    h = records.decode_header(records.encode_header(
        **args, payload_len=8, payload_digest=records.payload_hash(b"12345678")))
    records.check_payload(h, b"12345678")
    with pytest.raises(CorruptRecord, match="payload of 7 bytes"):
        records.check_payload(h, b"1234567")
    with pytest.raises(CorruptRecord, match="hash mismatch"):
        records.check_payload(h, b"12345679")


def test_other_version_and_magic_are_corrupt_with_reasons():
    head = bytearray(_header(dict(namespace=b"n" * 16, key=b"k" * 16, parent=b"p" * 16,
                                  root=b"r" * 16, depth=1, tokens=b"", hits=0, payload=b"x")))
    other = bytearray(head)
    struct.pack_into("<H", other, 8, 2)
    with pytest.raises(CorruptRecord, match="version 2"):
        records.decode_header(bytes(other))
    head[0:8] = b"NOTAREC!"
    with pytest.raises(CorruptRecord, match="bad magic"):
        records.decode_header(bytes(head))
    with pytest.raises(CorruptRecord, match="short record"):
        records.decode_header(b"TCKVREC1")


def test_encode_rejects_bad_fields_and_saturates_hits():
    base = dict(namespace=b"n" * 16, key=b"k" * 16, parent=b"p" * 16, root=b"r" * 16,
                depth=0, tokens=b"", hits=0, payload_len=0, payload_digest=b"h" * 16)
    for field, value, match in (("key", b"k" * 15, "key: expected 16"),
                                ("tokens", b"abc", "int32"),
                                ("depth", -1, "depth"), ("depth", 2**32, "depth"),
                                ("payload_len", -1, "payload_len"), ("hits", -1, "hits")):
        with pytest.raises(ValueError, match=match):
            records.encode_header(**{**base, field: value})
    h = records.decode_header(records.encode_header(**{**base, "hits": 2**70}))
    assert h.hits == 2**63 - 1


def test_encode_with_new_hits_changes_only_hits():
    h = records.decode_header(records.encode_header(
        b"n" * 16, b"k" * 16, b"p" * 16, b"r" * 16, 3, records.tokens_bytes(np.arange(16)), 5,
        100, xxhash.xxh3_128_digest(b"x")))
    again = records.decode_header(h.encode(hits=9))
    assert again == RecordHeader(h.namespace, h.key, h.parent, h.root, h.depth, h.tokens, 9,
                                 h.payload_len, h.payload_hash)


def test_corrupt_record_is_a_library_error_and_a_value_error():
    assert issubclass(CorruptRecord, TieredCacheError) and issubclass(CorruptRecord, ValueError)
