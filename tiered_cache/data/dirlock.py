"""One owner per disk-tier directory: an exclusive lock on a lock file that names its holder.

NOTE: flock, not POSIX record locks (fcntl F_SETLK). POSIX locks belong to the process: a second
pool opened in the same process would get the lock too, and closing any descriptor of the file
would silently release it. A flock belongs to the open file description, so a second opener in
the same process is refused like any other, and the kernel drops the lock when its holder exits
or is killed (SIGKILL included): a crashed owner never leaves a stale lock behind. A forked child
inherits the description and with it the lock, until it exits too.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from tiered_cache.errors import TierUnavailableError

LOCK_NAME = "lock"


class LockHeldError(TierUnavailableError):
    """Another process (or another pool in this process) owns the directory."""

    def __init__(self, message: str, path: Path, pid: int | None) -> None:
        super().__init__(message)
        self.path = path
        self.pid = pid


class DirLock:
    """Holds `directory/lock` exclusively from construction until `release()`."""

    def __init__(self, directory: Path) -> None:
        self.path = directory / LOCK_NAME
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = _read_pid(fd)
            os.close(fd)
            raise LockHeldError(_held_message(directory, self.path, pid), self.path,
                                pid) from None
        except BaseException:
            os.close(fd)
            raise
        # The holder's pid, for the message a second opener gets (not needed for the lock).
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        """Drop the lock (idempotent). The pid stays in the file; the next holder rewrites it."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            os.close(fd)


def _read_pid(fd: int) -> int | None:
    try:
        return int(os.pread(fd, 32, 0).split()[0])
    except (OSError, ValueError, IndexError):
        return None                     # the holder has not written it yet


def _held_message(directory: Path, lock: Path, pid: int | None) -> str:
    """One sentence per case: who holds the directory, and what the user can do."""
    where = f"tiers.disk.path: {directory}"
    if pid == os.getpid():
        return (f"{where} is already open in this process (pid {pid}): one disk tier "
                "directory serves one cache at a time; shut the other cache down first, or "
                "give this one another tiers.disk.path")
    if pid is None:
        who = "another process (it has not written its pid yet)"
    else:
        who = f"process {pid}"
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            who += " (no longer running: a child it forked may still hold the lock)"
        except PermissionError:
            pass
    return (f"{where} is in use by {who} (it holds {lock}): one process owns a disk tier "
            "directory at a time; stop that process, or give this cache another "
            "tiers.disk.path")
