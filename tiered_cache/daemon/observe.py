"""What the node daemon shows an operator: Prometheus metrics and a health endpoint, over HTTP.

`/metrics`: the engine's `tiered_cache_*` families for every tenant partition (the same names
as an engine's, with a `tenant` label), and the daemon's own `tiered_cache_daemon_*`.
`/health`: 200 `{"ok": true, ...}` while serving with every background thread alive, else 503.

NOTE: bound to `metrics.http_addr` (127.0.0.1 unless configured) and read-only: nothing here
changes the cache, so there is no admin surface to protect.
"""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample

from tiered_cache.errors import ConfigError
from tiered_cache.metrics import PREFIX, CacheCollector

D = f"{PREFIX}_daemon"


class DaemonCollector(Collector):
    def __init__(self, service) -> None:
        self.service = service

    def collect(self):
        svc = self.service
        merged: dict[str, Metric] = {}
        for name, part in list(svc.partitions.items()):
            for fam in CacheCollector(part.stats, part.index).collect():
                out = merged.get(fam.name)
                if out is None:
                    out = merged[fam.name] = Metric(fam.name, fam.documentation, fam.type)
                out.samples.extend(Sample(s.name, {**s.labels, "tenant": name}, s.value,
                                          s.timestamp, s.exemplar) for s in fam.samples)
        yield from merged.values()
        s = svc.stats(partitions=False)
        server = s["server"]
        clients = GaugeMetricFamily(f"{D}_clients", "Engine processes attached (with a lease)")
        clients.add_metric([], s["clients"])
        handles = GaugeMetricFamily(f"{D}_handles", "Fetch handles open (blocks pinned for a "
                                                    "client's copy)")
        handles.add_metric([], s["handles"])
        requests = CounterMetricFamily(f"{D}_requests", "Requests served")
        requests.add_metric([], server["requests"])
        rejected = CounterMetricFamily(f"{D}_rejected", "Frames, messages and peers refused, "
                                                        "by reason", labels=["reason"])
        for reason, n in server["rejected"].items():
            rejected.add_metric([reason], n)
        errors = CounterMetricFamily(f"{D}_errors", "Typed errors answered, by type",
                                     labels=["type"])
        for kind, n in server["errors"].items():
            errors.add_metric([kind], n)
        failures = CounterMetricFamily(f"{D}_failures", "Handler bugs caught (answered "
                                                        "`internal`), by reason",
                                       labels=["reason"])
        for kind, n in server["failures"].items():
            failures.add_metric([kind], n)
        reaped = CounterMetricFamily(f"{D}_reaped_clients", "Clients whose lease ended "
                                                            "(connection closed or timed out)")
        reaped.add_metric([], s["reaped_clients"])
        reaped_h = CounterMetricFamily(f"{D}_reaped_handles", "Handles released by a reap")
        reaped_h.add_metric([], s["reaped_handles"])
        fetched = CounterMetricFamily(f"{D}_fetched_blocks", "Blocks pinned for clients",
                                      labels=["tenant"])
        published = CounterMetricFamily(f"{D}_published_blocks", "Blocks clients published "
                                                                  "that the daemon took",
                                        labels=["tenant"])
        refused = CounterMetricFamily(f"{D}_rejected_blocks", "Published blocks not taken "
                                                              "(failed a check, or no room)",
                                      labels=["tenant"])
        requests_by = CounterMetricFamily(f"{D}_partition_requests", "Fetches and lookups a "
                                          "partition served, by outcome",
                                          labels=["tenant", "kind"])
        prefaulted = GaugeMetricFamily(f"{D}_pool_prefaulted_bytes", "Bytes of the partition's "
                                       "shared pool mapped by the daemon so far (prefaulted at "
                                       "start; the pool's size once done)", labels=["tenant"])
        for name, part in list(svc.partitions.items()):
            c = part.stats()["daemon"]
            prefaulted.add_metric([name], c["pool_prefaulted_bytes"])
            fetched.add_metric([name], c["fetched_blocks"])
            published.add_metric([name], c["published_blocks"])
            refused.add_metric([name], c["rejected_blocks"])
            for kind in ("fetches", "fetch_misses", "fetch_timeouts", "fetch_failures",
                         "lookups"):
                requests_by.add_metric([name, kind], c[kind])
        up = GaugeMetricFamily(f"{D}_up", "1 while the daemon serves and all its threads live")
        up.add_metric([], 1.0 if svc.healthy()[0] else 0.0)
        yield from (clients, handles, requests, rejected, errors, failures, reaped, reaped_h,
                    fetched, published, refused, requests_by, prefaulted, up)


def serve_http(service, addr: str, port: int) -> tuple[ThreadingHTTPServer, threading.Thread]:
    """Start the /metrics and /health endpoint; (server, thread)."""
    registry = CollectorRegistry()
    registry.register(DaemonCollector(service))

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:       # noqa: N802 - http.server's name
            path = self.path.split("?", 1)[0]
            if path == "/metrics":
                self._send(200, CONTENT_TYPE_LATEST, generate_latest(registry))
            elif path in ("/health", "/healthz"):
                ok, why = service.healthy()
                body = json.dumps({"ok": ok, "status": why,
                                   "clients": service.stats(partitions=False)["clients"]})
                self._send(200 if ok else 503, "application/json", body.encode())
            else:
                self._send(404, "text/plain", b"not found: try /metrics or /health\n")

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, fmt: str, *args) -> None:
            pass                        # scrapes every few seconds: not worth a log line

    try:
        family = socket.getaddrinfo(addr, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise ConfigError("metrics.http_addr", f"cannot resolve {addr!r}: {exc}") from None

    class Server(ThreadingHTTPServer):
        address_family = family         # "::" and IPv6 addresses as well as IPv4

    try:
        server = Server((addr, port), Handler)
    except OSError as exc:
        raise ConfigError("metrics.http_port", f"cannot serve on {addr}:{port} "
                                               f"(metrics.http_addr:port): "
                                               f"{exc.strerror or exc}") from None
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name="tc-daemon-http", daemon=True)
    thread.start()
    return server, thread
