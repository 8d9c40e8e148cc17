"""The daemon's wire format: round trips, every rejection typed and named, and fuzzing, both
in process and against a real reference daemon in a subprocess that must keep serving a
well-behaved client throughout and count every rejection by its reason."""

from __future__ import annotations

import shutil
import socket
import struct
import tempfile
import threading
from collections import Counter
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from tests.daemon_reference import ECHO_FIELDS, ServerProcess, make_protocol
from tiered_cache.wire.client import Client
from tiered_cache.wire.errors import (
    DaemonError,
    FrameTooLargeError,
    LeaseExpiredError,
    MalformedFrameError,
    ProtocolError,
    RemoteError,
    SchemaError,
    UnknownOpError,
    VersionError,
    from_wire,
)
from tiered_cache.wire.framing import FrameBuffer, TruncatedFrame
from tiered_cache.wire.protocol import (
    HEADER,
    VERSION,
    Bytes,
    Float,
    Int,
    IntArray,
    ListOf,
    Op,
    Protocol,
    frame,
    frame_length,
    key,
    unpack,
)

MAX_FRAME = 4096            # the fuzzed daemon's limit: small, so oversized frames are cheap
PROTO = make_protocol(MAX_FRAME)
# NOTE: not "events": its reply lists every connection the module's fuzzed daemon has seen, and
# past ~150 of them it no longer fits MAX_FRAME (an error reply, correctly: a flaky fuzz case).
SAFE_OPS = ("ping", "echo", "whoami", "peers", "stats")

ECHO = {"n": -(2**63), "f": 1.5, "s": "héllo", "b": b"\x00\xff" * 7, "flag": False,
        "ints": [-(2**31), 0, 2**31 - 1], "tokens": np.arange(500, dtype=np.int64),
        "keys": [bytes(range(16)), b"\xff" * 16], "nested": {"a": 3, "b": "x"}}


def body(msg: dict) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def request(op: str = "ping", **fields) -> dict:
    return {"v": VERSION, "op": op, "id": 9, **fields}


def rejects(msg_or_body, exc_type: type[ProtocolError], *words: str) -> ProtocolError:
    raw = msg_or_body if isinstance(msg_or_body, bytes) else body(msg_or_body)
    with pytest.raises(exc_type) as info:
        PROTO.decode_request(raw)
    text = str(info.value)
    for w in words:
        assert w in text, text
    return info.value


# --- round trips (in process) ------------------------------------------------------------------


def test_request_and_reply_round_trip_every_field_type():
    data = PROTO.encode_request("echo", 41, ECHO)
    (n,) = HEADER.unpack(data[:4])
    assert n == len(data) - 4
    req = PROTO.decode_request(data[4:])
    assert (req.op, req.id) == ("echo", 41)
    got = req.fields
    assert isinstance(got["tokens"], np.ndarray) and not got["tokens"].flags.writeable
    assert got["tokens"].tolist() == list(range(500))
    assert {k: v for k, v in got.items() if k != "tokens"} == {
        k: v for k, v in ECHO.items() if k != "tokens"}
    reply = PROTO.decode_reply(PROTO.encode_reply(41, "echo", got)[4:], "echo")
    assert reply.ok and reply.id == 41 and reply.error is None
    assert reply.fields["tokens"].tolist() == list(range(500))
    assert reply.fields["keys"] == ECHO["keys"]


def test_optional_fields_may_be_absent():
    req = PROTO.decode_request(PROTO.encode_request("echo", 1, {"n": 3})[4:])
    assert req.fields == {"n": 3}


