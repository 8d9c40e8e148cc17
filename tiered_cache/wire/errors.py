"""Errors of the daemon and its clients, and their names on the wire.

Every error a daemon reports travels as `{"type": str, "message": str}` (see protocol.py). The
`wire_type` of each class below is that `type`; a client turns a reported error back into the
same class with `from_wire`, so code on either side of the socket catches the same exceptions.
A service defines its own errors by subclassing `DaemonError` with a new `wire_type` and calling
`register_error`; a type this side does not know arrives as `RemoteError` with its name kept.
"""

from __future__ import annotations

from tiered_cache.errors import TieredCacheError, TierUnavailableError

MAX_ERROR_TYPE = 64          # bytes of an error's wire type
MAX_ERROR_MESSAGE = 4096     # characters of an error's message (longer ones are cut)


class DaemonError(TieredCacheError):
    """Base class of the errors a daemon reports to a client (and of the client's own)."""

    wire_type = "error"

    @property
    def message(self) -> str:
        return str(self.args[0]) if self.args else ""


class ProtocolError(DaemonError, ValueError):
    """A frame or message breaks the wire format. `request_id` is the id of the request it was
    read from when that much could be read (0 otherwise)."""

    wire_type = "protocol"

    def __init__(self, message: str, request_id: int = 0) -> None:
        super().__init__(message)
        self.request_id = request_id


class FrameTooLargeError(ProtocolError):
    """A length prefix (or a frame about to be sent) exceeds the frame-size limit."""

    wire_type = "frame_too_large"


class MalformedFrameError(ProtocolError):
    """A frame body is not exactly one msgpack map with string keys."""

    wire_type = "malformed"


class VersionError(ProtocolError):
    """The message's protocol version is not the one this side speaks."""

    wire_type = "version"


class UnknownOpError(ProtocolError):
    """The message names an op that is not registered."""

    wire_type = "unknown_op"


class SchemaError(ProtocolError):
    """A field is missing, extra, of the wrong type, out of range or too long."""

    wire_type = "schema"


class UnauthorizedError(DaemonError):
    """The peer's uid/gid (from SO_PEERCRED) is not in the daemon's allowlist."""

    wire_type = "unauthorized"


class OverloadedError(DaemonError):
    """The daemon already serves its maximum number of clients."""

    wire_type = "overloaded"


class InternalError(DaemonError):
    """The handler failed in a way it did not report as a typed error (a daemon bug)."""

    wire_type = "internal"


class LeaseExpiredError(DaemonError):
    """The client's lease is unknown or has expired: whatever it held (pins) is gone, and it
    must attach again before it uses anything it had."""

    wire_type = "lease_expired"


class RemoteError(DaemonError):
    """An error type reported by the daemon that this side does not know."""

    def __init__(self, wire_type: str, message: str) -> None:
        super().__init__(message)
        self.wire_type = wire_type

    def __str__(self) -> str:
        return f"{self.wire_type}: {self.message}"


class DaemonUnavailableError(DaemonError, TierUnavailableError):
    """The daemon cannot be reached: no socket, connection refused or closed mid-request. Never
    sent on the wire; a client that sees it may reconnect (a new connection is a new client:
    nothing the old one held survives)."""

    wire_type = "unavailable"


class DaemonTimeoutError(DaemonUnavailableError, TimeoutError):
    """No reply within the client's timeout. The connection is closed: a late reply must never
    be read as the answer to a later request."""

    wire_type = "timeout"


_REGISTRY: dict[str, type[DaemonError]] = {}


def register_error(cls: type[DaemonError]) -> type[DaemonError]:
    """Make `from_wire` rebuild `cls` from its wire type (usable as a class decorator)."""
    name = cls.wire_type
    if not name or len(name.encode()) > MAX_ERROR_TYPE:
        raise ValueError(f"wire_type {name!r} must have 1..{MAX_ERROR_TYPE} bytes")
    known = _REGISTRY.get(name)
    if known is not None and known is not cls:
        raise ValueError(f"wire_type {name!r} is already used by {known.__qualname__}")
    _REGISTRY[name] = cls
    return cls


for _cls in (ProtocolError, FrameTooLargeError, MalformedFrameError, VersionError,
             UnknownOpError, SchemaError, UnauthorizedError, OverloadedError, InternalError,
             LeaseExpiredError):
    register_error(_cls)


def from_wire(wire_type: str, message: str, request_id: int = 0) -> DaemonError:
    """The exception a reported error stands for."""
    cls = _REGISTRY.get(wire_type)
    if cls is None:
        return RemoteError(wire_type, message)
    if issubclass(cls, ProtocolError):
        return cls(message, request_id)
    return cls(message)


def to_wire(exc: DaemonError, limit: int = MAX_ERROR_MESSAGE) -> dict[str, str]:
    """The `error` map of a reply reporting `exc` (its message cut to `limit` characters)."""
    message = exc.message
    if len(message) > limit:
        message = message[:max(0, limit - 3)] + "..."
    return {"type": exc.wire_type, "message": message}


class DaemonRunningError(DaemonError):
    """Another daemon already serves this socket path (it holds the path's lock, or answers a
    connection there). Never sent on the wire."""

    wire_type = "running"
