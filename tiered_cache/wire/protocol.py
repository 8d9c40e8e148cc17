"""The daemon's wire format: length-prefixed msgpack maps, checked against a schema per op.

Framing
-------
A frame is a 4-byte big-endian unsigned length followed by that many bytes of body::

    frame := length:uint32be  body:byte[length]      1 <= length <= max_frame (default 1 MiB)

The length is checked against the frame-size limit on the 4 header bytes alone, before any body
byte is read or any buffer is allocated: a larger prefix is answered (best effort) with a
`frame_too_large` error and the connection is closed, since the stream can no longer be
resynchronised. A body is exactly one msgpack map with string keys (no trailing bytes, no
duplicate keys); anything else is `malformed`, answered, and the connection carries on.

Messages
--------
Every message is one flat map. A request::

    {"v": 1, "op": "lookup", "id": 7, <the op's request fields>}

`v` is the protocol version (int), `op` the operation (str), `id` the request id (int in
[1, 2**63 - 1], chosen by the client, echoed in the reply). A reply::

    {"v": 1, "id": 7, "ok": true, <the op's reply fields>}
    {"v": 1, "id": 7, "ok": false, "error": {"type": "schema", "message": "..."}}

The error reply is frozen across versions, so that a client of another version can still read
the `version` error that names both versions. `id` is 0 when the request's id could not be read,
and in the frames the daemon sends unasked: the welcome frame that opens every connection
(`WELCOME`: the client id, pid, uid and gid the daemon sees, and its frame limit) or a
connection-level error (`unauthorized`, `overloaded`, `frame_too_large`) just before it closes.

Schemas
-------
An op is registered with two schemas, one for its request and one for its reply. A schema is a
plain mapping of field name -> `Field`, for example::

    Op("lookup",
       request={"keys": ListOf(key(), max_len=4096),
                "tokens": IntArray(0, 2**31 - 1, max_len=262_144),
                "hint": Str(max_len=64, optional=True)},
       reply={"slots": IntList(0, 2**31 - 1, max_len=4096)})

Every field is bounded by construction: ints carry their range, strings, byte strings and lists
their maximum length, so a message that decodes is also a message of bounded cost. Fields are
exact: a missing required field, an unknown one, a wrong type (a bool is not an int, an int is
not a float), an int out of range or a list too long is a `schema` error naming the field path
(`lookup.keys[3]: expected 16 bytes, got 15`). `v`, `op`, `id`, `ok` and `error` are reserved.

`IntArray` carries ints as one msgpack bin of little-endian fixed-width ints (4 bytes a token,
decoded without a Python loop into a read-only numpy array); `IntList` as a msgpack array of
ints, for short lists. Both are range-checked on both sides.
"""

from __future__ import annotations

import math
import operator
import struct
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import numpy as np

from tiered_cache.wire.errors import (
    MAX_ERROR_MESSAGE,
    MAX_ERROR_TYPE,
    DaemonError,
    FrameTooLargeError,
    MalformedFrameError,
    SchemaError,
    UnknownOpError,
    VersionError,
    from_wire,
    to_wire,
)

VERSION = 1
DEFAULT_MAX_FRAME = 1 << 20
HEADER = struct.Struct(">I")
MAX_ID = 2**63 - 1
KEY_BYTES = 16
RESERVED = frozenset({"v", "op", "id", "ok", "error"})
WELCOME_OP = "_welcome"


# ---------------------------------------------------------------------------------------------
# fields


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _type_name(value: Any) -> str:
    return type(value).__name__


@dataclass(frozen=True)
class Field:
    """One field of a schema. `check` validates a decoded value (and may convert it, e.g. bin
    to numpy); `pack` turns a Python value into what msgpack writes, validating it likewise."""

    optional: bool = field(default=False, kw_only=True)

    def check(self, value: Any, where: str) -> Any:
        raise NotImplementedError

    def pack(self, value: Any, where: str) -> Any:
        return self.check(value, where)


@dataclass(frozen=True)
class Int(Field):
    lo: int
    hi: int

    def check(self, value: Any, where: str) -> int:
        if type(value) is not int:
            raise SchemaError(f"{where}: expected int, got {_type_name(value)}")
        if not self.lo <= value <= self.hi:
            raise SchemaError(f"{where}: {_short(value)} is outside [{self.lo}, {self.hi}]")
        return value

    def pack(self, value: Any, where: str) -> int:
        if isinstance(value, bool) or isinstance(value, np.bool_):
            raise SchemaError(f"{where}: expected int, got bool")
        try:
            value = operator.index(value)
        except TypeError:
            raise SchemaError(f"{where}: expected int, got {_type_name(value)}") from None
        return self.check(value, where)