def test_error_replies_decode_to_their_classes_whatever_the_version():
    exc = PROTO.decode_reply(PROTO.encode_error(5, LeaseExpiredError("gone"))[4:], "ping").error
    assert isinstance(exc, LeaseExpiredError) and exc.message == "gone"
    # NOTE: the error reply's shape is frozen, so a reply from another version still decodes.
    other = body({"v": VERSION + 7, "id": 5, "ok": False,
                  "error": {"type": "version", "message": "speaks 8"}})
    got = PROTO.decode_reply(other, "ping")
    assert isinstance(got.error, VersionError) and got.error.request_id == 5
    unknown = from_wire("quota_exceeded", "too much")
    assert isinstance(unknown, RemoteError) and unknown.wire_type == "quota_exceeded"
    with pytest.raises(VersionError, match="version 8"):
        PROTO.decode_reply(body({"v": 8, "id": 5, "ok": True}), "ping")


def test_welcome_and_frame_length():
    assert frame_length(HEADER.pack(MAX_FRAME), MAX_FRAME) == MAX_FRAME
    with pytest.raises(FrameTooLargeError, match="4,097 bytes exceeds the limit of 4,096"):
        frame_length(HEADER.pack(MAX_FRAME + 1), MAX_FRAME)
    with pytest.raises(FrameTooLargeError):
        PROTO.encode_request("echo", 1, {"b": b"x" * MAX_FRAME})


# --- every rejection, typed and named --------------------------------------------------------


def test_unknown_version_names_both_versions():
    err = rejects(request(v=VERSION + 1), VersionError, f"version {VERSION + 1}",
                  f"speaks version {VERSION}")
    assert err.request_id == 9 and err.wire_type == "version"


@pytest.mark.parametrize("msg, exc, words", [
    ({"op": "ping", "id": 1}, SchemaError, ["missing field 'v'"]),
    (request(v="1"), SchemaError, ["'v' must be an int", "str"]),
    (request(v=True), SchemaError, ["'v' must be an int", "bool"]),
    ({"v": VERSION, "op": "ping"}, SchemaError, ["'id'"]),
    (request(id=0) | {"id": 0}, SchemaError, ["'id'"]),
    ({"v": VERSION, "op": "ping", "id": 2**63}, SchemaError, ["'id'"]),
    ({"v": VERSION, "op": "ping", "id": -1}, SchemaError, ["'id'"]),
    ({"v": VERSION, "op": 7, "id": 1}, SchemaError, ["'op' must be a str"]),
    (request("lookup"), UnknownOpError, ["unknown op 'lookup'", "ping"]),
    (request("_welcome"), UnknownOpError, ["unknown op"]),
    (request(extra=1), SchemaError, ["ping", "unexpected field", "'extra'"]),
    (request("sleep"), SchemaError, ["sleep: missing field 'ms'"]),
    (request("sleep", ms=True), SchemaError, ["sleep.ms: expected int, got bool"]),
    (request("sleep", ms=1.0), SchemaError, ["sleep.ms: expected int, got float"]),
    (request("sleep", ms=60_001), SchemaError, ["sleep.ms", "outside [0, 60000]"]),
    (request("sleep", ms=-1), SchemaError, ["outside"]),
    (request("echo", f=1), SchemaError, ["echo.f: expected float, got int"]),
    (request("echo", f=float("nan")), SchemaError, ["echo.f", "outside"]),
    (request("echo", f=float("inf")), SchemaError, ["echo.f", "outside"]),
    (request("echo", s=b"x"), SchemaError, ["echo.s: expected str, got bytes"]),
    (request("echo", s="x" * 1025), SchemaError, ["echo.s: 1025 characters"]),
    (request("echo", b="x"), SchemaError, ["echo.b: expected bytes, got str"]),
    (request("echo", flag=1), SchemaError, ["echo.flag: expected bool, got int"]),
    (request("echo", keys=[b"x" * 16, b"x" * 15]), SchemaError,
     ["echo.keys[1]: expected 16 bytes, got 15"]),
    (request("echo", keys=b"x" * 16), SchemaError, ["echo.keys: expected a list"]),
    (request("echo", ints=[1, 2, True]), SchemaError, ["echo.ints[2]: expected int, got bool"]),
    (request("echo", ints=[1, 2**31]), SchemaError, ["echo.ints[1]", "outside"]),
    (request("echo", ints=list(range(4097))), SchemaError, ["echo.ints: 4,097 items"]),
    (request("echo", tokens=b"\x01\x00\x00"), SchemaError, ["echo.tokens", "3 bytes"]),
    (request("echo", tokens=np.array([5, -1], "<i4").tobytes()), SchemaError,
     ["echo.tokens[1]: -1 is outside"]),
    (request("echo", tokens=[1, 2]), SchemaError, ["echo.tokens: expected bytes"]),
    (request("echo", nested={"a": 1}), SchemaError, ["echo.nested: missing field 'b'"]),
    (request("echo", nested={"a": 1, "b": "x", "c": 0}), SchemaError,
     ["echo.nested: unexpected field"]),
    (request("echo", nested={"a": 11, "b": "x"}), SchemaError, ["echo.nested.a"]),
    (request("echo", nested=[1]), SchemaError, ["echo.nested: expected a map"]),
])
def test_bad_messages_get_typed_errors_naming_the_field(msg, exc, words):
    rejects(msg, exc, *words)


