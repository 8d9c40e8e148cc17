"""Frames out of a byte stream, for both ends of the socket (the format is in protocol.py).

`FrameBuffer` reads through one buffer per connection, so a small frame (every control message)
costs one receive call, header and body together; a frame larger than the buffer is read
straight into a buffer of its own. The length prefix is checked against the limit before any of
the body is read.

The receive function is the caller's: the daemon's tracks how long a begun frame may take, the
client's collects the file descriptors that ride along (SCM_RIGHTS).
"""

from __future__ import annotations

import socket
import struct
import time
from collections.abc import Callable

from tiered_cache.wire.protocol import frame_length

BUFFER_BYTES = 64 * 1024

Recv = Callable[[memoryview, "float | None"], int]
"""recv(view, started) reads into `view` and returns the count (0 at end of stream).
`started` is when the frame being read began arriving, None while none of it has."""


class TruncatedFrame(EOFError):
    """The stream ended in the middle of a frame."""


class FrameBuffer:
    def __init__(self, size: int = BUFFER_BYTES) -> None:
        self._buf = bytearray(size)
        self._view = memoryview(self._buf)
        self._lo = self._hi = 0

    @property
    def pending(self) -> int:
        """Bytes received and not yet returned as (part of) a frame."""
        return self._hi - self._lo

    def read(self, recv: Recv, max_frame: int) -> bytearray | None:
        """The next frame's body; None if the stream ends cleanly between frames."""
        started = time.monotonic() if self._hi > self._lo else None
        while self._hi - self._lo < 4:
            if not self._fill(recv, started):
                if self._hi == self._lo:
                    return None
                raise TruncatedFrame("the stream ended inside a frame header")
            if started is None:
                started = time.monotonic()
        n = frame_length(self._buf, max_frame, self._lo)
        need = 4 + n
        if need > len(self._buf):
            # NOTE: only a frame too large for the buffer gets its own, and only once its
            # length has passed the limit check above.
            body = bytearray(n)
            have = self._hi - self._lo - 4
            body[:have] = self._view[self._lo + 4:self._hi]
            self._lo = self._hi = 0
            view, got = memoryview(body), have
            while got < n:
                k = recv(view[got:], started)
                if k == 0:
                    raise TruncatedFrame(f"the stream ended after {got:,} of {n:,} bytes")
                got += k
            return body
        if self._lo + need > len(self._buf):
            self._compact()
        while self._hi - self._lo < need:
            if not self._fill(recv, started):
                raise TruncatedFrame(f"the stream ended after {self._hi - self._lo - 4:,} of "
                                     f"{n:,} bytes")
        body = self._buf[self._lo + 4:self._lo + need]
        self._lo += need
        if self._lo == self._hi:
            self._lo = self._hi = 0
        return body

    def _compact(self) -> None:
        n = self._hi - self._lo
        self._buf[:n] = self._view[self._lo:self._hi]
        self._lo, self._hi = 0, n

    def _fill(self, recv: Recv, started: float | None) -> bool:
        if self._hi == len(self._buf):
            self._compact()
        k = recv(self._view[self._hi:], started)
        self._hi += k
        return k > 0


def set_timeouts(sock: socket.socket, *, recv_s: float | None = None,
                 send_s: float | None = None) -> None:
    """Kernel-side timeouts (SO_RCVTIMEO / SO_SNDTIMEO) on a blocking socket: a call that waits
    longer fails with BlockingIOError.

    NOTE: not `settimeout`, which makes CPython poll() before every recv and send: with the
    kernel's timeouts a request costs one system call per read and per write.
    """
    for opt, seconds in ((socket.SO_RCVTIMEO, recv_s), (socket.SO_SNDTIMEO, send_s)):
        if seconds is not None:
            sec = int(seconds)
            usec = max(1 if sec == 0 else 0, int((seconds - sec) * 1e6))
            sock.setsockopt(socket.SOL_SOCKET, opt, struct.pack("ll", sec, usec))
