"""docs/metrics.md lists every metric the code exports, with its type and labels, and nothing
else: the engine's `tiered_cache_*` families (a real cache's registry) in the first table, the
node daemon's `tiered_cache_daemon_*` (a real NodeService's collector) in the daemon's table.
A metric added to the code without a row here, or a row whose metric is gone, fails."""

from __future__ import annotations

import ast
import re
import shutil
import tempfile
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from tiered_cache import CacheConfig, TieredKVCache
from tiered_cache.daemon.observe import D, DaemonCollector
from tiered_cache.daemon.service import NodeService

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "metrics.md"
DAEMON_HEADING = "## The node daemon's metrics"
ROW = re.compile(r"^\|\s*`(tiered_cache_[a-z0-9_]+)`\s*\|\s*([a-z]+)\s*\|([^|]*)\|")
COLLECTORS = {"tiered_cache/metrics.py", "tiered_cache/daemon/observe.py"}
"""The modules that build metric families; both are collected below."""


def documented(section: str) -> dict[str, tuple[str, set[str]]]:
    """{exposed name: (type, labels)} of the table rows in one part of the doc."""
    text = DOC.read_text(encoding="utf-8")
    assert DAEMON_HEADING in text, f"docs/metrics.md has no {DAEMON_HEADING!r} section"
    engine, _, rest = text.partition(DAEMON_HEADING)
    daemon = rest.split("\n## ", 1)[0]
    out = {}
    for line in (engine if section == "engine" else daemon).splitlines():
        m = ROW.match(line)
        if m:
            name, kind, labels = m.groups()
            out[name] = (kind, set(re.findall(r"`([a-z_]+)`", labels.split("=")[0]
                                              if "=" in labels else labels)))
    assert out, f"no metric rows found in the {section} part of docs/metrics.md"
    return out


def exposed(fam) -> str:
    """The name a scrape shows: counters get `_total`."""
    return fam.name + "_total" if fam.type == "counter" else fam.name


def labels_of(fam) -> set[str]:
    """Declared label names (also when the family has no sample yet), without `le`."""
    names = set(getattr(fam, "_labelnames", ()))
    for s in fam.samples:
        names |= set(s.labels)
    return names - {"le"}


def tiny() -> dict:
    return {"model": {"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "float16"},
            "block_size": 4, "tiers": {"gpu": {"device": "cpu", "num_blocks": 8},
                                       "host": {"num_blocks": 16}}}


@pytest.fixture(scope="module")
def engine_families():
    registry = CollectorRegistry()
    with TieredKVCache(CacheConfig.from_dict(tiny()), registry=registry):
        fams = list(registry.collect())
    return {exposed(f): f for f in fams}


@pytest.fixture(scope="module")
def daemon_families():
    # A short directory: a Unix socket path has at most 107 bytes.
    work = Path(tempfile.mkdtemp(prefix="tc-docm-", dir="/tmp" if Path("/tmp").is_dir()
                                 else None))
    config = tiny()
    config["tiers"]["disk"] = {"num_blocks": 8, "path": str(work / "disk")}
    config["daemon"] = {"socket": str(work / "d.sock")}
    service = NodeService(CacheConfig.from_dict(config))
    try:
        fams = list(DaemonCollector(service).collect())
    finally:
        service.stop(drain=False)
        shutil.rmtree(work, ignore_errors=True)
    return {exposed(f): f for f in fams}


def test_every_engine_metric_is_documented_with_its_type_and_labels(engine_families):
    doc = documented("engine")
    missing = sorted(set(engine_families) - set(doc))
    assert not missing, f"metrics the cache exports that docs/metrics.md does not list: {missing}"
    for name, fam in engine_families.items():
        kind, labels = doc[name]
        assert kind == fam.type, f"{name}: documented as {kind}, exported as {fam.type}"
        assert labels == labels_of(fam), (name, labels, labels_of(fam))


def test_every_documented_engine_metric_is_exported(engine_families):
    stale = sorted(set(documented("engine")) - set(engine_families))
    assert not stale, f"docs/metrics.md lists metrics the cache does not export: {stale}"


def test_every_daemon_metric_is_documented_with_its_type_and_labels(daemon_families):
    doc = documented("daemon")
    own = {n: f for n, f in daemon_families.items() if f.name.startswith(D + "_")}
    assert own, "the daemon exported none of its own families"
    missing = sorted(set(own) - set(doc))
    assert not missing, f"daemon metrics docs/metrics.md does not list: {missing}"
    for name, fam in own.items():
        kind, labels = doc[name]
        assert kind == fam.type, f"{name}: documented as {kind}, exported as {fam.type}"
        assert labels == labels_of(fam), (name, labels, labels_of(fam))
    stale = sorted(set(doc) - set(own))
    assert not stale, f"docs/metrics.md lists daemon metrics it does not export: {stale}"


def test_the_daemons_engine_families_are_the_documented_ones_with_a_tenant(daemon_families):
    """What the doc says of the per-tenant families: each is in the engine table, and each
    sample carries a `tenant` label."""
    engine = documented("engine")
    for name, fam in daemon_families.items():
        if fam.name.startswith(D + "_"):
            continue
        assert name in engine, f"the daemon exports {name}, which docs/metrics.md never lists"
        assert all("tenant" in s.labels for s in fam.samples), name


def test_no_other_module_builds_metric_families():
    """A collector in another module would escape the checks above: list it in COLLECTORS
    and collect it here."""
    found = set()
    for top in ("tiered_cache",):
        for path in sorted((ROOT / top).rglob("*.py")):
            text = path.read_text(encoding="utf-8")
            plain = ("Counter", "Gauge", "Histogram", "Summary", "Info") \
                if "prometheus_client" in text else ()
            for node in ast.walk(ast.parse(text, str(path))):
                if isinstance(node, ast.Call):
                    f = node.func
                    name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", "")
                    if name.endswith("MetricFamily") or name in plain:
                        found.add(path.relative_to(ROOT).as_posix())
    assert found == COLLECTORS, f"modules building metrics: {sorted(found)}"