@pytest.mark.parametrize("raw, words", [
    (b"", ["not one msgpack value"]),
    (b"\xc1", ["not one msgpack value"]),                        # a never-used byte
    (body(request()) + b"\x00", ["not one msgpack value"]),     # trailing data
    (body([1, 2]), ["msgpack list, expected a map"]),
    (body(7), ["msgpack int, expected a map"]),
    (b"\x82\xa1v\x01\xa1v\x02", ["duplicate key"]),             # {"v": 1, "v": 2}
    (body({b"v": 1}), ["keys must be strings"]),
    (b"\x81\x01\x01", ["not one msgpack value"]),               # int key (strict_map_key)
    (b"\x81\xa1v\xd9\x02\xff\xfe", ["not one msgpack value"]),  # invalid UTF-8
    (b"\x91" * 5000, ["not one msgpack value"]),                # nested past the unpacker stack
    (b"\xdd\xff\xff\xff\xff", ["not one msgpack value"]),       # array claiming 4G items
])
def test_malformed_bodies(raw, words):
    rejects(raw, MalformedFrameError, *words)


def test_schema_construction_rules():
    with pytest.raises(ValueError, match="reserved"):
        Op("bad", request={"id": Int(0, 1)})
    with pytest.raises(ValueError, match="finite"):
        Float(0.0, float("inf"))
    with pytest.raises(ValueError, match="exceed"):
        IntArray(0, 2**40, 10)
    p = Protocol([Op("x")])
    with pytest.raises(ValueError, match="already registered"):
        p.register(Op("x"))


def test_encoding_validates_before_anything_is_sent():
    with pytest.raises(SchemaError, match="echo.keys\\[0\\]: expected 16 bytes"):
        PROTO.encode_request("echo", 1, {"keys": [b"short"]})
    with pytest.raises(SchemaError, match="expected int, got bool"):
        PROTO.encode_request("sleep", 1, {"ms": True})
    with pytest.raises(SchemaError, match="outside"):
        PROTO.encode_request("echo", 1, {"tokens": np.array([2**31])})
    with pytest.raises(SchemaError, match="expected ints"):
        PROTO.encode_request("echo", 1, {"tokens": np.array([1.5])})
    with pytest.raises(UnknownOpError):
        PROTO.encode_request("nope", 1, {})
    assert ListOf(key(), 2).pack((bytearray(16), memoryview(bytes(16))), "k") == [bytes(16)] * 2
    assert Bytes(4).pack(bytearray(b"ab"), "b") == b"ab"


# --- framing -----------------------------------------------------------------------------------


def _feed(chunks):
    it = iter(chunks)

    def recv(view, started):
        try:
            chunk = next(it)
        except StopIteration:
            return 0
        view[:len(chunk)] = chunk
        return len(chunk)
    return recv