@dataclass(frozen=True)
class Float(Field):
    lo: float
    hi: float

    def __post_init__(self) -> None:
        # NOTE: finite bounds, so that inf fails the range check like any other large value.
        if not (math.isfinite(self.lo) and math.isfinite(self.hi)):
            raise ValueError("Float bounds must be finite")

    def check(self, value: Any, where: str) -> float:
        if type(value) is not float:
            raise SchemaError(f"{where}: expected float, got {_type_name(value)}")
        # NOTE: written so that NaN fails too (every comparison with NaN is false).
        if not self.lo <= value <= self.hi:
            raise SchemaError(f"{where}: {value!r} is outside [{self.lo}, {self.hi}]")
        return value

    def pack(self, value: Any, where: str) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float, np.floating)):
            raise SchemaError(f"{where}: expected float, got {_type_name(value)}")
        return self.check(float(value), where)


@dataclass(frozen=True)
class Bool(Field):
    def check(self, value: Any, where: str) -> bool:
        if type(value) is not bool:
            raise SchemaError(f"{where}: expected bool, got {_type_name(value)}")
        return value

    def pack(self, value: Any, where: str) -> bool:
        if isinstance(value, np.bool_):
            value = bool(value)
        return self.check(value, where)


@dataclass(frozen=True)
class Str(Field):
    max_len: int
    min_len: int = 0
    choices: tuple[str, ...] | None = None

    def check(self, value: Any, where: str) -> str:
        if type(value) is not str:
            raise SchemaError(f"{where}: expected str, got {_type_name(value)}")
        if not self.min_len <= len(value) <= self.max_len:
            raise SchemaError(f"{where}: {len(value)} characters, expected "
                              f"{self.min_len}..{self.max_len}")
        if self.choices is not None and value not in self.choices:
            raise SchemaError(f"{where}: {_short(value)} is not one of {list(self.choices)}")
        return value


@dataclass(frozen=True)
class Bytes(Field):
    max_len: int
    min_len: int = 0

    def check(self, value: Any, where: str) -> bytes:
        if type(value) is not bytes:
            raise SchemaError(f"{where}: expected bytes, got {_type_name(value)}")
        n = len(value)
        if not self.min_len <= n <= self.max_len:
            want = (f"{self.max_len}" if self.min_len == self.max_len
                    else f"{self.min_len}..{self.max_len}")
            raise SchemaError(f"{where}: expected {want} bytes, got {n}")
        return value

    def pack(self, value: Any, where: str) -> bytes:
        if isinstance(value, (bytearray, memoryview)):
            value = bytes(value)
        return self.check(value, where)


def key(*, optional: bool = False) -> Bytes:
    """A block key: exactly 16 bytes (xxh3-128 of the tenant salt and the token chain)."""
    return Bytes(KEY_BYTES, KEY_BYTES, optional=optional)


def _check_len(n: int, lo: int, hi: int, where: str, what: str = "items") -> None:
    if not lo <= n <= hi:
        raise SchemaError(f"{where}: {n:,} {what}, expected {lo:,}..{hi:,}")


@dataclass(frozen=True)
class IntList(Field):
    """A msgpack array of ints, each in [lo, hi] (for short lists; see IntArray)."""

    lo: int
    hi: int
    max_len: int
    min_len: int = 0

    def check(self, value: Any, where: str) -> list[int]:
        if type(value) is not list:
            raise SchemaError(f"{where}: expected a list of int, got {_type_name(value)}")
        _check_len(len(value), self.min_len, self.max_len, where)
        if value:
            if not all(type(x) is int for x in value):
                i, x = next((i, x) for i, x in enumerate(value) if type(x) is not int)
                raise SchemaError(f"{where}[{i}]: expected int, got {_type_name(x)}")
            lo, hi = min(value), max(value)
            if lo < self.lo or hi > self.hi:
                i, x = next((i, x) for i, x in enumerate(value) if not self.lo <= x <= self.hi)
                raise SchemaError(f"{where}[{i}]: {_short(x)} is outside "
                                  f"[{self.lo}, {self.hi}]")
        return value

    def pack(self, value: Any, where: str) -> list[int]:
        if isinstance(value, np.ndarray) or hasattr(value, "tolist"):
            value = value.tolist()
        elif isinstance(value, (tuple, range)):
            value = list(value)
        return self.check(value, where)


