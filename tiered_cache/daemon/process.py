"""A daemon as a child process: started, waited for (its READY line), stopped and killed.

`NodeProcess` runs the node daemon (`tiered-cache serve`); `tiered-cache run-shared`, the
tests and the benchmarks start it this way. (The tests' reference daemon, tests/
daemon_reference.py, is another `DaemonProcess`.)
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
from pathlib import Path


class DaemonProcess:
    """A daemon in a subprocess: `start()` runs `command()` and returns once the process
    prints its READY line, `stop()` sends SIGTERM and waits, `kill()` sends SIGKILL. Its
    stderr goes to `log_path` (default: the socket path + ".log")."""

    what = "daemon process"

    def __init__(self, socket_path: str | os.PathLike[str], *args: str,
                 log_path: str | os.PathLike[str] | None = None) -> None:
        self.socket_path = str(socket_path)
        self.args = list(args)
        self.log_path = Path(log_path) if log_path else Path(f"{self.socket_path}.log")
        self.proc: subprocess.Popen[str] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def command(self) -> list[str]:
        raise NotImplementedError

    def start(self, timeout_s: float = 60.0) -> DaemonProcess:
        with open(self.log_path, "ab") as err:
            self.proc = subprocess.Popen(self.command(), stdout=subprocess.PIPE, stderr=err,
                                         text=True)
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout_s)
        line = self.proc.stdout.readline() if ready else ""
        if not line.startswith("READY"):
            self.kill()
            raise RuntimeError(f"{self.what} did not start: {line!r}\n{self.log()}")
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM and wait; the exit status."""
        if self.proc is None:
            return 0
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout_s)
        finally:
            self._close()

    def kill(self) -> None:
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.wait()
            self._close()

    def _close(self) -> None:
        if self.proc is not None and self.proc.stdout is not None:
            self.proc.stdout.close()

    def __enter__(self) -> DaemonProcess:
        return self.start() if self.proc is None else self

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.stop()



class NodeProcess(DaemonProcess):
    """The real node daemon (`python -m tiered_cache serve --config PATH`) in a subprocess,
    for `tiered-cache run-shared`, tests and benchmarks: `start()` returns once it listens."""

    what = "node daemon"

    def __init__(self, config_path: str | os.PathLike[str], socket_path: str, *args: str,
                 log_path: str | os.PathLike[str] | None = None) -> None:
        super().__init__(socket_path, *args, log_path=log_path)
        self.config_path = str(config_path)

    def command(self) -> list[str]:
        return [sys.executable, "-m", "tiered_cache", "serve", "--config", self.config_path,
                *self.args]

    def start(self, timeout_s: float = 120.0) -> NodeProcess:
        super().start(timeout_s)
        return self