@given(st.lists(st.binary(max_size=300), max_size=8), st.integers(1, 97))
@settings(max_examples=150, deadline=None)
def test_frame_buffer_returns_frames_however_the_stream_is_cut(bodies, cut):
    stream = b"".join(frame(b) for b in bodies)
    chunks = [stream[i:i + cut] for i in range(0, len(stream), cut)]
    buf = FrameBuffer(256)
    recv = _feed(chunks)
    got = []
    while (b := buf.read(recv, 1000)) is not None:
        got.append(bytes(b))
    assert got == bodies


def test_frame_buffer_truncation_and_limit():
    with pytest.raises(TruncatedFrame):
        FrameBuffer(64).read(_feed([frame(b"x" * 10)[:7]]), 100)
    with pytest.raises(TruncatedFrame):
        FrameBuffer(64).read(_feed([b"\x00\x00"]), 100)
    with pytest.raises(FrameTooLargeError):
        FrameBuffer(64).read(_feed([HEADER.pack(101)]), 100)


# --- in-process fuzz ---------------------------------------------------------------------------

MSGPACK_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.floats()
    | st.text(max_size=20) | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.text(max_size=8), children, max_size=5),
    max_leaves=20)


@st.composite
def near_valid(draw) -> dict:
    """Envelopes that are mostly right, with fields drawn from the echo schema's names and
    random values: most fail the schema deep inside."""
    msg = {"v": draw(st.sampled_from([VERSION, VERSION, VERSION, 0, 2, -1, 2**40])),
           "op": draw(st.sampled_from([*SAFE_OPS, "echo", "echo", "nope", ""])),
           "id": draw(st.sampled_from([1, 2**63 - 1, 0, -5, 2**63]))}
    names = draw(st.lists(st.sampled_from([*ECHO_FIELDS, "v", "zz"]), max_size=4, unique=True))
    for n in names:
        msg[n] = draw(MSGPACK_VALUES)
    return msg


BODIES = (st.binary(max_size=200) | MSGPACK_VALUES.map(body) | near_valid().map(body))


@given(BODIES)
@settings(max_examples=150, deadline=None)
def test_decode_raises_only_protocol_errors(raw):
    try:
        PROTO.decode_request(raw)
    except ProtocolError as exc:
        assert exc.wire_type in {"malformed", "schema", "version", "unknown_op"}
        assert str(exc)


# --- against a real daemon in a subprocess -----------------------------------------------------


@pytest.fixture(scope="module")
def daemon():
    tmp = Path(tempfile.mkdtemp(prefix="tc-proto-"))
    proc = ServerProcess(tmp / "d.sock", "--max-frame", str(MAX_FRAME), "--frame-timeout-s",
                         "0.5").start()
    yield proc
    try:
        assert proc.stop() == 0, proc.log()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class WellBehavedClient:
    """Echo round trips with random payloads on its own connection, verified field by field,
    for as long as the `with` block lasts; then one more, so at least one is known to have been
    served after all the bad traffic."""

    def __init__(self, path: str) -> None:
        self.client = Client(path, PROTO, timeout_s=30)
        self.done = 0
        self.failures: list[BaseException] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def round_trip(self, i: int) -> None:
        rng = np.random.default_rng(i)
        sent = {"n": int(rng.integers(-(2**62), 2**62)), "b": rng.bytes(int(rng.integers(64))),
                "tokens": rng.integers(0, 2**31 - 1, int(rng.integers(1, 300)))}
        got = self.client.call("echo", **sent)
        assert got["n"] == sent["n"] and got["b"] == sent["b"]
        assert np.array_equal(got["tokens"], sent["tokens"])
        self.done += 1

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            try:
                self.round_trip(i)
            except BaseException as exc:        # noqa: BLE001 - reported by __exit__
                self.failures.append(exc)
                return
            i += 1

    def __enter__(self) -> WellBehavedClient:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self.failures, self.failures
        self.round_trip(10**6)
        assert self.done > 0
        self.client.close()


def stats(path: str) -> dict:
    with Client(path, PROTO) as c:
        return c.call("stats")