@dataclass(frozen=True)
class IntArray(Field):
    """Ints packed in one msgpack bin (`dtype`, little-endian), each in [lo, hi]. Decodes to a
    read-only numpy array over the frame's bytes: validating 256K tokens costs two vectorised
    reductions, not a Python loop."""

    lo: int
    hi: int
    max_len: int
    min_len: int = 0
    dtype: str = "<i4"

    def __post_init__(self) -> None:
        info = np.iinfo(np.dtype(self.dtype))
        if self.lo < info.min or self.hi > info.max:
            raise ValueError(f"IntArray bounds [{self.lo}, {self.hi}] exceed {self.dtype}")

    def check(self, value: Any, where: str) -> np.ndarray:
        if type(value) is not bytes:
            raise SchemaError(f"{where}: expected bytes of {self.dtype} ints, got "
                              f"{_type_name(value)}")
        width = np.dtype(self.dtype).itemsize
        if len(value) % width:
            raise SchemaError(f"{where}: {len(value)} bytes is not a whole number of "
                              f"{width}-byte ints")
        arr = np.frombuffer(value, dtype=self.dtype)
        _check_len(len(arr), self.min_len, self.max_len, where)
        self._check_range(arr, where)
        return arr

    def _check_range(self, arr: np.ndarray, where: str) -> None:
        if len(arr) and (int(arr.min()) < self.lo or int(arr.max()) > self.hi):
            i = int(np.flatnonzero((arr < self.lo) | (arr > self.hi))[0])
            raise SchemaError(f"{where}[{i}]: {int(arr[i])} is outside [{self.lo}, {self.hi}]")

    def pack(self, value: Any, where: str) -> bytes:
        arr = np.asarray(value)
        if arr.ndim != 1:
            raise SchemaError(f"{where}: expected a flat sequence of ints, got shape "
                              f"{tuple(arr.shape)}")
        if len(arr) and arr.dtype.kind not in "iu":
            raise SchemaError(f"{where}: expected ints, got dtype {arr.dtype}")
        _check_len(len(arr), self.min_len, self.max_len, where)
        self._check_range(arr, where)
        return arr.astype(self.dtype, copy=False).tobytes()


@dataclass(frozen=True)
class ListOf(Field):
    """A msgpack array whose items all match `item`."""

    item: Field
    max_len: int
    min_len: int = 0

    def _plain(self, value: Any) -> bool:
        """True when `value` is a list of an allowed length whose items all pass the item
        struct's plain check (`_plain_check`): check and pack would return it unchanged."""
        plain = getattr(self.item, "plain", None)
        return (plain is not None and type(value) is list
                and self.min_len <= len(value) <= self.max_len and plain(value))

    def check(self, value: Any, where: str) -> list[Any]:
        if self._plain(value):
            return value
        if type(value) is not list:
            raise SchemaError(f"{where}: expected a list, got {_type_name(value)}")
        _check_len(len(value), self.min_len, self.max_len, where)
        check = self.item.check
        return [check(x, f"{where}[{i}]") for i, x in enumerate(value)]

    def pack(self, value: Any, where: str) -> list[Any]:
        if self._plain(value):
            return value
        if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Iterable):
            raise SchemaError(f"{where}: expected a list, got {_type_name(value)}")
        value = list(value)
        _check_len(len(value), self.min_len, self.max_len, where)
        pack = self.item.pack
        return [pack(x, f"{where}[{i}]") for i, x in enumerate(value)]


