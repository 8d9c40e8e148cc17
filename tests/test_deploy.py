"""deploy/: the systemd unit, the container image and its config, and the Grafana dashboard,
checked against a live node daemon (`tiered-cache serve`): every metric the dashboard queries
is one the daemon exports, with the labels the queries filter and group by; /health answers;
the metrics endpoint binds loopback unless told otherwise."""

from __future__ import annotations

import configparser
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import urllib.error
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tiered_cache.config import CacheConfig, DaemonConfig
from tiered_cache.daemon.process import NodeProcess
from tiered_cache.wire.client import Client
from tiered_cache.wire.errors import DaemonError
from tiered_cache.wire.ops import make_protocol

DEPLOY = Path(__file__).resolve().parent.parent / "deploy"
DASHBOARD = DEPLOY / "grafana-dashboard.json"
UNIT = DEPLOY / "tiered-cache.service"
DOCKERFILE = DEPLOY / "Dockerfile"
CONTAINER_CONFIG = DEPLOY / "daemon.yaml"

# A metric name in PromQL: `tiered_cache_` then identifier characters.
METRIC_RE = re.compile(r"\btiered_cache_[A-Za-z0-9_]*[A-Za-z0-9]")
# `name{matchers}`: the label names a selector filters on.
SELECTOR_RE = re.compile(r"\b(tiered_cache_[A-Za-z0-9_]+)\{([^}]*)\}")
MATCHER_LABEL_RE = re.compile(r"([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
BY_RE = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")
VAR_RE = re.compile(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)")
# Labels Prometheus adds at scrape time (not in the exposition).
TARGET_LABELS = {"instance", "job"}
# Families declared from the start whose samples only a handler bug would create.
NEED_A_BUG = {"tiered_cache_daemon_failures_total"}
GRAFANA_VARS = {"__rate_interval", "__interval", "__range", "__interval_ms", "__range_s"}
SUFFIXES = {"counter": ("_total", "_created"), "histogram": ("_bucket", "_sum", "_count",
                                                             "_created"),
            "summary": ("_sum", "_count", "_created"), "gauge": ()}


# -- the dashboard ---------------------------------------------------------------------------

def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def query_panels(dash: dict) -> list[dict]:
    """Every panel with queries: rows themselves hold none (a collapsed row nests its panels)."""
    out = []
    for p in dash["panels"]:
        if p.get("type") == "row":
            out.extend(p.get("panels", []))
        else:
            out.append(p)
    return out


def templating_queries(dash: dict) -> list[str]:
    out = []
    for var in dash["templating"]["list"]:
        if var.get("type") != "query":
            continue
        q = var.get("query")
        out.append(q.get("query", "") if isinstance(q, dict) else q)
        if var.get("definition"):
            out.append(var["definition"])
    return out


def exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in query_panels(dash) for t in p["targets"]]


def referenced_names(dash: dict) -> set[str]:
    return {m for e in exprs(dash) + templating_queries(dash) for m in METRIC_RE.findall(e)}


# -- the live daemon -------------------------------------------------------------------------

@dataclass
class Exposition:
    """A parsed /metrics: declared names (families with their type's sample suffixes) and the
    label names seen on each sample name."""

    text: str
    declared: set[str] = field(default_factory=set)
    labels: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    samples: dict[str, list] = field(default_factory=lambda: defaultdict(list))

    @classmethod
    def parse(cls, text: str) -> Exposition:
        out = cls(text)
        for fam in text_string_to_metric_families(text):
            out.declared.add(fam.name)
            out.declared.update(fam.name + s for s in SUFFIXES.get(fam.type, ()))
            for s in fam.samples:
                out.declared.add(s.name)
                out.labels[s.name].update(s.labels)
                out.samples[s.name].append(s)
        return out

    def value(self, name: str, **labels: str) -> float:
        found = [s.value for s in self.samples[name]
                 if all(s.labels.get(k) == v for k, v in labels.items())]
        assert len(found) == 1, (name, labels, found)
        return found[0]