def raw_connection(path: str) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(path)
    welcome = read_frame(s)
    assert welcome is not None and welcome["ok"] and welcome["id"] == 0
    return s


def read_exact(s: socket.socket, n: int) -> bytes | None:
    out = b""
    while len(out) < n:
        try:
            chunk = s.recv(n - len(out))
        except ConnectionResetError:
            # NOTE: a daemon that closes a connection with bytes still unread makes the
            # kernel end the stream with ECONNRESET (after what was already queued).
            return None
        if not chunk:
            return None
        out += chunk
    return out


def read_frame(s: socket.socket) -> dict | None:
    header = read_exact(s, 4)
    if header is None:
        return None
    raw = read_exact(s, HEADER.unpack(header)[0])
    assert raw is not None
    return unpack(raw)


def expected(raw: bytes) -> tuple[str | None, int]:
    """(rejection reason or None, request id of the reply) that the daemon must give `raw`."""
    try:
        req = PROTO.decode_request(raw)
    except ProtocolError as exc:
        return exc.wire_type, exc.request_id
    return None, req.id


def rejected(path: str) -> Counter:
    return Counter(stats(path)["rejected"])


@pytest.mark.slow
@given(st.lists(BODIES, min_size=1, max_size=6))
@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzzed_frames_are_answered_and_counted_while_others_are_served(daemon, bodies):
    path = daemon.socket_path
    want = Counter()
    for raw in bodies:
        reason, _ = expected(raw)
        if reason is None:
            assume(unpack(raw)["op"] in SAFE_OPS)
        else:
            want[reason] += 1
    before = rejected(path)
    with WellBehavedClient(path):
        s = raw_connection(path)
        # NOTE: pipelined: every frame is sent before any reply is read.
        s.sendall(b"".join(frame(raw) for raw in bodies))
        for raw in bodies:
            reason, rid = expected(raw)
            reply = read_frame(s)
            assert reply is not None and reply["id"] == rid
            if reason is None:
                assert reply["ok"] is True
            else:
                assert reply["ok"] is False and reply["error"]["type"] == reason
                assert reply["error"]["message"]
        s.close()
    assert rejected(path) - before == want


def simulate(stream: bytes) -> tuple[Counter, int]:
    """What the daemon must count for a raw stream followed by end-of-stream, and how many
    replies it must send before it closes."""
    counts, replies, i = Counter(), 0, 0
    while i < len(stream):
        if len(stream) - i < 4:
            counts["truncated"] += 1
            break
        (n,) = HEADER.unpack_from(stream, i)
        if n > MAX_FRAME:
            counts["frame_too_large"] += 1
            replies += 1
            break
        if len(stream) - i - 4 < n:
            counts["truncated"] += 1
            break
        reason, _ = expected(stream[i + 4:i + 4 + n])
        replies += 1
        if reason:
            counts[reason] += 1
        i += 4 + n
    return counts, replies


CUT_STREAMS = st.lists(BODIES, max_size=3).map(lambda bs: b"".join(frame(b) for b in bs)).flatmap(
    lambda s: st.integers(0, len(s)).map(lambda k: s[:k]))


