"""Who is at the other end of a Unix socket, and whether the daemon lets them in.

The identity comes from the kernel (`SO_PEERCRED`), never from anything the client says: the
pid, uid and gid of the process that called `connect()`, fixed at that moment. The allowlist
admits a peer whose uid or (primary) gid it names.

NOTE: what SO_PEERCRED does not give. The gid is the connecting process's effective gid, not its
supplementary groups; the pid is that of the process that connected (a child that inherits the
socket is reported as its parent) and may be reused once that process exits, so it is for logs
and metrics, never a key: a connection's identity is its `client` id, unique for the daemon's
lifetime. A peer in another pid namespace is reported with the pid it has in ours (0 when it
has none there).
"""

from __future__ import annotations

import os
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass

_UCRED = struct.Struct("3i")        # struct ucred {pid_t pid; uid_t uid; gid_t gid;}


@dataclass(frozen=True)
class Peer:
    """One accepted connection: its client id (unique per daemon run) and the credentials the
    kernel reported for it."""

    client: int
    pid: int
    uid: int
    gid: int

    def __str__(self) -> str:
        return f"client {self.client} (pid {self.pid}, uid {self.uid}, gid {self.gid})"


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of a connected Unix socket."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    pid, uid, gid = _UCRED.unpack(raw)
    # uid_t/gid_t are unsigned; "i" reads (uid_t)-1 as -1.
    return pid, uid & 0xFFFFFFFF, gid & 0xFFFFFFFF


@dataclass(frozen=True)
class Allowlist:
    """The uids and gids a daemon accepts. Empty sets admit nobody; `Allowlist.own()` admits
    the daemon's own effective uid only, the default.

    NOTE: root gets no exemption. A daemon run as root that should serve root clients names
    uid 0, like any other; this is what lets a test refuse its own (root) client by naming
    another uid only.
    """

    uids: frozenset[int] = frozenset()
    gids: frozenset[int] = frozenset()

    @classmethod
    def of(cls, uids: Iterable[int] = (), gids: Iterable[int] = ()) -> Allowlist:
        uids, gids = frozenset(int(u) for u in uids), frozenset(int(g) for g in gids)
        for what, ids in (("uid", uids), ("gid", gids)):
            bad = [i for i in ids if not 0 <= i <= 0xFFFFFFFE]
            if bad:
                raise ValueError(f"allowlist {what}s must be in [0, 2**32 - 2], got {bad}")
        return cls(uids, gids)

    @classmethod
    def own(cls) -> Allowlist:
        return cls(frozenset({os.geteuid()}))

    def allows(self, uid: int, gid: int) -> bool:
        return uid in self.uids or gid in self.gids

    def __str__(self) -> str:
        return f"uids {sorted(self.uids)}, gids {sorted(self.gids)}"