@dataclass
class Live:
    node: NodeProcess
    port: int
    socket: str
    client: Client

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def scrape(self) -> Exposition:
        with urllib.request.urlopen(self.url("/metrics"), timeout=10) as r:
            assert r.status == 200
            return Exposition.parse(r.read().decode())


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TENANT = "main"


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """A daemon with a configured tenant (its partition, and so every per-tenant family, exists
    from the start), a disk tier, the metrics endpoint on a free port with http_addr left at its
    default, one attached client, one typed error answered and one bad frame rejected (so the
    by-reason and by-type families have samples)."""
    work = tmp_path_factory.mktemp("deploy")
    # A short socket path whatever the basetemp: a Unix socket path has at most 107 bytes.
    tmp_root = "/tmp" if os.path.isdir("/tmp") else None
    short = Path(tempfile.mkdtemp(prefix="tc-deploy-", dir=tmp_root))
    sock = str(short / "s" / "daemon.sock")
    port = free_port()
    config = work / "daemon.yaml"
    config.write_text(textwrap.dedent(f"""\
        model: {{name: tiny, num_layers: 2, num_kv_heads: 2, head_dim: 8, num_q_heads: 4,
                dtype: float32}}
        block_size: 4
        tiers:
          gpu: {{num_blocks: 8, device: cpu}}
          host: {{num_blocks: 64}}
          disk: {{num_blocks: 32, path: {json.dumps(str(work / 'disk'))}}}
        daemon:
          socket: {json.dumps(sock)}
          lease_s: 60
          tenants: {{"uid:{os.getuid()}": {TENANT}}}
        metrics:
          http_port: {port}
        """))
    node = NodeProcess(config, sock, log_path=work / "daemon.log")
    client = None
    try:
        node.start()
        client = Client(sock, make_protocol(), timeout_s=10).connect()
        assert client.call("hello")["tenant"] == TENANT
        root = client.call("root", salt=b"")["root"]
        tokens = np.arange(16, dtype=np.int32)
        assert client.call("lookup", root=root, parent=root, tokens=tokens)["blocks"] == 0
        fetched = client.call("fetch", root=root, parent=root, tokens=tokens, wait_ms=0)
        assert fetched["slots"] == []
        with pytest.raises(DaemonError):            # a root this tenant never registered
            client.call("fetch", root=b"\x01" * 16, parent=b"\x01" * 16, tokens=tokens,
                        wait_ms=0)
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as raw:
            raw.connect(sock)
            raw.sendall(b"\xff\xff\xff\xffnot a frame")
            raw.settimeout(5)
            try:
                while raw.recv(4096):               # the welcome, then the daemon hangs up
                    pass
            except OSError:
                pass
        lv = Live(node, port, sock, client)
        deadline = time.monotonic() + 10
        while not lv.scrape().samples["tiered_cache_daemon_rejected_total"]:
            assert time.monotonic() < deadline, "the bad frame was never counted"
            time.sleep(0.05)
        yield lv
    finally:
        if client is not None:
            client.close()
        rc = node.stop(timeout_s=60)
        shutil.rmtree(short, ignore_errors=True)
    assert rc == 0, node.log()


# -- (a) the dashboard against the daemon's exposition ----------------------------------------