@dataclass(frozen=True)
class Struct(Field):
    """A nested map with exactly the fields of `fields`."""

    fields: Mapping[str, Field]

    def __post_init__(self) -> None:
        # Not a dataclass field: equality and repr stay those of the schema. Used by ListOf
        # (a list of plain structs is checked column by column); one struct alone gains
        # nothing from it.
        object.__setattr__(self, "plain", _plain_check(self.fields))

    def check(self, value: Any, where: str) -> dict[str, Any]:
        if type(value) is not dict:
            raise SchemaError(f"{where}: expected a map, got {_type_name(value)}")
        return check_fields(self.fields, value, where)

    def pack(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise SchemaError(f"{where}: expected a map, got {_type_name(value)}")
        return pack_fields(self.fields, value, where)


@dataclass(frozen=True)
class MapOf(Field):
    """A map of string keys (at most `key_max_len` characters) to values matching `value`."""

    value: Field
    max_len: int
    key_max_len: int = 64

    def check(self, value: Any, where: str) -> dict[str, Any]:
        if type(value) is not dict:
            raise SchemaError(f"{where}: expected a map, got {_type_name(value)}")
        _check_len(len(value), 0, self.max_len, where, "entries")
        out = {}
        for k, v in value.items():
            self._check_key(k, where)
            out[k] = self.value.check(v, f"{where}.{k}")
        return out

    def pack(self, value: Any, where: str) -> dict[str, Any]:
        if not isinstance(value, Mapping):
            raise SchemaError(f"{where}: expected a map, got {_type_name(value)}")
        _check_len(len(value), 0, self.max_len, where, "entries")
        out = {}
        for k, v in value.items():
            self._check_key(k, where)
            out[k] = self.value.pack(v, f"{where}.{k}")
        return out

    def _check_key(self, k: Any, where: str) -> None:
        if type(k) is not str or len(k) > self.key_max_len:
            raise SchemaError(f"{where}: key {_short(k)} is not a str of at most "
                              f"{self.key_max_len} characters")


Schema = Mapping[str, Field]


def _plain_check(fields: Mapping[str, Field]) -> Callable[[list[Any]], bool] | None:
    """For a struct of required Int and Bytes fields only (None for any other): a predicate
    over a list of values that is True when each is a dict of exactly those names, each an
    exact int / bytes in range, which `check` and `pack` would return unchanged.

    NOTE: the general path builds a `where` string per field and a new dict per item (about
    7 us a publish entry, on each side); this one checks column by column with C loops (`map`,
    `set`, `min`, `max`: about 0.3 us an entry) and allocates no per-field strings. A list it
    rejects takes the general path, which raises the precise error (or converts, as pack does
    for numpy ints), so errors and results are the same either way."""
    names = list(fields)
    ints = [(i, f.lo, f.hi) for i, f in enumerate(fields.values())
            if type(f) is Int and not f.optional]
    blobs = [(i, f.min_len, f.max_len) for i, f in enumerate(fields.values())
             if type(f) is Bytes and not f.optional]
    if len(names) < 2 or len(ints) + len(blobs) != len(names):
        return None
    row = operator.itemgetter(*names)       # a tuple per dict (two names or more)
    width = {len(names)}

    def plain(values: list[Any]) -> bool:
        if not values:
            return True
        # Exact dicts of len(names) keys that all hold every name: exactly those keys.
        if set(map(type, values)) != _DICT or set(map(len, values)) != width:
            return False
        try:
            cols = list(zip(*map(row, values)))
        except KeyError:
            return False
        for i, lo, hi in ints:
            c = cols[i]
            if set(map(type, c)) != _INT or min(c) < lo or max(c) > hi:
                return False
        for i, lo, hi in blobs:
            c = cols[i]
            if set(map(type, c)) != _BYTES:
                return False
            n = list(map(len, c))
            if min(n) < lo or max(n) > hi:
                return False
        return True
    return plain


_DICT, _INT, _BYTES = {dict}, {int}, {bytes}


def check_fields(schema: Schema, msg: Mapping[str, Any], where: str,
                 envelope: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The validated fields of a decoded map: exactly `schema`'s names (plus `envelope`, which
    the caller has checked and which are not returned)."""
    extra = [k for k in msg if k not in schema and k not in envelope]
    if extra:
        raise SchemaError(f"{where}: unexpected field(s) {', '.join(_short(k) for k in extra)}")
    out = {}
    for name, f in schema.items():
        if name in msg:
            out[name] = f.check(msg[name], f"{where}.{name}")
        elif not f.optional:
            raise SchemaError(f"{where}: missing field {name!r}")
    return out


def pack_fields(schema: Schema, fields: Mapping[str, Any], where: str) -> dict[str, Any]:
    """What msgpack writes for `fields`, validated against `schema` (absent optional fields and
    optional fields set to None are left out)."""
    extra = [k for k in fields if k not in schema]
    if extra:
        raise SchemaError(f"{where}: unexpected field(s) {', '.join(_short(k) for k in extra)}")
    out = {}
    for name, f in schema.items():
        value = fields.get(name)
        if value is None:
            if not f.optional:
                raise SchemaError(f"{where}: missing field {name!r}")
            continue
        out[name] = f.pack(value, f"{where}.{name}")
    return out


# ---------------------------------------------------------------------------------------------
# ops, messages


@dataclass(frozen=True)
class Op:
    """An operation: its name and the schemas of its request and reply."""

    name: str
    request: Schema = field(default_factory=dict)
    reply: Schema = field(default_factory=dict)
    doc: str = ""

    def __post_init__(self) -> None:
        if not 1 <= len(self.name) <= 64:
            raise ValueError(f"op name {self.name!r} must have 1..64 characters")
        for side, schema in (("request", self.request), ("reply", self.reply)):
            clash = RESERVED.intersection(schema)
            if clash:
                raise ValueError(f"op {self.name!r}: {side} field(s) {sorted(clash)} are "
                                 "reserved for the envelope")


@dataclass
class Request:
    op: str
    id: int
    fields: dict[str, Any]


@dataclass
class Reply:
    """A decoded reply. `error` is set when `ok` is false; `fds` holds the file descriptors
    that came with the frame (SCM_RIGHTS), owned by whoever reads the reply."""

    id: int
    ok: bool
    fields: dict[str, Any]
    error: DaemonError | None = None
    fds: list[int] = field(default_factory=list)


WELCOME = Op(WELCOME_OP, reply={
    "client": Int(0, MAX_ID), "pid": Int(0, 2**31 - 1), "uid": Int(0, 2**32 - 1),
    "gid": Int(0, 2**32 - 1), "max_frame": Int(1, 2**32 - 1)},
    doc="sent by the daemon, unasked, as the first frame of every accepted connection")

_ERROR = Struct({"type": Str(MAX_ERROR_TYPE, 1), "message": Str(MAX_ERROR_MESSAGE)})
_REQUEST_ENVELOPE = frozenset({"v", "op", "id"})
_REPLY_ENVELOPE = frozenset({"v", "id", "ok"})


def _unique_map(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise ValueError("duplicate key in map")
    return out


def unpack(body: bytes) -> dict[str, Any]:
    """Exactly one msgpack map with string keys, or MalformedFrameError."""
    try:
        # NOTE: msgpack bounds every length by the buffer's size and its nesting depth by a
        # fixed stack, so hostile bodies fail here with an exception, never a crash.
        msg = msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True,
                              object_pairs_hook=_unique_map)
    except Exception as exc:    # ExtraData, FormatError, StackError, UnicodeDecodeError, ...
        raise MalformedFrameError(f"body is not one msgpack value: {exc}") from None
    if type(msg) is not dict:
        raise MalformedFrameError(f"body is a msgpack {_type_name(msg)}, expected a map")
    if not all(type(k) is str for k in msg):
        raise MalformedFrameError("message keys must be strings")
    return msg


def frame(body: bytes) -> bytes:
    return HEADER.pack(len(body)) + body


def frame_length(buf: bytes | bytearray | memoryview, max_frame: int, offset: int = 0) -> int:
    """The body length announced by the 4 header bytes at `offset`, checked against the
    limit."""
    (n,) = HEADER.unpack_from(buf, offset)
    if n > max_frame:
        raise FrameTooLargeError(f"frame of {n:,} bytes exceeds the limit of {max_frame:,}")
    return n


class Protocol:
    """The registered ops of one protocol version, with their encoders and validators. Both
    sides build the same Protocol; the daemon validates requests and its own replies, the
    client its requests and the daemon's replies."""

    def __init__(self, ops: Iterable[Op] = (), *, version: int = VERSION,
                 max_frame: int = DEFAULT_MAX_FRAME) -> None:
        if not 1024 <= max_frame <= 2**32 - 1:
            raise ValueError(f"max_frame {max_frame} must be in [1024, 2**32 - 1]")
        self.version = version
        self.max_frame = max_frame
        self.ops: dict[str, Op] = {WELCOME_OP: WELCOME}
        for op in ops:
            self.register(op)

    def register(self, op: Op) -> None:
        if op.name in self.ops:
            raise ValueError(f"op {op.name!r} is already registered")
        self.ops[op.name] = op

    def _body(self, msg: dict[str, Any], where: str) -> bytes:
        body = msgpack.packb(msg, use_bin_type=True)
        if len(body) > self.max_frame:
            raise FrameTooLargeError(f"{where}: message of {len(body):,} bytes exceeds the frame "
                                     f"limit of {self.max_frame:,}")
        return body

    # requests ---------------------------------------------------------------------------------

    def encode_request(self, op: str, request_id: int, fields: Mapping[str, Any]) -> bytes:
        """The frame of a request, its fields validated first."""
        spec = self.ops.get(op)
        if spec is None or op == WELCOME_OP:
            raise UnknownOpError(f"unknown op {op!r}")
        if not 1 <= request_id <= MAX_ID:
            raise SchemaError(f"request id {request_id} outside [1, {MAX_ID}]")
        msg = {"v": self.version, "op": op, "id": request_id}
        msg.update(pack_fields(spec.request, fields, op))
        return frame(self._body(msg, op))

    def decode_request(self, body: bytes) -> Request:
        """The request in a frame body, validated; ProtocolError (with the request id when it
        could be read) otherwise."""
        msg = unpack(body)
        rid = msg.get("id")
        request_id = rid if type(rid) is int and 1 <= rid <= MAX_ID else 0
        if "v" not in msg:
            raise SchemaError("missing field 'v' (the protocol version)", request_id)
        v = msg["v"]
        if type(v) is not int:
            raise SchemaError(f"'v' must be an int, got {_type_name(v)}", request_id)
        if v != self.version:
            raise VersionError(f"protocol version {_short(v)} is not supported: this daemon "
                               f"speaks version {self.version}", request_id)
        if not request_id:
            raise SchemaError(f"'id' must be an int in [1, {MAX_ID}], got {_short(rid)}")
        op = msg.get("op")
        if type(op) is not str:
            raise SchemaError(f"'op' must be a str, got {_type_name(op)}", request_id)
        spec = self.ops.get(op)
        if spec is None or op == WELCOME_OP:
            known = ", ".join(sorted(k for k in self.ops if k != WELCOME_OP))
            raise UnknownOpError(f"unknown op {_short(op)} (known: {known})", request_id)
        try:
            fields = check_fields(spec.request, msg, op, _REQUEST_ENVELOPE)
        except SchemaError as exc:
            exc.request_id = request_id
            raise
        return Request(op, request_id, fields)

    # replies ----------------------------------------------------------------------------------

    def encode_reply(self, request_id: int, op: str, fields: Mapping[str, Any]) -> bytes:
        """The frame of a successful reply to `op`, its fields validated against the op's reply
        schema (a handler bug surfaces as SchemaError here, not as a bad frame)."""
        msg = {"v": self.version, "id": request_id, "ok": True}
        msg.update(pack_fields(self.ops[op].reply, fields, f"{op} reply"))
        return frame(self._body(msg, f"{op} reply"))

    def encode_error(self, request_id: int, exc: DaemonError) -> bytes:
        # NOTE: the message is cut so that the reply fits the frame limit at any text
        # (4 bytes a character at most, 128 for the rest of the reply).
        limit = min(MAX_ERROR_MESSAGE, (self.max_frame - 128) // 4)
        msg = {"v": self.version, "id": request_id, "ok": False, "error": to_wire(exc, limit)}
        return frame(msgpack.packb(msg, use_bin_type=True))

    def decode_reply(self, body: bytes, op: str) -> Reply:
        """The reply to `op` in a frame body. An error reply is decoded whatever its version
        (its shape is frozen); a successful one must be of this version and match the op's
        reply schema."""
        msg = unpack(body)
        rid = msg.get("id")
        if type(rid) is not int or not 0 <= rid <= MAX_ID:
            raise SchemaError(f"reply 'id' must be an int in [0, {MAX_ID}], got {_short(rid)}")
        ok = msg.get("ok")
        if type(ok) is not bool:
            raise SchemaError(f"reply 'ok' must be a bool, got {_type_name(ok)}", rid)
        v = msg.get("v")
        if type(v) is not int:
            raise SchemaError(f"reply 'v' must be an int, got {_type_name(v)}", rid)
        if not ok:
            err = check_fields({"error": _ERROR}, msg, "error reply", _REPLY_ENVELOPE)["error"]
            return Reply(rid, False, {}, error=from_wire(err["type"], err["message"], rid))
        if v != self.version:
            raise VersionError(f"reply of protocol version {v}: this client speaks version "
                               f"{self.version}", rid)
        spec = self.ops.get(op)
        if spec is None:
            raise UnknownOpError(f"unknown op {op!r}", rid)
        return Reply(rid, True, check_fields(spec.reply, msg, f"{op} reply", _REPLY_ENVELOPE))