@pytest.mark.slow
@given(st.binary(max_size=64) | CUT_STREAMS)
@settings(max_examples=50, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
def test_fuzzed_streams_and_cut_frames_are_counted_and_closed(daemon, stream):
    path = daemon.socket_path
    want, replies = simulate(stream)
    before = rejected(path)
    with WellBehavedClient(path):
        s = raw_connection(path)
        s.sendall(stream)
        s.shutdown(socket.SHUT_WR)
        got = 0
        while read_frame(s) is not None:
            got += 1
        s.close()
    assert got == replies
    assert rejected(path) - before == want


@pytest.mark.slow
def test_broken_framing_cases(daemon):
    path = daemon.socket_path
    cases = [
        ("frame_too_large", HEADER.pack(MAX_FRAME + 1), True),
        ("frame_too_large", b"\xff\xff\xff\xff", True),
        ("truncated", HEADER.pack(100) + b"x" * 10, False),
        ("truncated", b"\x00\x00", False),
    ]
    with WellBehavedClient(path):
        for reason, data, answered in cases:
            before = rejected(path)
            s = raw_connection(path)
            s.sendall(data)
            if not answered:
                s.shutdown(socket.SHUT_WR)
            reply = read_frame(s)
            if answered:
                assert reply is not None and reply["id"] == 0
                assert reply["error"]["type"] == reason
                assert "exceeds the limit of 4,096" in reply["error"]["message"]
                assert read_frame(s) is None            # and the daemon closed the connection
            else:
                assert reply is None
            s.close()
            assert rejected(path) - before == Counter({reason: 1})
        # a frame begun and never finished: dropped after --frame-timeout-s (0.5 s)
        before = rejected(path)
        s = raw_connection(path)
        s.sendall(HEADER.pack(50) + b"abc")
        assert read_frame(s) is None
        s.close()
        assert rejected(path) - before == Counter({"stalled": 1})
        # an empty body keeps the connection: answered, then a good request on the same socket
        s = raw_connection(path)
        s.sendall(frame(b"") + frame(body(request())))
        assert read_frame(s)["error"]["type"] == "malformed"
        assert read_frame(s) == {"v": VERSION, "id": 9, "ok": True}
        s.close()


@pytest.mark.slow
def test_version_error_from_the_daemon_names_both_versions(daemon):
    s = raw_connection(daemon.socket_path)
    s.sendall(frame(body({"v": 99, "op": "ping", "id": 3})))
    reply = read_frame(s)
    s.close()
    assert reply["id"] == 3 and reply["error"]["type"] == "version"
    assert "version 99" in reply["error"]["message"]
    assert f"speaks version {VERSION}" in reply["error"]["message"]


@pytest.mark.slow
def test_client_raises_the_daemons_typed_errors(daemon):
    with Client(daemon.socket_path, PROTO) as c:
        with pytest.raises(LeaseExpiredError, match="asked to fail"):
            c.call("fail", how="lease")
        with pytest.raises(DaemonError, match="failed in the daemon") as info:
            c.call("fail", how="internal")
        assert info.value.wire_type == "internal"
        with pytest.raises(DaemonError, match="invalid reply") as info:
            c.call("fail", how="bad_reply")
        assert info.value.wire_type == "internal"
        assert c.call("ping") == {}                     # the connection carried on
        s = c.call("stats")
    assert s["failures"]["internal"] >= 1 and s["failures"]["bad_reply"] >= 1
    assert s["errors"]["lease_expired"] >= 1


def test_header_struct_is_big_endian():
    assert HEADER.pack(1) == b"\x00\x00\x00\x01" == struct.pack(">I", 1)


def test_maps_of_fields_pack_and_check():
    from tiered_cache.wire.protocol import MapOf, pack_fields
    counts = MapOf(Int(0, 10), max_len=2)
    assert counts.pack({"a": np.int64(3)}, "c") == {"a": 3}
    with pytest.raises(SchemaError, match="3 entries"):
        counts.pack({"a": 1, "b": 2, "c": 3}, "c")
    with pytest.raises(SchemaError, match="key 7"):
        counts.check({7: 1}, "c")
    tokens = MapOf(IntArray(0, 9, 4), max_len=2)
    packed = pack_fields({"t": tokens}, {"t": {"x": [1, 2]}}, "op")
    assert packed == {"t": {"x": np.array([1, 2], "<i4").tobytes()}}
    assert tokens.check(packed["t"], "t")["x"].tolist() == [1, 2]


def test_error_messages_are_cut_to_fit_the_frame():
    small = Protocol(max_frame=1024)
    data = small.encode_error(3, SchemaError("é" * 10_000))
    assert len(data) - 4 <= 1024
    err = small.decode_reply(data[4:], "_welcome").error
    assert isinstance(err, SchemaError) and err.message.endswith("...")
    with pytest.raises(ValueError, match="max_frame"):
        Protocol(max_frame=100)


# --- the page ops (daemon/ops.py PAGE_OPS), bounded and fuzzed in process ---------------------

from tiered_cache.wire import ops as node_ops  # noqa: E402

NODE = node_ops.make_protocol()
PAGE_OK = {
    "page_attach": {"version": 1, "format": b"f" * 16, "page_bytes": 6000},
    "page_exists": {"space": 1, "parts": [b"tp0/2", b"tp1/2"], "keys": [b"k" * 124, b"a"],
                    "deadline_ms": 5},
    "page_get": {"space": 1, "part": b"tp0/2", "keys": [b"k"], "deadline_ms": 0},
    "page_put": {"space": 1, "part": b"replicated", "entries": [{"slot": 3, "key": b"k"}]},
}


def node_request(op: str, **fields) -> bytes:
    return body({"v": VERSION, "op": op, "id": 5, **fields})


def test_page_ops_round_trip():
    for op, fields in PAGE_OK.items():
        req = NODE.decode_request(NODE.encode_request(op, 5, fields)[4:])
        assert req.op == op and req.fields == fields


@pytest.mark.parametrize("op, change, words", [
    ("page_attach", {"format": b"f" * 15}, ["page_attach.format: expected 16 bytes"]),
    ("page_attach", {"page_bytes": 0}, ["page_attach.page_bytes", "outside"]),
    ("page_attach", {"version": 0}, ["page_attach.version", "outside"]),
    ("page_exists", {"keys": [b"k" * 125]}, ["page_exists.keys[0]: expected 1..124 bytes"]),
    ("page_exists", {"keys": [b""]}, ["page_exists.keys[0]: expected 1..124 bytes"]),
    ("page_exists", {"keys": [b"k"] * 4097}, ["page_exists.keys: 4,097 items"]),
    ("page_exists", {"parts": []}, ["page_exists.parts: 0 items"]),
    ("page_exists", {"parts": [b"p"] * 65}, ["page_exists.parts: 65 items"]),
    ("page_exists", {"parts": [b"p" * 65]}, ["page_exists.parts[0]"]),
    ("page_exists", {"deadline_ms": 60_001}, ["page_exists.deadline_ms", "outside"]),
    ("page_exists", {"space": 0}, ["page_exists.space", "outside"]),
    ("page_get", {"keys": []}, ["page_get.keys: 0 items"]),
    ("page_get", {"part": "tp0"}, ["page_get.part: expected bytes, got str"]),
    ("page_put", {"entries": []}, ["page_put.entries: 0 items"]),
    ("page_put", {"entries": [{"slot": -1, "key": b"k"}]}, ["page_put.entries[0].slot"]),
    ("page_put", {"entries": [{"slot": 0, "key": b"k", "x": 1}]},
     ["page_put.entries[0]: unexpected field"]),
])
def test_page_op_fields_are_bounded(op, change, words):
    with pytest.raises(SchemaError) as info:
        NODE.decode_request(node_request(op, **{**PAGE_OK[op], **change}))
    for w in words:
        assert w in str(info.value), str(info.value)


@st.composite
def near_valid_page(draw) -> bytes:
    """Page requests that are mostly right: each field kept, dropped, or replaced by a random
    msgpack value, plus now and then an extra field."""
    op = draw(st.sampled_from(sorted(PAGE_OK)))
    msg = {"v": VERSION, "op": op, "id": draw(st.sampled_from([1, 7, 0, 2**63]))}
    for name, value in PAGE_OK[op].items():
        choice = draw(st.integers(0, 3))
        if choice == 0:
            continue
        msg[name] = value if choice == 1 else draw(MSGPACK_VALUES)
    if draw(st.booleans()):
        msg[draw(st.sampled_from(["zz", "slot", "key"]))] = draw(MSGPACK_VALUES)
    return body(msg)


@given(near_valid_page() | BODIES)
@settings(max_examples=200, deadline=None)
def test_fuzzed_page_requests_decode_within_bounds_or_fail_typed(raw):
    try:
        req = NODE.decode_request(raw)
    except ProtocolError as exc:
        assert exc.wire_type in {"malformed", "schema", "version", "unknown_op"}
        return
    f = req.fields
    for k in f.get("keys", []):
        assert isinstance(k, bytes) and 1 <= len(k) <= 124
    for p in f.get("parts", []) + ([f["part"]] if "part" in f else []):
        assert isinstance(p, bytes) and 1 <= len(p) <= 64
    for e in f.get("entries", []):
        assert set(e) == {"slot", "key"} and 0 <= e["slot"] < 2**31


# --- the plain-struct fast path (publish entries) ---------------------------------------------

def _general(item):
    """`item` with its fast path turned off: the general, field-by-field path."""
    from tiered_cache.wire.protocol import Struct
    slow = Struct(item.fields)
    object.__setattr__(slow, "plain", None)
    return slow


_FIELD_VALUES = (st.integers(-3, 2**31 + 3) | st.booleans() | st.none() | st.floats(0, 9)
                 | st.binary(max_size=70) | st.builds(np.int64, st.integers(0, 99))
                 | st.builds(bytearray, st.binary(max_size=20)))


@st.composite
def _entries(draw):
    from tiered_cache.wire.ops import ENTRY
    names = list(ENTRY.fields)
    good = {"slot": 3, "key": b"k" * 16, "parent": b"p" * 16, "depth": 2,
            "tokens": b"t" * 64, "hits": 0}
    out = []
    for _ in range(draw(st.integers(0, 5))):
        e = dict(good)
        for _ in range(draw(st.integers(0, 2))):
            change = draw(st.sampled_from(("set", "drop", "add")))
            name = draw(st.sampled_from(names))
            if change == "set":
                e[name] = draw(_FIELD_VALUES)
            elif change == "drop":
                e.pop(name, None)
            else:
                e[draw(st.sampled_from(("x", "slot2")))] = 1
        out.append(e if draw(st.integers(0, 20)) else draw(st.sampled_from((None, 7, [e]))))
    return out


def _outcome(fn, value):
    try:
        return ("ok", fn(value, "publish.entries"))
    except SchemaError as exc:
        return ("error", str(exc))


@given(_entries(), st.booleans())
@settings(max_examples=400, deadline=None)
def test_plain_fast_path_agrees_with_the_general_path(entries, pack):
    """Whatever the entries, the fast path gives the general path's result (equal values,
    numpy ints converted) or its error (the same message, naming the same field)."""
    from tiered_cache.wire.ops import ENTRY, MAX_BLOCKS
    fast = ListOf(ENTRY, MAX_BLOCKS, 1)
    slow = ListOf(_general(ENTRY), MAX_BLOCKS, 1)
    if pack:
        assert _outcome(fast.pack, entries) == _outcome(slow.pack, entries)
    else:
        assert _outcome(fast.check, entries) == _outcome(slow.check, entries)
    for e in entries if isinstance(entries, list) else ():
        assert _outcome(ENTRY.check, e) == _outcome(_general(ENTRY).check, e)


def test_plain_fast_path_applies_only_to_int_and_bytes_structs():
    from tiered_cache.wire.ops import ENTRY
    from tiered_cache.wire.protocol import Str, Struct
    assert ENTRY.plain is not None
    assert Struct({"a": Int(0, 1), "b": Str(4)}).plain is None
    assert Struct({"a": Int(0, 1), "b": Int(0, 1, optional=True)}).plain is None
    assert Struct({"a": Int(0, 1)}).plain is None          # one field: no tuple rows
    entries = [{"slot": 1, "key": b"k" * 16, "parent": b"p" * 16, "depth": 0,
                "tokens": b"t" * 64, "hits": 0}]
    assert ENTRY.plain(entries) and not ENTRY.plain([dict(entries[0], depth=True)])
    assert not ENTRY.plain([dict(entries[0], tokens=bytearray(64))])