def test_dashboard_is_well_formed():
    dash = dashboard()
    assert 36 <= dash["schemaVersion"] <= 41
    assert dash["uid"] and dash["title"]
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    ds = variables["DS_PROMETHEUS"]
    assert ds["type"] == "datasource" and ds["query"] == "prometheus"
    tenant = variables["tenant"]
    assert tenant["type"] == "query"
    q = tenant["query"]
    assert (q["query"] if isinstance(q, dict) else q) == \
        "label_values(tiered_cache_used_blocks, tenant)"
    ids = [p["id"] for p in dash["panels"]] + \
        [c["id"] for p in dash["panels"] for c in p.get("panels", [])]
    assert len(ids) == len(set(ids)), "panel ids repeat"
    panels = query_panels(dash)
    assert len(panels) >= 15
    for p in panels:
        where = f"panel {p.get('title')!r}"
        assert p.get("title"), where
        assert p.get("datasource", {}).get("uid") == "${DS_PROMETHEUS}", where
        assert set(p.get("gridPos", {})) >= {"x", "y", "w", "h"}, where
        assert p.get("targets"), f"{where} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), where
        for t in p["targets"]:
            assert t.get("datasource", {}).get("uid") == "${DS_PROMETHEUS}", where
            assert isinstance(t.get("expr"), str) and t["expr"].strip(), f"{where}: empty expr"
            assert METRIC_RE.search(t["expr"]), f"{where}: {t['expr']!r} queries no metric"
            assert t["expr"].count("(") == t["expr"].count(")"), f"{where}: {t['expr']!r}"
    # every $variable a query uses is defined (or one of Grafana's own)
    for e in exprs(dash) + templating_queries(dash):
        for var in VAR_RE.findall(e):
            assert var in variables or var in GRAFANA_VARS, f"${var} in {e!r} is not defined"
    # the panels the dashboard promises
    titles = " | ".join(p["title"].lower() for p in panels)
    for needed in ("hit ratio", "capacity", "evictions", "migrated bytes", "clients",
                   "handles", "reaped", "rejected", "errors", "fetched", "background",
                   "lock hold p99", "lookup p99", "up"):
        assert needed in titles, f"no panel about {needed!r}"


@pytest.mark.slow
def test_every_dashboard_metric_is_exported(live):
    dash = dashboard()
    names = referenced_names(dash)
    assert len(names) >= 20, sorted(names)
    exp = live.scrape()
    missing = sorted(n for n in names if n not in exp.declared)
    assert not missing, f"the dashboard queries metrics the daemon does not export: {missing}"
    # and every one of them has samples now (the fixture made the by-reason/by-type counters
    # count something), but for handler bugs caught, which nothing here can cause
    empty = sorted(n for n in names if not exp.samples[n] and n not in NEED_A_BUG)
    assert not empty, f"exported but without a sample: {empty}"


@pytest.mark.slow
def test_dashboard_labels_exist(live):
    """A selector's matchers, and the labels a query groups by, are labels the daemon puts on
    those samples (`instance` and `job` come from Prometheus)."""
    exp = live.scrape()
    dash = dashboard()
    for e in exprs(dash) + templating_queries(dash):
        for name, matchers in SELECTOR_RE.findall(e):
            for label in MATCHER_LABEL_RE.findall(matchers):
                if label in TARGET_LABELS or not exp.samples[name]:
                    continue
                assert label in exp.labels[name], f"{name} has no label {label!r} ({e!r})"
        # (a family without samples shows no labels: only NEED_A_BUG may be one, see above)
        in_expr = [n for n in METRIC_RE.findall(e) if exp.samples[n]]
        if not in_expr:
            continue
        have = set().union(*(exp.labels[n] for n in in_expr))
        for group in BY_RE.findall(e):
            for label in (x.strip() for x in group.split(",") if x.strip()):
                if label in TARGET_LABELS:
                    continue
                assert label in have, f"grouping by {label!r} but {in_expr} lack it ({e!r})"
    # the tenant variable's query finds the configured tenant
    assert {s.labels["tenant"] for s in exp.samples["tiered_cache_used_blocks"]} == {TENANT}


