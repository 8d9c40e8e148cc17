"""`tiered-cache serve --config configs/daemon.yaml`: run the node daemon until SIGTERM.

On SIGTERM or SIGINT it stops accepting connections, lets the requests in flight finish,
releases every client's pins, writes every block that lives only in the shared pool to the disk
tier (when there is one: the next start recovers them), and exits 0. It prints
`READY <pid> <socket>` on stdout once it listens (for supervisors and tests).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time

from tiered_cache.config import CacheConfig
from tiered_cache.wire.errors import DaemonError

DESCRIPTION = ("Run the node daemon: one cache that every engine process on the node shares "
               "(engines attach with tiers.daemon.socket).")

log = logging.getLogger("tiered_cache.daemon")


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message (and the traceback, if any)."""

    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
               + f".{int(record.msecs):03d}Z", "level": record.levelname,
               "logger": record.name, "msg": record.getMessage(),
               "thread": record.threadName}
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", required=True, help="the daemon's YAML (configs/daemon.yaml)")
    parser.add_argument("--socket", default=None, help="override daemon.socket")
    parser.add_argument("--log-level", default="INFO",
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"], help="log level")


def setup_logging(fmt: str, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(
        "%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())


def main(args: argparse.Namespace) -> int:
    config = CacheConfig.from_yaml(args.config)
    if args.socket:
        config.daemon.socket = args.socket
        config.daemon.__post_init__()
    setup_logging(config.daemon.log_format, args.log_level)
    from tiered_cache.daemon.service import NodeService

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        service = NodeService(config)
    except OSError as exc:          # one line, like every other reason not to start
        raise DaemonError(f"cannot start the daemon: {exc}") from exc
    http = None
    try:
        try:
            service.start()
        except OSError as exc:
            raise DaemonError(f"cannot start the daemon: {exc}") from exc
        if config.metrics.http_port is not None:
            from tiered_cache.daemon.observe import serve_http

            http = serve_http(service, config.metrics.http_addr, config.metrics.http_port)
        log.info("serving on %s (lease %.1f s, tenants %s)", config.daemon.socket,
                 config.daemon.lease_s, sorted(service.partitions) or "one per uid")
        print(f"READY {os.getpid()} {config.daemon.socket}", flush=True)
        stop.wait()
        log.info("stopping: draining clients and writing the pool to disk")
    finally:
        # /health answers 503 while the pool drains; the endpoint goes last.
        service.stop(drain=True)
        if http is not None:
            http[0].shutdown()
            http[0].server_close()
    log.info("stopped")
    return 0