@pytest.mark.slow
def test_exposition_values(live):
    """The numbers the panels show, for the state the fixture left: one client, a host tier of
    64 slots and a disk tier of 32, a rejected frame, an answered error, the daemon up."""
    exp = live.scrape()
    assert exp.value("tiered_cache_daemon_up") == 1.0
    assert exp.value("tiered_cache_daemon_clients") == 1.0
    assert exp.value("tiered_cache_daemon_handles") == 0.0
    assert exp.value("tiered_cache_capacity_blocks", tenant=TENANT, tier="host") == 64
    assert exp.value("tiered_cache_capacity_blocks", tenant=TENANT, tier="disk") == 32
    assert sum(s.value for s in exp.samples["tiered_cache_daemon_rejected_total"]) >= 1
    assert exp.value("tiered_cache_daemon_errors_total", type="unknown_root") == 1
    # the one fetch that reached the index: nothing cached, one lookup timed
    assert sum(s.value for s in exp.samples["tiered_cache_hit_tokens_total"]) == 0
    assert exp.value("tiered_cache_lookup_seconds_count", tenant=TENANT) == 1
    assert exp.value("tiered_cache_daemon_fetched_blocks_total", tenant=TENANT) == 0
    buckets = exp.samples["tiered_cache_lock_hold_seconds_bucket"]
    assert buckets and all("le" in s.labels and s.labels["tenant"] == TENANT for s in buckets)
    assert any(s.labels["le"] == "+Inf" for s in buckets)


@pytest.mark.slow
def test_fetch_counts_queried_tokens(live):
    """The fixture's fetch looked up 16 tokens (4 whole blocks) and found none: the hit-ratio
    panel's denominator, tiered_cache_query_tokens_total, should count them."""
    exp = live.scrape()
    assert exp.value("tiered_cache_query_tokens_total", tenant=TENANT) == 16


# -- (b) the container's config --------------------------------------------------------------

def test_container_config_loads():
    config = CacheConfig.from_yaml(CONTAINER_CONFIG)
    assert config.daemon.socket == "/run/tiered-cache/daemon.sock"
    assert config.metrics.http_port == 9400
    assert config.metrics.http_addr == "0.0.0.0"
    assert config.tiers.disk is not None
    assert config.tiers.disk.path.startswith("/var/lib/tiered-cache/")
    assert config.daemon.socket_mode == 0o600


# -- (c) the systemd unit --------------------------------------------------------------------

def unit() -> configparser.ConfigParser:
    parser = configparser.ConfigParser(strict=False, interpolation=None)
    parser.optionxform = str                       # systemd keys are case-sensitive
    parser.read_string(UNIT.read_text())
    return parser


def serve_help(argv: list[str]) -> str:
    """Run `argv` (a `tiered-cache ...` command line) as `python -m tiered_cache ... --help`."""
    assert Path(argv[0]).name == "tiered-cache", argv
    proc = subprocess.run([sys.executable, "-m", "tiered_cache", *argv[1:], "--help"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


DAEMON_DOC = DEPLOY.parent / "docs" / "daemon.md"


def documented_venv() -> str:
    """The virtual environment docs/daemon.md's systemd install steps create, checked to be
    followed by the steps that put the package, the config and the unit where the unit looks."""
    text = DAEMON_DOC.read_text(encoding="utf-8")
    _, found, rest = text.partition("### Installing as a systemd service")
    assert found, "docs/daemon.md has no systemd install section"
    (block,) = re.findall(r"```bash\n(.*?)```", rest.split("\n## ", 1)[0], re.S)
    (venv,) = re.findall(r"^python3 -m venv (\S+)$", block, re.M)
    assert re.search(rf"^{re.escape(venv)}/bin/pip install torch==", block, re.M)
    assert re.search(rf"^{re.escape(venv)}/bin/pip install '\.\[remote\]'", block, re.M)
    assert "install -D -m 0644 deploy/daemon.yaml /etc/tiered-cache/daemon.yaml" in block
    assert "install -m 0644 deploy/tiered-cache.service /etc/systemd/system/" in block
    return venv


@pytest.mark.slow
def test_systemd_unit():
    u = unit()
    assert set(u.sections()) >= {"Unit", "Service", "Install"}
    svc = u["Service"]
    argv = shlex.split(svc["ExecStart"])
    # the executable is the one the documented install steps create (nothing else installs
    # a `tiered-cache` at a fixed path)
    venv = documented_venv()
    assert argv[0] == f"{venv}/bin/tiered-cache"
    assert f"python3 -m venv {venv}" in UNIT.read_text()      # the unit's own install note
    assert argv[1:3] == ["serve", "--config"] and argv[3].startswith("/etc/tiered-cache/")
    assert "--config" in serve_help(argv[:2])      # the CLI really takes `serve --config`
    assert svc["User"] and svc["User"] not in ("root", "0")
    assert svc["Group"] == svc["User"]
    assert svc["RuntimeDirectoryMode"] == "0700"
    assert svc["KillSignal"] == "SIGTERM"
    assert int(svc["TimeoutStopSec"]) >= 60
    assert svc["Restart"] == "on-failure"
    assert svc["LimitMEMLOCK"] == "infinity"
    assert svc["NoNewPrivileges"] == "yes" and svc["ProtectSystem"] == "strict"
    assert svc["ProtectHome"] == "yes" and svc["PrivateTmp"] == "yes"
    assert svc["Type"] == "simple"
    # the default socket lives in the RuntimeDirectory; the disk tier in the StateDirectory
    assert DaemonConfig().socket == f"/run/{svc['RuntimeDirectory']}/daemon.sock"
    state = f"/var/lib/{svc['StateDirectory']}"
    assert state in svc["ReadWritePaths"].split()
    disk = CacheConfig.from_yaml(CONTAINER_CONFIG).tiers.disk
    assert disk is not None and disk.path.startswith(state + "/")
    assert u["Install"]["WantedBy"] == "multi-user.target"


# -- (d) the Dockerfile ----------------------------------------------------------------------

def dockerfile() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) in order: comments dropped, continuation lines joined."""
    out, pending = [], ""
    for line in DOCKERFILE.read_text().splitlines():
        if line.lstrip().startswith("#"):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        line = (pending + line).strip()
        pending = ""
        if line:
            instr, _, args = line.partition(" ")
            out.append((instr.upper(), args.strip()))
    assert not pending, "the Dockerfile ends in a continuation"
    return out


def instructions(name: str) -> list[str]:
    return [args for instr, args in dockerfile() if instr == name]


def pyproject_extras() -> set[str]:
    """The extras pyproject.toml declares (`[project.optional-dependencies]`; no tomllib on
    Python 3.10)."""
    text = (DEPLOY.parent / "pyproject.toml").read_text()
    section = text.split("[project.optional-dependencies]", 1)[1].split("\n[", 1)[0]
    return set(re.findall(r"^([A-Za-z0-9_-]+)\s*=", section, re.M))


@pytest.mark.slow
def test_dockerfile():
    steps = dockerfile()
    args = dict(a.split("=", 1) for a in instructions("ARG") if "=" in a)
    assert args["BASE_IMAGE"] == "python:3.11-slim"
    assert instructions("FROM") == ["${BASE_IMAGE}"]
    assert "download.pytorch.org/whl/cpu" in args["TORCH_INDEX_URL"]
    # a non-root user, in effect for the ENTRYPOINT
    users = [(i, a) for i, (instr, a) in enumerate(steps) if instr == "USER"]
    assert users and users[-1][1] not in ("root", "0") and not users[-1][1].startswith("0:")
    entry = [i for i, (instr, _) in enumerate(steps) if instr == "ENTRYPOINT"]
    assert entry and users[-1][0] < entry[-1]
    assert json.loads(instructions("ENTRYPOINT")[-1]) == ["tiered-cache", "serve"]
    cmd = json.loads(instructions("CMD")[-1])
    assert cmd[0] == "--config"
    assert "--config" in serve_help(["tiered-cache", "serve"])
    # the config the CMD names is the one copied in, deploy/daemon.yaml
    copies = [shlex.split(a) for a in instructions("COPY")]
    assert ["deploy/daemon.yaml", cmd[1]] in copies
    root = DEPLOY.parent
    for c in copies:
        for src in c[:-1]:
            assert (root / src).exists(), f"COPY {src}: no such path in the repository"
    # the package from the copied source, with extras that pyproject.toml defines, `remote`
    # among them (the daemon's tiers.remote)
    pips = [shlex.split(a) for a in instructions("RUN") if "pip install" in a]
    targets = [w for argv in pips for w in argv if w.startswith(".")]
    assert len(targets) == 1, pips
    extras = set(re.fullmatch(r"\.(?:\[([a-z,]+)\])?", targets[0]).group(1).split(","))
    declared = pyproject_extras()
    assert "remote" in extras and extras <= set(declared), (extras, sorted(declared))
    # the socket directory is a volume; the port exposed is the config's
    config = CacheConfig.from_yaml(CONTAINER_CONFIG)
    volumes = {v for a in instructions("VOLUME") for v in json.loads(a)}
    assert os.path.dirname(config.daemon.socket) in volumes
    assert config.tiers.disk is not None
    assert any(config.tiers.disk.path.startswith(v + "/") for v in volumes)
    assert instructions("EXPOSE") == [str(config.metrics.http_port)]
    assert instructions("STOPSIGNAL") == ["SIGTERM"]
    health = instructions("HEALTHCHECK")
    assert len(health) == 1
    assert f"http://127.0.0.1:{config.metrics.http_port}/health" in health[0]


def healthcheck_argv() -> list[str]:
    opts, _, cmd = instructions("HEALTHCHECK")[0].partition("CMD ")
    assert opts.split()[0].startswith("--")
    return json.loads(cmd)


@pytest.mark.slow
def test_dockerfile_healthcheck_runs_against_the_daemon(live):
    """The image's HEALTHCHECK command, pointed at the test daemon's port: exit 0."""
    argv = healthcheck_argv()
    assert argv[0] == "python"
    argv = [sys.executable, *(a.replace("127.0.0.1:9400", f"127.0.0.1:{live.port}")
                              for a in argv[1:])]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    # and it fails where nothing serves /health
    dead = [a.replace(f"127.0.0.1:{live.port}", f"127.0.0.1:{free_port()}") for a in argv]
    assert subprocess.run(dead, capture_output=True, timeout=30).returncode != 0


# -- (e) /health and the bind address -------------------------------------------------------

@pytest.mark.slow
def test_health(live):
    with urllib.request.urlopen(live.url("/health"), timeout=10) as r:
        assert r.status == 200
        assert r.headers["Content-Type"] == "application/json"
        body = json.loads(r.read())
    assert body["ok"] is True
    assert body["status"] == "ok"
    assert body["clients"] == 1
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(live.url("/no-such-page"), timeout=10)
    assert err.value.code == 404


def _listeners(port: int) -> list[str]:
    """Local addresses (hex, as /proc/net/tcp* writes them) listening on `port`."""
    out = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        if not os.path.exists(table):
            continue
        with open(table) as f:
            next(f)
            for line in f:
                cols = line.split()
                addr, hexport = cols[1].rsplit(":", 1)
                if cols[3] == "0A" and int(hexport, 16) == port:        # 0A: LISTEN
                    out.append(addr)
    return out


@pytest.mark.slow
def test_metrics_bind_loopback_by_default(live):
    if not os.path.exists("/proc/net/tcp"):
        pytest.skip("no /proc/net/tcp")
    assert _listeners(live.port) == ["0100007F"], "expected only 127.0.0.1 to listen"


def _ipv6_available() -> bool:
    if not socket.has_ipv6:
        return False
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::", 0))
        return True
    except OSError:
        return False


@pytest.mark.skipif(not _ipv6_available(), reason="no IPv6 here")
def test_metrics_endpoint_serves_ipv6_any():
    from tiered_cache.daemon.observe import serve_http

    class NoService:
        partitions: dict = {}

    server, thread = serve_http(NoService(), "::", 0)
    server.shutdown()
    server.server_close()
    thread.join(5)


def non_loopback_ipv4() -> list[str]:
    return sorted({a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                   if a.family == socket.AF_INET and not a.address.startswith("127.")})


@pytest.mark.slow
def test_metrics_unreachable_from_other_addresses(live):
    addresses = non_loopback_ipv4()
    if not addresses:
        pytest.skip("this machine has no non-loopback IPv4 address")
    for ip in addresses:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.settimeout(3)
            with pytest.raises(OSError):
                s.connect((ip, live.port))
